"""The recommendation attention mask (GEM_SPEC section 4), the specification every kernel follows.

A sequence of length ``L`` is ``[contextual | history | targets]`` with ``t = num_targets[b]`` targets
at the end and ``H = L - t`` non-target tokens. Query ``i`` may attend key ``j`` when

* ``j == i`` (every token sees itself), or
* ``j < H`` (the key is contextual or history) and either
  - ``i < contextual_len`` (contextual rows see all contextual + history tokens), or
  - with ``p = min(i, H)`` (every target sits just after the history):
    ``j <= p`` when causal, and ``|p - j| <= window`` when a window is given.

Targets are never seen by other tokens; with no targets and no contextual prefix this is plain causal
(or full) attention, optionally windowed. This matches generative-recommenders' HSTU mask.
"""

from __future__ import annotations

import torch


def attention_mask(
    seq_len: int,
    *,
    causal: bool,
    num_targets: int = 0,
    contextual_len: int = 0,
    window: int | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Bool ``[seq_len, seq_len]``: True where query row ``i`` may attend key column ``j``."""
    hist_len = seq_len - num_targets
    i = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    p = torch.clamp(i, max=hist_len)
    visible = j < hist_len
    if causal:
        visible = visible & (j <= p)
    if window is not None:
        visible = visible & ((p - j).abs() <= window)
    visible = visible | ((i < contextual_len) & (j < hist_len))
    return visible | (i == j)


def batched_attention_mask(
    lengths: torch.Tensor,
    size: int,
    *,
    causal: bool,
    num_targets: torch.Tensor | None = None,
    contextual_len: int = 0,
    window: int | None = None,
) -> torch.Tensor:
    """Bool ``[B, size, size]``: :func:`attention_mask` of each sample, padded with False to ``size``."""
    lengths = lengths.view(-1, 1, 1)
    targets = torch.zeros_like(lengths) if num_targets is None else num_targets.view(-1, 1, 1).to(lengths.dtype)
    hist_len = lengths - targets
    i = torch.arange(size, device=lengths.device).view(1, -1, 1)
    j = torch.arange(size, device=lengths.device).view(1, 1, -1)
    p = torch.minimum(i, hist_len)
    visible = j < hist_len
    if causal:
        visible = visible & (j <= p)
    if window is not None:
        visible = visible & ((p - j).abs() <= window)
    visible = visible | ((i < contextual_len) & (j < hist_len))
    visible = visible | (i == j)
    return visible & (i < lengths) & (j < lengths)
