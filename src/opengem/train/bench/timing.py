"""Timing and result-file plumbing shared by the training benchmarks."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from opengem.train.bench.watch import host_events

FLOP_CONVENTION = (
    "useful FLOPs (GEM_SPEC section 8): 2*M*N*K per GEMM on real rows, attention 4*H*D per unmasked pair, "
    "backward 2x GEMMs (the dense features have no input gradient) and 2.5x attention; embeddings, norms, "
    "element-wise and recompute count zero; MFU = FLOP/s / dense BF16 peak, also when FP8 runs"
)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class WindowTimer:
    """Elapsed seconds between ``start()`` and ``stop()``: CUDA events on a GPU (one synchronization, at the
    end of the window), wall clock on the CPU. ``lap()`` after each step marks its end the same way (an
    event, no sync), so :meth:`laps_ms` gives every step's share of the window: a step that waited seconds
    for the host (an autotuner timing its candidates, a compile) stands out from the median there."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def _mark(self) -> torch.cuda.Event | float:
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self._begin, self._laps = self._mark(), []

    def lap(self) -> None:
        self._laps.append(self._mark())

    def stop(self) -> float:
        """Seconds from ``start()`` to the last lap (the end of the last timed step), or to now without laps:
        the bench's bookkeeping after the last step is not the window's (on a busy 2-core CI runner it once
        added 1.5 s to a 150 ms window)."""
        self._end = self._laps[-1] if self._laps else self._mark()
        if self.device.type == "cuda":
            self._end.synchronize()
            return self._begin.elapsed_time(self._end) / 1e3
        return self._end - self._begin

    def laps_ms(self) -> list[float]:
        """Milliseconds from the start (then each lap) to the next lap; call after ``stop()``."""
        marks = [self._begin, *self._laps]
        if self.device.type == "cuda":
            return [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
        return [1e3 * (b - a) for a, b in zip(marks, marks[1:])]


def warm_until_settled(step: Callable[[], object], min_steps: int, max_extra: int, quiet_steps: int = 3,
                       agree: Callable[[bool], bool] = lambda unsettled: unsettled,
                       sync: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.perf_counter,
                       slow_factor: float = 1.5, slow_floor_s: float = 0.05) -> int:
    """Warm-up: ``min_steps`` runs of ``step``, then more (at most ``max_extra``) until ``quiet_steps`` calm
    runs in a row. Returns the extra runs. A run is calm when nothing was tuned or compiled in it (no new
    autotuner key, Triton kernel load or Dynamo graph: :mod:`opengem.train.bench.watch`) and it took at
    most ``slow_factor`` x the fastest run so far (or less than ``slow_floor_s`` more). Each run is timed between two ``sync()`` calls. ``agree`` turns this
    rank's "not settled" into every rank's (an all-reduce under torch.distributed), so all ranks run the
    same steps."""
    seen, calm, ran, fastest = host_events(allocator=False), 0, 0, float("inf")
    while ran < min_steps or (calm < quiet_steps and ran < min_steps + max_extra):
        sync()
        begin = clock()
        step()
        sync()
        took = clock() - begin
        ran += 1
        fastest = min(fastest, took)
        now = host_events(allocator=False)
        slow = ran == 1 or (took > slow_factor * fastest and took - fastest > slow_floor_s)  # 1st: no reference
        calm = 0 if agree(now.compiled_since(seen) or slow) else calm + 1
        seen = now
    return ran - min_steps


def time_ms(fn: Callable[[], Any], device: torch.device, warmup: int = 3, repeats: int = 10) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` runs (after ``warmup`` runs), each timed alone."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    timer, times = WindowTimer(device), []
    for _ in range(repeats):
        timer.start()
        fn()
        times.append(timer.stop() * 1e3)
    return sorted(times)[len(times) // 2]


def environment(device: torch.device) -> dict[str, Any]:
    """Date, versions, device name, git commit (``OPENGEM_GIT_COMMIT`` when the tree has no .git) and
    :func:`opengem_settings`."""
    commit = os.environ.get("OPENGEM_GIT_COMMIT", "")
    if not commit:
        try:
            found = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
            commit = found.stdout.strip() if found.returncode == 0 else ""
        except OSError:
            pass
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "git_commit": commit or "unknown",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "opengem_settings": opengem_settings(),
    }


ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def opengem_settings() -> dict[str, str]:
    """The ``OPENGEM_*`` variables of the environment but the commit, and the CUDA caching allocator's: the kernel
    tuning, launch and memory settings that two runs of an A/B differ in (``benchmarks.common.environment`` records
    them too; gem-large b384 ran out of memory on fragmentation without expandable segments, session 62)."""
    return {name: value for name, value in sorted(os.environ.items())
            if (name.startswith("OPENGEM_") and name != "OPENGEM_GIT_COMMIT") or name in ALLOCATOR_VARIABLES}


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
    return path
