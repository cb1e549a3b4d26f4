"""JFA's sequence-owned backward for batches of short sequences (opt-in: ``OPENGEM_JFA_FUSED_BWD=1``).

The default backward (:mod:`opengem.ops.triton.jagged_attention`) runs a dQ pass and a dK/dV pass: 7
GEMM-sized products per (query tile, key tile) pair, where FlashAttention-2 does 5 by adding dQ with float
atomics. Here one program owns one (sample, kv head): key tiles outer (dK, dV in registers), query tiles
inner, and each pair adds its ``dS K`` into an fp32 dQ scratch by a plain read-modify-write, race-free
because no other program touches the sample's rows, so the result stays deterministic. A query tile's
first key tile writes the scratch, its last one (the causal diagonal, or the sequence's last key tile)
finishes dQ and stores it: no memset, no conversion pass. 5 products per pair, at the cost of the scratch
traffic (an fp32 ``[BLOCK_M, D]`` tile read and written per pair, mostly from L2).

For the masks without a contextual prefix or targets (causal, full, window) and ``max_len <= 2048``: a
program does a whole (sample, head), so long sequences would serialize; they keep the two-pass backward.
Not yet timed on a GPU (session 8): ``benchmarks.diag.jfa_tma`` compares it with the two-pass backward.
Its risk is registers: one program of 8 warps per SM (see ``_FUSED``), where the two-pass kernels run two or
three.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from opengem.ops.triton.jagged_attention import (
    _INTERPRET,
    _KEY,
    LOG2E,
    Problem,
    _prune,
    _tuning_bench,
)
from opengem.ops.triton.masks import tile_mask

FUSED_MAX_LEN = 2048
# (BLOCK_M, BLOCK_N, num_warps, num_stages). sm_90 compile, D 128, causal (Triton 3.6): every shape takes 255
# registers; spills 16 / 96 B for 64 x 64 at 8 warps, 1 / 2 stages (72 / 128 KB of shared memory, one program
# per SM), 448 B at 4 warps (two per SM), 280-1,032 B for 128-row tiles
_FUSED = [(64, 64, 8, 1), (64, 64, 8, 2), (64, 64, 4, 1)]
_DELTA_ROWS = 64


def applies(pb: Problem) -> bool:
    """The sequence-owned backward runs when opted in and the masks and lengths allow it."""
    return (
        os.environ.get("OPENGEM_JFA_FUSED_BWD") == "1"
        and pb.num_targets is None
        and pb.opts.contextual_len == 0
        and pb.max_len <= FUSED_MAX_LEN
    )


def _configs() -> list[triton.Config]:
    if _INTERPRET:  # unequal tiles, so that a query tile's key span crosses tile borders
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32}, num_warps=1, num_stages=1)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in _FUSED]


@triton.jit
def _delta_kernel(O, DO, Delta, total_tokens, stride_ot, stride_oh, stride_dot, stride_doh,
                  HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """``delta = rowsum(dO * O)`` ``[H, T]`` fp32, the softmax-gradient term every pair of a row needs."""
    rows = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    h = tl.program_id(1)
    ok = rows < total_tokens
    d = tl.arange(0, HEAD_DIM)
    o = tl.load(O + rows[:, None] * stride_ot + h * stride_oh + d[None, :], mask=ok[:, None], other=0.0)
    do = tl.load(DO + rows[:, None] * stride_dot + h * stride_doh + d[None, :], mask=ok[:, None], other=0.0)
    tl.store(Delta + h * total_tokens + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=ok)


@triton.jit
def _key_tile_span(m_start, seq_len, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):  # fmt: skip
    """First and last key tile (start rows) the query tile at ``m_start`` sees: where its dQ starts and ends."""
    lo = 0
    hi = seq_len
    if HAS_WINDOW:
        lo = tl.maximum(m_start - window, 0)
        hi = tl.minimum(seq_len, m_start + BLOCK_M + window)
    if CAUSAL:
        hi = tl.minimum(seq_len, m_start + BLOCK_M)
    return (lo // BLOCK_N) * BLOCK_N, ((hi - 1) // BLOCK_N) * BLOCK_N


@triton.jit
def _query_tile_span(n_start, seq_len, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):  # fmt: skip
    """``[lo, hi)`` of the query tiles whose key span (:func:`_key_tile_span`) holds the key tile at
    ``n_start``: exactly those, so every dQ tile is started and finished once."""
    lo = 0
    hi = seq_len
    if CAUSAL:
        lo = tl.cdiv(tl.maximum(n_start - BLOCK_M + 1, 0), BLOCK_M) * BLOCK_M
    elif HAS_WINDOW:
        lo = tl.cdiv(tl.maximum(n_start - BLOCK_M - window + 1, 0), BLOCK_M) * BLOCK_M
    if HAS_WINDOW:
        hi = tl.minimum(seq_len, n_start + BLOCK_N + window)
    return lo, hi


@triton.jit
def _pairs(
    dk, dv, k, v, Q, DO, LSE, Delta, DQ_ACC, DQ, stride_qt, stride_dot, stride_at, stride_dqt,
    n_start, offs_n, offs_d, seq_len, window, scale, scale_log2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """One key tile against its query tiles of one head: dK, dV accumulate; each query tile's dQ part is
    added into the scratch (or started there, or finished into DQ)."""
    m_lo, m_hi = _query_tile_span(n_start, seq_len, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW)
    for m_start in range(m_lo, m_hi, BLOCK_M):
        offs_m = m_start + tl.arange(0, BLOCK_M)
        row_ok = offs_m < seq_len
        # rows past the sample load as zeros (q, dO, lse, delta): their terms vanish, as in the two-pass kernels
        q = tl.load(Q + offs_m[:, None] * stride_qt + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        do = tl.load(DO + offs_m[:, None] * stride_dot + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        lse = tl.load(LSE + offs_m, mask=row_ok, other=0.0)
        delta = tl.load(Delta + offs_m, mask=row_ok, other=0.0)
        p = tl.math.exp2(tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2 - lse[:, None])  # [M, N]
        visible = tile_mask(offs_m, offs_n, seq_len, seq_len, 0, window, CAUSAL, HAS_WINDOW, False)
        p = tl.where(visible, p, 0.0)
        dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv, input_precision=PRECISION)  # dV = P^T dO
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # dP = dO V^T
        ds = (p * (dp - delta[:, None])).to(q.dtype)  # dS = P * (dP - delta)
        dk = tl.dot(tl.trans(ds), q, dk, input_precision=PRECISION)  # dK = dS^T Q (scaled at the store)
        dq = tl.dot(ds, k, input_precision=PRECISION)  # this key tile's part of dQ = dS K
        first, last = _key_tile_span(m_start, seq_len, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW)
        acc_ptr = DQ_ACC + offs_m[:, None] * stride_at + offs_d[None, :]
        # branch-free: the scratch is read unless this is the tile's first key tile, written unless its last
        tile = offs_m * 0 + n_start  # the key tile as a row vector: masks of tensors (the interpreter needs it)
        dq += tl.load(acc_ptr, mask=(row_ok & (tile != first))[:, None], other=0.0)
        tl.store(acc_ptr, dq, mask=(row_ok & (tile != last))[:, None])
        tl.store(DQ + offs_m[:, None] * stride_dqt + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
                 mask=(row_ok & (tile == last))[:, None])  # fmt: skip
    return dk, dv


@triton.autotune(configs=_configs(), key=[*_KEY[:5]], prune_configs_by={"early_config_prune": _prune},
                 do_bench=_tuning_bench)  # fmt: skip
@triton.jit(do_not_specialize=["window", "total_tokens", "heads_kv"])
def _fused_bwd_kernel(
    Q, K, V, DO, LSE, Delta, DQ_ACC, DQ, DK, DV, offsets, samples,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_at, stride_ah, stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    total_tokens, heads_kv, scale, scale_log2, window, LEN_BUCKET,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Program (sample, kv head): the sample's dK, dV of that head and dQ of the query heads of its group."""
    b = tl.load(samples + tl.program_id(0) // heads_kv)
    h_kv = tl.program_id(0) % heads_kv
    start = tl.load(offsets + b).to(tl.int64)
    seq_len = (tl.load(offsets + b + 1) - start).to(tl.int32)
    offs_d = tl.arange(0, HEAD_DIM)
    for n_start in range(0, seq_len, BLOCK_N):
        # the previous key tile's scratch stores, made by other threads, come before this tile's loads
        tl.debug_barrier()
        offs_n = n_start + tl.arange(0, BLOCK_N)
        key_ok = offs_n[:, None] < seq_len
        k = tl.load(K + (start + offs_n[:, None]) * stride_kt + h_kv * stride_kh + offs_d[None, :], mask=key_ok, other=0.0)
        v = tl.load(V + (start + offs_n[:, None]) * stride_vt + h_kv * stride_vh + offs_d[None, :], mask=key_ok, other=0.0)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        for g in range(GROUP):  # the query heads sharing this kv head add into the same dK, dV
            h = h_kv * GROUP + g
            dk, dv = _pairs(
                dk, dv, k, v, Q + start * stride_qt + h * stride_qh, DO + start * stride_dot + h * stride_doh,
                LSE + h * total_tokens + start, Delta + h * total_tokens + start,
                DQ_ACC + start * stride_at + h * stride_ah, DQ + start * stride_dqt + h * stride_dqh,
                stride_qt, stride_dot, stride_at, stride_dqt, n_start, offs_n, offs_d, seq_len, window, scale,
                scale_log2, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW, PRECISION,
            )
        tl.store(DK + (start + offs_n[:, None]) * stride_dkt + h_kv * stride_dkh + offs_d[None, :],
                 (dk * scale).to(DK.dtype.element_ty), mask=key_ok)
        tl.store(DV + (start + offs_n[:, None]) * stride_dvt + h_kv * stride_dvh + offs_d[None, :],
                 dv.to(DV.dtype.element_ty), mask=key_ok)  # fmt: skip


def backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    pb: Problem, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
) -> None:
    """Fills ``dq, dk, dv`` (q, k, v, dout, out with unit last stride; some sample non-empty)."""
    total, heads, head_dim = q.shape
    delta = torch.empty_like(lse)
    _delta_kernel[(triton.cdiv(total, _DELTA_ROWS), heads)](
        out, dout, delta, total, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1),
        HEAD_DIM=head_dim, BLOCK=_DELTA_ROWS,
    )  # fmt: skip
    scratch = torch.empty(q.shape, dtype=torch.float32, device=q.device)  # every row written before it is read
    samples = pb.sched.samples
    constexprs, runtime = pb.constexprs(q, k), pb.runtime()
    _fused_bwd_kernel[(samples.shape[0] * k.shape[1],)](
        q, k, v, dout, lse, delta, scratch, dq, dk, dv, pb.offsets, samples,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), dout.stride(0), dout.stride(1),
        scratch.stride(0), scratch.stride(1), dq.stride(0), dq.stride(1), dk.stride(0), dk.stride(1),
        dv.stride(0), dv.stride(1), total, k.shape[1], pb.scale, pb.scale * LOG2E, runtime["window"],
        runtime["LEN_BUCKET"],
        **{name: constexprs[name] for name in ("HEAD_DIM", "GROUP", "CAUSAL", "HAS_WINDOW", "PRECISION")},
    )  # fmt: skip
