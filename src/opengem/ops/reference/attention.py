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
from collections.abc import Iterator

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
    pieces, rows_in_order = [], []
    for rows, lengths, size, targets in _length_groups(offsets, num_targets, heads, q.device):
        qp, kp, vp = (_pad(x[rows].to(compute), lengths, size) for x in (q, k, v))
        weights = _attention_weights(qp, kp, vp, lengths, size, group, scale, causal, targets, contextual_len, window)
        pieces.append(_unpad(weights @ vp.repeat_interleave(group, dim=1), lengths, size))
        rows_in_order.append(rows)
    if not pieces:
        return q.new_zeros(q.shape)
    out = pieces[0].new_empty((q.shape[0], *pieces[0].shape[1:]))
    return out.index_copy(0, torch.cat(rows_in_order), torch.cat(pieces)).to(q.dtype)


def jagged_attention_backward(
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
    """``dq, dk, dv`` of :func:`jagged_attention` (``scale`` final), written out because custom ops run
    without autograd: dV = P^T dO, dS = P * (dP - rowsum(dP * P)) with dP = dO V^T, dQ = scale dS K,
    dK = scale dS^T Q; GQA sums dK, dV over each K/V head's query heads."""
    heads, kv_heads = q.shape[1], k.shape[1]
    group = heads // kv_heads
    compute = torch.promote_types(q.dtype, torch.float32)
    grads = [torch.zeros(t.shape, dtype=compute, device=t.device) for t in (q, k, v)]
    for rows, lengths, size, targets in _length_groups(offsets, num_targets, heads, q.device):
        qp, kp, vp, dop = (_pad(x[rows].to(compute), lengths, size) for x in (q, k, v, grad_out))
        p = _attention_weights(qp, kp, vp, lengths, size, group, scale, causal, targets, contextual_len, window)
        kp, vp = kp.repeat_interleave(group, dim=1), vp.repeat_interleave(group, dim=1)
        dp = dop @ vp.transpose(-1, -2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        per_kv_head = (lengths.numel(), kv_heads, group, size, -1)
        dk = (scale * ds.transpose(-1, -2) @ qp).view(per_kv_head).sum(2)
        dv = (p.transpose(-1, -2) @ dop).view(per_kv_head).sum(2)
        for grad, value in zip(grads, (scale * ds @ kp, dk, dv)):
            grad[rows] = _unpad(value, lengths, size)
    return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))  # type: ignore[return-value]


def _length_groups(
    offsets: torch.Tensor, num_targets: torch.Tensor | None, heads: int, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]]:
    """Non-empty samples sorted longest first, cut into groups whose padded scores stay bounded.

    Yields the group's row indices, its lengths, its padded size and its num_targets.
    """
    bounds = offsets.detach().cpu().tolist()
    lengths = [bounds[b + 1] - bounds[b] for b in range(len(bounds) - 1)]
    order = sorted((b for b in range(len(lengths)) if lengths[b]), key=lambda b: -lengths[b])
    while order:
        size = lengths[order[0]]
        count = max(1, min(len(order), SCORES_PER_GROUP // (heads * size * size)))
        members, order = order[:count], order[count:]
        rows = torch.cat([torch.arange(bounds[b], bounds[b + 1]) for b in members]).to(device)
        group_lengths = torch.tensor([lengths[b] for b in members], device=device)
        targets = None if num_targets is None else num_targets[torch.tensor(members, device=num_targets.device)]
        yield rows, group_lengths, size, targets


def _pad(x: torch.Tensor, lengths: torch.Tensor, size: int) -> torch.Tensor:
    """Jagged rows ``[rows, H, D]`` -> ``[G, H, size, D]`` with zeros after each sequence."""
    padded = x.new_zeros((lengths.numel(), size, *x.shape[1:]))
    padded[_valid(lengths, size)] = x
    return padded.transpose(1, 2)


def _unpad(x: torch.Tensor, lengths: torch.Tensor, size: int) -> torch.Tensor:
    """Inverse of :func:`_pad`: ``[G, H, size, D]`` -> the jagged rows ``[rows, H, D]``."""
    return x.transpose(1, 2)[_valid(lengths, size)]


def _valid(lengths: torch.Tensor, size: int) -> torch.Tensor:
    return torch.arange(size, device=lengths.device)[None, :] < lengths[:, None]


def _attention_weights(
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
    """Softmax weights ``[G, H, size, size]`` of padded ``q [G, H, size, D]``, ``k [G, H_kv, size, D]``."""
    mask = batched_attention_mask(
        lengths, size, causal=causal, num_targets=num_targets, contextual_len=contextual_len, window=window
    )
    # padded query rows see no key; give them their own diagonal so softmax stays finite (rows dropped later)
    mask = mask | torch.eye(size, dtype=torch.bool, device=q.device)
    logits = (q @ k.repeat_interleave(group, dim=1).transpose(-1, -2)) * scale
    return torch.softmax(logits.masked_fill(~mask[:, None], float("-inf")), dim=-1)
