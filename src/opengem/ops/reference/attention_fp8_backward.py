"""Exact emulation of the FP8 JFA backward with E4M3 products (``backward_precision="fp8"``).

Against the straight-through backward (:func:`opengem.ops.reference.attention_fp8.jagged_attention_fp8_backward`)
one operand changes: ``dP = dO V^T`` multiplies dO quantized per block like V (one fp32 scale ``amax / 448`` per
sample-aligned block of ``block`` rows and head, E4M3 elements, no rotation). The rest is that gradient:

- P from the forward's operands (rotated Q and K, quantized and scaled back; logit scale ``/ n``), rows
  normalized as the forward's log-sum-exp does;
- ``delta = rowsum(dO * O)`` with the FP8 forward's output O and the unquantized dO, as the kernels compute it;
- ``dS = P * (dP - delta)``, ``dV = P^T dO`` (unquantized dO), ``dQ = scale dS K``, ``dK = scale dS^T Q`` on the
  straight-through operands, then dQ and dK rotated back by ``R^T``.
"""

from __future__ import annotations

import torch

from opengem.ops.reference.attention import _pad, _unpad
from opengem.ops.reference.attention_fp8 import (
    _dequantized,
    jagged_attention_fp8,
    quantized_groups,
    rotation_size,
    unrotate_gradient,
)


def jagged_attention_fp8_mma_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    *,
    block: int,
    causal: bool,
    num_targets: torch.Tensor | None,
    contextual_len: int,
    window: int | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dq, dk, dv`` of :func:`~opengem.ops.reference.attention_fp8.jagged_attention_fp8` as the E4M3-product
    backward computes them (module docstring), in the inputs' dtypes; ``scale`` final."""
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    group = heads // kv_heads
    mask_options = dict(causal=causal, contextual_len=contextual_len, window=window)
    out = jagged_attention_fp8(q, k, v, offsets, block=block, num_targets=num_targets, scale=scale, **mask_options)
    rotated_scale = scale / rotation_size(head_dim)  # (q R)(k R)^T = n q k^T
    grads = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v)]
    for rows, lengths, padded, (qd, kd, vd), mask in quantized_groups(q, k, v, offsets, num_targets, block,
                                                                       **mask_options):  # fmt: skip
        do, o = (_pad(t[rows].float(), lengths, padded) for t in (grad_out, out))
        logits = ((qd @ kd.transpose(-1, -2)) * rotated_scale).masked_fill(~mask[:, None], float("-inf"))
        p = torch.softmax(logits, -1).nan_to_num(0.0)  # rows past a sample see nothing
        dp = _dequantized(do, block) @ vd.transpose(-1, -2)
        ds = p * (dp - (do * o).sum(-1, keepdim=True))
        per_kv_head = (lengths.numel(), kv_heads, group, padded, head_dim)
        dq = rotated_scale * ds @ kd
        dk = (rotated_scale * ds.transpose(-1, -2) @ qd).view(per_kv_head).sum(2)
        dv = (p.transpose(-1, -2) @ do).view(per_kv_head).sum(2)
        for grad, value in zip(grads, (dq, dk, dv)):
            grad[rows] = _unpad(value, lengths, padded)
    dq, dk, dv = grads
    return unrotate_gradient(dq).to(q.dtype), unrotate_gradient(dk).to(k.dtype), dv.to(v.dtype)
