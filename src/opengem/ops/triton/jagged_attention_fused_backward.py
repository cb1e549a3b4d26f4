"""JFA's backward in one pass over key tiles: dK and dV accumulated in the program, dQ added into an fp32 buffer.

The two-pass backward (:func:`opengem.ops.triton.jagged_attention.backward`) recomputes ``S = Q K^T`` and ``dP =
dO V^T`` in its dQ pass: seven matrix products a (query tile, key tile) pair. Here each key tile's program also
forms its share of dQ, ``dS K``, from the ``dS`` it already holds and adds it into ``dq_acc [T, H, D]`` fp32 with
atomic adds: five products a pair, as FlashAttention-2/3's backward. The price: the adds' L2 traffic, a delta
pass and a scaling pass over dQ, and a dQ whose low bits depend on the order of the adds (not bitwise
reproducible), so :func:`use_fused_backward` keeps the two-pass kernels under
``torch.use_deterministic_algorithms``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.ragged_tma import atomic_add_ragged

from opengem.ops.triton.jagged_attention import (
    _INTERPRET,
    _LARGE,
    _SMALL,
    _TUNING,
    LOG2E,
    Problem,
    _configs,
    _descriptors,
    _grid,
    _item,
    _query_tiles,
    _sample,
)
from opengem.ops.triton.masks import tile_mask
from opengem.ops.triton.ragged_tiles import last_dim_contiguous, ragged_descriptor, ragged_tile, set_block_rows, tma_ok
from opengem.ops.triton.tuning import autotune

# (BLOCK_M, BLOCK_N, num_warps, num_stages), the first the untuned default: dK/dV's tiles less the 64 x 128 ones that
# spill most with dS K's extra [BLOCK_M, D] fp32 product. sm_90 static counts (Triton 3.6, D 128, bf16): 32 x 128 x 8
# at two / three stages spills 0-8 / 16-24 B (one program an SM), 64 x 128 x 8 x 2 272-360 B, 32 x 64 x 4 x 3
# 40-56 B (two programs), 64 x 64 x 4 x 2 200-256 B.
_FUSED = [(32, 128, 8, 2), (32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3), (32, 64, 4, 2), (64, 64, 4, 2)]
BACKWARDS = ("fused", "two_pass")


def backward_setting(text: str) -> str:
    """``OPENGEM_JFA_BACKWARD``'s value, checked."""
    if text not in BACKWARDS:
        raise ValueError(f"OPENGEM_JFA_BACKWARD must be one of {BACKWARDS}, got {text!r}")
    return text


# Which backward :func:`opengem.ops.triton.jagged_attention.backward` runs (benchmarks reassign it to time both).
BACKWARD = backward_setting(os.environ.get("OPENGEM_JFA_BACKWARD", "two_pass"))


# How the programs add their dQ shares: "atomic" (vectorized fp32 reductions from registers) or "tma" (a bulk tensor
# reduction of the tile from shared memory, FlashAttention-3's way; needs the TMA path, not in the interpreter).
DQ_ADDS = "atomic"


def use_fused_backward() -> bool:
    """The fused backward where chosen, but never under ``torch.use_deterministic_algorithms``."""
    return BACKWARD == "fused" and not torch.are_deterministic_algorithms_enabled()


@triton.jit
def _delta_kernel(O, DO, Delta, total_tokens, stride_ot, stride_oh, stride_dot, stride_doh,
                  HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr):  # fmt: skip
    """``delta [H, T] = rowsum(dO * O)`` fp32, the softmax gradient's row term, for one head and ``BLOCK_T`` rows."""
    h = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = rows[:, None] < total_tokens
    o = tl.load(O + rows[:, None].to(tl.int64) * stride_ot + h * stride_oh + offs_d[None, :], mask=ok, other=0.0)
    do = tl.load(DO + rows[:, None].to(tl.int64) * stride_dot + h * stride_doh + offs_d[None, :], mask=ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + h * total_tokens + rows, delta, mask=rows < total_tokens)


