"""Triton kernels of the FP8 GEMM recipes (Hopper and later; no autograd here).

- `rowwise_quantize`: per-row scaled E4M3 (scale = amax / 448), optionally of x^T (transpose-quantize),
  or both from one read of x (`rowwise_quantize_dual`), feeding `torch._scaled_mm`'s rowwise GEMM.
- `blockwise_quantize_dual`: one pass over x writing 1x128-tile quantizations of x and of x^T with
  power-of-two (E8M0) scales, bit-identical to `mx_quantize_reference(.., block=(128,), "e4m3", "rceil")`.
- `blockwise_gemm`: out = a @ b^T for E4M3 operands with E8M0 scales per 1x128 tile of a and per 1x128
  tile or 128x128 block of b, fp32 accumulation, scales applied per 128-wide K step. Autotuned per shape;
  ``OPENGEM_FP8_AUTOTUNE=0`` takes the default config instead (one compile, no tuning runs: tests, quick
  benchmarks).

The rowwise scales and multipliers use correctly rounded division (`tl.math.div_rn`; Triton's ``/`` is an
approximate fp32 division), so x * (448 / amax) rounds like torch's x / (amax / 448) except within an
fp32 ulp of an fp8 rounding tie.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from opengem.ops.triton.mx import exp2_int, fp32_to_fp8_bits, mul_exp2, shared_exponent

E4M3_MAX = 448.0
TILE = 128


@triton.jit
def _rcp(x, COMPILED: tl.constexpr):
    if COMPILED:  # one MUFU op; x >= 1 here, so no range fix-ups (compiled kernels only: no PTX in the interpreter)
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    return 1.0 / x


@triton.jit
def _exp2(x, COMPILED: tl.constexpr):
    # 2^x with subnormal results flushed to zero in both paths (the GELU's far left tail: no fp32 subnormals,
    # which the interpreter's FP8 conversion mishandles)
    if COMPILED:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    return tl.where(x < -126.0, 0.0, tl.exp2(x))


@triton.jit
def _normal_cdf_and_density(x, COMPILED: tl.constexpr):
    # (Phi(x), exp(-x^2 / 2)) with Phi(x) = erfc(-x / sqrt(2)) / 2 from Numerical Recipes' erfcc (fractional
    # error < 1.2e-7 for every x, so no cancellation in the left tail): one reciprocal, two exp2 and nine FMAs
    # in base 2 (w^2 = z^2 log2(e) for z = |x| / sqrt(2); the polynomial's coefficients are erfcc's times
    # log2(e), the last less 1 for the halving), against libdevice erff's two coefficient sets selected per
    # element. The row quantizer is instruction-bound (its GELU forward: 66 SASS instructions per element with
    # erff, 0.51 ms at 65536 x 4096 on an H200, session 13).
    w = tl.abs(x) * 0.8493218003
    t = _rcp(1.0 + 0.4162773056 * w, COMPILED)
    p = 0.246517298 * t - 1.18611495
    p = p * t + 2.14747446
    p = p * t - 1.63775315
    p = p * t + 0.402321582
    p = p * t - 0.26875686
    p = p * t + 0.139630057
    p = p * t + 0.539700616
    p = p * t + 1.4427292
    p = p * t - 2.82574822
    half_erfc = t * _exp2(p - w * w, COMPILED)  # erfc(z) / 2
    return tl.where(x >= 0, 1.0 - half_erfc, half_erfc), _exp2(-(w * w), COMPILED)


@triton.jit
def _prologue(x_ptr, u_ptr, offs, m, PROLOGUE: tl.constexpr, COMPILED: tl.constexpr):
    # the value to quantize: x (0), gelu(x) (1), or x * gelu'(u) (2, the GELU backward)
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    u = tl.load(u_ptr + offs, mask=m, other=0.0) if PROLOGUE == 2 else x
    return _prologue_values(x, u, PROLOGUE, COMPILED)


@triton.jit
def _prologue_values(x, u, PROLOGUE: tl.constexpr, COMPILED: tl.constexpr):
    # _prologue of values already loaded (u is read by the GELU backward only)
    x = x.to(tl.float32)
    if PROLOGUE == 1:
        cdf, _ = _normal_cdf_and_density(x, COMPILED)  # the unused density is dropped at compile time
        x = x * cdf
    if PROLOGUE == 2:
        u = u.to(tl.float32)
        cdf, density = _normal_cdf_and_density(u, COMPILED)
        x = x * (cdf + u * density * 0.3989422804014327)
    return x


@triton.jit
def _e4m3_multiplier(amax):
    # 448 / amax, correctly rounded (the plain fp32 division of compiled kernels is approximate)
    return tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), amax)


@triton.jit(do_not_specialize=["R", "SUM_ROWS"])  # rows (tokens) change every batch; R is no stride here
def _row_amax_quant_kernel(
    x_ptr, u_ptr, out_ptr, q_ptr, scale_ptr, sum_ptr, R, C, SUM_ROWS,
    PROLOGUE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ONE_CHUNK: tl.constexpr,
    PROGRAMS_PER_SM: tl.constexpr, COMPILED: tl.constexpr, COL_SUM: tl.constexpr,
):
    # BLOCK_R full rows per program (~16 KB of bf16): pass 1 takes the row amax, pass 2 quantizes. When a
    # row fits one chunk (ONE_CHUNK: C <= BLOCK_C) the values stay in registers between the passes: one read
    # and one prologue (the GELU's erf / exp) per element instead of two. Otherwise pass 2 re-reads the
    # rows, which a small per-program footprint keeps in L1/L2. With a prologue (GELU or its backward)
    # pass 2 also writes the transformed values to out_ptr. PROGRAMS_PER_SM > 0 (ONE_CHUNK only): persistent
    # programs instead, `_persistent_rows`, which with COL_SUM also sum the columns (`sum_ptr`, below).
    if PROGRAMS_PER_SM > 0:
        _persistent_rows(x_ptr, u_ptr, out_ptr, q_ptr, scale_ptr, sum_ptr, R, C, SUM_ROWS, PROLOGUE, BLOCK_R, BLOCK_C,
                         COMPILED, COL_SUM)
    else:
        _plain_rows(x_ptr, u_ptr, out_ptr, q_ptr, scale_ptr, R, C, PROLOGUE, BLOCK_R, BLOCK_C, ONE_CHUNK, COMPILED)


@triton.jit
def _plain_rows(x_ptr, u_ptr, out_ptr, q_ptr, scale_ptr, R, C, PROLOGUE: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_C: tl.constexpr, ONE_CHUNK: tl.constexpr, COMPILED: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < R
    base = r[:, None].to(tl.int64) * C
    if ONE_CHUNK:
        c = tl.arange(0, BLOCK_C)
        m = rmask[:, None] & (c[None, :] < C)
        x = _prologue(x_ptr, u_ptr, base + c[None, :], m, PROLOGUE, COMPILED)
        amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12)
        tl.store(scale_ptr + r, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), mask=rmask)
        _store_quantized(x, _e4m3_multiplier(amax), out_ptr, q_ptr, base + c[None, :], m, PROLOGUE, COMPILED)
    else:
        amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            x = _prologue(x_ptr, u_ptr, base + c[None, :], rmask[:, None] & (c[None, :] < C), PROLOGUE, COMPILED)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        amax = tl.maximum(amax, 1e-12)
        tl.store(scale_ptr + r, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), mask=rmask)
        mult = _e4m3_multiplier(amax)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            m = rmask[:, None] & (c[None, :] < C)
            x = _prologue(x_ptr, u_ptr, base + c[None, :], m, PROLOGUE, COMPILED)
            _store_quantized(x, mult, out_ptr, q_ptr, base + c[None, :], m, PROLOGUE, COMPILED)


@triton.jit
def _persistent_rows(x_ptr, u_ptr, out_ptr, q_ptr, scale_ptr, sum_ptr, R, C, SUM_ROWS, PROLOGUE: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, COMPILED: tl.constexpr, COL_SUM: tl.constexpr):
    # The one-chunk quantization with the programs striding over the row blocks, each block's loads issued
    # before the previous block's arithmetic: a program keeps two blocks of loads in flight. One row per
    # program (the best plain GELU tile, 16 warps at 31 registers, four programs an SM) left the GELU forward
    # latency-bound at 3.5 TB/s (session 14); this keeps twice the bytes in flight at the same occupancy when
    # its registers are capped at 32 (maxnreg: 8 bytes of spills, static sm_90 count).
    # COL_SUM: each program also sums its rows' values (as stored: rounded to out's dtype, or x itself) per
    # column in fp32 registers, in the tile's own layout (no cross-warp reduction per block), and writes the
    # sums to row pid of sum_ptr [SUM_ROWS, C]; rows no program of this launch owns are zeroed, so the host's
    # sum over rows is the column sum whatever grid the tuner chose (bias gradients without a pass over
    # the tensor; deterministic: a fixed order for a given grid).
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    rows = tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_C)
    cmask = c[None, :] < C
    r = pid * BLOCK_R + rows
    offs = r[:, None].to(tl.int64) * C + c[None, :]
    x_next = tl.load(x_ptr + offs, mask=(r < R)[:, None] & cmask, other=0.0)
    u_next = tl.load(u_ptr + offs, mask=(r < R)[:, None] & cmask, other=0.0) if PROLOGUE == 2 else x_next
    col_sums = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for block in range(pid, tl.cdiv(R, BLOCK_R), step):
        x_raw, u_raw = x_next, u_next
        r = block * BLOCK_R + rows
        offs = r[:, None].to(tl.int64) * C + c[None, :]
        m = (r < R)[:, None] & cmask
        ahead, ahead_m = offs + (step * BLOCK_R).to(tl.int64) * C, ((r + step * BLOCK_R) < R)[:, None] & cmask
        x_next = tl.load(x_ptr + ahead, mask=ahead_m, other=0.0)
        if PROLOGUE == 2:
            u_next = tl.load(u_ptr + ahead, mask=ahead_m, other=0.0)
        x = _prologue_values(x_raw, u_raw, PROLOGUE, COMPILED)
        amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12)
        tl.store(scale_ptr + r, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), mask=r < R)
        _store_quantized(x, _e4m3_multiplier(amax), out_ptr, q_ptr, offs, m, PROLOGUE, COMPILED)
        if COL_SUM:  # masked rows and columns hold zeros (loaded as 0; every prologue maps 0 to 0)
            stored = x if PROLOGUE == 0 else x.to(out_ptr.dtype.element_ty).to(tl.float32)
            col_sums += stored
    if COL_SUM:
        tl.store(sum_ptr + pid.to(tl.int64) * C + c, tl.sum(col_sums, axis=0), mask=c < C)
        for idle in range(pid + step, SUM_ROWS, step):  # rows of programs this grid does not have
            tl.store(sum_ptr + idle * C + c, tl.zeros((BLOCK_C,), dtype=tl.float32), mask=c < C)


@triton.jit
def _store_quantized(x, mult, out_ptr, q_ptr, offsets, m, PROLOGUE: tl.constexpr, COMPILED: tl.constexpr):
    """Stores x (when a prologue made it) and its E4M3 quantization x * mult (per-row multipliers)."""
    if PROLOGUE != 0:
        tl.store(out_ptr + offsets, x.to(out_ptr.dtype.element_ty), mask=m)
    q = x * mult[:, None]
    if not COMPILED:  # compiled, the conversion saturates by itself (F2FP.SATFINITE) and keeps NaN a NaN
        q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    tl.store(q_ptr + offsets, q.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=m)


@triton.jit
def _tile_amax_kernel(x_ptr, row_amax_ptr, col_amax_ptr, R, C, DO_ROW: tl.constexpr, BLOCK: tl.constexpr):
    # amax per row and/or column via atomic max on the fp32 bit patterns (non-negative: int order = float order)
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = (r[:, None] < R) & (c[None, :] < C)
    x = tl.abs(tl.load(x_ptr + r[:, None].to(tl.int64) * C + c[None, :], mask=m, other=0.0).to(tl.float32))
    xb = x.to(tl.int32, bitcast=True)
    tl.atomic_max(col_amax_ptr + c, tl.max(xb, axis=0), mask=c < C)
    if DO_ROW:
        tl.atomic_max(row_amax_ptr + r, tl.max(xb, axis=1), mask=r < R)


@triton.jit
def _tile_quant_kernel(
    x_ptr, q_ptr, qt_ptr, row_amax_ptr, col_amax_ptr, row_scale_ptr, col_scale_ptr, R, C, DO_ROW: tl.constexpr,
    BLOCK: tl.constexpr
):
    # writes x^T scaled per row of x^T (= column of x) and, with DO_ROW, x scaled per row, from one read; the
    # first row (column) of programs also writes the column (row) dequant scales, amax / 448 correctly rounded
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = (r[:, None] < R) & (c[None, :] < C)
    x = tl.load(x_ptr + r[:, None].to(tl.int64) * C + c[None, :], mask=m, other=0.0).to(tl.float32)
    col_amax = tl.maximum(tl.load(col_amax_ptr + c, mask=c < C, other=0).to(tl.float32, bitcast=True), 1e-12)
    if tl.program_id(0) == 0:
        tl.store(col_scale_ptr + c, tl.math.div_rn(col_amax, tl.full(col_amax.shape, 448.0, tl.float32)), mask=c < C)
    qt = tl.minimum(tl.maximum(x * _e4m3_multiplier(col_amax)[None, :], -448.0), 448.0)
    qt8 = qt.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    tl.store(qt_ptr + c[None, :].to(tl.int64) * R + r[:, None], qt8, mask=m)
    if DO_ROW:
        row_amax = tl.maximum(tl.load(row_amax_ptr + r, mask=r < R, other=0).to(tl.float32, bitcast=True), 1e-12)
        if tl.program_id(1) == 0:
            tl.store(row_scale_ptr + r, tl.math.div_rn(row_amax, tl.full(row_amax.shape, 448.0, tl.float32)),
                     mask=r < R)
        q = tl.minimum(tl.maximum(x * _e4m3_multiplier(row_amax)[:, None], -448.0), 448.0)
        q8 = q.to(tl.float8e4nv, fp_downcast_rounding="rtne")
        tl.store(q_ptr + r[:, None].to(tl.int64) * C + c[None, :], q8, mask=m)


PROLOGUES = {None: 0, "gelu": 1, "gelu_backward": 2}

ROW_ELEMENTS = 8192  # the untuned program below 4096 columns: BLOCK_R rows x BLOCK_C of about this many, 8 warps
# (rows, warps): a program of 8192 elements with 8 warps holds ~170 registers per thread in the GELU backward
# (x and u): one program per SM. Smaller programs or more warps keep more loads in flight; the tuner keeps
# the candidates of 4096..16384 elements and picks per (C, prologue). One row of 4096 with 16 warps: the GELU
# forward at 65536 x 4096 in 0.510 ms against 0.745 for the next (H200, session 13, fp8_mlp_kernels.json).
ROW_CONFIGS = ((1, 4), (1, 8), (1, 16), (2, 8), (2, 16), (4, 8), (4, 16), (8, 8), (16, 16))


def _default_row_program(block_c: int) -> tuple[int, int]:
    """(rows, warps) of a program when the tuner is off. Rows of 4096 columns and more: one row with 16 warps,
    the GELU forward at 65536 x 4096 in 0.387 ms and its backward in 0.494 ms, against 0.627 / 0.535 for the
    8192-element default (H200, session 14, fp8_mlp_kernels.json)."""
    return (1, 16) if block_c >= 4096 else (max(1, ROW_ELEMENTS // block_c), 8)


def _row_programs(block_c: int) -> list[triton.Config]:
    """The candidates of 4096..16384 elements at ``block_c`` columns (narrow rows, C < 256: the most rows)."""
    configs = [triton.Config({"BLOCK_R": rows, "PROGRAMS_PER_SM": 0}, num_warps=warps) for rows, warps in ROW_CONFIGS]
    kept = [c for c in configs if 4096 <= c.kwargs["BLOCK_R"] * block_c <= 16384]
    most_rows = max(c.kwargs["BLOCK_R"] for c in configs)
    return kept or [c for c in configs if c.kwargs["BLOCK_R"] == most_rows]


# Persistent candidates for rows in registers (`_persistent_rows`): blocks of 4096 elements, 8 values a thread at
# 16 warps; (warps, programs per SM, register cap): four programs an SM capped at 32 registers (the full
# occupancy), three at 40 (the GELU forward at 65536 x 4096 in 0.367 ms against 0.386 at 32 and 0.390 for the
# plain one-row program, H200, session 15) or two uncapped.
PERSISTENT_PROGRAMS = ((16, 4, 32), (16, 3, 40), (16, 2, None))
# The column-summing launches (`rowwise_quantize_with_sums`): persistent programs only (a plain program owns
# one row block, so its partial sums would be as large as the tensor). 16 warps hold 8 values and 8 sums a
# thread, 8 warps 16 of each; the cap keeps every program of the grid resident (programs x threads x cap <= 64K
# registers), else the last wave of a persistent grid runs alone. Static sm_90 counts, GELU backward at 4096
# columns: 64 registers uncapped at 16 warps (no spill), 32 bytes of spills at 40, 72 at 32; 121 registers at 8
# warps. Measured there (H200, session 15): 0.498 ms at 16 warps x 2, 0.568 at 16 x 3, 0.667 at 8 x 4 (0.974 at
# 16 x 4 capped at 32 and 1.84 at 8 x 6 capped at 40: dropped); x at 1024 columns 0.073-0.075 ms for all three.
# The first is the untuned default.
COLUMN_SUM_PROGRAMS = ((16, 2, 64), (16, 3, 40), (8, 4, 64))
MAX_COLUMN_SUM_PROGRAMS_PER_SM = max(programs for _, programs, _ in COLUMN_SUM_PROGRAMS)


def _persistent_programs(
    block_c: int, programs: tuple[tuple[int, int, int | None], ...] = PERSISTENT_PROGRAMS
) -> list[triton.Config]:
    """Configs of ``programs`` ((warps, programs per SM, register cap or None)) at ``block_c`` columns."""
    rows = max(1, 4096 // block_c)
    return [triton.Config({"BLOCK_R": rows, "PROGRAMS_PER_SM": per_sm}, num_warps=warps,
                          **({"maxnreg": cap} if cap else {}))
            for warps, per_sm, cap in programs]


def _column_sum_programs(block_c: int) -> list[triton.Config]:
    return _persistent_programs(block_c, COLUMN_SUM_PROGRAMS)


def _row_tuner(configs: list[triton.Config]):
    return triton.autotune(configs=configs, key=["C", "PROLOGUE"])(_row_amax_quant_kernel)


# One autotuner per column-block width, chosen on the host, rather than one pruned by `prune_configs_by`:
# Dynamo (torch 2.11) fails on a `prune_configs_by` autotuner launched twice in one trace ("ListVariable ...
# is already tracked for mutation", pytorch#177600), which every compiled MLP with FP8 linears does. Rows that
# fit one chunk (C <= 4096) may also run persistent programs; wider rows (two passes) have their own tuner.
_BLOCK_WIDTHS = [1 << i for i in range(13)]  # BLOCK_C = next power of two of C, at most 4096
_ROW_TUNERS = {block_c: _row_tuner(_row_programs(block_c) + _persistent_programs(block_c)) for block_c in _BLOCK_WIDTHS}
_CHUNKED_ROW_TUNER = _row_tuner(_row_programs(4096))
_COLUMN_SUM_TUNERS = {block_c: _row_tuner(_column_sum_programs(block_c)) for block_c in _BLOCK_WIDTHS}


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _row_grid(R: int, device: torch.device) -> Callable[[dict[str, Any]], tuple[int]]:
    """One program per row block, or for persistent programs as many as the SMs hold (at most one per block)."""
    def grid(meta: dict[str, Any]) -> tuple[int]:
        blocks = triton.cdiv(R, meta["BLOCK_R"])
        if not meta["PROGRAMS_PER_SM"]:
            return (blocks,)
        return (min(blocks, meta["PROGRAMS_PER_SM"] * _multiprocessors(device)),)
    return grid


def rowwise_quantize(
    x: torch.Tensor, prologue: str | None = None, u: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Contiguous 2-D ``x [R, C]`` -> (E4M3 ``[R, C]``, fp32 dequant scales ``[R]`` = amax / 448, out).

    ``prologue="gelu"`` quantizes gelu(x) (exact erf GELU) and returns it as ``out`` (x's dtype);
    ``"gelu_backward"`` quantizes and returns x * gelu'(u) for the pre-activation ``u`` (same shape).
    """
    q, scale, out, _ = _rowwise_launch(x, prologue, u, column_sums=False)
    return q, scale, out


