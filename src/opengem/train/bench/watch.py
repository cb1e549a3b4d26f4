"""Host-side events that stall a training step for far longer than its kernels, counted so a timed window
can say whether it held one: an autotuner timing candidates, a Triton kernel loaded (a new JIT
specialization of one of ours, or an Inductor kernel: 0.1-1 s each), a Dynamo graph compiled, a Python
garbage collection; and the CUDA caching allocator going to the driver (``cudaMalloc`` of a new segment, which
jagged batches of a new size can need, and a retry after freeing the cache: both stall the host, a free
synchronizes the device). Counters only, no device synchronization."""

from __future__ import annotations

import gc
import time
from typing import NamedTuple

_loaded_kernels: list[str] = []
_gc = {"ms": 0.0, "began": 0.0}
_installed = False


class HostEvents(NamedTuple):
    autotuner_keys: int
    kernels_loaded: int
    dynamo_graphs: int
    gc_ms: float
    device_mallocs: int = 0  # segments the CUDA caching allocator allocated from the driver
    alloc_retries: int = 0  # allocations that freed the cache and retried (a device synchronization)

    def since(self, before: HostEvents) -> HostEvents:
        return HostEvents(*(now - then for now, then in zip(self, before)))

    def compiled_since(self, before: HostEvents) -> bool:
        """Whether anything was tuned or compiled after ``before`` (a collection alone is not a compile)."""
        return self[:3] != before[:3]


def _on_kernel_load(module, function, name, metadata_group, hash) -> None:  # noqa: A002 (Triton's hook signature)
    _loaded_kernels.append(name)


def _on_gc(phase: str, info: dict) -> None:
    if phase == "start":
        _gc["began"] = time.perf_counter()
    else:
        _gc["ms"] += 1e3 * (time.perf_counter() - _gc["began"])


def _install() -> None:
    global _installed
    if _installed:
        return
    try:
        from triton import knobs

        knobs.runtime.kernel_load_end_hook.add(_on_kernel_load)
    except (ImportError, AttributeError):  # no Triton (or one without load hooks): nothing loads kernels
        pass
    gc.callbacks.append(_on_gc)
    _installed = True


def host_events(allocator: bool = True) -> HostEvents:
    """Totals so far (the kernel-load and collection counters start at the first call). Autotuner keys:
    the settled configurations of opengem's kernels (``opengem.ops.triton.tuning``, imported at the call).
    ``allocator=False`` leaves the allocator's counters at 0: reading them builds the dict of all its statistics,
    host work a per-step look inside a timed window should not add (`allocator_counts` at the window's end)."""
    from opengem.ops.triton.tuning import tuned_keys

    _install()
    try:
        from torch._dynamo.utils import counters

        graphs = int(counters["stats"]["unique_graphs"])
    except ImportError:
        graphs = 0
    counts = allocator_counts() if allocator else {}
    return HostEvents(tuned_keys(), len(_loaded_kernels), graphs, _gc["ms"], **counts)


def allocator_counts() -> dict[str, int]:
    """The CUDA caching allocator's cumulative segment allocations and retries (its host-side counters), as
    `HostEvents` fields; zeros without an initialized CUDA context."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {"device_mallocs": 0, "alloc_retries": 0}
    stats = torch.cuda.memory_stats()
    return {"device_mallocs": int(stats.get("segment.all.allocated", 0)),
            "alloc_retries": int(stats.get("num_alloc_retries", 0))}


def kernels_loaded_since(before: HostEvents) -> list[str]:
    """Names of the Triton kernels loaded after ``before`` was taken, in load order."""
    return _loaded_kernels[before.kernels_loaded:]


def events_report(before: HostEvents, limit: int = 20, after: HostEvents | None = None) -> dict[str, object]:
    """What happened after ``before`` (until ``after``, default now): the counts, and the first ``limit``
    kernels loaded."""
    delta = (host_events() if after is None else after).since(before)
    return {**delta._asdict(), "gc_ms": round(delta.gc_ms, 3), "kernels": kernels_loaded_since(before)[:limit]}
