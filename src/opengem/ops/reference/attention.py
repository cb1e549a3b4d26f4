"""Reference jagged softmax attention (JFA): fp32, with the recommendation mask.

Short and obviously correct; it is the specification the Triton kernel is tested against and the CPU
path of :func:`opengem.ops.jagged_attention`. Samples are padded in groups and computed with one
batched masked softmax per group (a per-sample loop is far too slow for CPU training); groups are
bounded in size so long sequences do not allocate ``B * L^2`` scores at once. Differentiable through
autograd.
"""

from __future__ import annotations

import math

import torch

from opengem.ops.reference.masks import batched_attention_mask

SCORES_PER_GROUP = 1 << 24  # elements of the [G, H, L, L] score tensor of one group


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
    heads, head_dim = q.shape[1], q.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if normalize_by_max_len:
        scale = scale / max(max_len, 1)
    group = heads // k.shape[1]
    compute = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for finite-difference checks
    bounds = offsets.detach().cpu().tolist()
    lengths = [bounds[b + 1] - bounds[b] for b in range(len(bounds) - 1)]
    out = q.new_zeros(q.shape, dtype=compute)
    first = 0
    while first < len(lengths):
        last, longest = first, 0
        while last < len(lengths):
            longest_next = max(longest, lengths[last])
            if last > first and (last - first + 1) * heads * longest_next**2 > SCORES_PER_GROUP:
                break
            longest = longest_next
            last += 1
        if longest > 0:
            rows = slice(bounds[first], bounds[last])
            group_lengths = torch.tensor(lengths[first:last], device=q.device)
            targets = None if num_targets is None else num_targets[first:last]
            out[rows] = _padded_group(
                q[rows].to(compute), k[rows].to(compute), v[rows].to(compute), group_lengths, longest, group,
                scale, causal, targets, contextual_len, window,
            )
        first = last
    return out.to(q.dtype)


def _padded_group(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    size: int,
    group: int,
    scale: float,
    causal: bool,
    num_targets: torch.Tensor | None,
    contextual_len: int,
    window: int | None,
) -> torch.Tensor:
    """Attention for consecutive samples padded to ``size``; returns their jagged ``[rows, H, D]``."""
    valid = torch.arange(size, device=q.device)[None, :] < lengths[:, None]  # [G, L]

    def pad(x: torch.Tensor) -> torch.Tensor:  # [rows, H, D] -> [G, H, L, D]
        padded = x.new_zeros((lengths.numel(), size, *x.shape[1:]))
        padded[valid] = x
        return padded.transpose(1, 2)

    qp, kp, vp = pad(q), pad(k).repeat_interleave(group, dim=1), pad(v).repeat_interleave(group, dim=1)
    mask = batched_attention_mask(
        lengths, size, causal=causal, num_targets=num_targets, contextual_len=contextual_len, window=window
    )
    # padded query rows see no key; give them their own diagonal so softmax stays finite (rows dropped below)
    mask = mask | torch.eye(size, dtype=torch.bool, device=q.device)
    logits = (qp @ kp.transpose(-1, -2)) * scale
    weights = torch.softmax(logits.masked_fill(~mask[:, None], float("-inf")), dim=-1)
    return (weights @ vp).transpose(1, 2)[valid]
