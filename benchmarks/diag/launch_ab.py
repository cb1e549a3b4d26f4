"""Diagnostic (issue 10): opengem's cached Triton launcher against Triton's own launch path, in one process.

Two `bench train` processes on one machine differ by more than the launcher can change (session 53: 175.1 and
210.9 ms a step, run one after the other on one H100, the host's pace varying). This times both paths in one
process on the same staged batches, in ABBA rounds so that a drift of the host's pace falls on both alike: each
round runs the staged steps once per path (:data:`opengem.ops.triton.launcher.CACHED`, read at every launch).

    PYTHONPATH=src:. python -m benchmarks.diag.launch_ab [--preset gem-large] [--batch-size 256] [--steps 4]
        [--rounds 8] [--out benchmarks/results/launch_ab_gem-large_b256.json]
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
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
from opengem.ops.triton import launcher
from opengem.train.bench.host_speed import host_speed

PATHS = ("triton", "cached")


def summary(step_ms: dict[str, Sequence[float]]) -> dict[str, Any]:
    """Each path's median and mean step ms, and cached over Triton's (median and mean; under 1 is faster)."""
    medians = {path: statistics.median(step_ms[path]) for path in PATHS}
    means = {path: statistics.fmean(step_ms[path]) for path in PATHS}
    return {"median_ms": medians, "mean_ms": means, "cached_over_triton_median": medians["cached"] / medians["triton"],
            "cached_over_triton_mean": means["cached"] / means["triton"]}  # fmt: skip


def time_rounds(run_steps: Callable[[], None], set_path: Callable[[str], None], rounds: int, steps: int,
                sync: Callable[[], None]) -> dict[str, list[float]]:
    """ms a step of each round's ``steps`` steps, by path."""
    step_ms: dict[str, list[float]] = {path: [] for path in PATHS}
    for order in abba(rounds, PATHS):
        for path in order:
            set_path(path)
            seconds, _ = timed(run_steps, sync)
            step_ms[path].append(1e3 * seconds / steps)
    return step_ms


def main() -> None:
    parser = diagnostic_parser(__doc__.splitlines()[0], "gem-large", 256, "staged steps a round and path",
                               "benchmarks/results/launch_ab_gem-large_b256.json")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=8, help="ABBA rounds (even)")
    args = parse_diagnostic_args(parser, "launch_ab times GPU training steps")
    abba(args.rounds, PATHS)  # a bad --rounds fails before the warm-up
    speed = host_speed(torch.device("cuda"))
    options, learner, batches = warmed_learner(args.preset, args.batch_size, args.steps, args.overrides)

    def run_steps() -> None:
        for batch in batches:
            learner.step(batch)

    def set_path(path: str) -> None:
        launcher.CACHED = path == "cached"

    run_steps()  # the first cached launches of each key go through Triton: not timed
    before = {name: cached.through_triton for name, cached in launcher.cached_launchers().items()}
    step_ms = time_rounds(run_steps, set_path, args.rounds, args.steps, torch.cuda.synchronize)
    result = summary(step_ms)
    # what each cached kernel sent through Triton while timed (0 when every key repeats) and its keys in all
    kernels = {name: {"through_triton": cached.through_triton - before.get(name, 0), "keys": cached.keys}
               for name, cached in launcher.cached_launchers().items()}
    print(f"host {speed['launch_us']:.2f} us / launch, {speed['python_ms']:.1f} ms of fixed Python")
    for path in PATHS:
        print(f"  {path:7s} median {result['median_ms'][path]:8.2f} ms  mean {result['mean_ms'][path]:8.2f} ms  "
              f"rounds {' '.join(f'{ms:.1f}' for ms in step_ms[path])}")
    print(f"cached kernels (calls sent through Triton while timed, keys): {kernels}")
    print(f"cached / triton: median {result['cached_over_triton_median']:.4f}, "
          f"mean {result['cached_over_triton_mean']:.4f}")
    write_diagnostic("launch_ab", args, options, host_speed=speed, step_ms=step_ms, cached_kernels=kernels, **result)


if __name__ == "__main__":
    main()
