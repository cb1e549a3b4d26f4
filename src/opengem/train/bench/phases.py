"""Where a training step's time goes: profiler ranges and the kernels (or CPU ops) inside them.

The benchmark marks the data fetch, the host-to-device copy and the model's forward with
``record_function`` ranges; backward work is found under the autograd engine's
``autograd::engine::evaluate_function`` events, optimizer work under ``Optimizer.step#...`` /
``Optimizer.zero_grad#...``, and embedding work (lookups and the fused sparse update in the backward)
under the ``opengem::embedding*`` ops. Each CUDA kernel (or, on a CPU run, each op's self CPU time) goes
to the innermost of those it was launched from. ``data`` is the host time spent in the data range
(the GPU is idle then while the step synchronizes on the host; it overlaps GPU work otherwise).
``unattributed``: GPU time of kernels the profiler could not link to the op that launched them (0 when
every launch is correlated; a large value means the split above under-counts).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import record_function

from opengem.data.schema import Batch

DATA_RANGE = "opengem.bench/data"
HOST_TO_DEVICE_RANGE = "opengem.bench/host_to_device"
FORWARD_RANGE = "opengem.bench/forward"
PHASES = ("data", "host_to_device", "forward", "embeddings", "backward", "optimizer", "other", "unattributed")


class ForwardRange(nn.Module):
    """Wraps a model so its forward runs inside the forward profiler range (parameters are shared)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Batch) -> torch.Tensor:
        with record_function(FORWARD_RANGE):
            return self.model(batch)


def phase_of(event: FunctionEvent) -> str:
    """The phase of a profiler event: the first marker found walking from it up its CPU parents."""
    current: FunctionEvent | None = event
    while current is not None:
        name = current.name
        if name.startswith("opengem::embedding"):
            return "embeddings"
        if name.startswith("Optimizer."):
            return "optimizer"
        if name == FORWARD_RANGE:
            return "forward"
        if name.startswith("autograd::engine::evaluate_function"):
            return "backward"
        if name == HOST_TO_DEVICE_RANGE:
            return "host_to_device"
        if name == DATA_RANGE:
            return "data"
        current = current.cpu_parent
    return "other"


def phase_split_us(events: Iterable[FunctionEvent], device: torch.device) -> dict[str, float]:
    """Microseconds per phase: CUDA kernel time on a GPU (host time for ``data``), self CPU time on a CPU."""
    totals = dict.fromkeys(PHASES, 0.0)
    device_spans: set[tuple[str, int, int]] = set()  # kernels, memcpys, memsets
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CPU:
            device_spans.add((event.name, event.time_range.start, event.time_range.end))
            continue
        if event.is_async:
            continue
        if device.type == "cuda":
            if event.name == DATA_RANGE:
                totals["data"] += event.cpu_time_total
            spent = sum(kernel.duration for kernel in event.kernels)
        else:
            spent = event.self_cpu_time_total
        if spent:
            totals[phase_of(event)] += spent
    if device.type == "cuda":
        attributed = sum(v for k, v in totals.items() if k != "data")
        device_total = _union_length((start, end) for _, start, end in device_spans)  # GPU busy time
        totals["unattributed"] = max(0.0, device_total - attributed)
    return totals


def _union_length(intervals: Iterable[tuple[int, int]]) -> int:
    """Total length covered by the intervals: busy time, whatever overlaps or repeats the profiler reports."""
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total
