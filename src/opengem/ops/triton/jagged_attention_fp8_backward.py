"""The FP8 JFA backward with E4M3 products (``jagged_attention(..., precision="fp8", backward_precision="fp8")``,
opt-in: slower than the straight-through bf16 one on an H200, session 19): the numerics of
:func:`opengem.ops.reference.attention_fp8_backward.jagged_attention_fp8_mma_backward`.

Hopper's FP8 MMA wants both operands contiguous along the reduction. The two products of each pass that reduce
over the head dim read row-major E4M3 blocks and run in E4M3: ``S = Q K^T`` (the forward's own operands, so P is
the forward's) and ``dP = dO V^T`` (dO quantized per block like V). The three that reduce over rows (``dV = P^T
dO``, ``dK = dS^T Q``, ``dQ = dS K``) run in the inputs' 16-bit type on the dequantized operands and the bf16 dO.
Blocks are the forward's (:mod:`opengem.ops.triton.jagged_attention_fp8`): every query or key tile lies in one
block, so each operand tile has one scale. dQ and dK come out rotated and go back through ``R^T``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from opengem.ops.reference.attention_fp8 import rotation_size
from opengem.ops.triton.jagged_attention import (
    _KEY,
    _LARGE,
    _SMALL,
    LOG2E,
    Problem,
    _grid,
    _item,
    _key_tiles,
    _query_tiles,
    _sample,
)
from opengem.ops.triton.jagged_attention_fp8 import (
    BLOCK,
    _configs,
    _prune,
    query_tile,
    quantize_for_backward,
    rotated_back,
    rotated_gradient_buffers,
)
from opengem.ops.triton.masks import tile_mask
from opengem.ops.triton.ragged_tiles import last_dim_contiguous
from opengem.ops.triton.tuning import autotune

# (BLOCK_M, num_warps, num_stages), the first the untuned default; the key tile is always one block. From sm_90
# static counts (benchmarks/sass.py, D = 128): dQ at 128 rows / 8 warps spills nothing at one stage, 8 B at two;
# dK/dV at 32 query rows / 8 warps holds 247 registers, at 64 rows it spills
_DQ = [(128, 8, 2), (128, 8, 1), (64, 8, 2)]
_DKDV = [(32, 8, 2), (32, 8, 1), (64, 8, 1)]


_TUNING = dict(key=_KEY, prune_configs_by={"early_config_prune": _prune})


@triton.jit
def _block_tile_t(X8, XS, h, num_blocks, block0, row, ROWS: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """``[HEAD_DIM, ROWS]`` view (contiguous along the head dim, an FP8 MMA's B operand) of the rows ``[row, row +
    ROWS)`` of a sample's head ``h`` in a row-major blocked layout, and their block's scale."""
    blk = h * num_blocks + block0 + row // BLOCK
    rows = row % BLOCK + tl.arange(0, ROWS)
    tile = tl.load(X8 + blk * BLOCK * HEAD_DIM + rows[None, :] * HEAD_DIM + tl.arange(0, HEAD_DIM)[:, None])
    return tile, tl.load(XS + blk)


@triton.jit
def _dq_tiles(dq, q8, do8, qk_scale, do_scale, lse, delta, K8, V8, KS, VS, kv_h, num_blocks, block0, n_lo, n_hi,
              offs_m, seq_len, hist_len, contextual_len, window, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CONTEXT: tl.constexpr,
              MMA_DTYPE: tl.constexpr):  # fmt: skip
    """Key tiles ``[n_lo, n_hi)`` (whole blocks) into the rotated dQ."""
    for n_start in range(n_lo, n_hi, BLOCK_N):
        kT, k_scale = _block_tile_t(K8, KS, kv_h, num_blocks, block0, n_start, BLOCK_N, BLOCK_N, HEAD_DIM)
        vT, v_scale = _block_tile_t(V8, VS, kv_h, num_blocks, block0, n_start, BLOCK_N, BLOCK_N, HEAD_DIM)
        p = tl.math.exp2(tl.dot(q8, kT) * (qk_scale * k_scale) - lse[:, None])  # the forward's P
        if MASKED:
            visible = tile_mask(offs_m, n_start + tl.arange(0, BLOCK_N), seq_len, hist_len, contextual_len, window,
                                CAUSAL, HAS_WINDOW, HAS_CONTEXT)  # fmt: skip
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(do8, vT) * (do_scale * v_scale)
        ds = p * (dp - delta[:, None])
        k = (tl.trans(kT).to(tl.float32) * k_scale).to(MMA_DTYPE)  # the straight-through K, as the forward's
        dq = tl.dot(ds.to(MMA_DTYPE), k, dq)
    return dq


@autotune(configs=_configs(_DQ), **_TUNING)
@triton.jit(do_not_specialize=["contextual_len", "window", "total_tokens", "heads", "num_blocks"])
def _dq_fp8_kernel(
    Q8, K8, V8, DO8, QS, KS, VS, DOS, O, DO, LSE, Delta, DQ, offsets, num_targets, block_base, sched_small,
    sched_large, stride_ot, stride_oh, stride_dot, stride_doh, stride_dqt, stride_dqh, total_tokens, heads,
    num_blocks, scale, scale_log2, contextual_len, window, LEN_BUCKET,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_CONTEXT: tl.constexpr, HAS_TARGETS: tl.constexpr, SMALL: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dQ (rotated) of one query tile; writes ``delta = rowsum(dO * O)`` for the dK/dV pass, as JFA's dQ pass."""
    b, m_start, h = _item(sched_small, sched_large, heads, BLOCK_M, SMALL)
    start, seq_len, hist_len = _sample(offsets, num_targets, b, HAS_TARGETS)
    block0 = tl.load(block_base + b).to(tl.int64)
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seq_len
    q8, q_scale = query_tile(Q8, QS, h, num_blocks, block0, m_start, BLOCK_M, BLOCK_N, HEAD_DIM)
    do8, do_scale = query_tile(DO8, DOS, h, num_blocks, block0, m_start, BLOCK_M, BLOCK_N, HEAD_DIM)
    rows = (start + offs_m[:, None]).to(tl.int64)
    do = tl.load(DO + rows * stride_dot + h * stride_doh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    o = tl.load(O + rows * stride_ot + h * stride_oh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + h * total_tokens + start + offs_m, delta, mask=row_ok)
    lse = tl.load(LSE + h * total_tokens + start + offs_m, mask=row_ok, other=0.0)
    qk_scale = q_scale * scale_log2
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    lo, f_lo, f_hi, hi = _key_tiles(m_start, seq_len, hist_len, contextual_len, window, BLOCK_M, BLOCK_N, CAUSAL,
                                    HAS_WINDOW, HAS_CONTEXT)  # fmt: skip
    kv_h = h // GROUP
    dq = _dq_tiles(dq, q8, do8, qk_scale, do_scale, lse, delta, K8, V8, KS, VS, kv_h, num_blocks, block0, lo, f_lo,
                   offs_m, seq_len, hist_len, contextual_len, window, BLOCK_N, HEAD_DIM, True, CAUSAL, HAS_WINDOW,
                   HAS_CONTEXT, DQ.dtype.element_ty)  # fmt: skip
    dq = _dq_tiles(dq, q8, do8, qk_scale, do_scale, lse, delta, K8, V8, KS, VS, kv_h, num_blocks, block0, f_lo, f_hi,
                   offs_m, seq_len, hist_len, contextual_len, window, BLOCK_N, HEAD_DIM, False, CAUSAL, HAS_WINDOW,
                   HAS_CONTEXT, DQ.dtype.element_ty)  # fmt: skip
    dq = _dq_tiles(dq, q8, do8, qk_scale, do_scale, lse, delta, K8, V8, KS, VS, kv_h, num_blocks, block0, f_hi, hi,
                   offs_m, seq_len, hist_len, contextual_len, window, BLOCK_N, HEAD_DIM, True, CAUSAL, HAS_WINDOW,
                   HAS_CONTEXT, DQ.dtype.element_ty)  # fmt: skip
    tl.store(DQ + rows * stride_dqt + h * stride_dqh + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=row_ok[:, None])  # fmt: skip


@triton.jit
def _dkdv_tiles(dk, dv, k8, v8, k_scale, v_scale, Q8, DO8, QS, DOS, DO, LSE, Delta, h, num_blocks, block0, start,
                total_tokens, stride_dot, stride_doh, scale_log2, m_lo, m_hi, offs_n, seq_len, hist_len,
                contextual_len, window, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CONTEXT: tl.constexpr,
                MMA_DTYPE: tl.constexpr):  # fmt: skip
    """Query tiles ``[m_lo, m_hi)`` of head ``h`` into one key tile's dK (rotated), dV; transposed, ``[N, M]``."""
    offs_d = tl.arange(0, HEAD_DIM)
    for m_start in range(m_lo, m_hi, BLOCK_M):
        offs_m = m_start + tl.arange(0, BLOCK_M)
        row_ok = offs_m < seq_len  # rows past the sample: Q, dO, lse and delta load as zeros, their terms vanish
        qT, q_scale = _block_tile_t(Q8, QS, h, num_blocks, block0, m_start, BLOCK_M, BLOCK, HEAD_DIM)
        doT, do_scale = _block_tile_t(DO8, DOS, h, num_blocks, block0, m_start, BLOCK_M, BLOCK, HEAD_DIM)
        lse = tl.load(LSE + h * total_tokens + start + offs_m, mask=row_ok, other=0.0)
        delta = tl.load(Delta + h * total_tokens + start + offs_m, mask=row_ok, other=0.0)
        pT = tl.math.exp2(tl.dot(k8, qT) * (k_scale * q_scale * scale_log2) - lse[None, :])
        if MASKED:
            visible = tile_mask(offs_m, offs_n, seq_len, hist_len, contextual_len, window, CAUSAL, HAS_WINDOW,
                                HAS_CONTEXT)  # fmt: skip
            pT = tl.where(tl.trans(visible), pT, 0.0)
        rows = (start + offs_m[:, None]).to(tl.int64)
        do = tl.load(DO + rows * stride_dot + h * stride_doh + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        dv = tl.dot(pT.to(MMA_DTYPE), do.to(MMA_DTYPE), dv)  # dV = P^T dO, the bf16 dO
        dpT = tl.dot(v8, doT) * (v_scale * do_scale)
        dsT = pT * (dpT - delta[None, :])
        q = (tl.trans(qT).to(tl.float32) * q_scale).to(MMA_DTYPE)  # the straight-through Q, as the forward's
        dk = tl.dot(dsT.to(MMA_DTYPE), q, dk)
    return dk, dv


@autotune(configs=_configs(_DKDV), **_TUNING)
@triton.jit(do_not_specialize=["contextual_len", "window", "total_tokens", "heads", "num_blocks"])
def _dkdv_fp8_kernel(
    Q8, K8, V8, DO8, QS, KS, VS, DOS, DO, LSE, Delta, DK, DV, offsets, num_targets, block_base, sched_small,
    sched_large, stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dvt, stride_dvh, total_tokens, heads,
    num_blocks, scale, scale_log2, contextual_len, window, LEN_BUCKET,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_CONTEXT: tl.constexpr, HAS_TARGETS: tl.constexpr, SMALL: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dK (rotated) and dV of one key tile (a whole block), over the query heads of its K/V head (GQA)."""
    b, n_start, kv_h = _item(sched_small, sched_large, heads, BLOCK_N, SMALL)
    start, seq_len, hist_len = _sample(offsets, num_targets, b, HAS_TARGETS)
    block0 = tl.load(block_base + b).to(tl.int64)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k8, k_scale = query_tile(K8, KS, kv_h, num_blocks, block0, n_start, BLOCK_N, BLOCK_N, HEAD_DIM)
    v8, v_scale = query_tile(V8, VS, kv_h, num_blocks, block0, n_start, BLOCK_N, BLOCK_N, HEAD_DIM)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    c_hi, lo, f_lo, f_hi, hi = _query_tiles(n_start, seq_len, hist_len, contextual_len, window, BLOCK_M, BLOCK_N,
                                            CAUSAL, HAS_WINDOW, HAS_CONTEXT)  # fmt: skip
    for g in range(GROUP):
        h = kv_h * GROUP + g
        dk, dv = _dkdv_tiles(dk, dv, k8, v8, k_scale, v_scale, Q8, DO8, QS, DOS, DO, LSE, Delta, h, num_blocks, block0,
                             start, total_tokens, stride_dot, stride_doh, scale_log2, 0, c_hi, offs_n, seq_len,
                             hist_len, contextual_len, window, BLOCK_M, BLOCK_N, HEAD_DIM, True, CAUSAL, HAS_WINDOW,
                             HAS_CONTEXT, DK.dtype.element_ty)  # fmt: skip
        dk, dv = _dkdv_tiles(dk, dv, k8, v8, k_scale, v_scale, Q8, DO8, QS, DOS, DO, LSE, Delta, h, num_blocks, block0,
                             start, total_tokens, stride_dot, stride_doh, scale_log2, lo, f_lo, offs_n, seq_len,
                             hist_len, contextual_len, window, BLOCK_M, BLOCK_N, HEAD_DIM, True, CAUSAL, HAS_WINDOW,
                             HAS_CONTEXT, DK.dtype.element_ty)  # fmt: skip
        dk, dv = _dkdv_tiles(dk, dv, k8, v8, k_scale, v_scale, Q8, DO8, QS, DOS, DO, LSE, Delta, h, num_blocks, block0,
                             start, total_tokens, stride_dot, stride_doh, scale_log2, f_lo, f_hi, offs_n, seq_len,
                             hist_len, contextual_len, window, BLOCK_M, BLOCK_N, HEAD_DIM, False, CAUSAL, HAS_WINDOW,
                             HAS_CONTEXT, DK.dtype.element_ty)  # fmt: skip
        dk, dv = _dkdv_tiles(dk, dv, k8, v8, k_scale, v_scale, Q8, DO8, QS, DOS, DO, LSE, Delta, h, num_blocks, block0,
                             start, total_tokens, stride_dot, stride_doh, scale_log2, f_hi, hi, offs_n, seq_len,
                             hist_len, contextual_len, window, BLOCK_M, BLOCK_N, HEAD_DIM, True, CAUSAL, HAS_WINDOW,
                             HAS_CONTEXT, DK.dtype.element_ty)  # fmt: skip
    rows = (start + offs_n[:, None]).to(tl.int64)
    key_ok = offs_n[:, None] < seq_len
    tl.store(DK + rows * stride_dkt + kv_h * stride_dkh + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=key_ok)  # fmt: skip
    tl.store(DV + rows * stride_dvt + kv_h * stride_dvh + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=key_ok)


def backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    pb: Problem, grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The FP8 forward's backward with E4M3 ``S`` and ``dP`` products (module docstring); ``grads`` as in JFA's."""
    q, k, v, dout, out = (last_dim_contiguous(t) for t in (q, k, v, dout, out))
    total, heads, head_dim = q.shape
    if total == 0 or pb.sched.query_tiles[_SMALL].shape[0] == 0:
        zeros = [torch.zeros_like(t) for t in (q, k, v)]
        return tuple(zeros) if grads is None else tuple(g.zero_() for g in grads)
    dq_rot, dk_rot, dv = rotated_gradient_buffers(q, k, v, grads)
    q8, k8, v8, do8, qs, ks, vs, do_s, block_base = quantize_for_backward(q, k, v, dout, pb)
    delta = torch.empty_like(lse)
    n = rotation_size(head_dim)
    scale = pb.scale / n  # (q R)(k R)^T = n q k^T
    constexprs = dict(HEAD_DIM=head_dim, GROUP=heads // k.shape[1], CAUSAL=pb.opts.causal,
                      HAS_WINDOW=pb.opts.window is not None, HAS_CONTEXT=pb.opts.contextual_len > 0,
                      HAS_TARGETS=pb.num_targets is not None, SMALL=_SMALL)  # fmt: skip
    runtime = dict(total_tokens=total, num_blocks=q8.shape[1], scale=scale, scale_log2=scale * LOG2E,
                   **pb.runtime())  # fmt: skip
    items = pb.sched.query_tiles
    _dq_fp8_kernel[_grid(items, heads, "BLOCK_M")](
        q8, k8, v8, do8, qs, ks, vs, do_s, out, dout, lse, delta, dq_rot, pb.offsets, pb.targets_arg(), block_base,
        items[_SMALL], items[_LARGE], out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), dq_rot.stride(0),
        dq_rot.stride(1), heads=heads, **runtime, **constexprs, BLOCK_N=BLOCK,
    )  # fmt: skip
    items = pb.sched.key_tiles
    _dkdv_fp8_kernel[(items[BLOCK].shape[0] * k.shape[1],)](
        q8, k8, v8, do8, qs, ks, vs, do_s, dout, lse, delta, dk_rot, dv, pb.offsets, pb.targets_arg(), block_base,
        items[_SMALL], items[_LARGE], dout.stride(0), dout.stride(1), dk_rot.stride(0), dk_rot.stride(1),
        dv.stride(0), dv.stride(1), heads=k.shape[1], **runtime, **constexprs, BLOCK_N=BLOCK,
    )  # fmt: skip
    return rotated_back(dq_rot, dk_rot, dv, grads)
