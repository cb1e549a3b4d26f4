"""Exact emulation of the MXFP8 JFA forward (``precision="mxfp8"``) and its straight-through backward.

The recipe follows GEM's MXFP8 attention (GEM_SPEC section 5) with OCP MX blocks (:mod:`opengem.ops.reference.mx`:
E4M3 elements, one power-of-two E8M0 scale per block of 32, ``rceil`` scales so nothing saturates):

- Q and K: first rotated along the head dim by FP8 JFA's randomized Hadamard matrix (``Q K^T`` unchanged once the
  logit scale takes ``1 / n``; :mod:`opengem.ops.reference.attention_fp8`), one of GEM_SPEC's recipe levers:
  a block of 32 channels holding an outlier channel loses the others' precision, and the rotation spreads the
  outlier over all of them (on outlier-channel inputs, error against fp32 0.17 -> 0.06 at D = 128). Then blocks of
  32 along the head dim (the reduction of ``Q K^T``), per token and head.
- V: blocks of 32 consecutive tokens of one sample (the reduction of ``P V``), per head and channel, starting at
  the sample's first token; a sample's last block may be partial, and no block crosses samples.
- P: blocks of 32 keys of one row, keys counted from the sample's first token, quantized after the softmax's
  exponent. The online softmax keeps its running maximum on integers (``m = ceil(max)`` in base 2), so every
  rescale ``exp2(m_old - m_new)`` is a power of two. MX quantization commutes with powers of two (the block's
  exponent moves, its elements stay), so quantizing P per key tile against the running maximum equals
  quantizing it once against the row's final one: the result does not depend on the kernel's tile sizes or
  the order of its key tiles. The row sum ``l`` is of the unquantized fp32 ``p``.
- ``out = (P_mx V_mx) / l`` with fp32 sums.

Hopper has no MX tensor cores: the kernel multiplies the MX values (exactly representable in bf16) on its bf16
tensor cores: this mode gives MXFP8's numerics, with more work than the bf16 path (``docs/fp8_attention.md``).

The backward goes straight through the quantization: the gradient of softmax attention over the operands the
forward multiplied (rotated Q and K, and V, quantized and scaled back; logit scale ``/ n``), against the forward's
log-sum-exp, with dQ and dK rotated back.
"""

from __future__ import annotations

import math

import torch

from opengem.jagged.blocks import block_offsets
from opengem.ops.reference.attention import _length_groups, _pad, _unpad, jagged_attention_backward
from opengem.ops.reference.attention_fp8 import rotate, rotation_size, unrotate_gradient
from opengem.ops.reference.masks import batched_attention_mask
from opengem.ops.reference.mx import (
    ELEM_FORMATS,
    MX_BLOCK,
    exp2_int,
    mx_dequantize_reference,
    mx_quantize_reference,
    scale_exponent,
)

LOG2E = 1.4426950408889634
_E4M3 = ELEM_FORMATS["e4m3"]


def mx_along_head_dim(x: torch.Tensor) -> torch.Tensor:
    """``[T, H, D]`` (D a multiple of 32) -> fp32 MX-E4M3 values, blocks of 32 along D."""
    rows = x.reshape(-1, x.shape[-1])
    data, scales = mx_quantize_reference(rows, (MX_BLOCK,), "e4m3", "rceil")
    return mx_dequantize_reference(data, scales, (MX_BLOCK,)).reshape(x.shape)


def sequence_blocks(offsets: torch.Tensor, total: int) -> tuple[torch.Tensor, int]:
    """Each token's MX block along the sequence (32 tokens of one sample, from its first token) ``[T]`` int64,
    and the number of blocks (:func:`~opengem.jagged.blocks.block_offsets`: cached, from the host mirror)."""
    starts = block_offsets(offsets, MX_BLOCK)
    tokens = torch.arange(total, device=offsets.device)
    return torch.searchsorted(starts, tokens.to(starts.dtype), right=True) - 1, starts.numel() - 1


