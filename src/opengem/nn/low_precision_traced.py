"""The fp8_rowwise linear under torch.compile in torch ops that Inductor compiles (``OPENGEM_FP8_COMPILE=inductor``).

The custom ops of `opengem.nn.low_precision_autograd` are opaque to the compiler: every call runs their Python
body (two Triton quantizer launches, ``torch._scaled_mm``) and no quantization fuses with the kernel
that produced its input. gem-large at batch 512 with its 138 FP8 linears: 424 ms a step against 285 ms in BF16,
with 118 ms of it the GPU waiting on the host (H200, session 21). Written in torch ops inside an
``autograd.Function``, the forward and backward trace into the compiled graph: Inductor generates the
quantizations (fused with their producers: norms, activations, the transposed weight's copy) and launches
cuBLAS from the graph. The numerics are the custom ops' (row amax / 448 scales, E4M3, bf16 GEMM output).

Session 12 found Dynamo's trace of the eager autograd.Function giving the backward zeros for its output gradient:
torch 2.11 loses the gradients of a Function whose output went through a no-op ``to`` (`_in_dtype`; session 21's
first GPU run of this module lost them too), and with dynamic shapes (the trainer's) a module-level float read inside
the Function became a free symbol Dynamo cannot lift (`opengem.ops.fp8_gemm` writes 448.0 as a literal). Both fixed
on the CPU in session 21; the GPU test `test_fp8_linears_under_torch_compile` holds every gradient of both paths to
the fp32 computation. The default since session 22 (H200, torch 2.11): the layer alone (16384 x 1024 -> 4096 ->
1024, forward + backward) 1.49 ms against 2.61 ms through the custom ops and 1.41 ms compiled BF16 in one run;
gem-small b2048 0.994x BF16 (one call), gem-large b512 0.787x with Inductor's mix-order reductions fusing the bias
gradient's column sum with dy's row amax (0.782x in session 23 with the sum as a GEMV, which Inductor decomposes
and fuses the same way), against 0.67x through the custom ops (session 21). FP8 MLPs cannot pay off much on
gem-large: its FP8 GEMMs saved 13.6 of BF16's 84.9 ms of GEMM time a step (session 23).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

from opengem.nn.low_precision_recipe import LowPrecisionRecipe
from opengem.ops.fp8_gemm import rowwise_matmul

COMPILE_PATHS = ("inductor", "custom_op")
FP8_ALIGNMENT = 16  # torch._scaled_mm: K and N multiples of 16


def compile_path() -> str:
    """How FP8 linears compile: ``inductor`` (default: this module, fp8_rowwise recipes) or ``custom_op``."""
    path = os.environ.get("OPENGEM_FP8_COMPILE", "inductor")
    if path not in COMPILE_PATHS:
        raise ValueError(f"OPENGEM_FP8_COMPILE must be one of {COMPILE_PATHS}, got {path!r}")
    return path


def traceable(recipe: LowPrecisionRecipe) -> bool:
    """Whether ``recipe`` compiles through this module: an fp8_rowwise forward, fp8_rowwise or BF16 gradient
    GEMMs, no rotation or stochastic rounding, and ``OPENGEM_FP8_COMPILE=inductor`` (the default)."""
    return (
        recipe.forward == "fp8_rowwise"
        and recipe.grad_input in ("fp8_rowwise", "bf16")
        and recipe.grad_weight in ("fp8_rowwise", "bf16")
        and not recipe.hadamard
        and not recipe.stochastic_rounding
        and compile_path() == "inductor"
    )


def _in_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the no-op ``to``: torch 2.11's Dynamo loses every gradient of an autograd.Function
    whose output went through a ``to`` that returned its input (found on the CPU in session 21; torch 2.13 is
    right); most likely also what lost session 12's gradients (``scaled_gemm`` ends in ``out.to(out_dtype)``)."""
    return t if t.dtype == dtype else t.to(dtype)


def _padded_tokens(t: torch.Tensor) -> torch.Tensor:
    """``t [C, tokens]`` with zero columns up to a multiple of 16 tokens (the weight gradient's contraction)."""
    return F.pad(t, (0, (-t.shape[1]) % FP8_ALIGNMENT))


class _RowwiseLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fast_accum: bool,
                grad_input_fp8: bool, fast_accum_grad: bool, grad_weight_fp8: bool) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.options = (bias is not None, grad_input_fp8, fast_accum_grad, grad_weight_fp8)
        return _in_dtype(rowwise_matmul(x, _in_dtype(weight, x.dtype), fast_accum, bias), x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        has_bias, grad_input_fp8, fast_accum_grad, grad_weight_fp8 = ctx.options
        dx = None
        if ctx.needs_input_grad[0]:  # contraction over out_features
            w = _in_dtype(weight, dy.dtype)
            dx = _in_dtype(rowwise_matmul(dy, w.t(), fast_accum_grad), dy.dtype) if grad_input_fp8 else dy @ w
        if grad_weight_fp8:  # contraction over tokens
            dw = rowwise_matmul(_padded_tokens(dy.t()), _padded_tokens(_in_dtype(x.t(), dy.dtype)), False)
        else:
            dw = dy.t() @ _in_dtype(x, dy.dtype)
        # Inductor fuses this column sum with dy's row amax above into mix-order reduction kernels (0.66-2.8 ms a
        # call on gem-large, sessions 22-23); as ``torch.mv`` it is decomposed into the same reduction and fused
        # alike (gem-large FP8 355.9 ms against 356.2, session 23), so the plain sum stays
        db = _in_dtype(dy.sum(0), weight.dtype) if has_bias else None
        return dx, _in_dtype(dw, weight.dtype), db, None, None, None, None


def rowwise_linear(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   recipe: LowPrecisionRecipe) -> torch.Tensor:
    """``x2d [tokens, in] @ weight^T + bias`` in x2d's dtype with ``recipe``'s GEMM precisions (`traceable`)."""
    return _RowwiseLinearFn.apply(x2d, weight, bias, recipe.fast_accum, recipe.grad_input == "fp8_rowwise",
                                  recipe.fast_accum_grad, recipe.grad_weight == "fp8_rowwise")
