"""fp32 reference for OCP MX quantization (the specification the Triton kernels are held to bit-exactly).

Conventions (OCP Microscaling Formats v1.0, with the choices the spec leaves open written down here):

- A block is 32 consecutive elements along one axis (``block=32``) or a 32x32 tile of a 2-D matrix
  (``block=(32, 32)``). Sizes that are not a multiple of the block are padded with zeros internally;
  padding never changes a block's amax.
- The shared scale is a power of two 2^e stored as E8M0: byte = e + 127, e clamped to [-127, 127],
  byte 0xFF = NaN.
- Exponents are read from the fp32 bit pattern (exact, unlike ``log2``). floor(log2(amax)) of a zero or
  fp32-subnormal amax is taken as -127, which clamps to the smallest scale either way.
- ``scale_rule="rceil"``: e = ceil(log2(amax / elem_max)), the smallest e with amax <= elem_max * 2^e,
  computed exactly (not through a rounded division); elements never saturate.
  ``scale_rule="floor"`` (OCP): e = floor(log2(amax)) - emax_elem; elements above elem_max saturate
  to +-elem_max.
- An all-zero block gets byte 0 (2^-127) and zero elements.
- A block holding inf or NaN gets byte 0xFF and all-zero element bits; dequantization gives NaN for the
  whole block (the scale alone carries the NaN, as the spec says).
- Elements are x * 2^-e rounded to nearest-even into the element format, subnormals included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ElemFormat:
    dtype: torch.dtype
    max: float  # largest finite magnitude
    emax: int  # exponent of the largest power of two <= max
    mantissa_bits: int
    exponent_bias: int


ELEM_FORMATS: dict[str, ElemFormat] = {
    "e4m3": ElemFormat(torch.float8_e4m3fn, 448.0, 8, 3, 7),
    "e5m2": ElemFormat(torch.float8_e5m2, 57344.0, 15, 2, 15),
}
MX_BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 255
# Both element maxima are 1.75 * 2^emax: 1.75 has fp32 mantissa bits 0x600000.
_MAX_MANTISSA_BITS = 0x600000


def scale_exponent(amax: torch.Tensor, fmt: ElemFormat, scale_rule: str) -> torch.Tensor:
    """int32 shared exponent e (clamped to [-127, 127]) of finite non-negative fp32 ``amax``."""
    bits = amax.float().contiguous().view(torch.int32)
    floor_log2 = (bits >> 23) - 127  # zero and fp32 subnormals read as -127
    e = floor_log2 - fmt.emax
    if scale_rule == "rceil":
        e = e + ((bits & 0x7FFFFF) > _MAX_MANTISSA_BITS).to(torch.int32)
    return e.clamp(-E8M0_BIAS, E8M0_BIAS)


def exp2_int(e: torch.Tensor) -> torch.Tensor:
    """Exact fp32 2^e for int32 e in [-127, 127] built from bits (2^-127 is an fp32 subnormal)."""
    normal = ((e + 127).clamp_min(1) << 23).view(torch.float32)
    return torch.where(e >= -126, normal, torch.full_like(normal, 2.0**-127))


def _blocked(x: torch.Tensor, block: tuple[int, ...]) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Zero-pad and reshape so each block is the trailing dim: [..., n_blocks, elems_per_block]."""
    if len(block) == 1:
        n = x.shape[-1]
        pad = (-n) % block[0]
        xp = torch.nn.functional.pad(x, (0, pad))
        return xp.reshape(*x.shape[:-1], xp.shape[-1] // block[0], block[0]), x.shape  # (no -1: empty x too)
    rows, cols = x.shape
    xp = torch.nn.functional.pad(x, (0, (-cols) % block[1], 0, (-rows) % block[0]))
    rb, cb = xp.shape[0] // block[0], xp.shape[1] // block[1]
    tiles = xp.reshape(rb, block[0], cb, block[1]).permute(0, 2, 1, 3).reshape(rb, cb, -1)
    return tiles, x.shape


def _unblocked(tiles: torch.Tensor, shape: tuple[int, ...], block: tuple[int, ...]) -> torch.Tensor:
    if len(block) == 1:
        return tiles.reshape(*shape[:-1], tiles.shape[-2] * tiles.shape[-1])[..., : shape[-1]]
    rb, cb = tiles.shape[:2]
    full = tiles.reshape(rb, cb, block[0], block[1]).permute(0, 2, 1, 3).reshape(rb * block[0], cb * block[1])
    return full[: shape[0], : shape[1]]


def mx_quantize_reference(
    x: torch.Tensor, block: tuple[int, ...], elem: str, scale_rule: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize along the last dim (``block=(32,)``) or in 32x32 tiles of a 2-D ``x`` (``block=(32, 32)``).

    Returns ``data`` (same shape as x, the element dtype) and ``scales`` (uint8 E8M0; shape x.shape with
    the last dim replaced by ceil(n / 32), or [ceil(rows / 32), ceil(cols / 32)] for square blocks).
    """
    fmt = ELEM_FORMATS[elem]
    tiles, shape = _blocked(x.float(), block)
    finite = torch.isfinite(tiles).all(-1)
    amax = torch.where(finite, tiles.abs().amax(-1), torch.zeros((), dtype=torch.float32))
    e = scale_exponent(amax, fmt, scale_rule)
    scaled = (tiles * exp2_int(-e).unsqueeze(-1)).clamp(-fmt.max, fmt.max)
    scaled = torch.where(finite.unsqueeze(-1), scaled, torch.zeros((), dtype=torch.float32))
    data = _unblocked(scaled.to(fmt.dtype), shape, block).contiguous()
    scales = torch.where(finite, e + E8M0_BIAS, torch.full_like(e, E8M0_NAN)).to(torch.uint8)
    return data, scales


def mx_dequantize_reference(
    data: torch.Tensor, scales: torch.Tensor, block: tuple[int, ...]
) -> torch.Tensor:
    """fp32 ``data * 2^(scale - 127)`` per block; a 0xFF scale gives NaN for its whole block."""
    tiles, shape = _blocked(data.float(), block)
    e = scales.to(torch.int32) - E8M0_BIAS
    factor = torch.where(scales == E8M0_NAN, torch.full((), float("nan")), exp2_int(e.clamp(max=127)))
    return _unblocked(tiles * factor.unsqueeze(-1), shape, block).contiguous()