def mx_along_sequence(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Jagged ``[T, H, D]`` -> fp32 MX-E4M3 values, blocks of 32 tokens of one sample per (head, channel). A block
    holding inf or NaN becomes NaN, as an MX block with a NaN scale does."""
    block, count = sequence_blocks(offsets, x.shape[0])
    magnitude = x.float().abs()
    index = block[:, None, None].expand_as(magnitude)
    amax = magnitude.new_zeros((count, *x.shape[1:])).scatter_reduce(0, index, magnitude, "amax")
    finite = torch.isfinite(amax)
    e = scale_exponent(torch.where(finite, amax, 0.0), _E4M3, "rceil")[block]
    elements = (x.float() * exp2_int(-e)).to(_E4M3.dtype).float()
    return torch.where(finite[block], elements * exp2_int(e), float("nan"))


def mx_along_keys(p: torch.Tensor) -> torch.Tensor:
    """fp32 ``p [..., L]`` (finite) -> its MX-E4M3 values, blocks of 32 along the last dim."""
    if p.numel() == 0:
        return p.float()
    data, scales = mx_quantize_reference(p, (MX_BLOCK,), "e4m3", "rceil")
    return mx_dequantize_reference(data, scales, (MX_BLOCK,))


def straight_through_operands(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the MXFP8 forward multiplies, fp32 ``[T, H, D]``: rotated Q and K quantized along D, V along the
    sequence, each scaled back."""
    return mx_along_head_dim(rotate(q)), mx_along_head_dim(rotate(k)), mx_along_sequence(v, offsets)


def jagged_attention_mxfp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    *,
    causal: bool = True,
    num_targets: torch.Tensor | None = None,
    contextual_len: int = 0,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The MXFP8 forward of :func:`opengem.ops.jagged_attention` (``scale`` final, default ``1 / sqrt(D)``);
    ``[T, H, D]`` in q's dtype. Shapes as in :func:`opengem.ops.reference.attention.jagged_attention`."""
    # (q R)(k R)^T = n q k^T: the power of two 1 / n goes with the logit scale
    scale_log2 = (1.0 / math.sqrt(q.shape[2]) if scale is None else scale) * LOG2E / rotation_size(q.shape[2])
    qd, kd, vd = straight_through_operands(q, k, v, offsets)
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for rows, lengths, size, targets in _length_groups(offsets, num_targets, q.shape[1], q.device):
        padded = -(-size // MX_BLOCK) * MX_BLOCK  # key blocks of P start at each sample's first token
        qp, kp, vp = (_pad(x[rows], lengths, padded) for x in (qd, kd, vd))
        kp, vp = kp.repeat_interleave(group, dim=1), vp.repeat_interleave(group, dim=1)
        mask = batched_attention_mask(lengths, padded, causal=causal, num_targets=targets,
                                      contextual_len=contextual_len, window=window)  # fmt: skip
        logits = ((qp @ kp.transpose(-1, -2)) * scale_log2).masked_fill(~mask[:, None], float("-inf"))
        row_max = logits.amax(-1, keepdim=True)
        sees_keys = torch.isfinite(row_max)
        p = torch.exp2(logits - torch.where(sees_keys, torch.ceil(row_max), 0.0))  # rows that see nothing: 0
        row_sum = p.sum(-1, keepdim=True)
        attended = (mx_along_keys(p) @ vp) / torch.where(row_sum > 0, row_sum, 1.0)
        out[rows] = _unpad(attended, lengths, padded)
    return out.to(q.dtype)


def jagged_attention_mxfp8_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    *,
    causal: bool,
    num_targets: torch.Tensor | None,
    contextual_len: int,
    window: int | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dq, dk, dv`` of :func:`jagged_attention_mxfp8`, straight through its quantization, in the inputs' dtypes."""
    qd, kd, vd = straight_through_operands(q, k, v, offsets)
    dq, dk, dv = jagged_attention_backward(
        grad_out.float(), qd, kd, vd, offsets, causal=causal, num_targets=num_targets, contextual_len=contextual_len,
        window=window, scale=scale / rotation_size(q.shape[2]),
    )  # fmt: skip
    return unrotate_gradient(dq).to(q.dtype), unrotate_gradient(dk).to(k.dtype), dv.to(v.dtype)
