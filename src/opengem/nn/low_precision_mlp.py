"""`LowPrecisionMLP`: fc2(gelu(fc1(x))) in FP8 with the GELU fused into the quantizations around it, and
`fuse_low_precision_mlps`, which puts it in place of converted ``Sequential(Linear, GELU, Linear)`` blocks.

Forward: fc1 (FP8 rowwise), then one kernel computes gelu(u), its row amax and its FP8 quantization for
fc2 (and writes gelu(u) in BF16 for fc2's weight gradient). Backward: fc2's input gradient in FP8, then
one kernel computes the GELU backward and quantizes it for fc1's input gradient. Weight gradients run in
BF16 (the recipe default); each forward quantizes the weights once for itself and its backward, as in
`LowPrecisionLinear`. With ``fuse_bias_grads`` the two bias gradients come from the backward's quantizing
kernels (column sums of dy and of the GELU backward) instead of two reductions over those tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from opengem.nn.low_precision import LowPrecisionLinear, LowPrecisionRecipe, resolve_recipe
from opengem.nn.low_precision_autograd import WeightQuantizer, uncached_quantizer
from opengem.nn.low_precision_traced import rowwise_linear, traceable
from opengem.ops.autocast import cast_inputs
from opengem.ops.fp8_gemm import (
    quantize_gelu,
    quantize_gelu_with_column_sums,
    quantize_operand,
    quantize_operand_with_column_sums,
    scaled_gemm,
)

FUSED_RECIPE = "fp8_rowwise"


def _mlp_forward(
    x: torch.Tensor, b1: torch.Tensor | None, b2: torch.Tensor | None, fc1_weight: WeightQuantizer,
    fc2_weight: WeightQuantizer, fast_accum: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, u = fc1(x), h = gelu(u)); u and h are kept for the backward."""
    u = scaled_gemm(quantize_operand(x, FUSED_RECIPE), fc1_weight("forward", FUSED_RECIPE, None), x.dtype,
                    fast_accum=fast_accum, bias=b1)
    h, qh = quantize_gelu(u)
    y = scaled_gemm(qh, fc2_weight("forward", FUSED_RECIPE, None), x.dtype, fast_accum=fast_accum, bias=b2)
    return y, u, h


def _mlp_backward(
    dy: torch.Tensor, x: torch.Tensor, u: torch.Tensor, h: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
    fc1_weight: WeightQuantizer, fc2_weight: WeightQuantizer, fast_accum_grad: bool, fuse_bias_grads: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dW1, db1, dW2, db2), the weight and bias gradients in the weights' dtypes; ``fuse_bias_grads``
    takes db2 and db1 from the quantizations of dy and of the GELU backward (fp32 column sums)."""
    dy = dy.contiguous()
    if fuse_bias_grads:
        qdy, db2 = quantize_operand_with_column_sums(dy)
    else:
        qdy, db2 = quantize_operand(dy, FUSED_RECIPE), None
    dh = scaled_gemm(qdy, fc2_weight("grad_input", FUSED_RECIPE, None), dy.dtype, fast_accum=fast_accum_grad)
    if fuse_bias_grads:
        du, qdu, db1 = quantize_gelu_with_column_sums(u, grad_out=dh)
    else:
        (du, qdu), db1 = quantize_gelu(u, grad_out=dh), None
    dx = scaled_gemm(qdu, fc1_weight("grad_input", FUSED_RECIPE, None), dy.dtype, fast_accum=fast_accum_grad)
    dw1, dw2 = (du.t() @ x).to(w1.dtype), (dy.t() @ h).to(w2.dtype)
    db1 = du.sum(0) if db1 is None else db1
    db2 = dy.sum(0) if db2 is None else db2
    return dx, dw1, db1.to(w1.dtype), dw2, db2.to(w2.dtype)


class _FusedMLPFn(torch.autograd.Function):
    """Eager path: the weights quantized once in the forward, reused by its backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor,
                b2: torch.Tensor | None, mlp: LowPrecisionMLP) -> torch.Tensor:
        fc1, fc2 = mlp.fc1, mlp.fc2
        y, u, h = _mlp_forward(x, b1, b2, fc1.quantized_weight, fc2.quantized_weight, fc1.recipe.fast_accum)
        ctx.mlp, ctx.biases = mlp, (b1 is not None, b2 is not None)
        ctx.save_for_backward(x, u, h, w1, w2)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, u, h, w1, w2 = ctx.saved_tensors
        mlp = ctx.mlp
        dx, dw1, db1, dw2, db2 = _mlp_backward(dy, x, u, h, w1, w2, mlp.fc1.quantized_weight, mlp.fc2.quantized_weight,
                                               mlp.fc1.recipe.fast_accum_grad, mlp.fuse_bias_grads)
        return dx, dw1, db1 if ctx.biases[0] else None, dw2, db2 if ctx.biases[1] else None, None


