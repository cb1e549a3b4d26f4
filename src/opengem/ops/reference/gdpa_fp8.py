"""Exact emulation of the FP8 GDPA forward (``gdpa(..., precision="fp8")``, self- and cross-attention), and its
backward.

Q, K and V are quantized as the FP8 JFA forward quantizes them (:mod:`opengem.ops.reference.attention_fp8`: Q and
K rotated by the randomized Hadamard matrix, ``1 / n`` folded into ``pre_scale``; one fp32 scale ``amax / 448`` per
sample-aligned block of ``block`` rows and head, E4M3 elements), so one quantize pass serves both ops
(cross-attention: Q blocked by its offsets, K and V by theirs). Then, key block by key block as the kernel runs
them:

- ``x = (q8 sq)(k8 sk)^T * pre_scale / n``, ``p = mask * phi_h(x)`` in fp32;
- ``P`` quantized per query row and key block: ``ps = amax_row / 448`` (amax at least 1e-12), elements
  ``rne(p * (448 / amax_row))``. Unlike softmax's ``p`` (at most 1, so a fixed power-of-two scale), an activation's
  values are unbounded and signed, so each row of each tile takes its own scale;
- ``O += (p8 ps) (v8 sv)``; at the end ``O *= out_scale`` (``post_scale / norm``).

The backward goes straight through the quantization, as JFA's FP8 backward: the bf16 GDPA gradient over the
operands the forward multiplied (rotated Q and K, and V, quantized and scaled back; ``pre_scale / n``) with P
recomputed unquantized, dQ and dK rotated back by ``R^T``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from opengem.ops.activations import activation_value
from opengem.ops.reference.attention import _unpad
from opengem.ops.reference.attention_fp8 import (
    E4M3_MAX,
    MIN_AMAX,
    quantized_groups,
    rotation_size,
    straight_through_operands,
    unrotate_gradient,
)
from opengem.ops.reference.gdpa import gdpa_backward


def quantize_rows(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``p [..., M, N]`` -> its E4M3 values as fp32 and each row's scale ``amax / 448`` ``[..., M, 1]``."""
    amax = p.abs().amax(-1, keepdim=True).clamp_min(MIN_AMAX)
    limit = torch.full_like(amax, E4M3_MAX)  # tensor quotients: correctly rounded, as the kernel divides
    return (p * (limit / amax)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float(), amax / limit


def gdpa_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    k_offsets: torch.Tensor | None = None,
    *,
    block: int,
    head_activations: Sequence[str],
    pre_scale: float = 1.0,
    out_scale: float = 1.0,
    causal: bool = False,
    num_targets: torch.Tensor | None = None,
    contextual_len: int = 0,
    window: int | None = None,
) -> torch.Tensor:
    """The FP8 forward of :func:`opengem.ops.reference.gdpa.gdpa`, self-attention (``k_offsets`` None or with a mask
    option, which needs equal offsets) or cross-attention; returns ``[Tq, H, D]`` in q's dtype."""
    x_scale = pre_scale / rotation_size(q.shape[2])  # (q R)(k R)^T = n q k^T
    masked = causal or num_targets is not None or contextual_len > 0 or window is not None
    if k_offsets is not None and k_offsets is not q_offsets and not masked:
        return _cross_attention(q, k, v, q_offsets, k_offsets, block, head_activations, x_scale, out_scale)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    mask_options = dict(causal=causal, contextual_len=contextual_len, window=window)
    for rows, lengths, padded, (qd, kd, vd), mask in quantized_groups(q, k, v, q_offsets, num_targets, block,
                                                                       **mask_options):  # fmt: skip
        x = (qd @ kd.transpose(-1, -2)) * x_scale
        p = torch.stack([activation_value(name, x[:, h]) for h, name in enumerate(head_activations)], 1)
        out[rows] = _unpad(_quantized_pv(p.masked_fill(~mask[:, None], 0.0), vd, block) * out_scale, lengths, padded)
    return out.to(q.dtype)


def _quantized_pv(p: torch.Tensor, v: torch.Tensor, block: int) -> torch.Tensor:
    """``P V`` key block by key block, each block of P quantized per row (:func:`quantize_rows`)."""
    acc = torch.zeros((*p.shape[:-1], v.shape[-1]), device=p.device)
    for start in range(0, p.shape[-1], block):
        p8, p_scale = quantize_rows(p[..., start : start + block])
        acc = acc + (p8 @ v[..., start : start + block, :]) * p_scale
    return acc


def _cross_attention(q, k, v, q_offsets, k_offsets, block, head_activations, x_scale, out_scale) -> torch.Tensor:
    """Every key of the sample visible; Q blocked by ``q_offsets``, K and V by ``k_offsets`` (one sample at a time:
    cross-attention's K/V are short)."""
    qd, kd, vd = straight_through_operands(q, k, v, q_offsets, block, k_offsets)
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    q_bounds, k_bounds = q_offsets.tolist(), k_offsets.tolist()
    for b in range(len(q_bounds) - 1):
        qs, ks = slice(q_bounds[b], q_bounds[b + 1]), slice(k_bounds[b], k_bounds[b + 1])
        for h, name in enumerate(head_activations):
            p = activation_value(name, (qd[qs, h] @ kd[ks, h // group].T) * x_scale)
            out[qs, h] = _quantized_pv(p, vd[ks, h // group], block) * out_scale
    return out.to(q.dtype)


def gdpa_fp8_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    k_offsets: torch.Tensor | None = None,
    *,
    block: int,
    head_activations: Sequence[str],
    pre_scale: float = 1.0,
    out_scale: float = 1.0,
    causal: bool = False,
    num_targets: torch.Tensor | None = None,
    contextual_len: int = 0,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dq, dk, dv`` of :func:`gdpa_fp8` straight through its quantization (module docstring), in the inputs'
    dtypes."""
    q_st, k_st, v_st = straight_through_operands(q, k, v, q_offsets, block, k_offsets)
    dq, dk, dv = gdpa_backward(
        grad_out.float(), q_st, k_st, v_st, q_offsets, q_offsets if k_offsets is None else k_offsets,
        head_activations=head_activations,
        pre_scale=pre_scale / rotation_size(q.shape[-1]), out_scale=out_scale, causal=causal,
        num_targets=num_targets, contextual_len=contextual_len, window=window,
    )  # fmt: skip
    return unrotate_gradient(dq).to(q.dtype), unrotate_gradient(dk).to(k.dtype), dv.to(v.dtype)