@triton.jit
def _fused_tiles(
    dk, dv, k, v, Q, DO, DQ, Q_desc, DO_desc, DQ_desc, start, h, LSE, Delta, stride_qt, stride_dot, stride_dqt, m_lo, m_hi,
    offs_n, offs_d, seq_len, hist_len, contextual_len, window, scale_log2,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_CONTEXT: tl.constexpr, USE_TMA: tl.constexpr, PRECISION: tl.constexpr,
    DQ_TMA: tl.constexpr,
):  # fmt: skip
    """``_dkdv_tiles`` (its products transposed: [N, M]), plus each query tile's ``dS K`` added into ``DQ``."""
    for m_start in range(m_lo, m_hi, BLOCK_M):
        offs_m = m_start + tl.arange(0, BLOCK_M)
        row_ok = offs_m < seq_len
        if USE_TMA:
            qT = tl.trans(ragged_tile(Q_desc, start, seq_len, m_start, h, BLOCK_M, HEAD_DIM))
            do = ragged_tile(DO_desc, start, seq_len, m_start, h, BLOCK_M, HEAD_DIM)
        else:
            qT = tl.load(Q + offs_m[None, :] * stride_qt + offs_d[:, None], mask=row_ok[None, :], other=0.0)
            do = tl.load(DO + offs_m[:, None] * stride_dot + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        lse = tl.load(LSE + offs_m, mask=row_ok, other=0.0)
        delta = tl.load(Delta + offs_m, mask=row_ok, other=0.0)
        pT = tl.math.exp2(tl.dot(k, qT, input_precision=PRECISION) * scale_log2 - lse[None, :])
        if MASKED:
            visible = tile_mask(offs_m, offs_n, seq_len, hist_len, contextual_len, window, CAUSAL, HAS_WINDOW, HAS_CONTEXT)
            pT = tl.where(tl.trans(visible), pT, 0.0)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dsT = (pT * (dpT - delta[None, :])).to(qT.dtype)
        dk = tl.dot(dsT, tl.trans(qT), dk, input_precision=PRECISION)
        dq = tl.dot(tl.trans(dsT), k, input_precision=PRECISION)  # [M, D]: this key tile's share of dS K
        # rows past the sample hold zeros (masked P) but would add into the next sample's rows: masked off
        if DQ_TMA:
            atomic_add_ragged(DQ_desc, start.to(tl.int32), seq_len, [m_start, h, 0], tl.reshape(dq, [BLOCK_M, 1, HEAD_DIM]))
        else:
            tl.atomic_add(DQ + offs_m[:, None] * stride_dqt + offs_d[None, :], dq, mask=row_ok[:, None], sem="relaxed")
    return dk, dv


def _with_dq_rows(hook):
    """dK/dV's pre-hook (Q's and dO's TMA boxes of BLOCK_M rows), and dQ's reduction box as theirs."""

    def both(nargs: dict) -> None:
        hook(nargs)
        set_block_rows(nargs["DQ_desc"], nargs["BLOCK_M"])

    return both


def _fused_configs() -> list[triton.Config]:
    configs = _configs("dkdv", _FUSED)
    for config in configs:
        config.pre_hook = _with_dq_rows(config.pre_hook)
    return configs


@autotune(configs=_fused_configs(), reset_to_zero=["DQ"], **_TUNING)  # (timing runs add into DQ)
@triton.jit(do_not_specialize=["contextual_len", "window", "total_tokens", "heads"])
def _fused_bwd_kernel(
    Q, K, V, DO, LSE, Delta, DQ, DK, DV, offsets, num_targets, sched_small, sched_large, Q_desc, DO_desc, DQ_desc,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    total_tokens, heads, scale, scale_log2, contextual_len, window, LEN_BUCKET,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_CONTEXT: tl.constexpr, HAS_TARGETS: tl.constexpr, SMALL: tl.constexpr, PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr, DQ_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    POINTER_LOADS: tl.constexpr = False,
):  # fmt: skip
    """One key tile of one kv head: its dK, dV, and its shares of dQ (unscaled, into fp32 ``DQ``)."""
    TMA: tl.constexpr = USE_TMA and not POINTER_LOADS
    b, n_start, h_kv = _item(sched_small, sched_large, heads, BLOCK_N, SMALL)
    start, seq_len, hist_len = _sample(offsets, num_targets, b, HAS_TARGETS)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    key_ok = offs_n[:, None] < seq_len
    k = tl.load(K + (start + offs_n[:, None]) * stride_kt + h_kv * stride_kh + offs_d[None, :], mask=key_ok, other=0.0)
    v = tl.load(V + (start + offs_n[:, None]) * stride_vt + h_kv * stride_vh + offs_d[None, :], mask=key_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    c_hi, lo, f_lo, f_hi, hi = _query_tiles(n_start, seq_len, hist_len, contextual_len, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_CONTEXT)
    for g in range(GROUP):
        h = h_kv * GROUP + g
        Qh = Q + start * stride_qt + h * stride_qh
        DOh = DO + start * stride_dot + h * stride_doh
        DQh = DQ + start * stride_dqt + h * stride_dqh
        LSEh = LSE + h * total_tokens + start
        Dh = Delta + h * total_tokens + start
        # the four ranges of _query_tiles: contextual rows, masked, fully visible, masked
        dk, dv = _fused_tiles(dk, dv, k, v, Qh, DOh, DQh, Q_desc, DO_desc, DQ_desc, start, h, LSEh, Dh, stride_qt, stride_dot,
                              stride_dqt, 0, c_hi, offs_n, offs_d, seq_len, hist_len, contextual_len, window,
                              scale_log2, BLOCK_M, HEAD_DIM, True, CAUSAL, HAS_WINDOW, HAS_CONTEXT, TMA, PRECISION,
                              DQ_TMA)
        dk, dv = _fused_tiles(dk, dv, k, v, Qh, DOh, DQh, Q_desc, DO_desc, DQ_desc, start, h, LSEh, Dh, stride_qt, stride_dot,
                              stride_dqt, lo, f_lo, offs_n, offs_d, seq_len, hist_len, contextual_len, window,
                              scale_log2, BLOCK_M, HEAD_DIM, True, CAUSAL, HAS_WINDOW, HAS_CONTEXT, TMA, PRECISION,
                              DQ_TMA)
        dk, dv = _fused_tiles(dk, dv, k, v, Qh, DOh, DQh, Q_desc, DO_desc, DQ_desc, start, h, LSEh, Dh, stride_qt, stride_dot,
                              stride_dqt, f_lo, f_hi, offs_n, offs_d, seq_len, hist_len, contextual_len, window,
                              scale_log2, BLOCK_M, HEAD_DIM, False, CAUSAL, HAS_WINDOW, HAS_CONTEXT, TMA, PRECISION,
                              DQ_TMA)
        dk, dv = _fused_tiles(dk, dv, k, v, Qh, DOh, DQh, Q_desc, DO_desc, DQ_desc, start, h, LSEh, Dh, stride_qt, stride_dot,
                              stride_dqt, f_hi, hi, offs_n, offs_d, seq_len, hist_len, contextual_len, window,
                              scale_log2, BLOCK_M, HEAD_DIM, True, CAUSAL, HAS_WINDOW, HAS_CONTEXT, TMA, PRECISION,
                              DQ_TMA)
    tl.store(DK + (start + offs_n[:, None]) * stride_dkt + h_kv * stride_dkh + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty), mask=key_ok)
    tl.store(DV + (start + offs_n[:, None]) * stride_dvt + h_kv * stride_dvh + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=key_ok)  # fmt: skip


KERNELS = {"fused_bwd": _fused_bwd_kernel}
_DELTA_ROWS = 16 if _INTERPRET else 64


def fused_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    pb: Problem, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
) -> None:
    """Writes ``dq, dk, dv`` (any unit-last-stride views) of a non-empty problem; inputs as JFA's ``backward``."""
    total, heads, head_dim = q.shape
    dout, out = last_dim_contiguous(dout), last_dim_contiguous(out)
    delta = torch.empty_like(lse)
    _delta_kernel[(triton.cdiv(total, _DELTA_ROWS), heads)](
        out, dout, delta, total, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1),
        HEAD_DIM=head_dim, BLOCK_T=_DELTA_ROWS,
    )  # fmt: skip
    dq_acc = torch.zeros((total, heads, head_dim), device=q.device, dtype=torch.float32)
    key_items = pb.sched.key_tiles
    descs, use_tma = _descriptors("dkdv", q, dout)
    dq_tma = DQ_ADDS == "tma" and use_tma and tma_ok(dq_acc)
    _fused_bwd_kernel[_grid(key_items, k.shape[1], "BLOCK_N")](
        q, k, v, dout, lse, delta, dq_acc, dk, dv, pb.offsets, pb.targets_arg(), key_items[_SMALL], key_items[_LARGE],
        *descs, ragged_descriptor(dq_acc) if dq_tma else dq_acc, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        dout.stride(0), dout.stride(1), dq_acc.stride(0), dq_acc.stride(1), dk.stride(0), dk.stride(1),
        dv.stride(0), dv.stride(1), total_tokens=total, heads=k.shape[1], scale=pb.scale,
        scale_log2=pb.scale * LOG2E, **pb.runtime(), **pb.constexprs(q, k), USE_TMA=use_tma, DQ_TMA=dq_tma,
    )  # fmt: skip
    torch.mul(dq_acc, pb.scale, out=dq)  # one pass: scaled and cast into dq's dtype and strides
