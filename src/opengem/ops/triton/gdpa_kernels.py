"""GDPA Triton kernels: forward, dK/dV pass (and a short-query form for seed pooling), dQ pass (and its broadcast-Q
reduction form).

Math (per sample, head h, ``x = pre_scale * q_i . k_j``, ``c = out_scale = post_scale / norm``):
``O = c * P V`` with ``P = mask * phi_h(x)``; backward without any row statistic:
``dV = c * P^T dO``, ``dP = c * dO V^T``, ``dX = mask * dP * phi_h'(x)``, ``dQ = pre_scale * dX K``,
``dK = pre_scale * dX^T Q``.

Masking: K/V, Q and dO rows outside the sample are loaded as zeros, so they contribute exactly 0 to
every product (``phi(x) * 0 = 0``, ``dP = 0``) without a mask; only the recommendation mask of
:mod:`opengem.ops.reference.masks` (self-attention, ``MASKED``) needs ``tile_mask``, and only on tiles
that ``tile_fully_visible`` cannot prove fully visible (diagonal, window edges, targets).

Work items come from the host scheduler (:mod:`opengem.ops.triton.gdpa`): one program per
(work item, head), item = (sample, first tile); ``TILES`` consecutive query tiles per item.

Tiles load through ragged TMA descriptors (``USE_TMA``; :mod:`opengem.ops.triton.ragged_tiles`, zeros past
the sample as the masked loads give) or masked pointer loads; the ``*_desc`` arguments are the tensors
themselves on the pointer path. A program's own K/V tile in the dK/dV pass stays a pointer load (JFA's
dK/dV measured faster so: the descriptor's reshape made k, v register operands).
"""

import triton
import triton.language as tl

from opengem.ops.triton.activations import activation_value, activation_value_and_grad, scaled_activation_value
from opengem.ops.triton.masks import key_range, tile_mask
from opengem.ops.triton.mx import mx_e4m3_rows
from opengem.ops.triton.ragged_tiles import ragged_tile


