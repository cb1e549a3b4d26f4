"""`opengem plan`: lay out a GEM preset on a cluster and predict step time, memory and MFU."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from opengem.models.presets import GEM_PRESETS


def add_plan_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("plan", help="plan a 5D layout for a GEM preset on a cluster (no GPU needed)")
    parser.add_argument("--preset", choices=sorted(GEM_PRESETS), default="gem-xl")
    parser.add_argument("--cluster", default="h100", help="shipped cluster name (h100, h200) or a TOML file")
    parser.add_argument("--gpus", type=int, help="GPU count (default: the whole cluster)")
    parser.add_argument("--calibration", help="calibration JSON from `opengem bench calibrate` (default: the cluster's)")
    parser.add_argument("--local-batch", type=int, help="fix the per-GPU batch (default: searched)")
    parser.add_argument("--no-batch-shuffling", action="store_true", help="predict without Base Batch Shuffling")
    parser.add_argument("--sparse-sync-every", type=int, default=1, help="2D sparse replica sync period (steps)")
    parser.add_argument("--top", type=int, default=5, help="layouts listed")
    parser.add_argument("--out", type=Path, help="JSON file of the ranked layouts")
    parser.add_argument("--plot", type=Path, help="PNG of the top layouts' step time")


def run_plan(args: argparse.Namespace) -> int:
    from opengem.plan.cluster import load_cluster
    from opengem.plan.planner import LOCAL_BATCHES, Planner
    from opengem.plan.report import format_plan, plot, write_json

    for flag, value in (("--gpus", args.gpus), ("--local-batch", args.local_batch),
                        ("--sparse-sync-every", args.sparse_sync_every), ("--top", args.top)):
        if value is not None and value < 1:  # None: the flag's default (the whole cluster, a searched batch)
            raise ValueError(f"{flag} must be >= 1, got {value}")
    cluster = load_cluster(args.cluster)
    batches = LOCAL_BATCHES if args.local_batch is None else (args.local_batch,)
    start = time.perf_counter()
    plan = Planner(args.preset, cluster, cluster.total_gpus if args.gpus is None else args.gpus, args.calibration).plan(
        batches, batch_shuffling=not args.no_batch_shuffling, sparse_sync_every=args.sparse_sync_every)
    print(format_plan(plan, args.top))
    print(f"planned in {time.perf_counter() - start:.1f} s")
    if args.out:
        print(f"wrote {write_json(plan, args.out)}")
    if args.plot:
        print(f"wrote {plot(plan, args.plot, args.top)}")
    return 0
