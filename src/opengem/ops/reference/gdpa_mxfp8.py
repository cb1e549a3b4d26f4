"""Exact emulation of the MXFP8 GDPA forward (``gdpa(..., precision="mxfp8")``) and its straight-through backward.

The operands are quantized as the MXFP8 JFA quantizes them (:mod:`opengem.ops.reference.attention_mxfp8`): Q and K
Hadamard-rotated (``1 / n`` folded into ``pre_scale``) and MX-E4M3 in blocks of 32 along the head dim, V in blocks
of 32 tokens of one sample (K/V's offsets) per channel. P = ``mask * phi_h(x)``, signed and unbounded, is
quantized to MX-E4M3 per row in blocks of 32 keys counted from the sample's first key (masked and padded keys are
0 and leave a block's scale alone), then ``O = out_scale * P V`` with fp32 sums. GDPA keeps no running statistic,
so the kernel's key tiles (multiples of 32, starting at the sample's first key) quantize exactly these blocks.

The backward goes straight through the quantization: GDPA's gradient over the operands the forward multiplied,
with P recomputed unquantized, dQ and dK rotated back.
"""

from __future__ import annotations

from typing import Sequence

import torch

from opengem.ops.reference.attention_fp8 import rotation_size, unrotate_gradient
from opengem.ops.reference.attention_mxfp8 import mx_along_keys, straight_through_operands
from opengem.ops.reference.gdpa import gdpa, gdpa_backward


def gdpa_mxfp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    k_offsets: torch.Tensor,
    *,
    head_activations: Sequence[str],
    pre_scale: float = 1.0,
    out_scale: float = 1.0,
    causal: bool = False,
    num_targets: torch.Tensor | None = None,
    contextual_len: int = 0,
    window: int | None = None,
    broadcast_q: bool = False,
) -> torch.Tensor:
    """The MXFP8 forward of :func:`opengem.ops.gdpa.gdpa`; arguments as :func:`opengem.ops.reference.gdpa.gdpa`'s,
    output in q's dtype."""
    qd, kd, vd = straight_through_operands(q, k, v, k_offsets)
    out = gdpa(qd, kd, vd, q_offsets, k_offsets, head_activations=head_activations,
               pre_scale=pre_scale / rotation_size(q.shape[2]), out_scale=out_scale, causal=causal,
               num_targets=num_targets, contextual_len=contextual_len, window=window, broadcast_q=broadcast_q,
               p_quantizer=mx_along_keys)  # fmt: skip
    return out.to(q.dtype)


def gdpa_mxfp8_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    k_offsets: torch.Tensor,
    *,
    head_activations: Sequence[str],
    pre_scale: float = 1.0,
    out_scale: float = 1.0,
    causal: bool = False,
    num_targets: torch.Tensor | None = None,
    contextual_len: int = 0,
    window: int | None = None,
    broadcast_q: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dq, dk, dv`` of :func:`gdpa_mxfp8`, straight through its quantization, in the inputs' dtypes."""
    qd, kd, vd = straight_through_operands(q, k, v, k_offsets)
    dq, dk, dv = gdpa_backward(grad_out.float(), qd, kd, vd, q_offsets, k_offsets, head_activations=head_activations,
                               pre_scale=pre_scale / rotation_size(q.shape[2]), out_scale=out_scale, causal=causal,
                               num_targets=num_targets, contextual_len=contextual_len, window=window,
                               broadcast_q=broadcast_q)  # fmt: skip
    return unrotate_gradient(dq).to(q.dtype), unrotate_gradient(dk).to(k.dtype), dv.to(v.dtype)