@triton.jit
def tile_fully_visible(m_start, n_start, hist_len, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Scalar: every in-sample pair of the tile is visible, so the mask can be skipped (conservative).

    Contextual rows and the diagonal only add visibility, so checking the history rule suffices.
    """
    n_last = n_start + BLOCK_N - 1
    p_first = tl.minimum(m_start, hist_len)
    p_last = tl.minimum(m_start + BLOCK_M - 1, hist_len)
    ok = n_last < hist_len
    if CAUSAL:
        ok = ok & (n_last <= p_first)
    if HAS_WINDOW:
        ok = ok & (p_last - n_start <= window) & (n_last - p_first <= window)
    return ok


@triton.jit
def query_range(n_start, seq_len, hist_len, contextual_len, window, BLOCK_N: tl.constexpr,
                CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CONTEXT: tl.constexpr):
    """``[lo, hi)``: the query rows that may attend some key of the tile at ``n_start`` (superset)."""
    n_end = tl.minimum(n_start + BLOCK_N, seq_len)
    lo = n_start * 0
    hi = seq_len + lo
    if CAUSAL:
        lo = n_start + lo
    if HAS_WINDOW:
        lo = tl.maximum(lo, n_start - window)
        last_key = tl.minimum(n_end, hist_len) - 1
        # history rows i <= last_key + window; target rows (p = hist_len) only if hist_len - key <= window
        hi = tl.where(hist_len - last_key <= window, seq_len, tl.minimum(n_end + window, seq_len))
    if HAS_CONTEXT:
        lo = tl.where(contextual_len > 0, 0, lo)
        hi = tl.maximum(hi, tl.minimum(contextual_len, seq_len))
    # keys beyond the history (targets) are seen by themselves only
    in_hist = n_start < hist_len
    lo = tl.minimum(tl.where(in_hist, lo, n_start), n_start)
    hi = tl.maximum(tl.where(in_hist, hi, n_end), n_end)
    return lo, hi


@triton.jit
def _sample_bounds(Q_OFF, K_OFF, TARGETS, b, bcast_len, HAS_TARGETS: tl.constexpr, BROADCAST_Q: tl.constexpr):
    """(q_start, q_len, o_start, k_start, k_len, hist_len) of sample ``b``."""
    k_start = tl.load(K_OFF + b).to(tl.int32)
    k_len = tl.load(K_OFF + b + 1).to(tl.int32) - k_start
    if BROADCAST_Q:
        q_start = k_start * 0
        q_len = q_start + bcast_len
        o_start = b * bcast_len
    else:
        q_start = tl.load(Q_OFF + b).to(tl.int32)
        q_len = tl.load(Q_OFF + b + 1).to(tl.int32) - q_start
        o_start = q_start
    hist_len = k_len
    if HAS_TARGETS:
        hist_len = k_len - tl.load(TARGETS + b).to(tl.int32)
    return q_start, q_len, o_start, k_start, k_len, hist_len


@triton.jit
def _weights(dot, pre_scale, act, ACT: tl.constexpr, FAST_ACT: tl.constexpr):
    """``phi_h(pre_scale * dot)``. One activation for all heads (``ACT >= 0``) may take the scale into its constants
    (fast_gelu); per-head ones (``act`` a runtime id) multiply first: Triton 3.6's software pipeliner fails on the
    forward's key loop with the folded form inside a runtime branch ("TritonGPUPipeline" pass, sm_90)."""
    if ACT >= 0:
        p = scaled_activation_value(dot, pre_scale, act, FAST_ACT)
    else:
        p = activation_value(dot * pre_scale, act, FAST_ACT)
    return p


@triton.jit
def gdpa_fwd_kernel(
    Q, K, V, O, Q_OFF, K_OFF, TARGETS, HEAD_ACT, WORK_B, WORK_T, Q_desc, K_desc, V_desc,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    num_heads, pre_scale, out_scale, contextual_len, window, bcast_len,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
    ACT: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_CONTEXT: tl.constexpr, BROADCAST_Q: tl.constexpr,
    KV_RESIDENT: tl.constexpr, USE_TMA: tl.constexpr, PRECISION: tl.constexpr, FAST_ACT: tl.constexpr,
    P_MX: tl.constexpr = False, EXACT: tl.constexpr = False,
):
    """``P_MX``: P quantized to MX-E4M3 per row in blocks of 32 keys before ``P V`` (``precision="mxfp8"``,
    :mod:`opengem.ops.reference.gdpa_mxfp8`; key tiles are multiples of 32 from the sample's first key)."""
    pid = tl.program_id(0)
    h = pid % num_heads
    item = pid // num_heads
    b = tl.load(WORK_B + item)
    first_tile = tl.load(WORK_T + item)
    q_start, q_len, o_start, k_start, k_len, hist_len = _sample_bounds(
        Q_OFF, K_OFF, TARGETS, b, bcast_len, HAS_TARGETS, BROADCAST_Q)
    if ACT >= 0:  # one activation for all heads: folded at compile time
        act = ACT
    else:
        act = tl.load(HEAD_ACT + h)
    hk = h // GROUP
    offs_d = tl.arange(0, D)
    q_base = Q + q_start.to(tl.int64) * stride_qt + h * stride_qh
    k_base = K + k_start.to(tl.int64) * stride_kt + hk * stride_kh
    v_base = V + k_start.to(tl.int64) * stride_vt + hk * stride_vh
    o_base = O + o_start.to(tl.int64) * stride_ot + h * stride_oh
    if KV_RESIDENT:
        # short K/V (<= 256): the whole sample's K/V is one tile, loaded once and reused by every Q tile
        offs_n = tl.arange(0, BLOCK_N)
        if USE_TMA:
            k_res = tl.trans(ragged_tile(K_desc, k_start, k_len, 0, hk, BLOCK_N, D))
            v_res = ragged_tile(V_desc, k_start, k_len, 0, hk, BLOCK_N, D)
        else:
            k_res = tl.load(k_base + offs_n[None, :] * stride_kt + offs_d[:, None], mask=offs_n[None, :] < k_len,
                            other=0.0)
            v_res = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :], mask=offs_n[:, None] < k_len,
                            other=0.0)
    m_stop = tl.minimum((first_tile + TILES) * BLOCK_M, q_len)
    # software pipelining across the item's Q tiles: the loads of the next tile overlap this tile's math
    for m_start in range(first_tile * BLOCK_M, m_stop, BLOCK_M):
        offs_m = m_start + tl.arange(0, BLOCK_M)
        if USE_TMA:
            q = ragged_tile(Q_desc, q_start, q_len, m_start, h, BLOCK_M, D)
        else:
            q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :], mask=offs_m[:, None] < q_len, other=0.0)
        if KV_RESIDENT:
            p = _weights(tl.dot(q, k_res, input_precision=PRECISION), pre_scale, act, ACT, FAST_ACT)
            if MASKED:
                p = tl.where(tile_mask(offs_m, offs_n, k_len, hist_len, contextual_len, window,
                                       CAUSAL, HAS_WINDOW, HAS_CONTEXT), p, 0.0)
            if P_MX:
                p = mx_e4m3_rows(p, BLOCK_M, BLOCK_N, EXACT)
            acc = tl.dot(p.to(v_res.dtype), v_res, input_precision=PRECISION)
        else:
            acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
            if MASKED:
                lo, hi = key_range(m_start, k_len, hist_len, contextual_len, window, BLOCK_M,
                                   CAUSAL, HAS_WINDOW, HAS_CONTEXT)
                lo = (lo // BLOCK_N) * BLOCK_N
            else:
                lo = k_len * 0
                hi = k_len
            for n_start in range(lo, hi, BLOCK_N):
                offs_n = n_start + tl.arange(0, BLOCK_N)
                if USE_TMA:
                    kt = tl.trans(ragged_tile(K_desc, k_start, k_len, n_start, hk, BLOCK_N, D))
                    v = ragged_tile(V_desc, k_start, k_len, n_start, hk, BLOCK_N, D)
                else:
                    kt = tl.load(k_base + offs_n[None, :] * stride_kt + offs_d[:, None],
                                 mask=offs_n[None, :] < k_len, other=0.0)
                    v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :],
                                mask=offs_n[:, None] < k_len, other=0.0)
                p = _weights(tl.dot(q, kt, input_precision=PRECISION), pre_scale, act, ACT, FAST_ACT)
                if MASKED:
                    if not tile_fully_visible(m_start, n_start, hist_len, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW):
                        p = tl.where(tile_mask(offs_m, offs_n, k_len, hist_len, contextual_len, window,
                                               CAUSAL, HAS_WINDOW, HAS_CONTEXT), p, 0.0)
                if P_MX:
                    p = mx_e4m3_rows(p, BLOCK_M, BLOCK_N, EXACT)
                acc += tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        out = (acc * out_scale).to(O.dtype.element_ty)
        tl.store(o_base + offs_m[:, None] * stride_ot + offs_d[None, :], out, mask=offs_m[:, None] < q_len)