def rowwise_quantize_with_sums(
    x: torch.Tensor, prologue: str | None = None, u: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """`rowwise_quantize` plus the fp32 column sums ``[C]`` of the values it stores (x, or ``out`` with a
    prologue, as rounded to its dtype): a bias gradient from the quantizing read instead of a pass of its own.
    Rows of up to 4096 columns sum in the persistent programs; wider ones quantize, then ``torch.sum``."""
    return _rowwise_launch(x, prologue, u, column_sums=True)


def _rowwise_launch(
    x: torch.Tensor, prologue: str | None, u: torch.Tensor | None, column_sums: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    R, C = x.shape
    block_c = min(triton.next_power_of_2(C), 4096)
    one_chunk = C <= block_c
    if column_sums and (not one_chunk or not x.numel()):
        q, scale, out, _ = _rowwise_launch(x, prologue, u, column_sums=False)
        return q, scale, out, torch.sum(x if out is None else out, 0, dtype=torch.float32)
    q = torch.empty((R, C), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((R,), dtype=torch.float32, device=x.device)
    out = torch.empty_like(x) if prologue else None
    if not x.numel():
        return q, scale, out, None
    # out_ptr is never q (unused without a prologue): Inductor clones each mutated argument of a user Triton
    # kernel separately, so one tensor behind two written pointers loses the writes (pytorch#196657)
    out_arg = out if out is not None else torch.empty(0, dtype=x.dtype, device=x.device)
    partial_rows = 0
    if column_sums:  # one row of partial sums per program of the widest grid a candidate can have
        blocks = triton.cdiv(R, max(1, 4096 // block_c))
        partial_rows = min(blocks, MAX_COLUMN_SUM_PROGRAMS_PER_SM * _multiprocessors(x.device))
    partial = torch.empty((partial_rows, C if column_sums else 0), dtype=torch.float32, device=x.device)
    args = (x, x if u is None else u, out_arg, q, scale, partial, R, C, partial_rows)
    # COMPILED (not the interpreter, which has no PTX): one-instruction reciprocal and exp2 in the GELUs, and the
    # saturating E4M3 conversion in place of a clamp
    shape = {"PROLOGUE": PROLOGUES[prologue], "BLOCK_C": block_c, "ONE_CHUNK": one_chunk, "COMPILED": x.is_cuda,
             "COL_SUM": column_sums}
    if x.is_cuda and autotune_enabled():
        if column_sums:
            tuner = _COLUMN_SUM_TUNERS[block_c]
        else:
            tuner = _ROW_TUNERS[block_c] if one_chunk else _CHUNKED_ROW_TUNER
        tuner[_row_grid(R, x.device)](*args, **shape)
    elif column_sums:
        config = _column_sum_programs(block_c)[0]
        _row_amax_quant_kernel[_row_grid(R, x.device)(config.kwargs)](*args, **shape, **config.kwargs,
                                                                      num_warps=config.num_warps)
    else:
        block_r, warps = _default_row_program(block_c)
        _row_amax_quant_kernel[(triton.cdiv(R, block_r),)](*args, **shape, BLOCK_R=block_r, PROGRAMS_PER_SM=0,
                                                           num_warps=warps)
    return q, scale, out, partial.sum(0) if column_sums else None


def rowwise_quantize_dual(
    x: torch.Tensor, with_rows: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Quantize x^T (``[C, R]``, per-row scales ``[C]``) and, with ``with_rows``, x (``[R, C]``, ``[R]``).

    Two passes over x (amax, then quantize); the second writes both outputs from one read.
    Returns (q, scale, qt, scale_t) with q, scale None when ``with_rows`` is False.
    """
    R, C = x.shape
    device = x.device
    # the atomic maxima start at zero; amax / 448, correctly rounded as `rowwise_quantize` writes it, comes from
    # the quantizing kernel. No rows: no row amax (a launch less for W^T, quantized every step)
    row_amax = torch.zeros((R if with_rows else 0,), dtype=torch.int32, device=device)
    col_amax = torch.zeros((C,), dtype=torch.int32, device=device)
    q = torch.empty((R, C), dtype=torch.float8_e4m3fn, device=device) if with_rows else None
    qt = torch.empty((C, R), dtype=torch.float8_e4m3fn, device=device)
    row_scale = torch.empty((R,), dtype=torch.float32, device=device) if with_rows else None
    col_scale = torch.empty((C,), dtype=torch.float32, device=device)
    if x.numel():
        grid = (triton.cdiv(R, 64), triton.cdiv(C, 64))
        _tile_amax_kernel[grid](x, row_amax, col_amax, R, C, DO_ROW=with_rows, BLOCK=64, num_warps=4)
        # unused outputs get their own empty tensors, never another output: see rowwise_quantize
        unused_q = torch.empty(0, dtype=torch.float8_e4m3fn, device=device)
        unused_scale = torch.empty(0, dtype=torch.float32, device=device)
        _tile_quant_kernel[grid](
            x, q if with_rows else unused_q, qt, row_amax, col_amax, row_scale if with_rows else unused_scale,
            col_scale, R, C, DO_ROW=with_rows, BLOCK=64, num_warps=4,
        )
    else:  # rows or columns but no values: the scale of an all-zero row
        for scale in (row_scale, col_scale):
            if scale is not None:
                scale.fill_(1e-12 / E4M3_MAX)
    return q, row_scale, qt, col_scale


@triton.jit
def _blockwise_dual_kernel(x_ptr, q_ptr, s_ptr, qt_ptr, st_ptr, R, C, SC, SR, BLOCK: tl.constexpr):
    # one [BLOCK, BLOCK] tile: 1x128 tiles along C for x, along R for x^T; power-of-two E4M3 scales
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = (r[:, None] < R) & (c[None, :] < C)
    x = tl.load(x_ptr + r[:, None].to(tl.int64) * C + c[None, :], mask=m, other=0.0).to(tl.float32)
    abits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    # x: one scale per row of the tile
    e_row = shared_exponent(tl.max(abits, axis=1), 8, True)
    q = tl.minimum(tl.maximum(mul_exp2(x, -e_row[:, None]), -448.0), 448.0)
    tl.store(q_ptr + r[:, None].to(tl.int64) * C + c[None, :], fp32_to_fp8_bits(q, 3, 7).to(tl.uint8), mask=m)
    tl.store(s_ptr + r.to(tl.int64) * SC + tl.program_id(1), (e_row + 127).to(tl.uint8), mask=r < R)
    # x^T: one scale per column of the tile, stored transposed
    e_col = shared_exponent(tl.max(abits, axis=0), 8, True)
    qt = tl.minimum(tl.maximum(mul_exp2(x, -e_col[None, :]), -448.0), 448.0)
    tl.store(qt_ptr + c[None, :].to(tl.int64) * R + r[:, None], fp32_to_fp8_bits(qt, 3, 7).to(tl.uint8), mask=m)
    tl.store(st_ptr + c.to(tl.int64) * SR + tl.program_id(0), (e_col + 127).to(tl.uint8), mask=c < C)


def blockwise_quantize_dual(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Finite contiguous 2-D ``x [R, C]`` -> (q ``[R, C]``, E8M0 ``[R, ceil(C/128)]``, qt ``[C, R]``,
    E8M0 ``[C, ceil(R/128)]``): E4M3, 1x128 tiles along the last dim of x and of x^T, rceil scales."""
    R, C = x.shape
    sc, sr = triton.cdiv(C, TILE), triton.cdiv(R, TILE)
    q = torch.empty((R, C), dtype=torch.uint8, device=x.device)
    qt = torch.empty((C, R), dtype=torch.uint8, device=x.device)
    s = torch.empty((R, sc), dtype=torch.uint8, device=x.device)
    st = torch.empty((C, sr), dtype=torch.uint8, device=x.device)
    if x.numel():
        _blockwise_dual_kernel[(sr, sc)](x, q, s, qt, st, R, C, sc, sr, BLOCK=TILE, num_warps=8)
    return q.view(torch.float8_e4m3fn), s, qt.view(torch.float8_e4m3fn), st


# (BLOCK_M, num_warps, num_stages); the first is the untuned default
GEMM_CONFIGS = ((128, 8, 3), (128, 4, 4), (64, 4, 4), (128, 8, 4))
GROUP_M = 8


def autotune_enabled() -> bool:
    """False when ``OPENGEM_FP8_AUTOTUNE=0``: the blockwise GEMM then runs the default config untuned."""
    return os.environ.get("OPENGEM_FP8_AUTOTUNE", "1") != "0"


@triton.jit(do_not_specialize=["M", "M_BUCKET"])  # as R above
def _blockwise_gemm_kernel(
    a_ptr, b_ptr, sa_ptr, sb_ptr, out_ptr, M, N, K, SK, M_BUCKET,
    B_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr,
):
    BLOCK_N: tl.constexpr = 128
    BLOCK_K: tl.constexpr = 128
    # grouped ordering so consecutive programs share b tiles in L2
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + rm[:, None].to(tl.int64) * K
    b_rows = b_ptr + rn[:, None].to(tl.int64) * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + rk
        a = tl.load(a_rows + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        b = tl.load(b_rows + k[None, :], mask=(rn[:, None] < N) & (k[None, :] < K), other=0.0)
        # E8M0 bytes -> fp32 powers of two, one per 1x128 tile of a and per tile (or block) of b
        sa = exp2_int(tl.load(sa_ptr + rm.to(tl.int64) * SK + kb, mask=rm < M, other=127).to(tl.int32) - 127)
        if B_BLOCKS:
            sb = exp2_int(tl.load(sb_ptr + pid_n * SK + kb).to(tl.int32) - 127)
            acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb)
        else:
            sbv = tl.load(sb_ptr + rn.to(tl.int64) * SK + kb, mask=rn < N, other=127).to(tl.int32)
            acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * exp2_int(sbv - 127)[None, :])
    out = out_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


_blockwise_gemm_tuned = triton.autotune(
    configs=[triton.Config({"BLOCK_M": bm, "GROUP_M": GROUP_M}, num_warps=w, num_stages=s) for bm, w, s in GEMM_CONFIGS],
    key=["M_BUCKET", "N", "K", "B_BLOCKS"],  # M (tokens) changes every batch: tuned per power of two
)(_blockwise_gemm_kernel)


def blockwise_gemm(
    a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, b_blocks: bool, out_dtype: torch.dtype
) -> torch.Tensor:
    """``a [M, K]`` E4M3 with E8M0 ``sa [M, ceil(K/128)]``; ``b [N, K]`` E4M3 with E8M0 ``sb`` either
    ``[N, ceil(K/128)]`` (1x128 tiles) or ``[ceil(N/128), ceil(K/128)]`` (128x128 blocks, ``b_blocks=True``)
    -> ``a @ b^T [M, N]`` in ``out_dtype``."""
    M, K = a.shape
    N = b.shape[0]
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if autotune_enabled():
        grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, 128),)  # noqa: E731
        bucket = triton.next_power_of_2(M)
        _blockwise_gemm_tuned[grid](a, b, sa, sb, out, M, N, K, sa.shape[1], bucket, B_BLOCKS=b_blocks)
    else:
        block_m, warps, stages = GEMM_CONFIGS[0]
        _blockwise_gemm_kernel[(triton.cdiv(M, block_m) * triton.cdiv(N, 128),)](
            a, b, sa, sb, out, M, N, K, sa.shape[1], triton.next_power_of_2(M),
            B_BLOCKS=b_blocks, BLOCK_M=block_m, GROUP_M=GROUP_M, num_warps=warps, num_stages=stages,
        )
    return out
