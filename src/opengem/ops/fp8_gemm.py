"""FP8 GEMM recipes: quantize two operands along their contraction dim and multiply, out = a @ b^T.

Recipes (``recipe`` argument):

- ``"fp8_rowwise"``: E4M3 with one fp32 scale (amax / 448) per row of each operand; on CUDA through
  cuBLAS `torch._scaled_mm` (bf16 output, needs K and N multiples of 16), elsewhere emulated exactly
  (fp32 GEMM of the dequantized operands).
- ``"fp8_blockwise"``: E4M3 with power-of-two (E8M0) scales per 1x128 tile of activations and per
  128x128 block of weights (``weight=True``); on CUDA cuBLAS blockwise `torch._scaled_mm` where the
  build supports it on sm90 (CUDA >= 12.9; checked once per process against the Triton kernel, see
  `cublas_blockwise_available`) and a Triton kernel otherwise (``OPENGEM_BLOCKWISE_GEMM=triton|cublas``
  forces one; ``OPENGEM_FP8_AUTOTUNE=0`` runs it untuned); fp32 emulation elsewhere. The weight blocks are square, so one weight quantization
  serves both GEMM directions (`transpose`).
- ``"mxfp8"``: OCP MXFP8, E4M3 with E8M0 scales per 1x32 block (rceil rule, `opengem.ops.mx`); native
  block-scaled `torch._scaled_mm` on Blackwell (sm100+), elsewhere the exact emulation
  dequantize(a) @ dequantize(b)^T (bf16 GEMM on GPU, whose inputs are exact, fp32 on CPU).
- ``"bf16"``: no quantization (plain matmul in the input dtype).

`hadamard_rotate` applies a random block-Hadamard rotation (size 128) along the contraction dim; rotating
both operands with the same signs leaves a @ b^T unchanged in exact math and spreads outliers.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from opengem.ops.checks import check_bools
from opengem.ops.mx import mx_quantize
from opengem.ops.reference.mx import exp2_int, mx_dequantize_reference, mx_quantize_reference

RECIPES = ("bf16", "fp8_rowwise", "fp8_blockwise", "mxfp8")
FP8_RECIPES = RECIPES[1:]
E4M3_MAX = 448.0
BLOCKWISE_TILE = 128
HADAMARD_SIZE = 128


@dataclass
class QuantizedOperand:
    """``x [R, K]`` quantized along K for `scaled_gemm`.

    ``data``: E4M3 ``[R, K]`` contiguous. ``scale``: fp8_rowwise: fp32 ``[R]`` (dequant multiplier);
    fp8_blockwise: uint8 E8M0 ``[R, ceil(K/128)]`` or, with ``blocks``, ``[ceil(R/128), ceil(K/128)]``;
    mxfp8: uint8 E8M0 ``[R, ceil(K/32)]``.
    """

    data: torch.Tensor
    scale: torch.Tensor
    recipe: str
    blocks: bool = False

    def transpose(self) -> QuantizedOperand:
        """x^T quantized along R: only exact for 128x128 weight blocks (the square blocks serve both ways)."""
        if not self.blocks:
            raise ValueError("only fp8_blockwise weight operands (128x128 blocks) can be transposed")
        return QuantizedOperand(self.data.t().contiguous(), self.scale.t().contiguous(), self.recipe, True)


def _check_recipe(recipe: str) -> None:
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")


def _check_matrix(x: torch.Tensor, name: str) -> None:
    """A 2-D floating ``x [R, K]`` with K >= 1 (metadata only): an int tensor had been quantized and cast back to
    int (GELU values truncated to 0), and K = 0 failed inside amax."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor [rows, K], got {tuple(getattr(x, 'shape', ())) or x!r}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if x.shape[1] == 0:
        raise ValueError(f"{name} must have K >= 1 columns to take a scale over, got K = 0")


