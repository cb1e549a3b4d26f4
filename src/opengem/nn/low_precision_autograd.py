"""The FP8 / MX linear's forward and backward, eager (an autograd.Function sharing the forward's weight
quantization with its backward) and under torch.compile (custom ops with a registered backward, no graph
break).

Why two paths: traced by Dynamo (torch 2.11, on an H200), the autograd.Function's backward got zeros in
place of its output gradient, so every gradient came back zero (GPU session 12: the AOTAutograd graph of
one FP8 linear builds `zeros` for ``dy`` and never reads the tangent; `benchmarks/results/
fp8_compile_backends.json`). A custom op is opaque to Dynamo and its autograd formula is registered with
torch.library, which AOTAutograd differentiates through. While compiling, the weight is quantized inside
the op on every call (a graph cannot hold the layer's cache); eagerly once per forward, for its backward too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from opengem.nn.low_precision_recipe import LowPrecisionRecipe
from opengem.nn.low_precision_traced import rowwise_linear, traceable
from opengem.ops.fp8_gemm import (
    HADAMARD_SIZE,
    QuantizedOperand,
    hadamard_matrix,
    hadamard_rotate,
    quantize_operand,
    quantize_operand_with_transpose,
    scaled_gemm,
)

if TYPE_CHECKING:
    from opengem.nn.low_precision import LowPrecisionLinear

# (role "forward" for W or "grad_input" for W^T, recipe, rotation or None) -> the quantized weight
WeightQuantizer = Callable[[str, str, "torch.Tensor | None"], QuantizedOperand]


def hadamard_rotation(signs: torch.Tensor | None, like: torch.Tensor, contraction: int) -> torch.Tensor | None:
    """The block Hadamard [128, 128] of ``signs`` in ``like``'s dtype; None without signs or when
    ``contraction`` is not a multiple of 128."""
    if signs is None or contraction % HADAMARD_SIZE:
        return None
    return hadamard_matrix(signs.to(like.device)).to(like.dtype)


def quantize_weight(weight: torch.Tensor, role: str, recipe: str, rotation: torch.Tensor | None) -> QuantizedOperand:
    """W ([out, in], role "forward") or W^T (role "grad_input"), rotated, quantized along its last dim."""
    mat = weight if role == "forward" else weight.t()
    mat = mat if rotation is None else hadamard_rotate(mat.to(rotation.dtype), rotation)
    return quantize_operand(mat, recipe, weight=True)


def uncached_quantizer(weight: torch.Tensor) -> WeightQuantizer:
    """Quantizes ``weight`` on every call (inside the compiled custom ops, which cannot hold a cache)."""

    def quantized(role: str, recipe: str, rotation: torch.Tensor | None) -> QuantizedOperand:
        with torch.no_grad():
            return quantize_weight(weight, role, recipe, rotation)

    return quantized


def linear_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: LowPrecisionRecipe,
    signs: torch.Tensor | None, weight_of: WeightQuantizer, fuse_transpose: bool,
) -> tuple[torch.Tensor, QuantizedOperand | None]:
    """``y = x W^T + b`` in x's dtype, and x^T quantized for the weight gradient when ``fuse_transpose`` and
    the recipe runs it in the forward's format (one fused pass quantizes both; else None)."""
    if recipe.forward == "bf16":
        return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype)), None
    rot = hadamard_rotation(signs, x, x.shape[1])
    qxt = None
    if fuse_transpose and recipe.grad_weight == recipe.forward and rot is None:
        qx, qxt = quantize_operand_with_transpose(x, recipe.forward)
    else:
        qx = quantize_operand(x if rot is None else hadamard_rotate(x, rot), recipe.forward)
    fast = recipe.fast_accum and recipe.forward == "fp8_rowwise"
    return scaled_gemm(qx, weight_of("forward", recipe.forward, rot), x.dtype, fast_accum=fast, bias=bias), qxt


def linear_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, qxt: QuantizedOperand | None,
    recipe: LowPrecisionRecipe, signs: torch.Tensor | None, weight_of: WeightQuantizer, needs_dx: bool,
    has_bias: bool,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """(dx = dy W or None, dW = dy^T x, db = sum of dy or None), dW and db in the weight's dtype."""
    dy = dy.contiguous()
    qdyt, dx = None, None
    if needs_dx and recipe.grad_input == "bf16":  # contraction over out_features
        dx = dy @ weight.to(dy.dtype)
    elif needs_dx:
        rot = hadamard_rotation(signs, dy, dy.shape[1])
        sr = recipe.stochastic_rounding
        if recipe.grad_weight == recipe.grad_input and rot is None and not sr:
            qdy, qdyt = quantize_operand_with_transpose(dy, recipe.grad_input)
        else:
            qdy = quantize_operand(dy if rot is None else hadamard_rotate(dy, rot), recipe.grad_input, stochastic=sr)
        fast = recipe.fast_accum_grad and recipe.grad_input == "fp8_rowwise"
        dx = scaled_gemm(qdy, weight_of("grad_input", recipe.grad_input, rot), dy.dtype, fast_accum=fast)
    if recipe.grad_weight == "bf16":  # contraction over tokens
        dw = dy.t() @ x.to(dy.dtype)
    else:
        qxt = qxt if qxt is not None else quantize_operand(x.t(), recipe.grad_weight)
        qdyt = qdyt if qdyt is not None else quantize_operand(dy.t(), recipe.grad_weight)
        dw = scaled_gemm(qdyt, qxt, torch.float32)
    db = dy.sum(0).to(weight.dtype) if has_bias else None
    return dx, dw.to(weight.dtype), db


