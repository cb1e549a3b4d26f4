"""Autocast for the custom attention ops.

``torch.autocast`` casts only the ops it knows. Ours would otherwise receive a mix (a Linear's bf16 output
next to a LayerNorm's fp32 one) and their reference paths would run half their matmuls in bf16 and half in
fp32. Like a matmul under autocast, an attention op casts its floating inputs to the autocast dtype and runs
with autocast off, so it sees one dtype and returns it.
"""

from __future__ import annotations

import contextlib

import torch


def autocast_dtype(tensor: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype active for ``tensor``'s device type, or None."""
    device_type = tensor.device.type
    if device_type not in ("cuda", "cpu") or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def cast_inputs(*tensors: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], contextlib.AbstractContextManager]:
    """``tensors`` cast to the autocast dtype of the first one's device, and the context to run the op in.

    Without autocast the tensors come back unchanged with a no-op context.
    """
    dtype = autocast_dtype(tensors[0])
    if dtype is None:
        return tensors, contextlib.nullcontext()
    cast = tuple(t.to(dtype) for t in tensors)
    return cast, torch.autocast(tensors[0].device.type, enabled=False)
