"""Where a training step's time goes: profiler ranges and the kernels (or CPU ops) inside them.

The benchmark marks the data fetch, the host-to-device copy and the model's forward with
``record_function`` ranges; backward work is found under the autograd engine's
``autograd::engine::evaluate_function`` events, optimizer work under ``Optimizer.step#...`` /
``Optimizer.zero_grad#...``, and embedding work (lookups and the fused sparse update in the backward)
under the ``opengem::embedding*`` ops. Each CUDA kernel (or, on a CPU run, each op's self CPU time) goes
to the innermost of those it was launched from. ``data`` is the host time spent in the data range
(the GPU is idle then while the step synchronizes on the host; it overlaps GPU work otherwise).

On CUDA a kernel is placed by its launch: the CUDA runtime or driver call (``cudaLaunchKernel``,
``cuLaunchKernelEx``, ``cudaMemcpyAsync``...) that carries the kernel's correlation id, at the innermost
marker range whose time span holds the call (forward and backward run on different threads but never at
once, so time decides). The profiler's own kernel-to-op links (``FunctionEvent.kernels``) are the
cross-check: on an H200 with torch 2.11 they covered only 2 of 35 ms of a gem-tiny step.
``unattributed``: GPU time of kernels with no launch call in the trace (a large value means the split
above under-counts).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import record_function

from opengem.data.schema import Batch
from opengem.train.bench.kernels import device_work

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
        if (phase := _marker_phase(current.name)) is not None:
            return phase
        current = current.cpu_parent
    return "other"


def phase_split_us(events: Iterable[FunctionEvent], device: torch.device) -> dict[str, float]:
    """Microseconds per phase: CUDA kernel time on a GPU (host time for ``data``), self CPU time on a CPU."""
    events = list(events)
    if device.type != "cuda":
        totals = dict.fromkeys(PHASES, 0.0)
        for event in events:
            if event.device_type == torch.autograd.DeviceType.CPU and not event.is_async and event.self_cpu_time_total:
                totals[phase_of(event)] += event.self_cpu_time_total
        return totals
    by_launch, by_link = _split_by_launch(events), _split_by_kernel_links(events)
    attributed = lambda totals: sum(v for k, v in totals.items() if k not in ("data", "unattributed"))
    return by_launch if attributed(by_launch) >= attributed(by_link) else by_link


def _with_data_and_unattributed(totals: dict[str, float], events: list[FunctionEvent]) -> dict[str, float]:
    totals["data"] += sum(e.cpu_time_total for e in events if e.name == DATA_RANGE and not e.is_async)
    device_total = _union_length((start, end) for _, start, end in device_work(events))  # GPU busy time
    totals["unattributed"] = max(0.0, device_total - sum(v for k, v in totals.items() if k != "data"))
    return totals


def _split_by_kernel_links(events: list[FunctionEvent]) -> dict[str, float]:
    """Each CPU op's linked kernels (``FunctionEvent.kernels``) to the op's phase."""
    totals = dict.fromkeys(PHASES, 0.0)
    for event in events:
        if event.device_type == torch.autograd.DeviceType.CPU and not event.is_async and event.kernels:
            totals[phase_of(event)] += sum(kernel.duration for kernel in event.kernels)
    return _with_data_and_unattributed(totals, events)


def _split_by_launch(events: list[FunctionEvent]) -> dict[str, float]:
    """Each device event to the phase of the marker range holding its launch call (same correlation id)."""
    cpu = torch.autograd.DeviceType.CPU
    # runtime / driver calls only: a PyTorch op's id is another numbering and may collide with a correlation id
    launches = {e.id: e for e in events if e.device_type == cpu and e.name.startswith("cu")}
    markers = sorted(
        (e.time_range.start, e.time_range.end, phase)
        for e in events if e.device_type == cpu and (phase := _marker_phase(e.name)) is not None
    )  # fmt: skip
    placed = [(launch.time_range.start, kernel) for kernel in device_work(events).values()
              if (launch := launches.get(kernel.id)) is not None]  # fmt: skip
    totals = dict.fromkeys(PHASES, 0.0)
    for phase, kernel in zip(_phases_at(markers, [t for t, _ in placed]), (k for _, k in placed), strict=True):
        totals[phase] += kernel.time_range.end - kernel.time_range.start
    return _with_data_and_unattributed(totals, events)


def _marker_phase(name: str) -> str | None:
    if name.startswith("opengem::embedding"):
        return "embeddings"
    if name.startswith("Optimizer."):
        return "optimizer"
    if name.startswith("autograd::engine::evaluate_function"):
        return "backward"
    return {FORWARD_RANGE: "forward", HOST_TO_DEVICE_RANGE: "host_to_device", DATA_RANGE: "data"}.get(name)


def _phases_at(markers: list[tuple[int, int, str]], times: list[int]) -> list[str]:
    """For each time, the phase of the shortest marker range holding it (the innermost), else ``other``.
    A sweep over both in time order: the open ranges at any time are few (the nesting depth)."""
    phases = ["other"] * len(times)
    open_ranges: list[tuple[int, int, str]] = []
    next_marker = 0
    for index in sorted(range(len(times)), key=times.__getitem__):
        time = times[index]
        while next_marker < len(markers) and markers[next_marker][0] <= time:
            open_ranges.append(markers[next_marker])
            next_marker += 1
        open_ranges = [r for r in open_ranges if r[1] >= time]
        if open_ranges:
            phases[index] = min(open_ranges, key=lambda r: r[1] - r[0])[2]
    return phases


def _union_length(intervals: Iterable[tuple[int, int]]) -> int:
    """Total length covered by the intervals: busy time, whatever overlaps or repeats the profiler reports."""
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total, reach = total + end - start, end
        elif end > reach:
            total, reach = total + end - reach, end
    return total
