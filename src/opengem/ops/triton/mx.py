"""Triton MX quantization: one pass per tile, bit-exact against `opengem.ops.reference.mx`.

Everything after the load is integer arithmetic on the fp32 bit pattern (amax, the E8M0 exponent and the
round-to-nearest-even fp8 conversion) plus exact power-of-two products that never take a subnormal operand
(`mul_exp2`), so the kernel gives the same bits on the GPU, whatever its denormal mode, and in the Triton
interpreter (whose own fp8 casts do not round to nearest-even nor handle subnormals).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from opengem.ops.reference.mx import ELEM_FORMATS


@triton.jit
def shared_exponent(amax_bits, EMAX: tl.constexpr, RCEIL: tl.constexpr):
    """E8M0 exponent e in [-127, 127] of a finite amax given as non-negative int32 fp32 bits."""
    e = (amax_bits >> 23) - 127 - EMAX
    if RCEIL:
        # amax <= 1.75 * 2^(floor_log2) iff its mantissa bits are <= 0x600000 (both maxima are 1.75 * 2^emax)
        e += ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def exp2_int(e):
    """Exact fp32 2^e for int32 e in [-127, 127] (2^-127 is the fp32 subnormal 0x00400000)."""
    bits = tl.where(e >= -126, (tl.maximum(e, -126) + 127) << 23, 0x00400000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def mul_exp2(x, e):
    """fp32 ``x * 2^e`` for int32 ``e`` in [-127, 127], exact whenever the result is an fp32 normal.

    A subnormal ``x`` (mant * 2^-149) is rebuilt from its integer mantissa, so a kernel compiled to flush
    subnormal operands to zero still scales the tiny blocks right. Results below 2^-126 may come out as
    signed zeros instead of subnormals: far below half the smallest fp8 subnormal, they quantize to the
    same fp8 bits either way.
    """
    bits = x.to(tl.int32, bitcast=True)
    # mant * 2^-23 is exact; times 2^(e - 126) stays exact down to 2^-126 (for e < 0 the result is < 2^-126)
    tiny = ((bits & 0x7FFFFF).to(tl.float32) * 1.1920928955078125e-07) * exp2_int(tl.maximum(e - 126, -126))
    tiny = tl.where(e >= 0, tiny, 0.0)
    tiny = (tiny.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)
    return tl.where((bits & 0x7F800000) == 0, tiny, x * exp2_int(e))


@triton.jit
def fp32_to_fp8_bits(q, MANT: tl.constexpr, BIAS: tl.constexpr):
    """Round finite fp32 ``q`` (|q| <= the format max) to nearest-even fp8 bits (int32 in [0, 255])."""
    bits = q.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    mag = bits & 0x7FFFFFFF
    # normal fp8 results: round the fp32 mantissa to MANT bits, then rebias the exponent
    shift: tl.constexpr = 23 - MANT
    normal = (mag + (1 << (shift - 1)) - 1 + ((mag >> shift) & 1)) >> shift
    normal -= (127 - BIAS) << MANT
    # subnormal fp8 results: the integer count of quanta 2^(1 - BIAS - MANT), rounded to nearest-even
    exp = mag >> 23
    mant = (mag & 0x7FFFFF) | tl.where(exp > 0, 0x800000, 0)
    s = tl.minimum(151 - BIAS - MANT - tl.maximum(exp, 1), 31)
    s = tl.maximum(s, 1)
    sub = (mant + (1 << (s - 1)) - 1 + ((mant >> s) & 1)) >> s
    min_normal_bits: tl.constexpr = (128 - BIAS) << 23
    out = tl.where(mag < min_normal_bits, sub, normal)
    return out | (sign << 7)


@triton.jit
def to_e4m3(x, EXACT: tl.constexpr):
    """fp32 ``x`` (|x| <= 448) to E4M3, nearest-even: the hardware conversion, or integer arithmetic when ``EXACT``."""
    if EXACT:
        return fp32_to_fp8_bits(x, 3, 7).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    return x.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def e4m3_values(x, EXACT: tl.constexpr):
    """fp32 ``x`` (|x| <= 448) rounded to its nearest-even E4M3 value, as fp32; ``EXACT`` decodes the bits by
    integer arithmetic (the interpreter's fp8 casts are not exact)."""
    if EXACT:
        bits = fp32_to_fp8_bits(x, 3, 7)
        exponent = (bits >> 3) & 15
        mantissa = (bits & 7).to(tl.float32)
        magnitude = tl.where(exponent == 0, mantissa * 0.001953125, (mantissa + 8.0) * exp2_int(exponent - 10))
        return tl.where((bits & 128) != 0, -magnitude, magnitude)
    return x.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.float32)


