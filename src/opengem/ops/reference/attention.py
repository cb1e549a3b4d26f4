"""Reference jagged softmax attention (JFA): per sample, fp32, with the recommendation mask.

Short and obviously correct; it is the specification the Triton kernel is tested against and the CPU
path of :func:`opengem.ops.jagged_attention`. Differentiable through autograd.
"""

from __future__ import annotations

import math

import torch

from opengem.ops.reference.masks import attention_mask


def jagged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_len: int,
    *,
    causal: bool = True,
    num_targets: torch.Tensor | None = None,
    contextual_len: int = 0,
    window: int | None = None,
    scale: float | None = None,
    normalize_by_max_len: bool = False,
) -> torch.Tensor:
    """``softmax(scale * q k^T [/ max_len] + mask) v`` per sample and head; returns ``[T, H, D]`` in q's dtype.

    q ``[T, H, D]``; k, v ``[T, H_kv, D]`` with ``H_kv`` dividing ``H`` (GQA/MQA); ``offsets [B + 1]``.
    ``scale`` defaults to ``1 / sqrt(D)``; ``normalize_by_max_len`` further divides the logits by
    ``max_len`` (FBGEMM sll's option). Inputs are assumed valid (the public op validates).
    """
    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if normalize_by_max_len:
        scale = scale / max(max_len, 1)
    group = q.shape[1] // k.shape[1]
    compute = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for finite-difference checks
    bounds = offsets.detach().cpu().tolist()
    targets = [0] * (len(bounds) - 1) if num_targets is None else num_targets.detach().cpu().tolist()
    outputs = []
    for b in range(len(bounds) - 1):
        start, end = bounds[b], bounds[b + 1]
        if end == start:
            continue
        qb = q[start:end].to(compute).transpose(0, 1)  # [H, L, D]
        kb = k[start:end].to(compute).repeat_interleave(group, dim=1).transpose(0, 1)
        vb = v[start:end].to(compute).repeat_interleave(group, dim=1).transpose(0, 1)
        mask = attention_mask(
            end - start,
            causal=causal,
            num_targets=int(targets[b]),
            contextual_len=contextual_len,
            window=window,
            device=q.device,
        )
        logits = (qb @ kb.transpose(1, 2)) * scale
        weights = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
        outputs.append((weights @ vb).transpose(0, 1))
    if not outputs:
        return q.new_zeros(q.shape)
    return torch.cat(outputs).to(q.dtype)
