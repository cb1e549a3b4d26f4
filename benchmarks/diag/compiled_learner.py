"""The learner ``opengem bench train --compile`` times, built the same way for the step diagnostics."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from opengem.nn.embedding import trust_ids
from opengem.train.bench.step import TrainBenchOptions, bench_config
from opengem.train.config import TrainConfig
from opengem.train.trainer import Learner, build_learner


def compiled_learner(preset: str, batch_size: int, overrides: Sequence[str] = ()
                     ) -> tuple[TrainBenchOptions, TrainConfig, torch.device, Learner]:
    """``preset`` at ``batch_size`` with the sequence stream in the compute dtype (as the GPU session's large_b512
    runs) and ``overrides`` (``bench train``'s ``--set``), seeded, ids trusted and its regions compiled: the same
    Inductor settings, so one compile cache serves both."""
    options = TrainBenchOptions(preset=preset, compile=True, batch_size=batch_size,
                                overrides=("gem.sequence_dtype=compute", *overrides))  # fmt: skip
    config, device, _ = bench_config(options)
    torch.manual_seed(config.seed)
    learner = build_learner(config, config.model.history, device)
    trust_ids(learner.model)  # before the first step, when the blocks build_learner compiled are traced
    return options, config, device, learner


def warmed_learner(preset: str, batch_size: int, staged: int, overrides: Sequence[str] = ()
                   ) -> tuple[TrainBenchOptions, Learner, list]:
    """:func:`compiled_learner`, run until no step tunes or compiles, and the stream's next ``staged`` batches already
    on the device (so what a diagnostic then measures is the steps, not the loader)."""
    from opengem.train.bench.timing import warm_until_settled
    from opengem.train.data_stream import train_batches

    options, config, device, learner = compiled_learner(preset, batch_size, overrides)
    stream = train_batches(config, start_step=0)
    warm_until_settled(lambda: learner.step(next(stream).to(device, non_blocking=True)), options.warmup,
                       options.max_tuning_steps, sync=torch.cuda.synchronize)  # fmt: skip
    return options, learner, [next(stream).to(device, non_blocking=True) for _ in range(staged)]


def write_diagnostic(name: str, args: argparse.Namespace, options: TrainBenchOptions, **figures: Any) -> None:
    """``figures`` as JSON at ``args.out``, with the run's preset, batch size, steps, overrides and environment."""
    from benchmarks.common import environment

    payload = {"benchmark": name, "preset": args.preset, "batch_size": args.batch_size, "steps": args.steps,
               "overrides": list(options.overrides), "environment": environment(), **figures}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.out}")


Result = TypeVar("Result")


def timed(run: Callable[[], Result], sync: Callable[[], None]) -> tuple[float, Result]:
    """``(seconds, result)`` of ``run``, timed on the host between two ``sync`` calls that drain the device queue
    (so the time is the work's, queued before and after alike)."""
    sync()
    start = time.perf_counter()
    result = run()
    sync()
    return time.perf_counter() - start, result


def abba(rounds: int, modes: tuple[str, str]) -> list[tuple[str, str]]:
    """The two ``modes``' order in each of ``rounds`` rounds, flipped every round (ABBA), so that each runs first in
    half the rounds and a drift of the host's pace falls on both alike."""
    if rounds < 2 or rounds % 2:
        raise ValueError(f"rounds must be an even number >= 2 (ABBA), got {rounds}")
    return [modes if r % 2 == 0 else modes[::-1] for r in range(rounds)]


def diagnostic_parser(description: str, preset: str, batch_size: int, steps_help: str,
                      out: str) -> argparse.ArgumentParser:
    """The flags every step diagnostic takes (``--preset``, ``--batch-size``, ``--steps``, ``--out``, ``--set``),
    with its defaults; add its own, then :func:`parse_diagnostic_args`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--preset", default=preset)
    parser.add_argument("--batch-size", type=int, default=batch_size)
    parser.add_argument("--steps", type=int, default=2, help=steps_help)
    parser.add_argument("--out", type=Path, default=Path(out))
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a training setting, as bench train's --set (e.g. compile_cpp_wrapper=true)")
    return parser


def parse_diagnostic_args(parser: argparse.ArgumentParser, needs_cuda: str) -> argparse.Namespace:
    """The parsed flags; exits naming the problem on ``--steps`` under 1, or without CUDA (``needs_cuda``: why the
    diagnostic needs it)."""
    args = parser.parse_args()
    if args.steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {args.steps}")
    if not torch.cuda.is_available():
        raise SystemExit(f"{needs_cuda}: it needs a CUDA device")
    return args
