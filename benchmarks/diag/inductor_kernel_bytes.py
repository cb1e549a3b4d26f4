"""Diagnostic (issue 10): how close each Inductor kernel of a compiled training step runs to the memory bandwidth.

gem-large b512 BF16 spends ~57 ms a step in Inductor's fused element-wise kernels (layer norms with their
backward, GELU, bias sums; session 28's profile). This times every Inductor kernel launch of a few steps with
CUDA events around it, counts the bytes of its tensor arguments (in-out buffers twice, as Inductor's own
``profile_bandwidth`` does: an upper bound on what it moves when it reads a tensor in part), and sets each
kernel's bandwidth against a device-to-device copy timed in the same run. The kernels' Triton sources, the most
costly first, go beside the JSON so what each one fuses can be read.

    PYTHONPATH=src:. python -m benchmarks.diag.inductor_kernel_bytes [--preset gem-large] [--batch-size 512]
        [--warm-steps 3] [--steps 2] [--out benchmarks/results]

Compiled and tuned exactly as ``opengem bench train --compile`` (same Inductor settings, so the compile cache
serves both); no profiler.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch._inductor.runtime.triton_heuristics import CachingAutotuner

from benchmarks.block_attention import copy_bandwidth_gbps
from benchmarks.common import environment
from benchmarks.diag.compiled_learner import compiled_learner
from opengem.train.data_stream import train_batches


@dataclass
class Launches:
    """Inductor kernel launches seen while recording: name, bytes of its tensor arguments, start / end events."""

    records: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)
    sources: dict[str, str] = field(default_factory=dict)
    recording: bool = False


def argument_bytes(tuner: CachingAutotuner, args: tuple[Any, ...]) -> int:
    """Bytes of the tensor arguments; ``in_out_ptr`` buffers (read and written) twice."""
    names = list(getattr(tuner.fn, "arg_names", []))
    total = 0
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            twice = i < len(names) and names[i].startswith("in_out_ptr")
            total += arg.numel() * arg.element_size() * (2 if twice else 1)
    return total


@contextmanager
def timed_launches(launches: Launches) -> Iterator[None]:
    """Wrap ``CachingAutotuner.run`` (every Inductor Triton kernel's launch) while the context is open."""
    original = CachingAutotuner.run

    def run(self: CachingAutotuner, *args: Any, stream: Any, **kwargs: Any) -> Any:
        if not launches.recording:
            return original(self, *args, stream=stream, **kwargs)
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        launches.sources.setdefault(name, getattr(self.fn, "src", ""))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = original(self, *args, stream=stream, **kwargs)
        end.record()
        launches.records.append((name, argument_bytes(self, args), start, end))
        return result

    CachingAutotuner.run = run
    try:
        yield
    finally:
        CachingAutotuner.run = original


def per_kernel(launches: Launches, steps: int, copy_gbps: float) -> list[dict[str, Any]]:
    """One row per kernel name: calls, milliseconds and GB a step, GB/s and its share of the copy's."""
    ms: dict[str, float] = defaultdict(float)
    nbytes: dict[str, int] = defaultdict(int)
    calls: dict[str, int] = defaultdict(int)
    for name, size, start, end in launches.records:
        ms[name] += start.elapsed_time(end)
        nbytes[name] += size
        calls[name] += 1
    rows = []
    for name in sorted(ms, key=ms.get, reverse=True):
        gbps = nbytes[name] / ms[name] / 1e6 if ms[name] > 0 else float("nan")
        rows.append({
            "kernel": name, "calls_per_step": calls[name] / steps, "ms_per_step": ms[name] / steps,
            "gb_per_step": nbytes[name] / steps / 1e9, "gbps": gbps, "copy_share": gbps / copy_gbps,
            "ms_at_copy_rate": nbytes[name] / steps / copy_gbps / 1e6,
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gem-large")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--warm-steps", type=int, default=3, help="untimed steps first (compile, tuning)")
    parser.add_argument("--steps", type=int, default=2, help="steps whose launches are timed")
    parser.add_argument("--sources", type=int, default=16, help="Triton sources written, the costliest first")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("inductor_kernel_bytes times Inductor's Triton kernels: it needs a CUDA device")
    if args.warm_steps < 1 or args.steps < 1:
        raise SystemExit(f"--warm-steps and --steps must be >= 1, got {args.warm_steps} and {args.steps}")
    _, config, device, learner = compiled_learner(args.preset, args.batch_size)
    stream = train_batches(config, start_step=0)
    launches = Launches()
    with timed_launches(launches):
        for step in range(args.warm_steps + args.steps):
            launches.recording = step >= args.warm_steps
            learner.step(next(stream).to(device, non_blocking=True))
            print(f"step {step} done", flush=True)
        torch.cuda.synchronize()
    copy_gbps = copy_bandwidth_gbps()
    rows = per_kernel(launches, args.steps, copy_gbps)
    total_ms = sum(r["ms_per_step"] for r in rows)
    floor_ms = sum(r["ms_at_copy_rate"] for r in rows)
    print(f"{len(rows)} Inductor kernels, {total_ms:.2f} ms a step, {floor_ms:.2f} ms at the copy's "
          f"{copy_gbps:.0f} GB/s for their argument bytes")
    for r in rows[:40]:
        print(f"{r['ms_per_step']:8.3f} ms {r['calls_per_step']:5.1f} calls {r['gb_per_step']:7.2f} GB "
              f"{r['gbps']:7.0f} GB/s ({100 * r['copy_share']:3.0f}% of copy)  {r['kernel']}")
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"inductor_kernel_bytes_{args.preset}_b{args.batch_size}"
    payload = {"benchmark": "inductor_kernel_bytes", "environment": environment(), "preset": args.preset,
               "batch_size": args.batch_size, "steps": args.steps, "copy_gbps": copy_gbps,
               "total_ms_per_step": total_ms, "ms_at_copy_rate_per_step": floor_ms,
               "bytes": "tensor arguments of each launch, in-out buffers twice", "rows": rows}  # fmt: skip
    (args.out / f"{stem}.json").write_text(json.dumps(payload, indent=1))
    with open(args.out / f"{stem}_sources.txt", "w") as sources:
        for r in rows[: args.sources]:
            sources.write(f"# ===== {r['kernel']}: {r['ms_per_step']:.3f} ms a step, {r['gbps']:.0f} GB/s\n")
            sources.write(launches.sources.get(r["kernel"], "") + "\n")
    print(f"wrote {args.out / stem}.json and _sources.txt")


if __name__ == "__main__":
    main()