class _LowPrecisionLinearFn(torch.autograd.Function):
    """Eager path: the weight quantized once per forward (`LowPrecisionLinear.quantized_weight`) and reused by
    the backward, x^T quantized in the forward's fused pass."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                layer: LowPrecisionLinear) -> torch.Tensor:
        # the recipe is kept as of this forward: a monitor may switch the layer to BF16 before backward
        recipe, signs = layer.recipe, layer.hadamard_signs if layer.recipe.hadamard else None
        y, qxt = linear_forward(x, weight, bias, recipe, signs, layer.quantized_weight, fuse_transpose=True)
        ctx.layer, ctx.recipe, ctx.signs, ctx.has_bias, ctx.qxt = layer, recipe, signs, bias is not None, qxt
        ctx.save_for_backward(x if qxt is None else None, weight)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        dx, dw, db = linear_backward(dy, x, weight, ctx.qxt, ctx.recipe, ctx.signs, ctx.layer.quantized_weight,
                                     ctx.needs_input_grad[0], ctx.has_bias)
        ctx.qxt = None
        return dx, dw, db, None


@torch.library.custom_op("opengem::low_precision_linear", mutates_args=())
def _linear_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, signs: torch.Tensor | None,
    forward: str, grad_input: str, grad_weight: str, hadamard: bool, stochastic: bool, fast_accum: bool,
    fast_accum_grad: bool,
) -> torch.Tensor:
    recipe = LowPrecisionRecipe(forward, grad_input, grad_weight, hadamard, stochastic, fast_accum, fast_accum_grad)
    y, _ = linear_forward(x, weight, bias, recipe, signs, uncached_quantizer(weight), fuse_transpose=False)
    return y


@_linear_op.register_fake
def _(x, weight, bias, signs, forward, grad_input, grad_weight, hadamard, stochastic, fast_accum, fast_accum_grad):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("opengem::low_precision_linear_backward", mutates_args=())
def _linear_backward_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, signs: torch.Tensor | None, forward: str,
    grad_input: str, grad_weight: str, hadamard: bool, stochastic: bool, fast_accum: bool, fast_accum_grad: bool,
    needs_dx: bool, has_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dW, db); dx and db are empty where not needed (an op returns tensors, not None)."""
    recipe = LowPrecisionRecipe(forward, grad_input, grad_weight, hadamard, stochastic, fast_accum, fast_accum_grad)
    dx, dw, db = linear_backward(dy, x, weight, None, recipe, signs, uncached_quantizer(weight), needs_dx, has_bias)
    return (dy.new_empty(0) if dx is None else dx), dw, (weight.new_empty(0) if db is None else db)


@_linear_backward_op.register_fake
def _(dy, x, weight, signs, forward, grad_input, grad_weight, hadamard, stochastic, fast_accum, fast_accum_grad,
      needs_dx, has_bias):
    dx = dy.new_empty(x.shape) if needs_dx else dy.new_empty(0)
    return dx, weight.new_empty(weight.shape), weight.new_empty(weight.shape[0] if has_bias else 0)


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, weight, bias, signs, *fields = inputs
    ctx.save_for_backward(x, weight, signs)
    ctx.fields, ctx.has_bias = fields, bias is not None


def _backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    x, weight, signs = ctx.saved_tensors
    needs_dx = ctx.needs_input_grad[0]
    dx, dw, db = torch.ops.opengem.low_precision_linear_backward(
        dy, x, weight, signs, *ctx.fields, needs_dx, ctx.has_bias)
    return (dx if needs_dx else None), dw, (db if ctx.has_bias else None), *([None] * (1 + len(ctx.fields)))


_linear_op.register_autograd(_backward, setup_context=_setup_context)


def low_precision_linear(
    x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: LowPrecisionLinear
) -> torch.Tensor:
    """The FP8 / MX linear of ``layer`` for ``x2d [tokens, in_features]``: while compiling, the torch-op
    linear of `opengem.nn.low_precision_traced` for the recipes it runs and the custom op for the others; the
    cached autograd.Function otherwise (see the module docstring)."""
    if torch.compiler.is_compiling():
        r = layer.recipe
        if traceable(r):
            return rowwise_linear(x2d, weight, bias, r)
        signs = layer.hadamard_signs if r.hadamard else None
        return torch.ops.opengem.low_precision_linear(
            x2d, weight, bias, signs, r.forward, r.grad_input, r.grad_weight, r.hadamard, r.stochastic_rounding,
            r.fast_accum, r.fast_accum_grad)
    return _LowPrecisionLinearFn.apply(x2d, weight, bias, layer)