@triton.jit
def _key_tile(K, V, k_start, k_len, n_start, hk, stride_kt, stride_kh, stride_vt, stride_vh,
              BLOCK_N: tl.constexpr, D: tl.constexpr):
    """``(k, v, rows, row_ok)``: one head's K and V rows ``[n_start, n_start + BLOCK_N)`` of a sample (zeros past
    it), their flat row indices and validity, for the dK/dV passes."""
    offs_d = tl.arange(0, D)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    row_ok = offs_n[:, None] < k_len
    rows = (k_start + offs_n[:, None]).to(tl.int64)
    k = tl.load(K + rows * stride_kt + hk * stride_kh + offs_d[None, :], mask=row_ok, other=0.0)
    v = tl.load(V + rows * stride_vt + hk * stride_vh + offs_d[None, :], mask=row_ok, other=0.0)
    return k, v, rows, row_ok


@triton.jit
def _scaled_key_tile_grads(dk, dv, pre_scale, out_scale):
    """A key tile's accumulated products scaled into its gradients: ``dK = c pre_scale dX^T Q``, ``dV = c P^T dO``."""
    return dk * (out_scale * pre_scale), dv * out_scale


@triton.jit
def _tile_column_sums(dk, dv, row_ok):
    """fp32 column sums of a key tile's dK and dV over its rows in the sample (``[D]`` each: a K/V bias's
    gradient)."""
    return tl.sum(tl.where(row_ok, dk, 0.0), 0), tl.sum(tl.where(row_ok, dv, 0.0), 0)


@triton.jit
def _store_key_tile_grads(DK, DV, dk, dv, rows, row_ok, hk, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                          pre_scale, out_scale, D: tl.constexpr, COLUMN_SUMS: tl.constexpr):
    """dK and dV of a key tile (:func:`_scaled_key_tile_grads`) in the gradients' dtype; with ``COLUMN_SUMS``
    returns their :func:`_tile_column_sums`, else zeros."""
    offs_d = tl.arange(0, D)
    dk, dv = _scaled_key_tile_grads(dk, dv, pre_scale, out_scale)
    tl.store(DK + rows * stride_dkt + hk * stride_dkh + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=row_ok)
    tl.store(DV + rows * stride_dvt + hk * stride_dvh + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=row_ok)
    dk_sum = tl.zeros([D], dtype=tl.float32)
    dv_sum = tl.zeros([D], dtype=tl.float32)
    if COLUMN_SUMS:
        dk_sum, dv_sum = _tile_column_sums(dk, dv, row_ok)
    return dk_sum, dv_sum


@triton.jit
def _store_kv_sums(SUMS, pid, dk_sum, dv_sum, D: tl.constexpr):
    """A dK/dV program's column sums into its row of ``SUMS [programs, 2, D]`` fp32 (the host sums the rows)."""
    offs_d = tl.arange(0, D)
    tl.store(SUMS + (pid.to(tl.int64) * 2) * D + offs_d, dk_sum)
    tl.store(SUMS + (pid.to(tl.int64) * 2 + 1) * D + offs_d, dv_sum)


