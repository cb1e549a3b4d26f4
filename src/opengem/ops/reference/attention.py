"""Reference jagged softmax attention (JFA): fp32, with the recommendation mask.

Short and obviously correct; it is the specification the Triton kernel is tested against and the CPU
path of :func:`opengem.ops.jagged_attention`. Samples are sorted by length, padded in groups of
similar length and computed with one batched masked softmax per group (a per-sample loop is far too
slow for CPU training); groups are bounded in size so long sequences never allocate ``B * L^2``
scores at once. Differentiable through
autograd.
"""

from __future__ import annotations

import math

import torch

from opengem.ops.reference.masks import batched_attention_mask

SCORES_PER_GROUP = 1 << 22  # elements of the [G, H, L, L] score tensor of one group


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
    # group samples of similar length (longest first) so padding inside a group stays small
    order = sorted((b for b in range(len(lengths)) if lengths[b]), key=lambda b: -lengths[b])
    pieces, rows_in_order = [], []
    while order:
        longest = lengths[order[0]]
        count = max(1, min(len(order), SCORES_PER_GROUP // (heads * longest * longest)))
        members, order = order[:count], order[count:]
        rows = torch.cat([torch.arange(bounds[b], bounds[b + 1]) for b in members]).to(q.device)
        group_lengths = torch.tensor([lengths[b] for b in members], device=q.device)
        targets = None if num_targets is None else num_targets[torch.tensor(members, device=num_targets.device)]
        pieces.append(
            _padded_group(
                q[rows].to(compute), k[rows].to(compute), v[rows].to(compute), group_lengths, longest, group,
                scale, causal, targets, contextual_len, window,
            )
        )
        rows_in_order.append(rows)
    if not pieces:
        return q.new_zeros(q.shape)
    out = pieces[0].new_empty((q.shape[0], *pieces[0].shape[1:]))
    out = out.index_copy(0, torch.cat(rows_in_order), torch.cat(pieces))
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
