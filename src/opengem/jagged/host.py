"""Host mirrors of small device index tensors (offsets, lengths), so validation and tile scheduling read
them without a device synchronization.

A training step needs the batch layout on the host (to size grids, build tile schedules, check inputs),
and the data loader had it there before the copy to the GPU. Whoever creates a device offsets/lengths
tensor from host values registers the host copy; readers call :func:`host_copy`, which returns the mirror
(or, for an unregistered tensor, reads it once with a sync and caches it). Entries die with their tensor and
are ignored once the tensor is modified in place.
"""

from __future__ import annotations

import weakref

import torch

_MIRRORS: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}


def register_host_copy(device_tensor: torch.Tensor, host_tensor: torch.Tensor) -> None:
    """Record that ``host_tensor`` (CPU) holds the current contents of ``device_tensor``."""
    if device_tensor.device.type == "cpu" or torch.compiler.is_compiling():
        return
    key = id(device_tensor)
    _MIRRORS[key] = (weakref.ref(device_tensor, lambda _: _MIRRORS.pop(key, None)), device_tensor._version, host_tensor)


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor equal to ``tensor``: itself on the CPU, the registered mirror, or (once) a synced copy."""
    if tensor.device.type == "cpu":
        return tensor
    entry = _MIRRORS.get(id(tensor))
    if entry is not None and entry[0]() is tensor and entry[1] == tensor._version:
        return entry[2]
    host = tensor.detach().cpu()
    register_host_copy(tensor, host)
    return host


def to_device(host_tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small host tensor to ``device`` without a sync (through pinned memory) and register the mirror.

    A copy from pageable memory would wait for all queued GPU work before starting.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return host_tensor
    source = host_tensor.pin_memory() if device.type == "cuda" else host_tensor
    out = source.to(device, non_blocking=True)
    register_host_copy(out, host_tensor)
    return out
