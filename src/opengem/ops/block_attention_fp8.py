"""Low-precision BlockAttention (``block_attention(..., precision="fp8" | "mxfp8")``): rotary in fp32 torch ops,
then JFA (softmax) or GDPA (pointwise activations) in that precision over the blocks as sequences of their own.

Block-diagonal attention is full attention inside each block, so cutting every sequence into its blocks
(:func:`block_offsets`) makes it a jagged batch of non-causal sequences of at most ``block_size`` tokens. The
numerics, the exact emulation (``backend="reference"``) and the backward (straight through the quantization) are
then those of the FP8 (or MXFP8) JFA and GDPA (``docs/fp8_attention.md``); each block is a quantization block of
its own (FP8: one scale per block and operand; MXFP8: V's and P's blocks of 32 start at the block's first token). Rotary goes through autograd (its transpose rotates the gradients
back), in fp32 and rounded to q's dtype, where the bf16 kernel rotates inside its tiles.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from opengem.jagged.host import host_copy, to_device
from opengem.ops.gdpa import gdpa
from opengem.ops.jagged_attention import jagged_attention
from opengem.ops.reference.rotary import apply_rotary


_BLOCK_OFFSETS: OrderedDict[tuple, torch.Tensor] = OrderedDict()  # every layer of a model asks for the same
_BLOCK_OFFSETS_CACHE_SIZE = 16


@torch.compiler.disable  # sizes a new offsets tensor from the host copy: one graph break under torch.compile
def block_offsets(offsets: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[n_blocks + 1]`` offsets of every block of every sequence, in ``offsets``' dtype and device: each
    sequence cut into ``block_size``-token blocks from its first token, the last one partial, empty ones none.
    Cached by the offsets' host values (the layers of one batch share them)."""
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


def block_attention_fp8(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, *, block_size: int, scale: float,
    activation: str, rotary_phase: torch.Tensor | None, rotary_base: float, backend: str, precision: str = "fp8",
) -> torch.Tensor:
    """Block attention of checked inputs in ``precision`` (``"fp8"`` or ``"mxfp8"``; see
    :func:`opengem.ops.block_attention.block_attention`)."""
    if rotary_phase is not None:
        q = apply_rotary(q, rotary_phase, rotary_base).to(q.dtype)
        k = apply_rotary(k, rotary_phase, rotary_base).to(k.dtype)
    blocks = block_offsets(offsets, block_size)
    if activation == "softmax":  # (JFA's backend None: its own default, Triton for CUDA tensors)
        return jagged_attention(q, k, v, blocks, block_size, causal=False, scale=scale,
                                backend=None if backend == "auto" else backend, precision=precision)  # fmt: skip
    return gdpa(q, k, v, blocks, blocks, block_size, block_size, activation=activation, pre_scale=scale,
                backend=backend, precision=precision)  # fmt: skip
