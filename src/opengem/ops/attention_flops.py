"""Useful-work accounting for the attention ops (GEM_SPEC section 8): unmasked query-key pairs on host.

Shared by every attention family's FLOP formula and benchmark, so counts agree across kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor

from opengem.jagged.host import host_copy


def counted_or_bound(offsets: torch.Tensor, bound: int, count: Callable[[], int]) -> int:
    """``count()``, the pairs the offsets' lengths give, for a FLOP formula. Tensors without data (fake or meta: a
    trace, or the compiler's activation memory budget, which runs the formulas on fake tensors to rank what to
    recompute) have no lengths to read: then ``bound``, the pairs if every query saw ``max_len`` keys."""
    if isinstance(offsets, FakeTensor) or offsets.is_meta:
        return bound
    return count()


def visible_pairs(
    q_lengths: torch.Tensor,
    k_lengths: torch.Tensor,
    *,
    masked: bool = False,
    causal: bool = False,
    num_targets: torch.Tensor | None = None,
    contextual_len: int = 0,
    window: int | None = None,
) -> int:
    """Number of (query, key) pairs the mask of :mod:`opengem.ops.reference.masks` leaves visible.

    ``q_lengths``/``k_lengths`` ``[B]`` host or device ints. Without ``masked`` every sample is full
    cross-attention (``q_len * k_len`` pairs). With ``masked`` (self-attention, ``q_lengths == k_lengths``)
    the recommendation mask is counted in closed form per query row, O(total tokens).
    """
    q_len = host_copy(q_lengths).long()
    k_len = host_copy(k_lengths).long()
    if not masked:
        return int((q_len * k_len).sum())
    lengths = k_len
    targets = torch.zeros_like(lengths) if num_targets is None else host_copy(num_targets).long()
    sample = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    i = torch.arange(int(lengths.sum())) - starts[sample]
    hist = (lengths - targets)[sample]
    # visible non-diagonal keys form one interval [lo, hi) of the history for every row
    p = torch.minimum(i, hist)
    lo = torch.zeros_like(i)
    hi = hist.clone()
    if causal:
        hi = torch.minimum(hi, p + 1)
    if window is not None:
        lo = torch.maximum(lo, p - window)
        hi = torch.minimum(hi, p + window + 1)
    context = i < contextual_len
    lo = torch.where(context, 0, lo)
    hi = torch.where(context, hist, hi)
    in_interval = (i >= lo) & (i < hi)
    return int((torch.clamp(hi - lo, min=0) + (~in_interval).long()).sum())


def attention_flops(pairs: int, heads: int, head_dim: int) -> tuple[int, int]:
    """``(forward, backward)`` useful FLOPs: ``4 H D pairs`` and 2.5x that."""
    forward = 4 * heads * head_dim * pairs
    return forward, forward * 5 // 2

