"""The `opengem` command: train, data synth, data movielens, info, bench, plan."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from opengem.cli.bench import add_bench_parser, run_bench
from opengem.cli.info import add_info_parser, run_info
from opengem.cli.movielens import add_movielens_parser, movielens_command
from opengem.cli.plan import add_plan_parser, run_plan
from opengem.parallel.mesh import parse_parallel
from opengem.train.checkpoint import checkpoint_config, resolve_checkpoint
from opengem.train.config import PRESETS, apply_overrides, config_from_dict, load_config
from opengem.train.guards import TrainingDiverged
from opengem.train.sequential import SEQUENTIAL_PRESETS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="opengem", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    train_parser = commands.add_parser("train", help="train a model (default: the CPU demo preset)")
    train_parser.add_argument("--config", help="TOML file of settings (top-level keys and a [model] table)")
    train_parser.add_argument(
        "--preset", choices=sorted(PRESETS) + sorted(SEQUENTIAL_PRESETS), help="start from this preset"
    )
    train_parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting")
    train_parser.add_argument("--steps", type=int, help="total training steps")
    train_parser.add_argument("--device", help="auto, cpu or cuda")
    train_parser.add_argument("--resume", type=Path, help="run folder (or checkpoint file) to continue from, with the "
                              "settings saved there (no --preset or --config; --set, --steps and --device apply)")
    train_parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    train_parser.add_argument(
        "--parallel", metavar="KEY=VALUE,...",
        help="distributed layout, e.g. dense_shard=2,expert=2 (keys: dense_replicate, dense_shard, expert, "
             "sparse_group, sparse_replicate, reshard_after_forward, prefetch, activation_checkpointing, "
             "collectives); launch with torchrun. Under torchrun without it: FSDP over all ranks",
    )  # fmt: skip

    data_parser = commands.add_parser("data", help="data tools")
    data_commands = data_parser.add_subparsers(dest="data_command", required=True)
    synth = data_commands.add_parser("synth", help="write synthetic samples as sharded Parquet files")
    synth.add_argument("--out", type=Path, required=True)
    synth.add_argument("--samples", type=int, required=True)
    synth.add_argument("--preset", default="gem-tiny")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--holdout", action="store_true",
                       help="write held-out samples (the range training never reads) for a run's eval_dir")
    add_movielens_parser(data_commands)
    add_info_parser(commands)
    add_bench_parser(commands)
    add_plan_parser(commands)

    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "info":
            return run_info(args)
        if args.command == "bench":
            return run_bench(args)
        if args.command == "plan":
            return run_plan(args)
        if args.data_command == "movielens":
            return movielens_command(args)
        return _synth(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"opengem: error: {error}", file=sys.stderr)
        return 2
    except TrainingDiverged as error:  # the guard's message says what to do; a traceback added nothing
        print(f"opengem: training stopped: {error}", file=sys.stderr)
        return 1


def _train(args: argparse.Namespace) -> int:
    from opengem.train.trainer import train

    overrides = list(args.set)
    parallel = parse_parallel(args.parallel) if args.parallel is not None else None
    if args.preset in SEQUENTIAL_PRESETS:
        if parallel is not None:
            raise ValueError(f"--parallel is not supported for {args.preset}")
        return _train_sequential(args, overrides)
    if args.steps is not None:
        overrides.append(f"steps={args.steps}")
    if args.device is not None:
        overrides.append(f"device={args.device}")
    if args.resume is not None:
        # a resumed run keeps the settings it was started with, plus explicit overrides; a preset or file given beside
        # it was once dropped without a word
        given = [flag for flag, value in (("--preset", args.preset), ("--config", args.config)) if value is not None]
        if given:
            flags = " and ".join(given)
            raise ValueError(f"{flags} with --resume: a resumed run's config comes from its checkpoint, so {flags} "
                             "would be ignored; change the saved settings with --set KEY=VALUE (any setting but "
                             "preset, applied on top of the checkpoint's), --steps or --device")
        args.resume = resolve_checkpoint(args.resume)  # settings and state from the same checkpoint
        try:
            saved = config_from_dict(checkpoint_config(args.resume))
        except ValueError as error:
            raise ValueError(f"--resume {args.resume}: {error}") from error
        config = apply_overrides(saved, overrides)
    else:
        config = load_config(args.preset, args.config, overrides)
    summary = train(config, resume=args.resume, progress=not args.no_progress, parallel=parallel)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"run folder: {summary['run_dir']}")
    return 0


def _train_sequential(args: argparse.Namespace, overrides: list[str]) -> int:
    """Next-item models on MovieLens (counted in epochs; no --steps, --config or --resume)."""
    from opengem.train.sequential import load_sequential_config, train_sequential

    for flag, value in (("--steps", args.steps), ("--config", args.config), ("--resume", args.resume)):
        if value is not None:
            raise ValueError(f"{flag} is not supported for {args.preset}; use --set epochs=N and friends")
    if args.device is not None:
        overrides.append(f"device={args.device}")
    summary = train_sequential(load_sequential_config(args.preset, overrides), progress=not args.no_progress)
    print(f"run folder: {summary['run_dir']}")
    return 0


def _synth(args: argparse.Namespace) -> int:
    from opengem.data.parquet import synthesize_to_parquet
    from opengem.data.synthetic import HOLDOUT_START

    if args.samples < 1:  # the writer's own message names none of the flags: "num_samples, rows_per_file and ..."
        raise ValueError(f"--samples must be >= 1, got {args.samples}")
    start = time.perf_counter()
    first_sample = HOLDOUT_START if args.holdout else 0
    paths = synthesize_to_parquet(args.out, args.samples, args.preset, seed=args.seed, first_sample=first_sample)
    elapsed = time.perf_counter() - start
    kind = "held-out samples" if args.holdout else "samples"
    print(f"wrote {args.samples} {kind} in {len(paths)} files under {args.out} in {elapsed:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