@triton.jit
def gdpa_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, Q_OFF, K_OFF, TARGETS, HEAD_ACT, WORK_B, WORK_T, Q_desc, DO_desc, SUMS, WORK_CHUNK, PARTIAL,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    num_kv_heads, pre_scale, out_scale, contextual_len, window, bcast_len,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ACT: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_CONTEXT: tl.constexpr, BROADCAST_Q: tl.constexpr, USE_TMA: tl.constexpr,
    PRECISION: tl.constexpr, FAST_ACT: tl.constexpr, COLUMN_SUMS: tl.constexpr = False,
    QUERY_CHUNKS: tl.constexpr = False,
):
    """One program per (sample, key tile, K/V head): loops over the group's Q heads and the Q tiles. ``COLUMN_SUMS``:
    also its dK and dV column sums into ``SUMS[program]`` (``_store_kv_sums``).

    ``QUERY_CHUNKS``: an item may be one chunk of its sample's query rows, ``WORK_CHUNK[item] = (lo, hi, slot)``
    (``slot < 0``: the whole sample, stored as above). A chunk stores its scaled fp32 dK and dV to ``PARTIAL[slot]``
    (``[slots, 2, BLOCK_N, H_kv, D]``), which ``gdpa_bwd_dkdv_chunk_sum_kernel`` sums in chunk order: a long
    sample's key tile is then spread over several programs instead of holding the pass for its whole length."""
    pid = tl.program_id(0)
    hk = pid % num_kv_heads
    item = pid // num_kv_heads
    b = tl.load(WORK_B + item)
    n_start = tl.load(WORK_T + item) * BLOCK_N
    q_start, q_len, o_start, k_start, k_len, hist_len = _sample_bounds(
        Q_OFF, K_OFF, TARGETS, b, bcast_len, HAS_TARGETS, BROADCAST_Q)
    offs_d = tl.arange(0, D)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    k, v, rows, row_ok = _key_tile(K, V, k_start, k_len, n_start, hk, stride_kt, stride_kh, stride_vt, stride_vh,
                                   BLOCK_N, D)
    dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    if MASKED:
        lo, hi = query_range(n_start, k_len, hist_len, contextual_len, window, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_CONTEXT)
        lo = (lo // BLOCK_M) * BLOCK_M
    else:
        lo = q_len * 0
        hi = q_len
    slot = -1
    if QUERY_CHUNKS:  # chunk bounds are multiples of BLOCK_M, as lo is
        lo = tl.maximum(lo, tl.load(WORK_CHUNK + 3 * item))
        hi = tl.minimum(hi, tl.load(WORK_CHUNK + 3 * item + 1))
        slot = tl.load(WORK_CHUNK + 3 * item + 2)
    for g in range(GROUP):
        h = hk * GROUP + g
        if ACT >= 0:  # one activation for all heads: folded at compile time
            act = ACT
        else:
            act = tl.load(HEAD_ACT + h)
        q_base = Q + q_start.to(tl.int64) * stride_qt + h * stride_qh
        do_base = DO + o_start.to(tl.int64) * stride_dot + h * stride_doh
        for m_start in range(lo, hi, BLOCK_M):
            offs_m = m_start + tl.arange(0, BLOCK_M)
            if USE_TMA:
                qt = tl.trans(ragged_tile(Q_desc, q_start, q_len, m_start, h, BLOCK_M, D))
                do = ragged_tile(DO_desc, o_start, q_len, m_start, h, BLOCK_M, D)
            else:
                qt = tl.load(q_base + offs_m[None, :] * stride_qt + offs_d[:, None], mask=offs_m[None, :] < q_len,
                             other=0.0)
                do = tl.load(do_base + offs_m[:, None] * stride_dot + offs_d[None, :],
                             mask=offs_m[:, None] < q_len, other=0.0)
            xt = tl.dot(k, qt, input_precision=PRECISION) * pre_scale  # [BLOCK_N, BLOCK_M]
            pt, dphit = activation_value_and_grad(xt, act, FAST_ACT)
            dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
            dxt = dpt * dphit
            if MASKED:
                if not tile_fully_visible(m_start, n_start, hist_len, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW):
                    visible = tl.trans(tile_mask(offs_m, offs_n, k_len, hist_len, contextual_len, window,
                                                 CAUSAL, HAS_WINDOW, HAS_CONTEXT))
                    pt = tl.where(visible, pt, 0.0)
                    dxt = tl.where(visible, dxt, 0.0)
            dv += tl.dot(pt.to(do.dtype), do, input_precision=PRECISION)
            dk += tl.dot(dxt.to(qt.dtype), tl.trans(qt), input_precision=PRECISION)
    if slot >= 0:
        dk, dv = _scaled_key_tile_grads(dk, dv, pre_scale, out_scale)
        tile = PARTIAL + slot.to(tl.int64) * (2 * BLOCK_N * num_kv_heads * D) + hk * D
        offs_row = tl.arange(0, BLOCK_N)[:, None] * (num_kv_heads * D) + offs_d[None, :]
        tl.store(tile + offs_row, dk)
        tl.store(tile + BLOCK_N * num_kv_heads * D + offs_row, dv)
        if COLUMN_SUMS:
            dk_sum, dv_sum = _tile_column_sums(dk, dv, row_ok)
            _store_kv_sums(SUMS, pid, dk_sum, dv_sum, D)
    else:
        dk_sum, dv_sum = _store_key_tile_grads(DK, DV, dk, dv, rows, row_ok, hk, stride_dkt, stride_dkh, stride_dvt,
                                               stride_dvh, pre_scale, out_scale, D, COLUMN_SUMS)
        if COLUMN_SUMS:
            _store_kv_sums(SUMS, pid, dk_sum, dv_sum, D)


@triton.jit
def gdpa_bwd_dkdv_chunk_sum_kernel(
    PARTIAL, DK, DV, GROUPS, stride_dkt, stride_dkh, stride_dvt, stride_dvh, num_kv_heads,
    BLOCK_N: tl.constexpr, D: tl.constexpr,
):
    """One program per (chunked key tile, K/V head): ``GROUPS[g] = (first row, rows, first slot, chunks)``; sums the
    tile's chunks' ``PARTIAL`` slots in order (deterministic, no atomics) into dK and dV's rows."""
    pid = tl.program_id(0)
    hk = pid % num_kv_heads
    g = pid // num_kv_heads
    first_row = tl.load(GROUPS + 4 * g)
    rows = tl.load(GROUPS + 4 * g + 1)
    first_slot = tl.load(GROUPS + 4 * g + 2)
    chunks = tl.load(GROUPS + 4 * g + 3)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    offs_row = offs_n[:, None] * (num_kv_heads * D) + hk * D + offs_d[None, :]
    dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    for c in range(chunks):
        tile = PARTIAL + (first_slot + c).to(tl.int64) * (2 * BLOCK_N * num_kv_heads * D)
        dk += tl.load(tile + offs_row)
        dv += tl.load(tile + BLOCK_N * num_kv_heads * D + offs_row)
    out_rows = (first_row + offs_n[:, None]).to(tl.int64)
    row_ok = offs_n[:, None] < rows
    tl.store(DK + out_rows * stride_dkt + hk * stride_dkh + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=row_ok)
    tl.store(DV + out_rows * stride_dvt + hk * stride_dvh + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=row_ok)


@triton.jit
def gdpa_bwd_dkdv_short_q_kernel(
    Q, K, V, DO, DK, DV, Q_OFF, K_OFF, HEAD_ACT, WORK_B, WORK_T, SUMS,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    num_kv_heads, pre_scale, out_scale, bcast_len,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
    ACT: tl.constexpr, BROADCAST_Q: tl.constexpr, PRECISION: tl.constexpr, FAST_ACT: tl.constexpr,
    COLUMN_SUMS: tl.constexpr = False,
):
    """dK/dV where every sample's queries fit one tile of ``BLOCK_M`` rows (seed pooling's broadcast queries), no
    mask: one program per (sample, ``TILES`` key tiles, K/V head), each key tile finished in one step, so the loop
    over key tiles has no inner loop and Triton pipelines its K/V loads, where ``gdpa_bwd_dkdv_kernel`` runs one key
    tile a program. On gem-large's pooling this kernel ran 1.45-1.50x faster (H200, session 30, same run)."""
    pid = tl.program_id(0)
    hk = pid % num_kv_heads
    item = pid // num_kv_heads
    b = tl.load(WORK_B + item)
    first_tile = tl.load(WORK_T + item)
    q_start, q_len, o_start, k_start, k_len, hist_len = _sample_bounds(Q_OFF, K_OFF, K_OFF, b, bcast_len, False,
                                                                       BROADCAST_Q)
    # Column sums over the keys with one Q head a K/V head (GEM's pooling): sum_n dV = (sum_n P)^T dO and
    # sum_n dK = (sum_n dX)^T Q, Q and dO the same for every key tile of the sample, so the loop only adds the P and
    # dX tiles ([BLOCK_N, BLOCK_M]) and the products wait for the end (per-tile sums of dK and dV took the 64-key
    # tile to 255 registers and 40 B of spills, Triton 3.6, sm_90). GQA groups sum each tile's dK and dV instead.
    p_total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    dx_total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    dk_sum = tl.zeros([D], dtype=tl.float32)
    dv_sum = tl.zeros([D], dtype=tl.float32)
    n_stop = tl.minimum((first_tile + TILES) * BLOCK_N, k_len)
    for n_start in range(first_tile * BLOCK_N, n_stop, BLOCK_N):
        k, v, rows, row_ok = _key_tile(K, V, k_start, k_len, n_start, hk, stride_kt, stride_kh, stride_vt, stride_vh,
                                       BLOCK_N, D)
        dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
        for g in tl.static_range(GROUP):
            h = hk * GROUP + g
            qt, do, act = _short_q_tile(Q, DO, HEAD_ACT, q_start, o_start, q_len, h, stride_qt, stride_qh, stride_dot,
                                        stride_doh, ACT, D, BLOCK_M)  # fmt: skip
            xt = tl.dot(k, qt, input_precision=PRECISION) * pre_scale  # [BLOCK_N, BLOCK_M]
            pt, dphit = activation_value_and_grad(xt, act, FAST_ACT)
            pt = pt.to(do.dtype)
            dxt = (tl.dot(v, tl.trans(do), input_precision=PRECISION) * dphit).to(qt.dtype)
            dv += tl.dot(pt, do, input_precision=PRECISION)
            dk += tl.dot(dxt, tl.trans(qt), input_precision=PRECISION)
            if COLUMN_SUMS and GROUP == 1:
                p_total += tl.where(row_ok, pt.to(tl.float32), 0.0)
                dx_total += tl.where(row_ok, dxt.to(tl.float32), 0.0)
        tile_dk_sum, tile_dv_sum = _store_key_tile_grads(DK, DV, dk, dv, rows, row_ok, hk, stride_dkt, stride_dkh,
                                                         stride_dvt, stride_dvh, pre_scale, out_scale, D,
                                                         COLUMN_SUMS and GROUP > 1)  # fmt: skip
        if COLUMN_SUMS and GROUP > 1:
            dk_sum += tile_dk_sum
            dv_sum += tile_dv_sum
    if COLUMN_SUMS:
        if GROUP == 1:
            qt, do, _ = _short_q_tile(Q, DO, HEAD_ACT, q_start, o_start, q_len, hk, stride_qt, stride_qh, stride_dot,
                                      stride_doh, ACT, D, BLOCK_M)  # fmt: skip
            dk_sum = tl.sum(qt.to(tl.float32) * tl.sum(dx_total, 0)[None, :], 1) * (out_scale * pre_scale)
            dv_sum = tl.sum(do.to(tl.float32) * tl.sum(p_total, 0)[:, None], 0) * out_scale
        _store_kv_sums(SUMS, pid, dk_sum, dv_sum, D)


@triton.jit
def _short_q_tile(Q, DO, HEAD_ACT, q_start, o_start, q_len, h, stride_qt, stride_qh, stride_dot, stride_doh,
                  ACT: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr):
    """``(q^T [D, BLOCK_M], dO [BLOCK_M, D], activation)`` of head ``h``: the sample's queries and output gradients,
    one tile read from L2 by every key tile (zeros past ``q_len``)."""
    offs_d = tl.arange(0, D)
    offs_m = tl.arange(0, BLOCK_M)
    if ACT >= 0:  # one activation for all heads: folded at compile time
        act = ACT
    else:
        act = tl.load(HEAD_ACT + h)
    qt = tl.load(Q + (q_start + offs_m[None, :]).to(tl.int64) * stride_qt + h * stride_qh + offs_d[:, None],
                 mask=offs_m[None, :] < q_len, other=0.0)
    do = tl.load(DO + (o_start + offs_m[:, None]).to(tl.int64) * stride_dot + h * stride_doh + offs_d[None, :],
                 mask=offs_m[:, None] < q_len, other=0.0)
    return qt, do, act


@triton.jit
def _dq_tile(Q, K, V, DO, Q_desc, K_desc, V_desc, DO_desc, h, hk, m_start, q_start, q_len, o_start, k_start,
             k_len, hist_len, act, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot,
             stride_doh, pre_scale, contextual_len, window,
             D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
             CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CONTEXT: tl.constexpr, USE_TMA: tl.constexpr,
             PRECISION: tl.constexpr, FAST_ACT: tl.constexpr):
    """fp32 ``sum_j dX_ij k_j`` for the query tile at ``m_start`` of one sample and head (unscaled)."""
    offs_d = tl.arange(0, D)
    offs_m = m_start + tl.arange(0, BLOCK_M)
    row_ok = offs_m[:, None] < q_len
    q_rows = (q_start + offs_m[:, None]).to(tl.int64)
    o_rows = (o_start + offs_m[:, None]).to(tl.int64)
    if USE_TMA:
        q = ragged_tile(Q_desc, q_start, q_len, m_start, h, BLOCK_M, D)
        do = ragged_tile(DO_desc, o_start, q_len, m_start, h, BLOCK_M, D)
    else:
        q = tl.load(Q + q_rows * stride_qt + h * stride_qh + offs_d[None, :], mask=row_ok, other=0.0)
        do = tl.load(DO + o_rows * stride_dot + h * stride_doh + offs_d[None, :], mask=row_ok, other=0.0)
    k_base = K + k_start.to(tl.int64) * stride_kt + hk * stride_kh
    v_base = V + k_start.to(tl.int64) * stride_vt + hk * stride_vh
    dq = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    if MASKED:
        lo, hi = key_range(m_start, k_len, hist_len, contextual_len, window, BLOCK_M, CAUSAL, HAS_WINDOW, HAS_CONTEXT)
        lo = (lo // BLOCK_N) * BLOCK_N
    else:
        lo = k_len * 0
        hi = k_len
    for n_start in range(lo, hi, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        if USE_TMA:
            kt = tl.trans(ragged_tile(K_desc, k_start, k_len, n_start, hk, BLOCK_N, D))
            vt = tl.trans(ragged_tile(V_desc, k_start, k_len, n_start, hk, BLOCK_N, D))
        else:
            col_ok = offs_n[None, :] < k_len
            kt = tl.load(k_base + offs_n[None, :] * stride_kt + offs_d[:, None], mask=col_ok, other=0.0)
            vt = tl.load(v_base + offs_n[None, :] * stride_vt + offs_d[:, None], mask=col_ok, other=0.0)
        x = tl.dot(q, kt, input_precision=PRECISION) * pre_scale
        _, dphi = activation_value_and_grad(x, act, FAST_ACT)
        dx = tl.dot(do, vt, input_precision=PRECISION) * dphi
        if MASKED:
            if not tile_fully_visible(m_start, n_start, hist_len, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW):
                dx = tl.where(tile_mask(offs_m, offs_n, k_len, hist_len, contextual_len, window,
                                       CAUSAL, HAS_WINDOW, HAS_CONTEXT), dx, 0.0)
        dq += tl.dot(dx.to(kt.dtype), tl.trans(kt), input_precision=PRECISION)
    return dq


@triton.jit
def gdpa_bwd_dq_kernel(
    Q, K, V, DO, DQ, Q_OFF, K_OFF, TARGETS, HEAD_ACT, WORK_B, WORK_T, Q_desc, K_desc, V_desc, DO_desc, SUMS,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh,
    num_heads, pre_scale, dq_scale, contextual_len, window,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ACT: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_CONTEXT: tl.constexpr, USE_TMA: tl.constexpr, PRECISION: tl.constexpr,
    FAST_ACT: tl.constexpr, KV_RESIDENT: tl.constexpr = False, TILES: tl.constexpr = 1,
    COLUMN_SUMS: tl.constexpr = False,
):
    """One program per (sample, query tile, head): dQ without atomics. ``KV_RESIDENT``: short K/V (the whole
    sample's keys one tile of ``BLOCK_N``) loaded once, then ``TILES`` query tiles in a pipelined loop, as the
    forward's resident path: a program per tile reads its q and dO with nothing in flight behind them (GEM's PFFN dQ,
    32 keys a sample: the resident path ran it 1.52-1.67x faster, H200, session 30, same run). ``COLUMN_SUMS``: also
    the program's dQ column sum (fp32, ``[D]``: a Q bias's gradient) into ``SUMS[program]``, which the host sums."""
    pid = tl.program_id(0)
    h = pid % num_heads
    item = pid // num_heads
    b = tl.load(WORK_B + item)
    first_tile = tl.load(WORK_T + item)
    q_start, q_len, o_start, k_start, k_len, hist_len = _sample_bounds(
        Q_OFF, K_OFF, TARGETS, b, 0, HAS_TARGETS, False)
    if ACT >= 0:  # one activation for all heads: folded at compile time
        act = ACT
    else:
        act = tl.load(HEAD_ACT + h)
    hk = h // GROUP
    offs_d = tl.arange(0, D)
    dq_sum = tl.zeros([D], dtype=tl.float32)
    if KV_RESIDENT:
        offs_n = tl.arange(0, BLOCK_N)
        if USE_TMA:
            kt = tl.trans(ragged_tile(K_desc, k_start, k_len, 0, hk, BLOCK_N, D))
            vt = tl.trans(ragged_tile(V_desc, k_start, k_len, 0, hk, BLOCK_N, D))
        else:
            col_ok = offs_n[None, :] < k_len
            kt = tl.load(K + (k_start + offs_n[None, :]).to(tl.int64) * stride_kt + hk * stride_kh + offs_d[:, None],
                         mask=col_ok, other=0.0)
            vt = tl.load(V + (k_start + offs_n[None, :]).to(tl.int64) * stride_vt + hk * stride_vh + offs_d[:, None],
                         mask=col_ok, other=0.0)
        q_base = Q + q_start.to(tl.int64) * stride_qt + h * stride_qh
        do_base = DO + o_start.to(tl.int64) * stride_dot + h * stride_doh
        # with COLUMN_SUMS: sum_rows dQ = (sum_rows dX) K over the program's tiles, K resident, so the loop only adds
        # dX tiles ([BLOCK_M, BLOCK_N], 16 registers at 64 x 32) and the one reduction waits for the end
        dx_total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        m_stop = tl.minimum((first_tile + TILES) * BLOCK_M, q_len)
        for m_start in range(first_tile * BLOCK_M, m_stop, BLOCK_M):
            offs_m = m_start + tl.arange(0, BLOCK_M)
            row_ok = offs_m[:, None] < q_len
            if USE_TMA:
                q = ragged_tile(Q_desc, q_start, q_len, m_start, h, BLOCK_M, D)
                do = ragged_tile(DO_desc, o_start, q_len, m_start, h, BLOCK_M, D)
            else:
                q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :], mask=row_ok, other=0.0)
                do = tl.load(do_base + offs_m[:, None] * stride_dot + offs_d[None, :], mask=row_ok, other=0.0)
            x = tl.dot(q, kt, input_precision=PRECISION) * pre_scale
            _, dphi = activation_value_and_grad(x, act, FAST_ACT)
            dx = tl.dot(do, vt, input_precision=PRECISION) * dphi
            if MASKED:
                dx = tl.where(tile_mask(offs_m, offs_n, k_len, hist_len, contextual_len, window,
                                        CAUSAL, HAS_WINDOW, HAS_CONTEXT), dx, 0.0)
            dx = dx.to(kt.dtype)
            dq = tl.dot(dx, tl.trans(kt), input_precision=PRECISION) * dq_scale
            tl.store(DQ + (q_start + offs_m[:, None]).to(tl.int64) * stride_dqt + h * stride_dqh + offs_d[None, :],
                     dq.to(DQ.dtype.element_ty), mask=row_ok)
            if COLUMN_SUMS:
                dx_total += tl.where(row_ok, dx.to(tl.float32), 0.0)
        if COLUMN_SUMS:
            dq_sum = tl.sum(kt.to(tl.float32) * tl.sum(dx_total, 0)[None, :], 1) * dq_scale
    else:
        m_start = first_tile * BLOCK_M
        dq = _dq_tile(Q, K, V, DO, Q_desc, K_desc, V_desc, DO_desc, h, hk, m_start, q_start, q_len, o_start,
                      k_start, k_len, hist_len, act, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                      stride_dot, stride_doh, pre_scale, contextual_len, window, D, BLOCK_M, BLOCK_N, MASKED, CAUSAL,
                      HAS_WINDOW, HAS_CONTEXT, USE_TMA, PRECISION, FAST_ACT)
        offs_m = m_start + tl.arange(0, BLOCK_M)
        row_ok = offs_m[:, None] < q_len
        dq = dq * dq_scale
        tl.store(DQ + (q_start + offs_m[:, None]).to(tl.int64) * stride_dqt + h * stride_dqh + offs_d[None, :],
                 dq.to(DQ.dtype.element_ty), mask=row_ok)
        if COLUMN_SUMS:
            dq_sum = tl.sum(tl.where(row_ok, dq, 0.0), 0)
    if COLUMN_SUMS:
        tl.store(SUMS + pid.to(tl.int64) * D + offs_d, dq_sum)


@triton.jit
def gdpa_bwd_dq_broadcast_kernel(
    Q, K, V, DO, DQ_PARTIAL, K_OFF, HEAD_ACT, CHUNK_B,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_pc, stride_pt, stride_ph,
    num_heads, num_q_tiles, keys_first, keys_per_chunk, bcast_len, pre_scale, dq_scale,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ACT: tl.constexpr, PRECISION: tl.constexpr, FAST_ACT: tl.constexpr,
):
    """Broadcast-Q dQ: one program per (chunk of keys, query tile, head) sums, in a fixed order, the key rows
    ``[keys_first + chunk * keys_per_chunk, + keys_per_chunk)`` of the samples ``CHUNK_B[2 chunk : 2 chunk + 2]``
    that hold them into ``DQ_PARTIAL[chunk]``; the host then sums the chunks (a deterministic reduction). Equal key
    ranges, not equal sample counts: a long sample spans several chunks, so no program walks a whole one."""
    pid = tl.program_id(0)
    h = pid % num_heads
    tile = (pid // num_heads) % num_q_tiles
    chunk = pid // (num_heads * num_q_tiles)
    if ACT >= 0:  # one activation for all heads: folded at compile time
        act = ACT
    else:
        act = tl.load(HEAD_ACT + h)
    m_start = tile * BLOCK_M
    dq = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    chunk_start = keys_first + chunk * keys_per_chunk
    chunk_end = chunk_start + keys_per_chunk
    for b in range(tl.load(CHUNK_B + 2 * chunk), tl.load(CHUNK_B + 2 * chunk + 1)):
        k_start = tl.maximum(tl.load(K_OFF + b).to(tl.int32), chunk_start)
        k_len = tl.minimum(tl.load(K_OFF + b + 1).to(tl.int32), chunk_end) - k_start
        # pointer loads: the broadcast Q is not jagged, and K/V change sample by sample within the program
        dq += _dq_tile(Q, K, V, DO, Q, K, V, DO, h, h // GROUP, m_start, 0, bcast_len, b * bcast_len, k_start,
                       k_len, k_len, act, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                       stride_dot, stride_doh, pre_scale, 0, 0, D, BLOCK_M, BLOCK_N, False, False, False, False,
                       False, PRECISION, FAST_ACT)
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    partial = DQ_PARTIAL + chunk.to(tl.int64) * stride_pc + h * stride_ph
    tl.store(partial + offs_m[:, None] * stride_pt + offs_d[None, :], dq * dq_scale, mask=offs_m[:, None] < bcast_len)
