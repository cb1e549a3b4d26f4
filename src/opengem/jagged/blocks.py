"""Cutting jagged sequences into fixed-size blocks from each sequence's first token (BlockAttention's blocks run
as sequences of their own; MX quantization's blocks of 32 tokens along a sample)."""

from __future__ import annotations

from collections import OrderedDict

import torch

from opengem.jagged.host import host_copy, to_device
from opengem.jagged.jagged import OFFSET_DTYPES
from opengem.validation import is_int

_BLOCK_OFFSETS: OrderedDict[tuple, torch.Tensor] = OrderedDict()  # every layer of a model asks for the same
_BLOCK_OFFSETS_CACHE_SIZE = 16


@torch.compiler.disable  # sizes a new offsets tensor from the host copy: one graph break under torch.compile
def block_offsets(offsets: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[n_blocks + 1]`` offsets of every block of every sequence, in ``offsets``' dtype and device: each
    sequence cut into ``block_size``-token blocks from its first token, the last one partial, empty ones none.
    Cached by the offsets' host values (the layers of one batch share them)."""
    if not is_int(block_size) or block_size < 1:  # -2 had given one block of everything, True blocks of 1
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    # float offsets had given float block starts
    if not isinstance(offsets, torch.Tensor) or offsets.dtype not in OFFSET_DTYPES:
        got = offsets.dtype if isinstance(offsets, torch.Tensor) else type(offsets).__name__
        raise ValueError(f"offsets must be an int32 or int64 tensor, got {got}")
    host = host_copy(offsets).long()
    key = (host.numpy().tobytes(), block_size, offsets.dtype, str(offsets.device))
    if key in _BLOCK_OFFSETS:
        _BLOCK_OFFSETS.move_to_end(key)
        return _BLOCK_OFFSETS[key]
    lengths = host[1:] - host[:-1]
    blocks = torch.div(lengths + block_size - 1, block_size, rounding_mode="floor")
    sequence = torch.repeat_interleave(torch.arange(lengths.numel()), blocks)
    first_block = torch.repeat_interleave(torch.cumsum(blocks, 0) - blocks, blocks)
    starts = host[:-1][sequence] + (torch.arange(sequence.numel()) - first_block) * block_size
    result = to_device(torch.cat([starts, host[-1:]]).to(offsets.dtype), offsets.device)
    _BLOCK_OFFSETS[key] = result
    if len(_BLOCK_OFFSETS) > _BLOCK_OFFSETS_CACHE_SIZE:
        _BLOCK_OFFSETS.popitem(last=False)
    return result
