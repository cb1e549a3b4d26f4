"""`LowPrecisionMLP`: fc2(gelu(fc1(x))) in FP8 with the GELU fused into the quantizations around it.

Forward: fc1 (FP8 rowwise), then one kernel computes gelu(u), its row amax and its FP8 quantization for
fc2 (and writes gelu(u) in BF16 for fc2's weight gradient). Backward: fc2's input gradient in FP8, then
one kernel computes the GELU backward and quantizes it for fc1's input gradient. Weight gradients run in
BF16 (the recipe default), weight quantizations are cached per optimizer step as in `LowPrecisionLinear`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from opengem.nn import low_precision
from opengem.nn.low_precision import LowPrecisionLinear, LowPrecisionRecipe, resolve_recipe
from opengem.ops.fp8_gemm import quantize_gelu, quantize_operand, scaled_gemm

FUSED_RECIPE = "fp8_rowwise"


class _FusedMLPFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor,
                b2: torch.Tensor | None, mlp: LowPrecisionMLP) -> torch.Tensor:
        fc1, fc2 = mlp.fc1, mlp.fc2
        fast = fc1.recipe.fast_accum
        u = scaled_gemm(quantize_operand(x, FUSED_RECIPE), fc1.quantized_weight("forward", FUSED_RECIPE, None),
                        x.dtype, fast_accum=fast, bias=b1)
        h, qh = quantize_gelu(u)
        y = scaled_gemm(qh, fc2.quantized_weight("forward", FUSED_RECIPE, None), x.dtype, fast_accum=fast, bias=b2)
        ctx.mlp, ctx.biases = mlp, (b1 is not None, b2 is not None)
        ctx.save_for_backward(x, u, h, w1, w2)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, u, h, w1, w2 = ctx.saved_tensors
        fc1, fc2 = ctx.mlp.fc1, ctx.mlp.fc2
        dy = dy.contiguous()
        qdy = quantize_operand(dy, FUSED_RECIPE)
        dh = scaled_gemm(qdy, fc2.quantized_weight("grad_input", FUSED_RECIPE, None), dy.dtype)
        dw2 = dy.t() @ h
        du, qdu = quantize_gelu(u, grad_out=dh)
        dx = scaled_gemm(qdu, fc1.quantized_weight("grad_input", FUSED_RECIPE, None), dy.dtype)
        dw1 = du.t() @ x
        db1 = du.sum(0).to(w1.dtype) if ctx.biases[0] else None
        db2 = dy.sum(0).to(w2.dtype) if ctx.biases[1] else None
        return dx, dw1.to(w1.dtype), db1, dw2.to(w2.dtype), db2, None


@torch.compiler.disable
def _eager_fused_mlp(
    x2d: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None,
    mlp: LowPrecisionMLP,
) -> torch.Tensor:
    return _FusedMLPFn.apply(x2d, w1, b1, w2, b2, mlp)


def _fused_mlp(
    x2d: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None,
    mlp: LowPrecisionMLP,
) -> torch.Tensor:
    """A graph break under torch.compile unless `opengem.nn.low_precision.TRACE_UNDER_COMPILE` (see there)."""
    if low_precision.TRACE_UNDER_COMPILE:
        return _FusedMLPFn.apply(x2d, w1, b1, w2, b2, mlp)
    return _eager_fused_mlp(x2d, w1, b1, w2, b2, mlp)


class LowPrecisionMLP(nn.Module):
    """``fc2(gelu(fc1(x)))`` (exact erf GELU, like ``nn.GELU()``) for ``x [..., fc1.in_features]``.

    Built from two ``nn.Linear`` (parameters shared, not copied). ``recipe`` must run forward and input
    gradients in fp8_rowwise with BF16 weight gradients (the fused kernels' recipe); the fused path runs
    on CUDA and an exact emulation of it elsewhere. Hadamard rotation and stochastic rounding are not
    available here (use `LowPrecisionLinear`), and the `NumericsMonitor` hooks do not see these layers.
    """

    def __init__(self, fc1: nn.Linear, fc2: nn.Linear, recipe: str | LowPrecisionRecipe = FUSED_RECIPE) -> None:
        super().__init__()
        resolved = resolve_recipe(recipe)
        expected = (FUSED_RECIPE, FUSED_RECIPE, "bf16", False, False)
        got = (resolved.forward, resolved.grad_input, resolved.grad_weight, resolved.hadamard,
               resolved.stochastic_rounding)
        if got != expected:
            raise ValueError(f"LowPrecisionMLP runs fp8_rowwise forward/input-gradient GEMMs with BF16 weight "
                             f"gradients and no rotation or stochastic rounding, got {resolved}")
        if fc1.out_features != fc2.in_features:
            raise ValueError(f"fc1.out_features ({fc1.out_features}) != fc2.in_features ({fc2.in_features})")
        self.fc1 = LowPrecisionLinear.from_linear(fc1, resolved)
        self.fc2 = LowPrecisionLinear.from_linear(fc2, resolved, seed=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.fc1.in_features)
        y = _fused_mlp(x2d, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias, self)
        return y.reshape(*x.shape[:-1], self.fc2.out_features)
