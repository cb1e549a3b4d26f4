"""Host mirrors of small device index tensors (offsets, lengths), so validation and tile scheduling read
them without a device synchronization.

A training step needs the batch layout on the host (to size grids, build tile schedules, check inputs),
and the data loader had it there before the copy to the GPU. Whoever creates a device offsets/lengths
tensor from host values registers the host copy; readers call :func:`host_copy`, which returns the mirror
(or, for an unregistered tensor, reads it once with a sync and caches it). Entries die with their tensor and
are ignored once the tensor is modified in place.

:func:`offsets_summary` derives what validation and scheduling read from an offsets vector (lengths, longest,
first decrease) once per mirrored tensor: every attention layer of a step reads the same batch offsets in its
forward and backward, and recomputing them cost each GDPA call tens of microseconds of host time.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class OffsetsSummary:
    """What checks and tile schedules read from a ``[B + 1]`` offsets vector (from its host copy)."""

    lengths: np.ndarray  # int64 [B]: offsets[1:] - offsets[:-1] (negative where the offsets decrease)
    first: int  # offsets[0]
    last: int  # offsets[-1]
    first_decrease: int  # the first i with offsets[i + 1] < offsets[i], else -1
    longest: int  # max(lengths), 0 for B = 0


# id(device tensor) -> (weak ref, version, host copy, its summary once computed)
_MIRRORS: dict[int, tuple[weakref.ref, int, torch.Tensor, OffsetsSummary | None]] = {}


def register_host_copy(device_tensor: torch.Tensor, host_tensor: torch.Tensor) -> None:
    """Record that ``host_tensor`` (CPU) holds the current contents of ``device_tensor``."""
    if device_tensor.device.type == "cpu" or torch.compiler.is_compiling():
        return
    # a mirror of another shape had been read as the layout (wrong lengths, out-of-range reads) by every check
    if not isinstance(host_tensor, torch.Tensor) or host_tensor.shape != device_tensor.shape:
        got = tuple(host_tensor.shape) if isinstance(host_tensor, torch.Tensor) else type(host_tensor).__name__
        raise ValueError(
            f"host_tensor must be a tensor of device_tensor's shape {tuple(device_tensor.shape)}, got {got}"
        )
    key = id(device_tensor)
    _MIRRORS[key] = (weakref.ref(device_tensor, lambda _: _MIRRORS.pop(key, None)), device_tensor._version, host_tensor,
                     None)


def _entry(tensor: torch.Tensor) -> tuple | None:
    entry = _MIRRORS.get(id(tensor))
    if entry is not None and entry[0]() is tensor and entry[1] == tensor._version:
        return entry
    return None


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor equal to ``tensor``: itself on the CPU, the registered mirror, or (once) a synced copy."""
    if tensor.device.type == "cpu":
        return tensor
    entry = _entry(tensor)
    if entry is not None:
        return entry[2]
    host = tensor.detach().cpu()
    register_host_copy(tensor, host)
    return host


def known_host_copy(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor`` on the CPU, else its registered mirror; None where reading it would synchronize the device."""
    if tensor.device.type == "cpu":
        return tensor
    entry = _entry(tensor)
    return None if entry is None else entry[2]


def offsets_summary(offsets: torch.Tensor) -> OffsetsSummary:
    """The :class:`OffsetsSummary` of a 1-D offsets tensor with at least one entry; computed once per mirrored
    device tensor (and version), each call for a CPU tensor (which may change in place without a mirror)."""
    host_tensor = host_copy(offsets)  # registers the mirror of a device tensor that had none
    entry = None if offsets.device.type == "cpu" else _entry(offsets)
    if entry is not None and entry[3] is not None:
        return entry[3]
    host = host_tensor.numpy().astype(np.int64, copy=False)
    lengths = host[1:] - host[:-1]
    lengths.setflags(write=False)  # shared by every reader
    decreasing = np.flatnonzero(lengths < 0)
    summary = OffsetsSummary(lengths, int(host[0]), int(host[-1]), int(decreasing[0]) if decreasing.size else -1,
                             int(lengths.max()) if lengths.size else 0)
    if entry is not None:
        _MIRRORS[id(offsets)] = (*entry[:3], summary)
    return summary


def to_device(host_tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small host tensor to ``device`` without a sync (through pinned memory) and register the mirror.

    A copy from pageable memory would wait for all queued GPU work before starting.
    """
    if not isinstance(host_tensor, torch.Tensor) or host_tensor.device.type != "cpu":
        got = host_tensor.device if isinstance(host_tensor, torch.Tensor) else type(host_tensor).__name__
        raise ValueError(f"host_tensor must be a CPU tensor, got {got}")
    device = torch.device(device)
    if device.type == "cpu":
        return host_tensor
    source = host_tensor.pin_memory() if device.type == "cuda" else host_tensor
    out = source.to(device, non_blocking=True)
    register_host_copy(out, host_tensor)
    return out
