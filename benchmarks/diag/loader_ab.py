"""Diagnostic (issue 10): does the data loader, running beside the step, slow gem-large's step?

Session 53: on one fast H100 host, gem-large b256 ran 141.0 ms a step on batches staged on the device beforehand
(`launch_ab`): the kernels' own time, no idle. `bench train`, whose steps take their batches from the loader as
they go, has read 150-210 ms on H100 hosts, with 17-82 ms of GPU idle a step. This times both in one process, in
ABBA rounds: ``staged`` steps on batches already on the device (the loader, its prefetch full, waits), ``stream``
steps as `bench train` runs them (``next(stream).to(device, non_blocking=True)``, the workers and the pin-memory
thread busy beside the step). Batches differ between the two, so each round reports useful TFLOP/s (GEM_SPEC
section 8) as well as ms a step.

    PYTHONPATH=src:. python -m benchmarks.diag.loader_ab [--preset gem-large] [--batch-size 256] [--steps 4]
        [--rounds 6] [--num-workers 12] [--switch-interval-ms MS] [--out ...]
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from benchmarks.diag.compiled_learner import (
    abba,
    diagnostic_parser,
    parse_diagnostic_args,
    timed,
    warmed_learner,
    write_diagnostic,
)
from opengem.train.bench.host_speed import host_speed
from opengem.train.bench.step import bench_config
from opengem.train.data_stream import train_batches
from opengem.train.flops import device_peak_flops, train_flops

MODES = ("staged", "stream")


def mode_summary(rows: list[dict[str, Any]], peak_tflops: float) -> dict[str, dict[str, float]]:
    """Per mode: median ms a step and median useful TFLOP/s and E2E MFU over its rounds."""
    out = {}
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        tflops = statistics.median(r["tflops"] for r in mine)
        out[mode] = {"step_ms": statistics.median(r["step_ms"] for r in mine), "tflops": tflops,
                     "mfu": tflops / peak_tflops}  # fmt: skip
    return out


def time_round(steps: Callable[[], list[float]], sync: Callable[[], None]) -> tuple[float, float]:
    """(seconds, FLOPs) of one round: ``steps`` runs the round's steps and returns each step's useful FLOPs."""
    seconds, flops = timed(steps, sync)
    return seconds, sum(flops)


def main() -> None:
    parser = diagnostic_parser(__doc__.splitlines()[0], "gem-large", 256, "steps a round and mode",
                               "benchmarks/results/loader_ab_gem-large_b256.json")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=6, help="ABBA rounds (even)")
    parser.add_argument("--num-workers", type=int, default=12, help="the stream's loader workers (as bench runs)")
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="sys.setswitchinterval for the whole run (Python's GIL hand-off; default 5 ms)")
    args = parse_diagnostic_args(parser, "loader_ab times GPU training steps")
    abba(args.rounds, MODES)  # a bad --rounds fails before the warm-up
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    speed = host_speed(torch.device("cuda"))
    options, learner, staged = warmed_learner(args.preset, args.batch_size, args.steps, args.overrides)
    config, device, _ = bench_config(dataclasses.replace(options, num_workers=args.num_workers))
    staged_flops = [train_flops(learner.model, b.history_age.lengths_host()).train for b in staged]
    stream: Iterator = train_batches(config, start_step=10_000)  # batches the warm-up did not see
    for _ in range(3):  # the workers' start is not timed
        learner.step(next(stream).to(device, non_blocking=True))

    def staged_steps() -> list[float]:
        for batch in staged:
            learner.step(batch)
        return staged_flops

    def stream_steps() -> list[float]:
        flops = []
        for _ in range(args.steps):
            batch = next(stream)
            flops.append(train_flops(learner.model, batch.history_age.lengths_host()).train)
            learner.step(batch.to(device, non_blocking=True))
        return flops

    run = {"staged": staged_steps, "stream": stream_steps}
    rows = []
    for order in abba(args.rounds, MODES):
        for mode in order:
            seconds, flops = time_round(run[mode], torch.cuda.synchronize)
            rows.append({"mode": mode, "step_ms": 1e3 * seconds / args.steps, "tflops": flops / seconds / 1e12})
    peak = device_peak_flops(torch.cuda.get_device_name(device), "bf16", None) / 1e12
    result = mode_summary(rows, peak)
    print(f"host {speed['launch_us']:.2f} us / launch, {speed['python_ms']:.1f} ms of fixed Python; "
          f"switch interval {sys.getswitchinterval() * 1e3:.2f} ms, {args.num_workers} workers")
    for row in rows:
        print(f"  {row['mode']:7s} {row['step_ms']:8.2f} ms a step  {row['tflops']:7.1f} TFLOP/s")
    for mode, figures in result.items():
        print(f"{mode}: median {figures['step_ms']:.2f} ms, {figures['tflops']:.1f} TFLOP/s, "
              f"E2E MFU {100 * figures['mfu']:.1f}% (useful FLOPs, {peak:.0f} TFLOP/s dense BF16)")
    write_diagnostic("loader_ab", args, options, host_speed=speed, num_workers=args.num_workers,
                     switch_interval_ms=sys.getswitchinterval() * 1e3, peak_tflops=peak, rounds=rows,
                     modes=result)  # fmt: skip


if __name__ == "__main__":
    main()