def _expected_scale(q: QuantizedOperand) -> tuple[torch.dtype, tuple[int, ...]]:
    """The dtype and shape of ``q.scale`` for ``q.data [R, K]`` (`QuantizedOperand`'s docstring)."""
    rows, k = q.data.shape
    if q.recipe == "fp8_rowwise":
        return torch.float32, (rows,)
    if q.recipe == "fp8_blockwise":
        return torch.uint8, ((-(-rows // BLOCKWISE_TILE) if q.blocks else rows), -(-k // BLOCKWISE_TILE))
    return torch.uint8, (rows, -(-k // 32))


def _check_operand(q: QuantizedOperand, name: str) -> None:
    """Metadata checks of a `scaled_gemm` operand: a rowwise scale of shape [1] had been broadcast over every row
    and one of [R, 1] made a 3-D output, fp32 data or scales were read as if quantized, and a 1-D operand or an
    unknown recipe failed deep in torch. A few microseconds; skipped while compiling (shapes are symbols there)."""
    if q.recipe not in FP8_RECIPES:
        raise ValueError(f"{name}.recipe must be one of {FP8_RECIPES}, got {q.recipe!r}")
    if q.data.dim() != 2 or q.data.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}.data must be a 2-D float8_e4m3fn tensor [R, K], got {q.data.dtype} "
                         f"{tuple(q.data.shape)}")
    dtype, shape = _expected_scale(q)
    if q.scale.dtype != dtype or tuple(q.scale.shape) != shape or q.scale.device != q.data.device:
        raise ValueError(f"{name}.scale must be a {dtype} tensor of shape {list(shape)} on {q.data.device} for "
                         f"{q.recipe} data {list(q.data.shape)}, got {q.scale.dtype} {list(q.scale.shape)} on "
                         f"{q.scale.device}")


def _stochastic_round_e4m3(v: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Round fp32 ``v`` (|v| <= 448) onto the E4M3 grid, up or down with probability given by the distance."""
    exponent = ((v.abs().view(torch.int32) >> 23) - 127).clamp(min=-6)  # subnormals share the 2^-6 binade
    ulp = exp2_int(exponent - 3)
    noise = torch.rand(v.shape, generator=generator, device=v.device)
    return (torch.floor(v / ulp + noise) * ulp).clamp(-E4M3_MAX, E4M3_MAX)


def _rowwise_torch(
    x: torch.Tensor, stochastic: bool, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    # 448.0 (E4M3_MAX) as literals: a module-level float read inside an autograd.Function that Dynamo traces with
    # dynamic shapes becomes a free symbol it fails to lift ("lift_tracked_freevar_to_input should not be called on
    # root SubgraphTracer", torch 2.11 and 2.13; `rowwise_matmul` in `opengem.nn.low_precision_traced`)
    amax = x.float().abs().amax(dim=1).clamp_min(1e-12)
    v = (x.float() * (448.0 / amax)[:, None]).clamp(-448.0, 448.0)
    if stochastic:
        v = _stochastic_round_e4m3(v, generator)
    return v.to(torch.float8_e4m3fn), amax / 448.0


def rowwise_matmul(a: torch.Tensor, b: torch.Tensor, fast_accum: bool, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a [M, K] @ b [N, K]^T (+ bias [N])`` in fp8_rowwise (the numerics of `quantize_operand` and `scaled_gemm`),
    in torch ops alone: under torch.compile Inductor fuses each operand's row amax, scaling and cast (a transposed
    operand's copy included) into one kernel, with the operand's producer where it can, and calls
    ``torch._scaled_mm`` from the compiled graph. Output in bf16; K and N must be multiples of 16."""
    qa, sa = _rowwise_torch(a, False, None)
    qb, sb = _rowwise_torch(b, False, None)
    return torch._scaled_mm(
        qa.contiguous(), qb.contiguous().t(), scale_a=sa[:, None], scale_b=sb[None, :],
        bias=None if bias is None else bias.to(torch.bfloat16), out_dtype=torch.bfloat16, use_fast_accum=fast_accum,
    )


def quantize_operand(
    x: torch.Tensor,
    recipe: str,
    weight: bool = False,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> QuantizedOperand:
    """Quantize a 2-D ``x [R, K]`` along K. ``weight`` picks 128x128 blocks in the blockwise recipe.

    ``stochastic`` (gradients; fp8_rowwise only) rounds stochastically instead of to nearest-even.
    """
    _check_recipe(recipe)
    check_bools("quantize_operand", weight=weight, stochastic=stochastic)  # "no" had been taken as True
    if recipe == "bf16":
        raise ValueError("recipe 'bf16' has no quantized operand")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [rows, K], got shape {tuple(x.shape)}")
    if not x.is_floating_point():  # an int tensor came back as an int32 "product"
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
    if x.shape[1] == 0:
        raise ValueError("x must have K >= 1 columns to take a scale over, got K = 0")
    if stochastic and recipe != "fp8_rowwise":
        raise ValueError(f"stochastic rounding is implemented for 'fp8_rowwise' only, got {recipe!r}")
    if recipe == "fp8_rowwise" and x.is_cuda and not stochastic:
        from opengem.ops.triton.fp8_gemm import rowwise_quantize, rowwise_quantize_dual

        if not x.is_contiguous() and x.t().is_contiguous():
            # a transposed view (W^T for the input gradients): quantized in place of a transposed copy, which
            # torch makes with a strided element-wise kernel (likely the unnamed 0.06 ms kernel of session 14's
            # MLP block profile; not yet confirmed on the GPU)
            _, _, q, scale = rowwise_quantize_dual(x.t(), with_rows=False)
        else:
            q, scale, _ = rowwise_quantize(x.contiguous())
        return QuantizedOperand(q, scale, recipe)
    x = x.contiguous()
    if recipe == "fp8_rowwise":
        return QuantizedOperand(*_rowwise_torch(x, stochastic, generator), recipe)
    if recipe == "fp8_blockwise":
        block = (BLOCKWISE_TILE, BLOCKWISE_TILE) if weight else (BLOCKWISE_TILE,)
        if x.is_cuda:
            from opengem.ops.triton.mx import mx_quantize_triton

            return QuantizedOperand(*mx_quantize_triton(x, block, "e4m3", "rceil"), recipe, weight)
        return QuantizedOperand(*mx_quantize_reference(x, block, "e4m3", "rceil"), recipe, weight)
    mx = mx_quantize(x, 32, "e4m3", "rceil")
    return QuantizedOperand(mx.data, mx.scales, recipe)


def quantize_gelu(u: torch.Tensor, grad_out: torch.Tensor | None = None) -> tuple[torch.Tensor, QuantizedOperand]:
    """Fused GELU and fp8_rowwise quantization of a 2-D pre-activation ``u [R, C]``.

    Without ``grad_out``: returns (gelu(u) in u's dtype, its quantization). With ``grad_out`` (the
    gradient w.r.t. gelu(u), same shape): the GELU backward, (grad_out * gelu'(u), its quantization).
    Both quantize the fp32 values before they are rounded to u's dtype (exact erf GELU). On CUDA one
    Triton kernel does the activation, the row amax and the quantization (saving a pass over the tensor).
    """
    value, quantized, _ = _gelu_quantized(u, grad_out, column_sums=False)
    return value, quantized


def quantize_gelu_with_column_sums(
    u: torch.Tensor, grad_out: torch.Tensor | None = None
) -> tuple[torch.Tensor, QuantizedOperand, torch.Tensor]:
    """`quantize_gelu` plus the fp32 sums ``[C]`` of the returned values over the rows: with ``grad_out``, the
    bias gradient of the layer before the GELU, from the same kernel on CUDA (no pass of its own)."""
    return _gelu_quantized(u, grad_out, column_sums=True)


def _gelu_quantized(
    u: torch.Tensor, grad_out: torch.Tensor | None, column_sums: bool
) -> tuple[torch.Tensor, QuantizedOperand, torch.Tensor | None]:
    if u.dim() != 2 or (grad_out is not None and grad_out.shape != u.shape):
        raise ValueError(f"u must be 2-D and grad_out the same shape, got {tuple(u.shape)}, "
                         f"{None if grad_out is None else tuple(grad_out.shape)}")
    _check_matrix(u, "u")
    if grad_out is not None and not grad_out.is_floating_point():
        raise ValueError(f"grad_out must be a floating-point tensor, got {grad_out.dtype}")
    if u.is_cuda:
        from opengem.ops.triton.fp8_gemm import rowwise_quantize, rowwise_quantize_with_sums

        x, prologue, pre = (u, "gelu", None) if grad_out is None else (grad_out, "gelu_backward", u.contiguous())
        if column_sums:
            q, scale, value, sums = rowwise_quantize_with_sums(x.contiguous(), prologue, pre)
        else:
            (q, scale, value), sums = rowwise_quantize(x.contiguous(), prologue, pre), None
        return value, QuantizedOperand(q, scale, "fp8_rowwise"), sums
    u32 = u.float()
    if grad_out is None:
        value = torch.nn.functional.gelu(u32)
    else:
        cdf = 0.5 * (1.0 + torch.erf(u32 * math.sqrt(0.5)))
        value = grad_out.float() * (cdf + u32 * torch.exp(-0.5 * u32 * u32) / math.sqrt(2 * math.pi))
    quantized = QuantizedOperand(*_rowwise_torch(value, False, None), "fp8_rowwise")
    value = value.to(u.dtype)
    return value, quantized, torch.sum(value, 0, dtype=torch.float32) if column_sums else None


def quantize_operand_with_column_sums(x: torch.Tensor) -> tuple[QuantizedOperand, torch.Tensor]:
    """fp8_rowwise quantization of a 2-D ``x [R, C]`` and its fp32 column sums ``[C]`` (the bias gradient when
    x is an output gradient), both from one read of x on CUDA."""
    _check_matrix(x, "x")
    if x.is_cuda:
        from opengem.ops.triton.fp8_gemm import rowwise_quantize_with_sums

        q, scale, _, sums = rowwise_quantize_with_sums(x.contiguous())
        return QuantizedOperand(q, scale, "fp8_rowwise"), sums
    return QuantizedOperand(*_rowwise_torch(x, False, None), "fp8_rowwise"), torch.sum(x, 0, dtype=torch.float32)


def quantize_operand_with_transpose(x: torch.Tensor, recipe: str) -> tuple[QuantizedOperand, QuantizedOperand]:
    """(x quantized along its last dim, x^T quantized along x's first dim) for an activation ``x [R, C]``.

    On CUDA the rowwise and blockwise recipes write both from one fused kernel (one read of x for the
    blockwise recipe, two for rowwise, whose per-column amax needs a full pass first).
    """
    _check_recipe(recipe)
    _check_matrix(x, "x")  # the CUDA kernels below had no checks of their own (the CPU path's quantize_operand has)
    if x.is_cuda and recipe in ("fp8_rowwise", "fp8_blockwise"):
        from opengem.ops.triton.fp8_gemm import blockwise_quantize_dual, rowwise_quantize_dual

        dual = rowwise_quantize_dual if recipe == "fp8_rowwise" else blockwise_quantize_dual
        q, s, qt, st = dual(x.contiguous())
        return QuantizedOperand(q, s, recipe), QuantizedOperand(qt, st, recipe)
    return quantize_operand(x, recipe), quantize_operand(x.t(), recipe)


def dequantize_operand(q: QuantizedOperand) -> torch.Tensor:
    """fp32 ``[R, K]`` values the quantized operand stands for."""
    if q.recipe == "fp8_rowwise":
        return q.data.float() * q.scale[:, None]
    if q.recipe == "fp8_blockwise":
        block = (BLOCKWISE_TILE, BLOCKWISE_TILE) if q.blocks else (BLOCKWISE_TILE,)
        return mx_dequantize_reference(q.data, q.scale, block)
    return mx_dequantize_reference(q.data, q.scale, (32,))


def _to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 ``[rows, cols]`` into the 128x4 swizzled layout of cuBLAS block-scaled GEMMs (sm100)."""
    rows, cols = scales.shape
    rb, cb = -(-rows // 128), -(-cols // 4)
    padded = torch.nn.functional.pad(scales, (0, cb * 4 - cols, 0, rb * 128 - rows))
    blocks = padded.view(rb, 128, cb, 4).permute(0, 2, 1, 3)
    return blocks.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16).flatten()


def _native_mx(a: QuantizedOperand, b: QuantizedOperand) -> bool:
    return (
        a.data.is_cuda
        and torch.cuda.get_device_capability(a.data.device)[0] >= 10
        and a.data.shape[1] % 32 == 0
        and b.data.shape[0] % 16 == 0
    )


def scaled_gemm(
    a: QuantizedOperand,
    b: QuantizedOperand,
    out_dtype: torch.dtype,
    fast_accum: bool = False,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``a [M, K]`` and ``b [N, K]`` quantized with the same recipe -> ``a @ b^T (+ bias [N]) [M, N]``
    in ``out_dtype``. ``fast_accum`` lets cuBLAS rowwise GEMMs skip periodic fp32 promotion (faster, for
    forward GEMMs); the bias is fused into the cuBLAS epilogue where cuBLAS runs.
    """
    if a.recipe != b.recipe:
        raise ValueError(f"operands quantized with different recipes: {a.recipe!r} and {b.recipe!r}")
    if not torch.compiler.is_compiling():
        _check_operand(a, "a")
        _check_operand(b, "b")
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"contraction dims differ: a has K={a.data.shape[1]}, b has K={b.data.shape[1]}")
    if not out_dtype.is_floating_point:
        raise ValueError(f"out_dtype must be a floating-point dtype, got {out_dtype}")
    if bias is not None and tuple(bias.shape) != (b.data.shape[0],):  # [1] was broadcast silently
        raise ValueError(f"bias must have shape [{b.data.shape[0]}] (b's rows, N), got {list(bias.shape)}")
    on_cuda = a.data.is_cuda
    if a.recipe == "fp8_rowwise" and on_cuda and a.data.shape[1] % 16 == 0 and b.data.shape[0] % 16 == 0:
        # any row count: torch._scaled_mm asks 16-multiples of K and N only; the rows' pad to 16 kept until session
        # 21 copied every activation operand (the GPU tests run ragged row counts)
        out = torch._scaled_mm(
            a.data, b.data.t(), scale_a=a.scale[:, None], scale_b=b.scale[None, :],
            bias=None if bias is None else bias.to(torch.bfloat16), out_dtype=torch.bfloat16,
            use_fast_accum=fast_accum,
        )
        return out.to(out_dtype)
    if a.recipe == "fp8_blockwise" and on_cuda:
        if _cublas_blockwise_eligible(a, b) and _use_cublas_blockwise(b.blocks):
            out = _cublas_blockwise_gemm(a, b).to(out_dtype)
        else:
            out = torch.ops.opengem.fp8_blockwise_gemm(a.data, a.scale, b.data, b.scale, b.blocks, out_dtype)
    elif a.recipe == "mxfp8" and _native_mx(a, b):
        e8m0 = torch.float8_e8m0fnu
        out = torch._scaled_mm(
            a.data, b.data.t(), scale_a=_to_blocked(a.scale).view(e8m0), scale_b=_to_blocked(b.scale).view(e8m0),
            out_dtype=torch.bfloat16,
        ).to(out_dtype)
    else:
        # exact emulation: dequantized operands, fp32 accumulation (bf16 inputs on GPU are exact for MX)
        compute = torch.bfloat16 if on_cuda and a.recipe == "mxfp8" else torch.float32
        out = (dequantize_operand(a).to(compute) @ dequantize_operand(b).to(compute).t()).to(out_dtype)
    return out if bias is None else out + bias.to(out_dtype)


def _e8m0_to_fp32(scale: torch.Tensor) -> torch.Tensor:
    return exp2_int(scale.to(torch.int32) - 127)


def _cublas_blockwise_eligible(a: QuantizedOperand, b: QuantizedOperand) -> bool:
    k, n = a.data.shape[1], b.data.shape[0]
    return (
        torch.cuda.get_device_capability(a.data.device) == (9, 0)
        and k % (4 * BLOCKWISE_TILE) == 0  # cuBLAS pads scale blocks along K to a multiple of 4
        and n % BLOCKWISE_TILE == 0
        and a.data.shape[0] % 16 == 0
    )


def _cublas_blockwise_gemm(a: QuantizedOperand, b: QuantizedOperand) -> torch.Tensor:
    """cuBLAS DeepSeek-style scaling: 1x128 scales outer-dim-major, 128x128 scales as [K/128, N/128]."""
    sa = _e8m0_to_fp32(a.scale).t().contiguous().t()
    sb = _e8m0_to_fp32(b.scale)
    sb = sb.t() if b.blocks else sb.t().contiguous()
    return torch._scaled_mm(a.data, b.data.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)


_CUBLAS_BLOCKWISE_OK: dict[bool, bool] = {}
CUBLAS_BLOCKWISE_PROBE: dict[bool, str] = {}  # b_blocks -> what the probe saw (for logs and benchmarks)


def cublas_blockwise_available(b_blocks: bool) -> bool:
    """Whether cuBLAS blockwise `_scaled_mm` runs here and agrees with the Triton kernel (checked once on
    a small problem per kind of b scales: some builds lack it, older ones mis-handled scale layouts).
    Any error the call raises (RuntimeError, NotImplementedError, ValueError from torch's scale checks)
    means "not available"; `CUBLAS_BLOCKWISE_PROBE` keeps the reason."""
    if b_blocks not in _CUBLAS_BLOCKWISE_OK:
        from opengem.ops.triton.fp8_gemm import blockwise_gemm

        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(256, 1024, device="cuda", generator=g) * torch.rand(256, 1, device="cuda", generator=g)
        w = torch.randn(384, 1024, device="cuda", generator=g) * torch.rand(384, 1, device="cuda", generator=g)
        qa, qb = quantize_operand(x, "fp8_blockwise"), quantize_operand(w, "fp8_blockwise", weight=b_blocks)
        ref = blockwise_gemm(qa.data, qa.scale, qb.data, qb.scale, b_blocks, torch.float32)
        try:
            out = _cublas_blockwise_gemm(qa, qb).float()
            torch.cuda.synchronize()
            err = float((out - ref).norm() / ref.norm())
            ok = err < 1e-2  # NaN fails too
            CUBLAS_BLOCKWISE_PROBE[b_blocks] = f"{'ok' if ok else 'mismatch'}: rel_err vs Triton {err:.3g}"
        except Exception as exc:  # noqa: BLE001  (unsupported here: report and fall back to Triton)
            ok = False
            CUBLAS_BLOCKWISE_PROBE[b_blocks] = f"error: {type(exc).__name__}: {exc}"[:300]
        _CUBLAS_BLOCKWISE_OK[b_blocks] = ok
    return _CUBLAS_BLOCKWISE_OK[b_blocks]


def _use_cublas_blockwise(b_blocks: bool) -> bool:
    choice = os.environ.get("OPENGEM_BLOCKWISE_GEMM", "auto")
    if choice not in ("auto", "triton", "cublas"):
        raise ValueError(f"OPENGEM_BLOCKWISE_GEMM must be 'auto', 'triton' or 'cublas', got {choice!r}")
    return choice == "cublas" or (choice == "auto" and cublas_blockwise_available(b_blocks))


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, recipe: str, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``a [M, K] @ b [N, K]^T`` with both quantized by ``recipe`` (b as a weight); ``"bf16"`` multiplies as is."""
    _check_recipe(recipe)
    if out_dtype is not None and not out_dtype.is_floating_point:  # bf16 had returned an int "product"
        raise ValueError(f"out_dtype must be a floating-point dtype, got {out_dtype}")
    out_dtype = out_dtype or a.dtype
    if a.dim() == 2 and b.dim() == 2 and a.shape[1] != b.shape[1]:  # every recipe's message, bf16's too
        raise ValueError(f"contraction dims differ: a has K={a.shape[1]}, b has K={b.shape[1]}")
    if recipe == "bf16":
        # an int pair had multiplied as ints; mixed dtypes failed in torch naming neither operand
        if not a.is_floating_point() or a.dtype != b.dtype:
            raise ValueError(f"a and b must be floating-point tensors of one dtype for recipe 'bf16', got {a.dtype} "
                             f"and {b.dtype}")
        return (a @ b.t()).to(out_dtype)
    return scaled_gemm(quantize_operand(a, recipe), quantize_operand(b, recipe, weight=True), out_dtype)


def hadamard_matrix(signs: torch.Tensor) -> torch.Tensor:
    """Orthonormal ``diag(signs) @ H / sqrt(n)`` (Sylvester H) for ``signs [n]`` of +-1, n a power of two."""
    n = signs.numel()
    h = torch.ones(1, 1, dtype=torch.float32, device=signs.device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return signs.float()[:, None] * h / math.sqrt(n)


def hadamard_rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """``x [..., K]`` times the block-diagonal rotation (blocks ``rotation [n, n]``) along K (K % n == 0)."""
    if rotation.dim() != 2 or rotation.shape[0] != rotation.shape[1]:  # had failed in a reshape naming neither
        raise ValueError(f"rotation must be a square [n, n] matrix, got {tuple(rotation.shape)}")
    n = rotation.shape[0]
    if x.shape[-1] % n:
        raise ValueError(f"Hadamard rotation needs the contraction dim {x.shape[-1]} to be a multiple of {n}")
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // n, n)
    return (blocks @ rotation.to(x.dtype)).reshape(x.shape)


@torch.library.custom_op("opengem::fp8_blockwise_gemm", mutates_args=())
def _fp8_blockwise_gemm(
    a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, b_blocks: bool, out_dtype: torch.dtype
) -> torch.Tensor:
    from opengem.ops.triton.fp8_gemm import blockwise_gemm

    return blockwise_gemm(a, sa, b, sb, b_blocks, out_dtype)


@_fp8_blockwise_gemm.register_fake
def _(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, b_blocks: bool, out_dtype: torch.dtype):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def _register_flops() -> None:
    from torch.utils.flop_counter import register_flop_formula

    @register_flop_formula(torch.ops.opengem.fp8_blockwise_gemm)
    def _flops(a_shape, sa_shape, b_shape, *args, **kwargs) -> int:
        return 2 * a_shape[0] * a_shape[1] * b_shape[0]


_register_flops()