# Under torch.compile: custom ops (opaque to Dynamo, backward registered), as `low_precision_autograd` explains.
@torch.library.custom_op("opengem::fp8_mlp", mutates_args=())
def _mlp_op(
    x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None,
    fast_accum: bool, fast_accum_grad: bool, fuse_bias_grads: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _mlp_forward(x, b1, b2, uncached_quantizer(w1), uncached_quantizer(w2), fast_accum)


@_mlp_op.register_fake
def _(x, w1, b1, w2, b2, fast_accum, fast_accum_grad, fuse_bias_grads):
    hidden = x.new_empty((x.shape[0], w1.shape[0]))
    return x.new_empty((x.shape[0], w2.shape[0])), hidden, torch.empty_like(hidden)


@torch.library.custom_op("opengem::fp8_mlp_backward", mutates_args=())
def _mlp_backward_op(
    dy: torch.Tensor, x: torch.Tensor, u: torch.Tensor, h: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
    fast_accum_grad: bool, fuse_bias_grads: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _mlp_backward(dy, x, u, h, w1, w2, uncached_quantizer(w1), uncached_quantizer(w2), fast_accum_grad,
                         fuse_bias_grads)


@_mlp_backward_op.register_fake
def _(dy, x, u, h, w1, w2, fast_accum_grad, fuse_bias_grads):
    return (dy.new_empty(x.shape), w1.new_empty(w1.shape), w1.new_empty(w1.shape[0]), w2.new_empty(w2.shape),
            w2.new_empty(w2.shape[0]))


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, w1, b1, w2, b2, _, fast_accum_grad, fuse_bias_grads = inputs
    _, u, h = output
    ctx.mark_non_differentiable(u, h)
    ctx.save_for_backward(x, u, h, w1, w2)
    ctx.biases, ctx.fast_accum_grad, ctx.fuse_bias_grads = (b1 is not None, b2 is not None), fast_accum_grad, fuse_bias_grads


def _backward(ctx: Any, dy: torch.Tensor, du: torch.Tensor | None, dh: torch.Tensor | None) -> tuple:
    x, u, h, w1, w2 = ctx.saved_tensors
    dx, dw1, db1, dw2, db2 = torch.ops.opengem.fp8_mlp_backward(dy, x, u, h, w1, w2, ctx.fast_accum_grad,
                                                                ctx.fuse_bias_grads)
    return dx, dw1, db1 if ctx.biases[0] else None, dw2, db2 if ctx.biases[1] else None, None, None, None


_mlp_op.register_autograd(_backward, setup_context=_setup_context)


def _fused_mlp(
    x2d: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, w2: torch.Tensor, b2: torch.Tensor | None,
    mlp: LowPrecisionMLP,
) -> torch.Tensor:
    if torch.compiler.is_compiling():
        recipe = mlp.fc1.recipe
        if traceable(recipe):  # Inductor fuses the GELU into fc2's input quantization (and back)
            return rowwise_linear(F.gelu(rowwise_linear(x2d, w1, b1, recipe)), w2, b2, recipe)
        return torch.ops.opengem.fp8_mlp(x2d, w1, b1, w2, b2, recipe.fast_accum, recipe.fast_accum_grad,
                                         mlp.fuse_bias_grads)[0]
    return _FusedMLPFn.apply(x2d, w1, b1, w2, b2, mlp)


def fused_recipe(recipe: LowPrecisionRecipe) -> bool:
    """Whether the fused kernels run ``recipe``: fp8_rowwise forward and input-gradient GEMMs, BF16 weight
    gradients, no rotation or stochastic rounding (``fp8_rowwise`` and ``fp8_rowwise_fast``)."""
    return (recipe.forward, recipe.grad_input, recipe.grad_weight, recipe.hadamard, recipe.stochastic_rounding) == (
        FUSED_RECIPE, FUSED_RECIPE, "bf16", False, False)


class LowPrecisionMLP(nn.Sequential):
    """``fc2(gelu(fc1(x)))`` (exact erf GELU, like ``nn.GELU()``) for ``x [..., fc1.in_features]``.

    Built from two ``nn.Linear`` (parameters shared, not copied) or two `LowPrecisionLinear` of the recipe. A
    ``Sequential`` of ``(fc1, GELU, fc2)``, so its state-dict keys are those of the ``nn.Sequential(Linear,
    GELU, Linear)`` it replaces (`fuse_low_precision_mlps`). ``recipe`` must run forward and input gradients
    in fp8_rowwise with BF16 weight gradients (the fused kernels' recipe: ``fp8_rowwise`` or
    ``fp8_rowwise_fast``, whose input-gradient GEMMs accumulate fast too); the fused path runs on CUDA and an
    exact emulation of it elsewhere. The layers run one by one instead (the same FP8 layers, the GELU
    between them unfused) while a forward hook watches either linear (`NumericsMonitor`, `select_precision`)
    or once their recipes differ from a fused one (a BF16 fallback, the auto selection).

    ``fuse_bias_grads`` (default): the bias gradients come out of the backward's quantizing kernels as fp32
    column sums (of dy and of the GELU backward, as stored) instead of two reductions over those tensors (the
    block of `benchmarks.low_precision`, H200: 0.10 ms less kernel time of 4.15, session 15).
    """

    def __init__(self, fc1: nn.Linear, fc2: nn.Linear, recipe: str | LowPrecisionRecipe = FUSED_RECIPE,
                 activation: nn.GELU | None = None, fuse_bias_grads: bool = True) -> None:
        resolved = resolve_recipe(recipe)
        if not fused_recipe(resolved):
            raise ValueError(f"LowPrecisionMLP runs fp8_rowwise forward/input-gradient GEMMs with BF16 weight "
                             f"gradients and no rotation or stochastic rounding, got {resolved}")
        if fc1.out_features != fc2.in_features:
            raise ValueError(f"fc1.out_features ({fc1.out_features}) != fc2.in_features ({fc2.in_features})")
        activation = nn.GELU() if activation is None else activation
        if not isinstance(activation, nn.GELU) or activation.approximate != "none":
            raise ValueError(f"the fused kernels compute the exact erf GELU, got {activation}")
        super().__init__(_as_low_precision(fc1, resolved, seed=0), activation, _as_low_precision(fc2, resolved, seed=1))
        self.fuse_bias_grads = fuse_bias_grads

    @property
    def fc1(self) -> LowPrecisionLinear:
        return self[0]

    @property
    def fc2(self) -> LowPrecisionLinear:
        return self[2]

    def runs_fused(self) -> bool:
        """Both layers still on one fused recipe and no forward hook on either (hooks must see each layer)."""
        fc1, fc2 = self.fc1, self.fc2
        watched = fc1._forward_hooks or fc2._forward_hooks or fc1._forward_pre_hooks or fc2._forward_pre_hooks
        return not watched and _share_fused_recipe(fc1, fc2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.runs_fused():
            return super().forward(x)
        self.fc1.new_forward()
        self.fc2.new_forward()
        (x,), region = cast_inputs(x)  # the autocast dtype, as LowPrecisionLinear takes it
        with region:
            y = _fused_mlp(x.reshape(-1, self.fc1.in_features), self.fc1.weight, self.fc1.bias, self.fc2.weight,
                           self.fc2.bias, self)
        return y.reshape(*x.shape[:-1], self.fc2.out_features)


def _share_fused_recipe(fc1: nn.Module, fc2: nn.Module) -> bool:
    return (isinstance(fc1, LowPrecisionLinear) and isinstance(fc2, LowPrecisionLinear) and fc1.recipe == fc2.recipe
            and fused_recipe(fc1.recipe))


def _as_low_precision(linear: nn.Linear, recipe: LowPrecisionRecipe, seed: int) -> LowPrecisionLinear:
    if isinstance(linear, LowPrecisionLinear) and linear.recipe == recipe:
        return linear
    return LowPrecisionLinear.from_linear(linear, recipe, seed=seed)


def fuse_low_precision_mlps(model: nn.Module) -> list[str]:
    """Replace, in place, every ``nn.Sequential`` of exactly (`LowPrecisionLinear`, exact ``nn.GELU``,
    `LowPrecisionLinear`) whose two layers share a fused recipe (`fused_recipe`) by a `LowPrecisionMLP` of
    the same layers: the GELU and its backward fused into the quantizations around them, one pass over the
    hidden activation less each way. State-dict keys and layer names stay. ``model`` itself is left as it is
    (it cannot be replaced in place: wrap it in `LowPrecisionMLP` instead). Returns the fused modules' names."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, LowPrecisionMLP) or not isinstance(module, nn.Sequential) or len(module) != 3:
            continue
        fc1, act, fc2 = module
        if (name and _share_fused_recipe(fc1, fc2) and isinstance(act, nn.GELU) and act.approximate == "none"
                and fc1.out_features == fc2.in_features):
            found.append((name, module))
    for name, module in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LowPrecisionMLP(module[0], module[2], module[0].recipe, activation=module[1]))
    return [name for name, _ in found]
