"""The fp8_rowwise linear under torch.compile, in torch ops that Inductor compiles (the default there).

The custom ops of `opengem.nn.low_precision_autograd` are opaque to the compiler: every call runs their Python
body (two Triton quantizer launches, a row pad, ``torch._scaled_mm``) and no quantization fuses with the kernel
that produced its input. gem-large at batch 512 with its 138 FP8 linears: 424 ms a step against 285 ms in BF16,
with 118 ms of it the GPU waiting on the host (H200, session 21). Written in torch ops inside an
``autograd.Function``, the forward and backward trace into the compiled graph: Inductor generates the
quantizations (fused with their producers: norms, activations, the transposed weight's copy) and launches
cuBLAS from the graph. The numerics are the custom ops' (row amax / 448 scales, E4M3, bf16 GEMM output).

Session 12 found Dynamo's trace of the earlier autograd.Function (whose forward launched user Triton kernels)
giving the backward zeros for its output gradient; this one holds torch ops only, and the GPU test
`test_fp8_linears_under_torch_compile` asserts every gradient against eager for both paths.
``OPENGEM_FP8_COMPILE=custom_op`` keeps the custom ops.
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
    """How FP8 linears compile: ``inductor`` (this module, fp8_rowwise recipes) or ``custom_op``."""
    path = os.environ.get("OPENGEM_FP8_COMPILE", "inductor")
    if path not in COMPILE_PATHS:
        raise ValueError(f"OPENGEM_FP8_COMPILE must be one of {COMPILE_PATHS}, got {path!r}")
    return path


def traceable(recipe: LowPrecisionRecipe) -> bool:
    """Whether ``recipe`` compiles through this module: an fp8_rowwise forward, fp8_rowwise or BF16 gradient
    GEMMs, no rotation or stochastic rounding, and ``OPENGEM_FP8_COMPILE`` not ``custom_op``."""
    return (
        recipe.forward == "fp8_rowwise"
        and recipe.grad_input in ("fp8_rowwise", "bf16")
        and recipe.grad_weight in ("fp8_rowwise", "bf16")
        and not recipe.hadamard
        and not recipe.stochastic_rounding
        and compile_path() == "inductor"
    )


def _padded_tokens(t: torch.Tensor) -> torch.Tensor:
    """``t [C, tokens]`` with zero columns up to a multiple of 16 tokens (the weight gradient's contraction)."""
    return F.pad(t, (0, (-t.shape[1]) % FP8_ALIGNMENT))


class _RowwiseLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fast_accum: bool,
                grad_input_fp8: bool, fast_accum_grad: bool, grad_weight_fp8: bool) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.options = (bias is not None, grad_input_fp8, fast_accum_grad, grad_weight_fp8)
        return rowwise_matmul(x, weight.to(x.dtype), fast_accum, bias).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        has_bias, grad_input_fp8, fast_accum_grad, grad_weight_fp8 = ctx.options
        dx = None
        if ctx.needs_input_grad[0]:  # contraction over out_features
            w = weight.to(dy.dtype)
            dx = rowwise_matmul(dy, w.t(), fast_accum_grad).to(dy.dtype) if grad_input_fp8 else dy @ w
        if grad_weight_fp8:  # contraction over tokens
            dw = rowwise_matmul(_padded_tokens(dy.t()), _padded_tokens(x.t().to(dy.dtype)), False)
        else:
            dw = dy.t() @ x.to(dy.dtype)
        db = dy.sum(0).to(weight.dtype) if has_bias else None
        return dx, dw.to(weight.dtype), db, None, None, None, None


def rowwise_linear(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   recipe: LowPrecisionRecipe) -> torch.Tensor:
    """``x2d [tokens, in] @ weight^T + bias`` in x2d's dtype with ``recipe``'s GEMM precisions (`traceable`)."""
    return _RowwiseLinearFn.apply(x2d, weight, bias, recipe.fast_accum, recipe.grad_input == "fp8_rowwise",
                                  recipe.fast_accum_grad, recipe.grad_weight == "fp8_rowwise")
