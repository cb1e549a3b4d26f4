"""OCP MX (microscaling) quantization: `mx_quantize`, `mx_dequantize`, `MXTensor`.

Rounding, scale rules and special values are specified in `opengem.ops.reference.mx` (module docstring).
CUDA tensors run the Triton kernel, CPU tensors the fp32 reference; ``backend="triton"`` (or the env var
``OPENGEM_MX_BACKEND=triton``) forces the kernel, e.g. under ``TRITON_INTERPRET=1``. Both give the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from opengem.ops.backend import triton_chosen
from opengem.ops.reference.mx import ELEM_FORMATS, MX_BLOCK, mx_dequantize_reference, mx_quantize_reference
from opengem.validation import is_int

SCALE_RULES = ("rceil", "floor")


@dataclass
class MXTensor:
    """An MX-quantized tensor.

    ``data``: the element values, same shape and layout as the input, dtype float8_e4m3fn / float8_e5m2.
    ``scales``: uint8 E8M0 (byte = exponent + 127, 0xFF = NaN). For 1-D blocks: the input's shape with
    the blocked ``axis`` replaced by ceil(n / 32); for 32x32 blocks: [ceil(rows / 32), ceil(cols / 32)].
    ``block``: (32,) or (32, 32). ``axis``: the blocked axis (normalized to be non-negative).
    ``orig_dtype``: the dtype `mx_dequantize` returns by default.
    """

    data: torch.Tensor
    scales: torch.Tensor
    elem: str
    block: tuple[int, ...]
    axis: int
    orig_dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


@torch.library.custom_op("opengem::mx_quantize", mutates_args=())
def _mx_quantize_op(
    x: torch.Tensor, block: list[int], elem: str, scale_rule: str, use_triton: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton:
        from opengem.ops.triton.mx import mx_quantize_triton

        return mx_quantize_triton(x.contiguous(), tuple(block), elem, scale_rule)
    return mx_quantize_reference(x, tuple(block), elem, scale_rule)


@_mx_quantize_op.register_fake
def _(x: torch.Tensor, block: list[int], elem: str, scale_rule: str, use_triton: bool):
    n_cols = -(-x.shape[-1] // MX_BLOCK)
    if len(block) == 2:
        scales_shape = (-(-x.shape[0] // block[0]), n_cols)
    else:
        scales_shape = (*x.shape[:-1], n_cols)
    data = x.new_empty(x.shape, dtype=ELEM_FORMATS[elem].dtype)
    return data, x.new_empty(scales_shape, dtype=torch.uint8)


@torch.library.custom_op("opengem::mx_dequantize", mutates_args=())
def _mx_dequantize_op(data: torch.Tensor, scales: torch.Tensor, block: list[int], dtype: torch.dtype) -> torch.Tensor:
    return mx_dequantize_reference(data, scales, tuple(block)).to(dtype)


@_mx_dequantize_op.register_fake
def _(data: torch.Tensor, scales: torch.Tensor, block: list[int], dtype: torch.dtype):
    return data.new_empty(data.shape, dtype=dtype)


def _normalize_block(block: int | tuple[int, int], ndim: int) -> tuple[int, ...]:
    if isinstance(block, int) and block == MX_BLOCK:
        return (MX_BLOCK,)
    if isinstance(block, (tuple, list)) and tuple(block) == (MX_BLOCK, MX_BLOCK):
        if ndim != 2:
            raise ValueError(f"block=(32, 32) needs a 2-D tensor, got {ndim} dims")
        return (MX_BLOCK, MX_BLOCK)
    raise ValueError(f"block must be 32 or (32, 32), got {block!r}")


def _check_scales(t: MXTensor) -> None:
    """``t.scales`` uint8 of the shape `MXTensor` documents for ``t.data`` (metadata only): scales of a wrong
    shape had been broadcast or cut by the reference without an error, fp32 ones read as exponent bytes."""
    if t.block not in ((MX_BLOCK,), (MX_BLOCK, MX_BLOCK)) or not (is_int(t.axis) and 0 <= t.axis < t.data.dim()):
        raise ValueError(f"MXTensor block must be (32,) or (32, 32) and axis a dim of data, got block={t.block!r}, "
                         f"axis={t.axis!r}")
    shape = list(t.data.shape)
    if len(t.block) == 2:
        if len(shape) != 2:
            raise ValueError(f"MXTensor data with block (32, 32) must be 2-D, got {shape}")
        expected = [-(-shape[0] // MX_BLOCK), -(-shape[1] // MX_BLOCK)]
    else:
        expected = shape[: t.axis] + [-(-shape[t.axis] // MX_BLOCK)] + shape[t.axis + 1:]
    if t.scales.dtype != torch.uint8 or list(t.scales.shape) != expected or t.scales.device != t.data.device:
        raise ValueError(f"MXTensor scales must be uint8 {expected} on {t.data.device} for data {shape}, got "
                         f"{t.scales.dtype} {list(t.scales.shape)} on {t.scales.device}")


def mx_quantize(
    x: torch.Tensor,
    block: int | tuple[int, int] = 32,
    elem: str = "e4m3",
    scale_rule: str = "rceil",
    axis: int = -1,
    backend: str | None = None,
) -> MXTensor:
    """Quantize a floating tensor ``x`` (any shape; fp32/bf16/fp16) to MX.

    ``block=32``: blocks of 32 consecutive elements along ``axis`` (the GEMM contraction dim).
    ``block=(32, 32)``: one scale per 32x32 tile of a 2-D ``x`` (``axis`` is ignored), so the same
    quantization serves a GEMM in both directions (transposing data and scales gives the other one).
    ``elem``: "e4m3" (max 448) or "e5m2" (max 57344). ``scale_rule``: "rceil" (never saturates) or
    "floor" (OCP; saturates). Sizes need not be multiples of 32. See `MXTensor` for the result.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dim, got a 0-d tensor")
    if elem not in ELEM_FORMATS:
        raise ValueError(f"elem must be one of {sorted(ELEM_FORMATS)}, got {elem!r}")
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    if not is_int(axis):  # 1.5 had failed inside movedim, True had been taken as 1
        raise ValueError(f"axis must be an int, got {axis!r}")
    if not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis {axis} out of range for a {x.dim()}-d tensor")
    blk = _normalize_block(block, x.dim())
    if len(blk) == 2 and x.numel() == 0:  # had failed in the reference's reshape ("ambiguous" -1)
        raise ValueError(f"block=(32, 32) needs a non-empty x, got shape {tuple(x.shape)}")
    axis = axis % x.dim()
    moved = x if len(blk) == 2 or axis == x.dim() - 1 else x.movedim(axis, -1)
    triton = triton_chosen(x.device, backend, "OPENGEM_MX_BACKEND")
    data, scales = _mx_quantize_op(moved, list(blk), elem, scale_rule, triton)
    if moved is not x:
        data, scales = data.movedim(-1, axis), scales.movedim(-1, axis)
    return MXTensor(data, scales, elem, blk, x.dim() - 1 if len(blk) == 2 else axis, x.dtype)


def mx_dequantize(t: MXTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``data * 2^(scale - 127)`` per block in ``dtype`` (default: the quantized tensor's original dtype).

    Blocks whose scale is 0xFF come back all NaN. Exact in fp32; bf16 output rounds only if a value
    falls below bf16's subnormal range.
    """
    dtype = dtype or t.orig_dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:  # int32 had truncated the values
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    if not torch.compiler.is_compiling():  # shapes are symbols there: no guards on them
        _check_scales(t)
    if len(t.block) == 2 or t.axis == t.data.dim() - 1:
        return _mx_dequantize_op(t.data, t.scales, list(t.block), dtype)
    out = _mx_dequantize_op(t.data.movedim(t.axis, -1), t.scales.movedim(t.axis, -1), list(t.block), dtype)
    return out.movedim(-1, t.axis)
