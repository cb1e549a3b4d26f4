"""GPU time of a profiled step by kernel family: what the MFU gap is made of.

Families: ``gemm`` (cuBLAS / CUTLASS / nvjet kernels, Inductor's extern GEMMs), ``attention`` and
``embedding`` and ``low_precision`` (opengem's own Triton kernels, named from the modules that define
them), ``optimizer`` (AdamW's multi-tensor kernels), ``fused_elementwise`` (Inductor's generated
``triton_*`` kernels: norms, casts, activations, residual adds), ``copy`` (memcpy / memset / copies),
and ``other`` (eager element-wise and reduction kernels, everything else).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import types
from collections.abc import Iterable
from typing import Literal

import torch
from torch.autograd.profiler_util import FunctionEvent

import opengem.ops.triton as triton_ops

FAMILIES = ("gemm", "attention", "embedding", "low_precision", "optimizer", "fused_elementwise", "copy", "other")
_MODULE_FAMILY = {  # opengem.ops.triton module -> family of its kernels
    "jagged_attention": "attention", "jagged_attention_fp8": "attention", "gdpa": "attention",
    "gdpa_kernels": "attention", "block_attention": "attention", "masks": "attention", "activations": "attention",
    "embedding": "embedding", "fp8_gemm": "low_precision", "mx": "low_precision",
    "qkv_projection_fp8": "low_precision",  # the QKV GEMM that quantizes for FP8 attention in its epilogue
}  # fmt: skip
_GEMM_MARKERS = ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "splitk")


def device_work(events: Iterable[FunctionEvent]) -> dict[tuple[str, int, int], FunctionEvent]:
    """Kernels, memcpys and memsets by (name, start, end), once each (the profiler may list one twice).
    ``record_function`` ranges also come back as device events (GPU user annotations spanning their
    kernels): on an H200 with torch 2.11 they made 46 of 48 ms of a gem-tiny step's "device time"."""
    cpu = torch.autograd.DeviceType.CPU
    return {(e.name, e.time_range.start, e.time_range.end): e for e in events
            if e.device_type != cpu and not getattr(e, "is_user_annotation", False)}  # fmt: skip


@functools.cache
def opengem_kernel_families() -> dict[str, str]:
    """Name of every ``@triton.jit`` function in ``opengem.ops.triton`` -> its family."""
    names: dict[str, str] = {}
    for info in pkgutil.iter_modules(triton_ops.__path__):
        family = _MODULE_FAMILY.get(info.name)
        if family is None:
            continue
        module = importlib.import_module(f"{triton_ops.__name__}.{info.name}")
        for value in vars(module).values():
            fn = _python_function(value)
            if fn is not None and fn.__module__ == module.__name__:
                names[fn.__name__] = family
    return names


def _python_function(value: object) -> types.FunctionType | None:
    """The Python function under a jit function (through autotuner / heuristics / interpreter wrappers)."""
    for _ in range(4):
        value = getattr(value, "fn", None)
        if isinstance(value, types.FunctionType):
            return value
    return None


def kernel_family(name: str) -> str:
    ours = opengem_kernel_families().get(name)
    if ours is not None:
        return ours
    lowered = name.lower()
    if any(marker in lowered for marker in _GEMM_MARKERS):
        return "gemm"
    if "adam" in lowered or "multi_tensor_apply" in lowered:
        return "optimizer"
    if name.startswith("triton_"):
        return "fused_elementwise"
    if "memcpy" in lowered or "memset" in lowered or "copy" in lowered:
        return "copy"
    return "other"


def family_split(events: Iterable[FunctionEvent]) -> tuple[dict[str, float], dict[str, int]]:
    """Device microseconds and launches (kernels, memcpys, memsets) per family, each kernel once. Launches matter
    when the GPU's idle is the few microseconds between consecutive kernels (session 33)."""
    us, launches = dict.fromkeys(FAMILIES, 0.0), dict.fromkeys(FAMILIES, 0)
    for name, start, end in device_work(events):
        family = kernel_family(name)
        us[family] += end - start
        launches[family] += 1
    return us, launches


def top_kernels(
    events: Iterable[FunctionEvent], steps: int, count: int = 25, by: Literal["time", "launches"] = "time"
) -> list[dict[str, object]]:
    """The ``count`` kernels with the most GPU time (``by="launches"``: the most launches), per step: what to attack
    first in a family's total, or where a step's launches (and the gap each costs) come from."""
    if by not in ("time", "launches"):
        raise ValueError(f"top_kernels ranks by 'time' or 'launches', got {by!r}")
    totals: dict[str, list[float]] = {}
    for name, start, end in device_work(events):
        entry = totals.setdefault(name, [0.0, 0])
        entry[0] += end - start
        entry[1] += 1
    rank = 0 if by == "time" else 1
    ranked = sorted(totals.items(), key=lambda item: (item[1][rank], item[1][0]), reverse=True)[:count]
    return [{"name": name, "family": kernel_family(name), "ms_per_step": us / 1e3 / steps, "calls_per_step": calls / steps}
            for name, (us, calls) in ranked]


def idle_gaps(
    events: Iterable[FunctionEvent], steps: int, min_gap_us: float = 10.0, count: int = 10
) -> dict[str, object]:
    """Where the GPU waits between the first and the last device work of the profiled steps, per step.

    ``idle_ms_per_step``: every gap; ``spacing_ms_per_step``: the part in gaps shorter than ``min_gap_us`` (kernels
    that follow each other from a full queue); ``gaps``: the ``count`` costliest (previous kernel, next kernel) pairs
    among the longer gaps, where the next kernel started late (under a profiler, mostly because the profiled host
    launched it late). The profiler slows the host, so these overstate the timed steps' gaps; they say where, not how
    much (``benchmarks.diag.host_lead`` found gem-large's timed host 23-81 ms ahead of the GPU, session 31).
    """
    work = sorted(device_work(events), key=lambda item: (item[1], item[2]))
    idle = spacing = 0.0
    pairs: dict[tuple[str, str], list[float]] = {}
    if work:
        previous, busy_until = work[0][0], work[0][2]
        for name, start, end in work[1:]:
            gap = start - busy_until
            if gap > 0:
                idle += gap
                if gap < min_gap_us:
                    spacing += gap
                else:
                    entry = pairs.setdefault((previous, name), [0.0, 0])
                    entry[0] += gap
                    entry[1] += 1
            if end >= busy_until:
                previous, busy_until = name, end
    ranked = sorted(pairs.items(), key=lambda item: item[1][0], reverse=True)[:count]
    return {
        "idle_ms_per_step": idle / 1e3 / steps,
        "spacing_ms_per_step": spacing / 1e3 / steps,
        "min_gap_us": min_gap_us,
        "gaps": [{"after": after, "before": before, "ms_per_step": us / 1e3 / steps, "gaps_per_step": n / steps}
                 for (after, before), (us, n) in ranked],
    }