@triton.jit
def mx_e4m3_rows(x, ROWS: tl.constexpr, COLS: tl.constexpr, EXACT: tl.constexpr, BLOCK: tl.constexpr = 32,
                 NAN_BLOCKS: tl.constexpr = False):  # fmt: skip
    """fp32 ``x [ROWS, COLS]`` -> its MX-E4M3 values in fp32: each row's blocks of ``BLOCK`` columns scaled by their
    power of two (``rceil``: nothing saturates), rounded to E4M3, scaled back. ``BLOCK``: 32, or COLS when a row is
    shorter (one block zero-padded to 32: the padding leaves its maximum). ``x`` finite (P in the attention
    kernels' loops), or with ``NAN_BLOCKS`` anything: a block holding inf or NaN then comes out NaN, as an MX block
    with the NaN scale dequantizes (operands from a model).

    Plain products, not :func:`mul_exp2`: they are exact but where an input or a result is an fp32 subnormal
    (under 2^-126) and the GPU flushes it, which moves an attention output by ~1e-38 at most; the guarded
    products doubled the JFA forward's instructions (sm_90: 3,032 bf16, 5,896 guarded, 3,872 plain, at 128 x 64)."""
    blocks = tl.reshape(x, (ROWS, COLS // BLOCK, BLOCK))
    amax_bits = tl.max(blocks.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2)
    if NAN_BLOCKS:
        finite = amax_bits < 0x7F800000
        blocks = tl.where(finite[:, :, None], blocks, 0.0)
        amax_bits = tl.where(finite, amax_bits, 0)
    e = shared_exponent(amax_bits, 8, True)[:, :, None]
    values = e4m3_values(blocks * exp2_int(-e), EXACT) * exp2_int(e)
    if NAN_BLOCKS:
        values = tl.where(finite[:, :, None], values, float("nan"))
    return tl.reshape(values, (ROWS, COLS))


@triton.jit(do_not_specialize=["rows"])  # rows (tokens) change every batch; cols is the stride
def _mx_quantize_kernel(
    x_ptr, data_ptr, scale_ptr, rows, cols, scale_cols,
    SQUARE: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
    EMAX: tl.constexpr, MAX: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, RCEIL: tl.constexpr,
):
    # one program: BLOCK_ROWS rows of one BLOCK_COLS-wide column block; one scale per row (1-D blocks) or
    # one for the whole tile (SQUARE). Plain 2-D tiles and reductions keep the compiled code small.
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    c = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    inside = (r[:, None] < rows) & (c[None, :] < cols)
    offs = r[:, None].to(tl.int64) * cols + c[None, :]
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    # block amax as an integer max of |bits| (exact, and NaN/inf show up as >= 0x7F800000)
    amax_bits = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
    if SQUARE:
        amax_bits = tl.zeros_like(amax_bits) + tl.max(amax_bits, axis=0)
    finite = amax_bits < 0x7F800000
    e = shared_exponent(tl.where(finite, amax_bits, 0), EMAX, RCEIL)
    # elements: x * 2^-e (exact), saturated to the format max, rounded to fp8 bits
    q = tl.minimum(tl.maximum(mul_exp2(x, -e[:, None]), -MAX), MAX)
    q8 = tl.where(finite[:, None], fp32_to_fp8_bits(tl.where(finite[:, None], q, 0.0), MANT, BIAS), 0)
    tl.store(data_ptr + offs, q8.to(tl.uint8), mask=inside)
    scale = tl.where(finite, e + 127, 255).to(tl.uint8)
    if SQUARE:  # the tile's one scale, written by its first row
        first = tl.arange(0, BLOCK_ROWS) == 0
        tl.store(scale_ptr + tl.program_id(0) * scale_cols + tl.program_id(1) + 0 * r, scale, mask=first)
    else:
        tl.store(scale_ptr + r.to(tl.int64) * scale_cols + tl.program_id(1), scale, mask=r < rows)


def mx_quantize_triton(
    x: torch.Tensor, block: tuple[int, ...], elem: str, scale_rule: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `mx_quantize_reference` for a contiguous ``x`` (blocks along the last dim).

    ``block`` is (cols,) or (rows, cols) with each entry 32 or 128: the 128 sizes serve the blockwise FP8
    recipe (1x128 activation tiles, 128x128 weight blocks) with the same power-of-two scale rules.
    """
    fmt = ELEM_FORMATS[elem]
    cols = x.shape[-1]
    rows = x.numel() // max(cols, 1)
    row_group, col_group = (block[0], block[1]) if len(block) == 2 else (1, block[0])
    scale_cols = triton.cdiv(cols, col_group)
    data = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    if len(block) == 2:
        scales = torch.empty((triton.cdiv(rows, row_group), scale_cols), dtype=torch.uint8, device=x.device)
    else:
        scales = torch.empty((*x.shape[:-1], scale_cols), dtype=torch.uint8, device=x.device)
    if x.numel() > 0:
        # 1-D blocks: 32 rows of a 32-wide block or 8 of a 128-wide one per program; square: one tile
        block_rows = row_group if len(block) == 2 else 4096 // col_group // 4
        grid = (triton.cdiv(rows, block_rows), scale_cols)
        _mx_quantize_kernel[grid](
            x, data, scales, rows, cols, scale_cols,
            SQUARE=len(block) == 2, BLOCK_ROWS=block_rows, BLOCK_COLS=col_group,
            EMAX=fmt.emax, MAX=fmt.max, MANT=fmt.mantissa_bits, BIAS=fmt.exponent_bias,
            RCEIL=scale_rule == "rceil", num_warps=8 if block_rows * col_group >= 128 * 128 else 4,
        )
    return data.view(fmt.dtype), scales
