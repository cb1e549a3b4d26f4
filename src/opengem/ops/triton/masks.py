"""The recommendation attention mask for one (query tile, key tile), shared by the Triton kernels.

Same rule as :mod:`opengem.ops.reference.masks` (read its docstring for the semantics).
"""

import triton
import triton.language as tl


@triton.jit
def tile_mask(
    offs_m,
    offs_n,
    seq_len,
    hist_len,
    contextual_len,
    window,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CONTEXT: tl.constexpr,
):
    """Bool ``[BLOCK_M, BLOCK_N]``: query rows ``offs_m`` may attend key columns ``offs_n`` of one sample.

    Positions are relative to the sample start; rows or columns ``>= seq_len`` are masked out.
    """
    i = offs_m[:, None]
    j = offs_n[None, :]
    p = tl.minimum(i, hist_len)
    visible = j < hist_len
    if CAUSAL:
        visible = visible & (j <= p)
    if HAS_WINDOW:
        visible = visible & (tl.abs(p - j) <= window)
    if HAS_CONTEXT:
        visible = visible | ((i < contextual_len) & (j < hist_len))
    visible = visible | (i == j)
    return visible & (i < seq_len) & (j < seq_len)


@triton.jit
def key_range(
    m_start,
    seq_len,
    hist_len,
    contextual_len,
    window,
    BLOCK_M: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CONTEXT: tl.constexpr,
):
    """``[lo, hi)``: the key columns any row of the query tile starting at ``m_start`` may attend.

    Key tiles outside it are fully masked and need not be visited; inside it ``tile_mask`` decides.
    """
    m_end = tl.minimum(m_start + BLOCK_M, seq_len)
    p_first = tl.minimum(m_start, hist_len)
    p_last = tl.minimum(m_end - 1, hist_len)
    lo = 0
    hi = hist_len
    if CAUSAL:
        hi = tl.minimum(hist_len, p_last + 1)
    if HAS_WINDOW:
        lo = tl.maximum(0, p_first - window)
        hi = tl.minimum(hi, p_last + window + 1)
    if HAS_CONTEXT:
        if m_start < contextual_len:
            lo = 0
            hi = hist_len
    # every row also sees itself (targets sit beyond hist_len)
    lo = tl.minimum(lo, m_start)
    hi = tl.maximum(hi, m_end)
    return lo, hi
