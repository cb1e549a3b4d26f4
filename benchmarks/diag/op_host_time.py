"""Diagnostic (issue 10): the host time of each opengem custom-op call in a compiled training step, and where it goes.

`launch_sources` put opengem's attention ops at 1.7-1.9 ms of self CPU a backward call and ~0.85 ms a forward call
(gem-large b256, one H100, session 51), under a profiler that records Python stacks and so slows the host. This
times the calls without that profiler. Every opengem custom op's implementation is wrapped: the device queue is
drained before the call, so its launches never wait for the GPU, and the call is timed on the host. A cProfile
that runs only inside those calls says which Python functions take the time.

    PYTHONPATH=src:. python -m benchmarks.diag.op_host_time [--preset gem-large] [--batch-size 256] [--steps 2]
        [--no-profile] [--top 30] [--out benchmarks/results/op_host_time_gem-large_b256.json]

``--no-profile`` times the calls without the cProfile (the function table is then empty); in gem-large b256 it
changed little (session 53: 48.7-50.1 ms a step without, 51.8 with, 7.3 of which the profiler's own).
``OPENGEM_TRITON_LAUNCH`` (recorded in the result) picks how opengem launches its Triton kernels
(:mod:`opengem.ops.triton.launcher`).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch._library import custom_ops

OPENGEM_OPS = "opengem::"


@contextmanager
def timed_ops(sync: Callable[[], None], profiler: cProfile.Profile | None = None,
              prefix: str = OPENGEM_OPS) -> Iterator[dict[str, list[float]]]:
    """While active, each call of a custom op whose name starts with ``prefix`` records its implementation's host
    seconds (after ``sync`` drains the device queue) and runs under ``profiler`` when given. An op called inside
    another is part of the outer call's time. The implementations are restored on exit."""
    times: dict[str, list[float]] = collections.defaultdict(list)
    depth = [0]
    patched = []

    def timed(name: str, implementation: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if depth[0]:
                return implementation(*args, **kwargs)
            sync()
            depth[0] += 1
            if profiler is not None:
                profiler.enable()
            start = time.perf_counter()
            try:
                return implementation(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                if profiler is not None:
                    profiler.disable()
                depth[0] -= 1
                times[name].append(elapsed)
        return call

    for name, definition in custom_ops.OPDEFS.items():
        if name.startswith(prefix):
            for key, implementation in list(definition._backend_fns.items()):
                definition._backend_fns[key] = timed(name, implementation)
                patched.append((definition, key, implementation))
    try:
        yield times
    finally:
        for definition, key, implementation in patched:
            definition._backend_fns[key] = implementation


def per_op(times: dict[str, list[float]], steps: int) -> list[dict[str, Any]]:
    """Each op's calls a step, mean and median host us a call and host ms a step, heaviest first."""
    rows = [{"op": name, "calls_per_step": len(calls) / steps, "mean_us": 1e6 * statistics.fmean(calls),
             "median_us": 1e6 * statistics.median(calls), "ms_per_step": 1e3 * sum(calls) / steps}
            for name, calls in times.items() if calls]  # fmt: skip
    return sorted(rows, key=lambda row: -row["ms_per_step"])


def heaviest_functions(profiler: cProfile.Profile, steps: int, top: int = 30) -> list[dict[str, Any]]:
    """The Python functions (and C calls) with the most own time inside the timed calls: ms a step."""
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, primitive, own s, cumulative s, callers)}
    rows = [{"function": f"{Path(file).name}:{line}({name})", "calls_per_step": calls / steps,
             "own_ms_per_step": 1e3 * own / steps, "cumulative_ms_per_step": 1e3 * cumulative / steps}
            for (file, line, name), (_, calls, own, cumulative, _) in stats.items()]  # fmt: skip
    return sorted(rows, key=lambda row: -row["own_ms_per_step"])[:top]


def main() -> None:
    from benchmarks.diag.compiled_learner import (
        diagnostic_parser,
        parse_diagnostic_args,
        warmed_learner,
        write_diagnostic,
    )
    from opengem.ops.triton.launcher import launch_mode_setting
    from opengem.train.bench.host_speed import host_speed

    parser = diagnostic_parser(__doc__.splitlines()[0], "gem-large", 256, "timed steps (after the warm-up)",
                               "benchmarks/results/op_host_time_gem-large_b256.json")  # fmt: skip
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                        help="cProfile inside the timed calls (default); --no-profile times them alone")
    parser.add_argument("--top", type=int, default=30, help="Python functions listed, by own time")
    args = parse_diagnostic_args(parser, "op_host_time drains the CUDA queue before each op call")
    speed = host_speed(torch.device("cuda"))  # before the loader's workers start, as `bench train` measures it
    options, learner, batches = warmed_learner(args.preset, args.batch_size, args.steps, args.overrides)
    torch.cuda.synchronize()
    profiler = cProfile.Profile() if args.profile else None
    with timed_ops(torch.cuda.synchronize, profiler) as times:
        for batch in batches:
            learner.step(batch)
        torch.cuda.synchronize()
    ops = per_op(times, args.steps)
    functions = heaviest_functions(profiler, args.steps, args.top) if profiler is not None else []
    print(f"host {speed['launch_us']:.2f} us / launch, {speed['python_ms']:.1f} ms of fixed Python")
    print(f"opengem ops, host ms a step (queue drained before each call): {sum(r['ms_per_step'] for r in ops):.2f}")
    for row in ops:
        print(f"  {row['ms_per_step']:8.3f} ms  {row['calls_per_step']:5.1f} calls  {row['mean_us']:8.1f} us mean  "
              f"{row['median_us']:8.1f} median  {row['op']}")
    print("inside them, own ms a step (cumulative), calls a step:")
    for row in functions:
        print(f"  {row['own_ms_per_step']:8.3f} ({row['cumulative_ms_per_step']:8.3f})  {row['calls_per_step']:7.1f}  "
              f"{row['function']}")
    write_diagnostic("op_host_time", args, options, host_speed=speed, profiled=args.profile,
                     triton_launch=launch_mode_setting(), ops=ops, functions=functions)


if __name__ == "__main__":
    main()
