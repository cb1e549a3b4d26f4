"""FP8 JFA (``precision="fp8"``): one fused quantize pass over Q, K, V, then E4M3 Q K^T and P V; the backward
straight through the quantization (:func:`backward`).

The numerics are those of :mod:`opengem.ops.reference.attention_fp8` (Q and K rotated by a randomized
Hadamard matrix along the head dim, one MMA per ``n``-wide slice in the quantize pass, its ``1 / n`` in the
logit scale; per sample-aligned block of ``BLOCK`` rows and head: one fp32 scale, E4M3 elements; P
quantized as ``rne(p * 256)``). ``BLOCK`` is the
JFA large tile (128 on the GPU, 32 in the interpreter); the forward's key tile is one block, its query
tile (64 or 128) lies inside one, so every tile has a single scale per operand, applied to the fp32 result.

Blocked layout written by the quantize pass, ``NB`` the number of blocks of the batch (one per large
query tile of the schedule) and ``block_base [B + 1]`` the first block of each sample:
q8 ``[H, NB, BLOCK, D]``, k8 ``[H_kv, NB, BLOCK, D]``, v8 ``[H_kv, NB, D, BLOCK]`` (transposed: the P V
operand is then contiguous along its reduction, what Hopper's FP8 MMA wants), rows past a sample zero;
scales ``[H, NB]`` / ``[H_kv, NB]`` fp32. Padded blocks keep every load aligned and unmasked.

Rounding: the quantize pass rounds with integer arithmetic (:func:`fp32_to_fp8_bits`), bit-exact against
torch's round-to-nearest-even cast everywhere (of V exactly; of rotated Q and K up to the rotation's fp32
sums, whose order differs from the emulation's, so an element within an fp32 ulp of a rounding midpoint,
about 2^-20 of them, may take the neighbouring E4M3 value). P is rounded in the hot loop by the hardware conversion
``.to(tl.float8e4nv, fp_downcast_rounding="rtne")`` (PTX ``cvt.rn.satfinite.e4m3x2.f32``: nearest-even,
saturating, so torch's cast for |x| <= 448; tests/gpu checks that assumption bit for bit), and in the
interpreter by :func:`fp32_to_fp8_bits`: Triton 3.6's interpreter rounds fp32 -> fp8 half-away-from-zero
on the truncated mantissa and ORs a mantissa carry into the exponent field instead of adding it
(1.9375 -> 1.0 rather than 2.0), which is what made its fp8 dots disagree with torch. Its fp8 ``dot``
itself (exact fp8 -> fp16 upcast, fp32 matmul) is fine.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import torch
import triton
import triton.language as tl

from opengem.ops.reference import attention_fp8 as emulation
from opengem.ops.reference.attention_fp8 import rotation, rotation_size
from opengem.ops.triton import jagged_attention as jfa
from opengem.ops.triton.jagged_attention import (
    _INTERPRET,
    _KEY,
    _LARGE,
    _SMALL,
    LOG2E,
    Problem,
    _grid,
    _item,
    _key_tiles,
    _row_max_scaled,
    _sample,
    forward_buffers,
)
from opengem.ops.triton.masks import tile_mask
from opengem.ops.triton.mx import to_e4m3
from opengem.ops.triton.tuning import autotune

BLOCK = _LARGE
# the emulation's constants, as constexpr: a compiled kernel reads no other globals (the interpreter would)
E4M3_MAX = tl.constexpr(emulation.E4M3_MAX)
MIN_AMAX = tl.constexpr(emulation.MIN_AMAX)
P_SCALE_LOG2 = tl.constexpr(math.log2(emulation.P_SCALE))
FP8_HEAD_DIMS = (32, 64, 128, 256)  # the E4M3 MMA reduces over at least 32
# the quantize pass: registers for one tile without spills, from static sm_90 counts (benchmarks/sass.py), and a
# register cap per head dim (None: ptxas's choice; ``benchmarks.diag.fp8_quantize_pass`` times the alternatives).
# D 128: 4 warps capped at 168 registers (no spills, three programs an SM against two at 8 warps) ran 0.306 / 0.319 ms
# on workloads (a) / (c) against 0.335 / 0.350 for 8 warps uncapped, bits equal (H200, session 29).
QUANTIZE_WARPS = {32: 4, 64: 4, 128: 4, 256: 16}
QUANTIZE_MAXNREG: dict[int, int | None] = {32: None, 64: None, 128: 168, 256: None}
# (BLOCK_M, num_warps, num_stages[, maxnreg]); BLOCK_N is always BLOCK. The first is the untuned default.
# The 64-row tile at 4 warps holds 226 registers (sm_90, D 128, Triton 3.6): two programs an SM, each waiting on its
# Q K^T before its exp2s (Triton 3.6 overlaps neither the next tile's product nor warp-specializes this loop on
# sm_90), so only another program's MMAs fill those waits. Capped at 168 registers it spills 24 bytes and a third
# program fits (shared memory 74 KB at 3 stages, 58 KB at 2): the tuner's pick on workloads (a) and (c), the kernel
# 1.29-1.31 ms on (a) against 1.396 for the best uncapped tile in session 27 (across runs; H200, session 28).
_FWD_FP8 = [
    (128, 8, 3), (128, 8, 2), (128, 4, 3), (64, 4, 3), (128, 8, 4), (64, 4, 4), (64, 4, 3, 168), (64, 4, 2, 168),
]  # fmt: skip


def _config(block_m: int, num_warps: int, num_stages: int, maxnreg: int | None = None) -> triton.Config:
    return triton.Config({"BLOCK_M": block_m}, num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg)


def _configs(candidates: list[tuple[int, ...]]) -> list[triton.Config]:
    """The FP8 kernels' ``(BLOCK_M, num_warps, num_stages[, maxnreg])`` candidates as tuning configs."""
    if _INTERPRET:  # query tiles of 16 inside blocks of 32: several tiles share one block's scale
        return [_config(_SMALL, 1, 1)]
    return [_config(*candidate) for candidate in candidates]


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """OPENGEM_JFA_AUTOTUNE=0 keeps the default; D = 256 keeps two stages (a 128 x 256 E4M3 K and V tile
    per stage would overflow shared memory at three)."""
    if os.environ.get("OPENGEM_JFA_AUTOTUNE") == "0":
        configs = configs[:1]
    if kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM")) != 256 or _INTERPRET:
        return configs
    kept = {}
    for c in configs:
        shallower = (c.kwargs["BLOCK_M"], c.num_warps, min(c.num_stages, 2), c.maxnreg)
        kept.setdefault(shallower, _config(*shallower))
    return list(kept.values())


