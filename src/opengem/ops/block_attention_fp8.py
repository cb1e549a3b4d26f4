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

import torch

from opengem.jagged.blocks import block_offsets
from opengem.ops.gdpa import gdpa
from opengem.ops.jagged_attention import jagged_attention
from opengem.ops.reference.rotary import apply_rotary


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
