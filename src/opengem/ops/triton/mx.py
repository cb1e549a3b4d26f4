"""Triton MX quantization: one pass per tile, bit-exact against `opengem.ops.reference.mx`.

Everything after the load is integer arithmetic on the fp32 bit pattern (amax, the E8M0 exponent and the
round-to-nearest-even fp8 conversion), so the kernel gives the same bits on the GPU and in the Triton
interpreter (whose own fp8 casts do not round to nearest-even nor handle subnormals).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from opengem.ops.reference.mx import ELEM_FORMATS, MX_BLOCK


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
def _mx_quantize_kernel(
    x_ptr, data_ptr, scale_ptr, rows, cols, scale_cols,
    ROW_GROUP: tl.constexpr, COL_GROUP: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
    EMAX: tl.constexpr, MAX: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, RCEIL: tl.constexpr,
):
    # one program: a [BLOCK_ROWS, BLOCK_COLS] tile = [BLOCK_ROWS / ROW_GROUP, BLOCK_COLS / COL_GROUP] blocks
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    c = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    inside = (r[:, None] < rows) & (c[None, :] < cols)
    offs = r[:, None].to(tl.int64) * cols + c[None, :]
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    # block amax as an integer max of |bits| (exact, and NaN/inf show up as >= 0x7F800000)
    abits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    blocks = tl.reshape(abits, (BLOCK_ROWS // ROW_GROUP, ROW_GROUP, BLOCK_COLS // COL_GROUP, COL_GROUP))
    amax_bits = tl.max(tl.max(blocks, axis=3), axis=1)
    finite = amax_bits < 0x7F800000
    e = shared_exponent(tl.where(finite, amax_bits, 0), EMAX, RCEIL)
    # elements: x * 2^-e (exact), saturated to the format max, rounded to fp8 bits
    inv = tl.reshape(exp2_int(-e), (BLOCK_ROWS // ROW_GROUP, 1, BLOCK_COLS // COL_GROUP, 1))
    xb = tl.reshape(x, (BLOCK_ROWS // ROW_GROUP, ROW_GROUP, BLOCK_COLS // COL_GROUP, COL_GROUP))
    q = tl.minimum(tl.maximum(xb * inv, -MAX), MAX)
    fin = tl.reshape(finite, (BLOCK_ROWS // ROW_GROUP, 1, BLOCK_COLS // COL_GROUP, 1))
    q8 = tl.where(fin, fp32_to_fp8_bits(tl.where(fin, q, 0.0), MANT, BIAS), 0)
    tl.store(data_ptr + offs, tl.reshape(q8, (BLOCK_ROWS, BLOCK_COLS)).to(tl.uint8), mask=inside)
    # scales
    sr = tl.program_id(0) * (BLOCK_ROWS // ROW_GROUP) + tl.arange(0, BLOCK_ROWS // ROW_GROUP)
    sc = tl.program_id(1) * (BLOCK_COLS // COL_GROUP) + tl.arange(0, BLOCK_COLS // COL_GROUP)
    scale = tl.where(finite, e + 127, 255).to(tl.uint8)
    srows = (rows + ROW_GROUP - 1) // ROW_GROUP
    smask = (sr[:, None] < srows) & (sc[None, :] < scale_cols)
    tl.store(scale_ptr + sr[:, None].to(tl.int64) * scale_cols + sc[None, :], scale, mask=smask)


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
        block_rows = max(row_group, 16)
        block_cols = max(col_group, 128)
        grid = (triton.cdiv(rows, block_rows), triton.cdiv(cols, block_cols))
        _mx_quantize_kernel[grid](
            x, data, scales, rows, cols, scale_cols,
            ROW_GROUP=row_group, COL_GROUP=col_group, BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols,
            EMAX=fmt.emax, MAX=fmt.max, MANT=fmt.mantissa_bits, BIAS=fmt.exponent_bias,
            RCEIL=scale_rule == "rceil", num_warps=8 if block_rows * block_cols >= 128 * 128 else 4,
        )
    return data.view(fmt.dtype), scales