# ------------------------------------------------------------------------------------------ quantize


@triton.jit
def rotate_slices(x, R, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, ROT: tl.constexpr, PRECISION: tl.constexpr):
    """``x R`` on every ``ROT``-wide slice of each row, ``R`` the ``[ROT, ROT]`` +-1 Hadamard block: one MMA
    (products by +-1 are exact, the sums fp32)."""
    offs_n = tl.arange(0, ROT)
    r = tl.load(R + offs_n[:, None] * ROT + offs_n[None, :])
    slices = tl.reshape(x, (BLOCK * HEAD_DIM // ROT, ROT))
    return tl.reshape(tl.dot(slices, r, input_precision=PRECISION), (BLOCK, HEAD_DIM))


@triton.jit
def _e4m3_tile(x, EXACT: tl.constexpr):
    """A tile ``x`` (fp32, rows past the sample zero) as E4M3 elements and its fp32 scale amax / 448."""
    amax = tl.maximum(tl.max(tl.max(tl.abs(x), 1), 0), MIN_AMAX)
    e4m3_max = amax * 0.0 + E4M3_MAX
    # both quotients correctly rounded, as torch divides (a compiled ``/`` is approximate)
    scaled = x * tl.math.div_rn(e4m3_max, amax)
    if EXACT:  # integer rounding wants |x| <= 448; the hardware conversion saturates by itself
        scaled = tl.minimum(tl.maximum(scaled, -E4M3_MAX), E4M3_MAX)
    return to_e4m3(scaled, EXACT), tl.math.div_rn(amax, e4m3_max)


@triton.jit
def _store_quantized(x, X8, XS, h, block_id, num_blocks, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                     TRANSPOSE: tl.constexpr, EXACT: tl.constexpr):  # fmt: skip
    """One (block, head) tile ``x`` (fp32 ``[BLOCK, HEAD_DIM]``, rows past the sample zero): its fp32 scale
    amax / 448 and its E4M3 elements, in the blocked layout (``TRANSPOSE``: ``[D, BLOCK]``, V's)."""
    offs_r = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    x8, scale = _e4m3_tile(x, EXACT)
    tl.store(XS + h * num_blocks + block_id, scale)
    base = X8 + (h * num_blocks + block_id).to(tl.int64) * BLOCK * HEAD_DIM
    if TRANSPOSE:
        tl.store(base + offs_d[None, :] * BLOCK + offs_r[:, None], x8)
    else:
        tl.store(base + offs_r[:, None] * HEAD_DIM + offs_d[None, :], x8)


@triton.jit
def _quantize_block(X, X8, XS, R, start, row, seq_len, stride_t, h, block_id, num_blocks, out_heads,
                    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, TRANSPOSE: tl.constexpr, ROTATE: tl.constexpr,
                    ROT: tl.constexpr, PRECISION: tl.constexpr, EXACT: tl.constexpr,
                    DEQUANTIZE: tl.constexpr):  # fmt: skip
    """One (block, head) of ``X``, loaded (rows past the sample as zeros), rotated when ``ROTATE``, quantized;
    with ``DEQUANTIZE`` its E4M3 elements times its scale go to ``X8``, a contiguous ``[T, out_heads, D]`` tensor
    of X's dtype, instead."""
    offs_r = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = (row + offs_r)[:, None] < seq_len
    x = tl.load(X + (start + row + offs_r[:, None]) * stride_t + offs_d[None, :], mask=ok, other=0.0)
    if ROTATE:
        x = rotate_slices(x, R, BLOCK, HEAD_DIM, ROT, PRECISION)
    if DEQUANTIZE:
        x8, scale = _e4m3_tile(x.to(tl.float32), EXACT)
        rows = (start + row + offs_r[:, None]).to(tl.int64) * (out_heads * HEAD_DIM)
        tl.store(X8 + rows + h * HEAD_DIM + offs_d[None, :], (x8.to(tl.float32) * scale).to(X8.dtype.element_ty),
                 mask=ok)  # fmt: skip
    else:
        _store_quantized(x.to(tl.float32), X8, XS, h, block_id, num_blocks, HEAD_DIM, BLOCK, TRANSPOSE, EXACT)


@triton.jit(do_not_specialize=["num_blocks"])
def _quantize_kernel(
    Q, K, V, Q8, K8, V8, QS, KS, VS, R, offsets, block_base, items,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, num_blocks, heads, kv_heads,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, ROT: tl.constexpr, PRECISION: tl.constexpr, EXACT: tl.constexpr,
    DEQUANTIZE: tl.constexpr = False, V_ROWS: tl.constexpr = False,
):  # fmt: skip
    """Program (block item, operand head): axis 1 runs over Q's heads, then K's, then V's, one tile each, Q and K
    rotated by ``R``; V's blocks transposed (the forward's P V operand) unless ``V_ROWS`` (the backward's). One
    tile a program keeps its registers to one tile: a program quantizing Q, K and V in turn held 255 registers and
    spilled at 4 warps, one program per SM, and ran ~10x over the copy time.
    ``DEQUANTIZE``: Q8, K8, V8 are jagged ``[T, H, D]`` outputs of the straight-through values (no scales)."""
    b = tl.load(items + 2 * tl.program_id(0))
    row = tl.load(items + 2 * tl.program_id(0) + 1)
    operand = tl.program_id(1)
    start, seq_len, _ = _sample(offsets, offsets, b, False)
    block_id = tl.load(block_base + b) + row // BLOCK
    if operand < heads:
        _quantize_block(Q + operand * stride_qh, Q8, QS, R, start, row, seq_len, stride_qt, operand, block_id,
                        num_blocks, heads, HEAD_DIM, BLOCK, False, True, ROT, PRECISION, EXACT, DEQUANTIZE)  # fmt: skip
    elif operand < heads + kv_heads:
        h = operand - heads
        _quantize_block(K + h * stride_kh, K8, KS, R, start, row, seq_len, stride_kt, h, block_id, num_blocks,
                        kv_heads, HEAD_DIM, BLOCK, False, True, ROT, PRECISION, EXACT, DEQUANTIZE)  # fmt: skip
    else:
        h = operand - heads - kv_heads
        if V_ROWS:  # (a constexpr branch: ``not V_ROWS`` would pass a runtime value)
            _quantize_block(V + h * stride_vh, V8, VS, R, start, row, seq_len, stride_vt, h, block_id, num_blocks,
                            kv_heads, HEAD_DIM, BLOCK, False, False, ROT, PRECISION, EXACT, DEQUANTIZE)  # fmt: skip
        else:
            _quantize_block(V + h * stride_vh, V8, VS, R, start, row, seq_len, stride_vt, h, block_id, num_blocks,
                            kv_heads, HEAD_DIM, BLOCK, True, False, ROT, PRECISION, EXACT, DEQUANTIZE)  # fmt: skip


# ------------------------------------------------------------------------------------------- forward


@triton.jit
def _fwd_fp8_tiles(
    acc, l_i, m_i, v_scale, q, K8, V8, KS, VS, kv_block0, qk_scale, n_lo, n_hi,
    offs_m, offs_d, seq_len, hist_len, contextual_len, window,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_CONTEXT: tl.constexpr, NEGATIVE_SCALE: tl.constexpr, EXACT: tl.constexpr,
):  # fmt: skip
    """Key tiles ``[n_lo, n_hi)`` (whole blocks). ``acc`` holds sum(p8 v8) in units of the current
    block's ``v_scale``, and ``l_i`` sums ``p * P_SCALE``: a new block's scale ratio is folded into the softmax
    rescale ``alpha``.

    ``P_SCALE`` (a power of two) is folded into the exponent and, on tiles without a mask, the logit scale into
    one FMA with the row maximum taken on the raw logits: two multiplies less a score (sm_90 SASS of the 128 x 128
    tile, 8 warps: the unmasked key loop 655 -> 526 instructions a thread). No run has timed the kernel before
    and after the change side by side."""
    offs_j = tl.arange(0, BLOCK_N)
    for n_start in range(n_lo, n_hi, BLOCK_N):
        blk = kv_block0 + n_start // BLOCK_N
        kT = tl.load(K8 + blk * BLOCK_N * HEAD_DIM + offs_j[None, :] * HEAD_DIM + offs_d[:, None])
        v = tl.load(V8 + blk * BLOCK_N * HEAD_DIM + offs_d[None, :] * BLOCK_N + offs_j[:, None])
        s = tl.dot(q, kT)
        logit_scale = qk_scale * tl.load(KS + blk)  # raw products -> logits in base 2, dequantized
        # online softmax: rescale the running sum and accumulator to the new row maximum
        if MASKED:
            visible = tile_mask(
                offs_m, n_start + offs_j, seq_len, hist_len, contextual_len, window, CAUSAL, HAS_WINDOW, HAS_CONTEXT
            )
            s = tl.where(visible, s * logit_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - (m_new - P_SCALE_LOG2)[:, None])  # p * P_SCALE
        else:
            m_new = tl.maximum(m_i, _row_max_scaled(s, logit_scale, NEGATIVE_SCALE))
            p = tl.math.exp2(s * logit_scale - (m_new - P_SCALE_LOG2)[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        new_v_scale = tl.load(VS + blk)
        p8 = to_e4m3(p, EXACT)
        acc = tl.dot(p8, v, acc * (alpha * (v_scale / new_v_scale))[:, None])
        v_scale = new_v_scale
        m_i = m_new
    return acc, l_i, m_i, v_scale


@triton.jit
def query_tile(Q8, QS, h, num_blocks, block0, m_start, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               HEAD_DIM: tl.constexpr):  # fmt: skip
    """The E4M3 query tile at row ``m_start`` of the sample whose first block is ``block0`` (head ``h``), inside one
    block of the blocked layout, and that block's scale."""
    q_block = h * num_blocks + block0 + m_start // BLOCK_N
    rows = m_start % BLOCK_N + tl.arange(0, BLOCK_M)
    q = tl.load(Q8 + q_block * BLOCK_N * HEAD_DIM + rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :])
    return q, tl.load(QS + q_block)


@autotune(configs=_configs(_FWD_FP8), key=_KEY, prune_configs_by={"early_config_prune": _prune})
@triton.jit(do_not_specialize=["contextual_len", "window", "total_tokens", "heads", "num_blocks"])
def _fwd_fp8_kernel(
    Q8, K8, V8, QS, KS, VS, O, LSE, offsets, num_targets, block_base, sched_small, sched_large,
    stride_ot, stride_oh, total_tokens, heads, num_blocks, scale_log2, contextual_len, window, LEN_BUCKET,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_CONTEXT: tl.constexpr, HAS_TARGETS: tl.constexpr, SMALL: tl.constexpr, NEGATIVE_SCALE: tl.constexpr,
    EXACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    b, m_start, h = _item(sched_small, sched_large, heads, BLOCK_M, SMALL)
    start, seq_len, hist_len = _sample(offsets, num_targets, b, HAS_TARGETS)
    block0 = tl.load(block_base + b).to(tl.int64)
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q, q_scale = query_tile(Q8, QS, h, num_blocks, block0, m_start, BLOCK_M, BLOCK_N, HEAD_DIM)
    qk_scale = q_scale * scale_log2
    kv_block0 = (h // GROUP) * num_blocks + block0
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30  # finite: rows that see nothing stay free of inf - inf
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    v_scale = scale_log2 * 0.0 + 1.0  # acc starts at 0: any finite unit does
    lo, f_lo, f_hi, hi = _key_tiles(
        m_start, seq_len, hist_len, contextual_len, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_CONTEXT
    )
    acc, l_i, m_i, v_scale = _fwd_fp8_tiles(  # keys [lo, f_lo), masked
        acc, l_i, m_i, v_scale, q, K8, V8, KS, VS, kv_block0, qk_scale, lo, f_lo, offs_m, offs_d, seq_len,
        hist_len, contextual_len, window, HEAD_DIM, BLOCK_N, True, CAUSAL, HAS_WINDOW, HAS_CONTEXT, NEGATIVE_SCALE,
        EXACT
    )  # fmt: skip
    acc, l_i, m_i, v_scale = _fwd_fp8_tiles(  # keys [f_lo, f_hi), all visible
        acc, l_i, m_i, v_scale, q, K8, V8, KS, VS, kv_block0, qk_scale, f_lo, f_hi, offs_m, offs_d, seq_len,
        hist_len, contextual_len, window, HEAD_DIM, BLOCK_N, False, CAUSAL, HAS_WINDOW, HAS_CONTEXT, NEGATIVE_SCALE,
        EXACT
    )  # fmt: skip
    acc, l_i, m_i, v_scale = _fwd_fp8_tiles(  # keys [f_hi, hi), masked
        acc, l_i, m_i, v_scale, q, K8, V8, KS, VS, kv_block0, qk_scale, f_hi, hi, offs_m, offs_d, seq_len,
        hist_len, contextual_len, window, HEAD_DIM, BLOCK_N, True, CAUSAL, HAS_WINDOW, HAS_CONTEXT, NEGATIVE_SCALE,
        EXACT
    )  # fmt: skip
    l_i = tl.where(l_i > 0.0, l_i, 1.0)  # only rows past the sample see nothing
    out = acc * v_scale / l_i[:, None]  # P_SCALE cancels: both acc and l_i carry it
    row_ok = offs_m < seq_len
    tl.store(
        O + (start + offs_m[:, None]) * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(O.dtype.element_ty),
        mask=row_ok[:, None],
    )
    lse = m_i + (tl.math.log2(l_i) - P_SCALE_LOG2)  # l_i sums p * P_SCALE
    tl.store(LSE + h * total_tokens + start + offs_m, lse, mask=row_ok)


# ------------------------------------------------------------------------------------------ launchers


@functools.cache
def _rotation_on(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The Hadamard block in the inputs' dtype on their device, copied there once."""
    return rotation(n, dtype, device)


def _block_base(pb: Problem, device: torch.device) -> torch.Tensor:
    """``[B + 1]`` int32: each sample's first block of ``BLOCK`` rows in the blocked layout."""
    lengths = pb.offsets[1:] - pb.offsets[:-1]
    block_base = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=device)
    torch.cumsum(torch.div(lengths + BLOCK - 1, BLOCK, rounding_mode="floor"), 0, out=block_base[1:])
    return block_base


def blocked_buffers(
    pb: Problem, heads: int, kv_heads: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """Empty ``(q8, k8, v8, q_scale, k_scale, v_scale)`` in the blocked layout of the module docstring, and
    ``block_base [B + 1]`` (filled: each sample's first block)."""
    num_blocks = pb.sched.query_tiles[BLOCK].shape[0]  # one item per block
    block_base = _block_base(pb, device)
    new = lambda *shape: torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
    scales = lambda h: torch.empty((h, num_blocks), dtype=torch.float32, device=device)
    return (
        new(heads, num_blocks, BLOCK, head_dim),
        new(kv_heads, num_blocks, BLOCK, head_dim),
        new(kv_heads, num_blocks, head_dim, BLOCK),
        scales(heads), scales(kv_heads), scales(kv_heads), block_base,
    )  # fmt: skip


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pb: Problem) -> tuple[torch.Tensor, ...]:
    """One launch rotating Q and K and quantizing Q, K and V per (sample-aligned block of ``BLOCK`` rows, head);
    returns ``(q8, k8, v8, q_scale, k_scale, v_scale, block_base)`` in the blocked layout of the module docstring."""
    quantized = blocked_buffers(pb, q.shape[1], k.shape[1], q.shape[2], q.device)
    _quantize_pass(q, k, v, quantized[:6], quantized[6], pb, dequantize=False)
    return quantized


def quantize_for_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, pb: Problem
) -> tuple[torch.Tensor, ...]:
    """The FP8 backward's operands: Q, K, V blocked as :func:`quantize_qkv` but V's blocks row-major, and dO
    quantized as V (no rotation, row-major blocks; one launch more); returns ``(q8, k8, v8, do8, q_scale, k_scale,
    v_scale, do_scale, block_base)``."""
    q8, k8, _, qs, ks, _, block_base = blocked_buffers(pb, q.shape[1], k.shape[1], q.shape[2], q.device)
    v8, do8 = torch.empty_like(k8), torch.empty_like(q8)
    vs, do_s = torch.empty_like(ks), torch.empty_like(qs)
    _quantize_pass(q, k, v, (q8, k8, v8, qs, ks, vs), block_base, pb, dequantize=False, v_rows=True)
    _quantize_pass(dout, dout, dout, (do8, do8, do8, do_s, do_s, do_s), block_base, pb, dequantize=False,
                   operands="v", v_rows=True)  # fmt: skip
    return q8, k8, v8, do8, qs, ks, vs, do_s, block_base


def quantize_q_and_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pb: Problem, k_pb: Problem
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Cross-attention's quantize pass: Q blocked by ``q_pb``'s offsets, K and V by ``k_pb``'s (one launch each);
    returns ``(q8, q_scale, q_block_base)`` and ``(k8, v8, k_scale, v_scale, k_block_base)``."""
    q8, _, _, qs, _, _, q_base = blocked_buffers(q_pb, q.shape[1], 0, q.shape[2], q.device)
    _, k8, v8, _, ks, vs, k_base = blocked_buffers(k_pb, 0, k.shape[1], k.shape[2], k.device)
    _quantize_pass(q, k, v, (q8, k8, v8, qs, ks, vs), q_base, q_pb, dequantize=False, operands="q")
    _quantize_pass(q, k, v, (q8, k8, v8, qs, ks, vs), k_base, k_pb, dequantize=False, operands="kv")
    return (q8, qs, q_base), (k8, v8, ks, vs, k_base)


def _quantize_pass(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, outputs: tuple[torch.Tensor, ...], block_base: torch.Tensor,
    pb: Problem, dequantize: bool, operands: str = "qkv", v_rows: bool = False,
) -> None:
    """The quantize kernel over every (block, operand head) into ``outputs``: the blocked E4M3 data and scales, or
    (``dequantize``) three jagged tensors and, standing for the unused scales, anything. ``operands``: ``"qkv"``,
    or only ``"q"`` or ``"kv"`` (cross-attention: Q and K/V blocked by different offsets, ``pb``'s), or ``"v"``
    (the backward's dO, quantized as V); ``v_rows``: V's blocks row-major, as the backward's products want them."""
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    items = pb.sched.query_tiles[BLOCK]  # one item per block
    # the kernel's second grid axis runs over Q's heads, then K's, then V's: "kv" starts it at K's (no Q heads)
    # "v": V alone (its heads are then axis 1's only operands: no Q and no K heads before them)
    heads, kv_heads, operand_heads = {"qkv": (heads, kv_heads, heads + 2 * kv_heads), "q": (heads, kv_heads, heads),
                                      "kv": (0, kv_heads, 2 * kv_heads), "v": (0, 0, v.shape[1])}[operands]  # fmt: skip
    num_blocks = items.shape[0]
    if not (num_blocks and operand_heads):
        return
    n = rotation_size(head_dim)
    arguments = (q, k, v, *outputs, _rotation_on(n, q.dtype, q.device), pb.offsets, block_base, items,
                 q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), num_blocks, heads,
                 kv_heads)  # fmt: skip
    constexprs = dict(HEAD_DIM=head_dim, BLOCK=BLOCK, ROT=n, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                      EXACT=_INTERPRET, DEQUANTIZE=dequantize, num_warps=QUANTIZE_WARPS[head_dim])  # fmt: skip
    cap = QUANTIZE_MAXNREG[head_dim]
    constexprs |= {"maxnreg": cap} if cap and not _INTERPRET else {}  # (the interpreter takes no such option)
    _quantize_kernel[(num_blocks, operand_heads)](*arguments, **constexprs, V_ROWS=v_rows)


def unblock(
    data: torch.Tensor, scale: torch.Tensor, block_base: torch.Tensor, offsets: torch.Tensor, transposed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocked ``data`` and ``scale`` back as jagged ``[T, H, D]`` E4M3 and per-row ``[T, H]`` scales (tests)."""
    if transposed:
        data = data.transpose(-1, -2)
    rows = torch.arange(int(offsets[-1]), device=offsets.device)
    sample = torch.searchsorted(offsets, rows, right=True) - 1
    pos = rows - offsets[sample]
    block = block_base[sample].long() + pos // BLOCK
    values = data.view(torch.uint8)[:, block, pos % BLOCK].transpose(0, 1).view(torch.float8_e4m3fn)
    return values, scale[:, block].transpose(0, 1)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pb: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 forward: ``out [T, H, D]`` in q's dtype and ``lse [H, T]`` fp32 base 2 (for :func:`backward`)."""
    (q, k, v), out, lse, has_work = forward_buffers(q, k, v, pb)
    if has_work:
        attend(quantize_qkv(q, k, v, pb), out, lse, k.shape[1], pb)
    return out, lse


def straight_through_operands(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pb: Problem
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the FP8 forward multiplies, new ``[T, H, D]`` tensors in q's dtype: rotated Q and K, and V, their E4M3
    blocks times their scales (the quantize pass writing those instead of the blocked layout; the emulation's
    ``straight_through_operands`` to the dtype's rounding)."""
    outs = tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    _quantize_pass(q, k, v, (*outs, *outs), _block_base(pb, q.device), pb, dequantize=True)
    return outs


def straight_through_q_and_kv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pb: Problem, k_pb: Problem
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`straight_through_operands` of cross-attention: Q blocked by ``q_pb``'s offsets, K and V by ``k_pb``'s."""
    outs = tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    _quantize_pass(q, k, v, (*outs, *outs), _block_base(q_pb, q.device), q_pb, dequantize=True, operands="q")
    _quantize_pass(q, k, v, (*outs, *outs), _block_base(k_pb, k.device), k_pb, dequantize=True, operands="kv")
    return outs


def backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    pb: Problem, grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The FP8 forward's backward, straight through its quantization (the emulation's
    ``jagged_attention_fp8_backward``): JFA's bf16 backward kernels on :func:`straight_through_operands` with
    the logit scale ``/ n``, against the FP8 forward's ``out`` and ``lse``, so P is the forward's; then dQ and dK
    rotated back (``R^T``). ``grads`` as in JFA's ``backward``."""
    head_dim = q.shape[2]
    n = rotation_size(head_dim)
    q_st, k_st, v_st = straight_through_operands(q, k, v, pb)
    buffers = rotated_gradient_buffers(q_st, k_st, v, grads)
    rotated_pb = dataclasses.replace(pb, scale=pb.scale / n)  # (q R)(k R)^T = n q k^T
    jfa.backward(dout, q_st, k_st, v_st, out, lse, rotated_pb, grads=buffers)
    return rotated_back(*buffers, grads)


def rotated_gradient_buffers(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where a straight-through backward writes: new dQ and dK of the rotated operands (:func:`rotated_back` turns
    them back), and dV (``grads[2]`` when given, else new)."""
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v) if grads is None else grads[2]


def rotated_back(
    dq_st: torch.Tensor, dk_st: torch.Tensor, dv: torch.Tensor,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` from the gradients of the rotated Q and K (times ``R^T``), written into ``grads`` when
    given (``matmul`` cannot write a strided view, so those are copies)."""
    head_dim = dq_st.shape[2]
    n = rotation_size(head_dim)
    rotation_t = _rotation_on(n, dq_st.dtype, dq_st.device).T
    unrotated = [(g.view(*g.shape[:2], head_dim // n, n) @ rotation_t).view(g.shape) for g in (dq_st, dk_st)]
    if grads is None:
        return unrotated[0], unrotated[1], dv
    grads[0].copy_(unrotated[0])
    grads[1].copy_(unrotated[1])
    return grads


def attend(
    quantized: tuple[torch.Tensor, ...], out: torch.Tensor, lse: torch.Tensor, kv_heads: int, pb: Problem
) -> None:
    """The attention kernel alone, from :func:`quantize_qkv`'s output, into ``out [T, H, D]`` and ``lse [H, T]``."""
    q8, k8, v8, qs, ks, vs, block_base = quantized
    total, heads, head_dim = out.shape
    items = pb.sched.query_tiles
    constexprs = {"HEAD_DIM": head_dim, "GROUP": heads // kv_heads, "CAUSAL": pb.opts.causal, "HAS_WINDOW": pb.opts.window is not None,
                      "HAS_CONTEXT": pb.opts.contextual_len > 0, "HAS_TARGETS": pb.num_targets is not None, "SMALL": _SMALL}  # fmt: skip
    _fwd_fp8_kernel[_grid(items, heads, "BLOCK_M")](
        q8, k8, v8, qs, ks, vs, out, lse, pb.offsets, pb.targets_arg(), block_base, items[_SMALL], items[_LARGE],
        out.stride(0), out.stride(1), total, heads, q8.shape[1], pb.scale * LOG2E / rotation_size(head_dim),
        **pb.runtime(), **constexprs,
        NEGATIVE_SCALE=pb.scale < 0, EXACT=_INTERPRET, BLOCK_N=BLOCK,
    )  # fmt: skip
