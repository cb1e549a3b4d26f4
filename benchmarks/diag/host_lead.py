"""Diagnostic (issue 10): where in a training step the GPU waits for the host, without a profiler.

gem-large b512's timed steps idle the GPU 12-19 ms a step (session 31, ``bench train``), but any profiler slows the
host enough to move the gaps (a kernels-only profile showed 40-62 ms of them). This marks points of the step on the
host: each GEM layer's forward call and its return, the moment autograd reaches the layer's output gradient (its
backward starts), the model's forward, the optimizer step. At each mark it records a CUDA event and the host clock.
One synchronization before the steps aligns the two clocks; after them, each mark's *lead* is how long after the host
reached it the GPU did: a lead near 0 means the GPU had drained its queue and waited for the host there. Between two
marks, the GPU span minus the host span says who was slower. Each step's garbage collections and the caching
allocator's trips to the driver are counted beside (host-side counters), the host stalls a step may hide.

Once the launch queue is full the host runs at the GPU's pace, so the host time between marks then says nothing of
its own. ``--drain-before-step`` synchronizes before each marked step: the forward then starts on an empty queue and
its host ms between marks are the host's own pace (session 32: the lead shrank through every forward).
``--profile-forward`` runs cProfile over the model's forward in the marked steps and keeps the functions with the
most own time (cProfile slows Python code, so read their shares, not their milliseconds).

    PYTHONPATH=src:. python -m benchmarks.diag.host_lead [--preset gem-large] [--batch-size 512] [--steps 6]
        [--drain-before-step] [--profile-forward] [--out benchmarks/results/host_lead_gem-large_b512.json]

Compiled and warmed exactly as ``opengem bench train --compile`` (the same batches, replayed after the warm-up).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import json
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.common import environment
from benchmarks.diag.compiled_learner import compiled_learner
from opengem.train.bench.timing import warm_until_settled
from opengem.train.bench.watch import allocator_counts
from opengem.train.data_stream import train_batches


@dataclass
class Marks:
    """(name, host seconds, event) per mark, in the order the host reached them; ``recording`` gates them."""

    taken: list[tuple[str, float, Any]] = field(default_factory=list)
    recording: bool = False

    def mark(self, name: str) -> None:
        if not self.recording:
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.taken.append((name, time.perf_counter(), event))


class Marked(nn.Module):
    """A module whose calls mark their start and end, and, through a hook on the first output tensor that needs a
    gradient, the moment autograd reaches that gradient (the module's backward starts after it)."""

    def __init__(self, inner: nn.Module, name: str, marks: Marks) -> None:
        super().__init__()
        self.inner, self.name, self.marks = inner, name, marks

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.marks.mark(f"{self.name} forward")
        out = self.inner(*args, **kwargs)
        self.marks.mark(f"{self.name} forward end")
        first = next((t for t in (out if isinstance(out, tuple) else (out,))
                      if isinstance(t, torch.Tensor) and t.requires_grad), None)  # fmt: skip
        if first is not None:
            first.register_hook(lambda grad: self.marks.mark(f"{self.name} backward"))
        return out


class Profiled(nn.Module):
    """A module whose calls run under ``profiler`` while ``marks.recording``."""

    def __init__(self, inner: nn.Module, marks: Marks, profiler: cProfile.Profile) -> None:
        super().__init__()
        self.inner, self.marks, self.profiler = inner, marks, profiler

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.marks.recording:
            return self.inner(*args, **kwargs)
        self.profiler.enable()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.profiler.disable()


def instrument(learner: Any, marks: Marks, profiler: cProfile.Profile | None = None) -> None:
    """Marks on the model's forward, each GEM layer (forward, end, backward) and the optimizer step; with
    ``profiler``, the model's forward (the layers' marks included) runs under it."""
    model = learner.model
    for i, layer in enumerate(model.layers):
        model.layers[i] = Marked(layer, f"layer {i}", marks)
    learner.model = Marked(model if profiler is None else Profiled(model, marks, profiler), "model", marks)
    learner.optimizer.register_step_pre_hook(lambda *_: marks.mark("optimizer"))
    learner.optimizer.register_step_post_hook(lambda *_: marks.mark("optimizer end"))


def leads(marks: Marks, steps: int, reference: torch.cuda.Event, host_zero: float) -> list[dict[str, Any]]:
    """Per mark (in step order, over every step but the first, whose queue starts empty after the alignment):
    its lead in each step (GPU time of the mark less host time of it, ms), their mean and minimum, and the mean host
    and GPU ms since the previous mark."""
    per_step = len(marks.taken) // steps
    if per_step * steps != len(marks.taken):
        raise ValueError(f"{len(marks.taken)} marks over {steps} steps: the steps marked different points")
    rows: dict[int, dict[str, list[float]]] = {}
    previous: tuple[float, float] | None = None
    for index, (name, host_s, event) in enumerate(marks.taken):
        host_ms, gpu_ms = 1e3 * (host_s - host_zero), reference.elapsed_time(event)
        step, slot = divmod(index, per_step)
        if step > 0 and previous is not None:
            row = rows.setdefault(slot, {"lead": [], "host": [], "gpu": []})
            row["lead"].append(gpu_ms - host_ms)
            row["host"].append(host_ms - previous[0])
            row["gpu"].append(gpu_ms - previous[1])
        previous = (host_ms, gpu_ms)
    names = [name for name, _, _ in marks.taken[:per_step]]
    return [{"mark": names[slot], "lead_ms_each_step": r["lead"], "lead_ms": statistics.fmean(r["lead"]),
             "min_lead_ms": min(r["lead"]), "host_ms_since_previous": statistics.fmean(r["host"]),
             "gpu_ms_since_previous": statistics.fmean(r["gpu"])}
            for slot, r in sorted(rows.items())]  # fmt: skip


def step_spans(marks: Marks, steps: int, reference: torch.cuda.Event) -> list[dict[str, float]]:
    """Host and GPU ms from each step's first mark to the next step's (every step but the last)."""
    per_step = len(marks.taken) // steps
    firsts = marks.taken[::per_step]
    return [{"host_ms": 1e3 * (b[1] - a[1]), "gpu_ms": reference.elapsed_time(b[2]) - reference.elapsed_time(a[2])}
            for a, b in zip(firsts, firsts[1:])]  # fmt: skip


@contextmanager
def collector_time(totals: list[float]) -> Iterator[None]:
    """Appends the seconds of each garbage collection run inside the block to ``totals``."""
    started: list[float] = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            totals.append(time.perf_counter() - started.pop())

    gc.callbacks.append(callback)
    try:
        yield
    finally:
        gc.callbacks.remove(callback)


def top_functions(profiler: cProfile.Profile, count: int = 40) -> str:
    """The ``count`` functions with the most own time (cProfile's table; a line saying so when nothing ran)."""
    if not profiler.getstats():
        return "nothing ran under the profiler"
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(count)
    return text.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gem-large")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=6, help="marked steps (the first only sets the queue going)")
    parser.add_argument("--drain-before-step", action="store_true",
                        help="synchronize before each marked step: the forward runs at the host's own pace")
    parser.add_argument("--profile-forward", action="store_true", help="cProfile of the model's forward (module doc)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/host_lead_gem-large_b512.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_lead sets CUDA events against the host clock: it needs a CUDA device")
    if args.steps < 2:
        raise SystemExit(f"--steps must be >= 2 (the first marked step is not reported), got {args.steps}")
    options, config, device, learner = compiled_learner(args.preset, args.batch_size)
    marks = Marks()
    profiler = cProfile.Profile() if args.profile_forward else None
    instrument(learner, marks, profiler)
    stream = train_batches(config, start_step=0)
    warm_until_settled(lambda: learner.step(next(stream).to(device, non_blocking=True)), options.warmup + args.steps,
                       options.max_tuning_steps, sync=torch.cuda.synchronize)  # fmt: skip
    stream = train_batches(config, start_step=0)  # the marked steps replay batches the warm-up ran
    batches = [next(stream) for _ in range(args.steps)]
    torch.cuda.synchronize()
    reference = torch.cuda.Event(enable_timing=True)
    reference.record()
    reference.synchronize()
    host_zero = time.perf_counter()  # the GPU ran ``reference`` just before: the clocks agree to ~10 us
    collections: list[float] = []
    allocator = [allocator_counts()]  # per step: the caching allocator's trips to the driver (cudaMalloc) and retries
    marks.recording = True
    with collector_time(collections):
        for batch in batches:
            if args.drain_before_step:
                torch.cuda.synchronize()
            marks.mark("step")
            learner.step(batch.to(device, non_blocking=True))
            allocator.append(allocator_counts())
    marks.recording = False
    mallocs = [{name: b[name] - a[name] for name in a} for a, b in zip(allocator, allocator[1:])]
    torch.cuda.synchronize()
    rows, spans = leads(marks, args.steps, reference, host_zero), step_spans(marks, args.steps, reference)
    print(f"{args.steps} marked steps; host / GPU ms of each step (first mark to the next step's): "
          + ", ".join(f"{s['host_ms']:.1f} / {s['gpu_ms']:.1f}" for s in spans)
          + f"; {len(collections)} garbage collections, {1e3 * sum(collections):.1f} ms; device mallocs / retries "
          + "each step: " + ", ".join(f"{m['device_mallocs']} / {m['alloc_retries']}" for m in mallocs))
    print("per mark: lead in each step after the first (ms), mean host / GPU ms since the previous mark")
    for r in rows:
        print(" ".join(f"{lead:7.2f}" for lead in r["lead_ms_each_step"])
              + f"   {r['host_ms_since_previous']:7.2f} {r['gpu_ms_since_previous']:7.2f}  {r['mark']}")
    forward_profile = top_functions(profiler) if profiler is not None else None
    if forward_profile is not None:
        print(forward_profile)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": "host_lead", "preset": args.preset, "batch_size": args.batch_size, "steps": args.steps,
               "drain_before_step": args.drain_before_step, "environment": environment(), "step_spans": spans,
               "collections_ms": [1e3 * c for c in collections], "allocator_each_step": mallocs, "marks": rows,
               "forward_profile": forward_profile}  # fmt: skip
    args.out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
