"""Low-precision linear layers: `LowPrecisionLinear` (drop-in `nn.Linear`) and `convert_to_low_precision`.

A layer runs three GEMMs, each with its own recipe from `opengem.ops.fp8_gemm` (see `LowPrecisionRecipe`):
forward y = x W^T (contraction over in_features), input gradient dx = dy W (over out_features) and
weight gradient dW = dy^T x (over tokens; BF16 by default, the one most sensitive to rounding).
Weight quantizations are cached and reused until the weight changes (keyed on its ``_version``, which
every in-place optimizer update bumps), so weights are quantized once per optimizer step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from opengem.ops.fp8_gemm import (
    HADAMARD_SIZE,
    RECIPES,
    QuantizedOperand,
    hadamard_matrix,
    hadamard_rotate,
    quantize_operand,
    quantize_operand_with_transpose,
    scaled_gemm,
)


@dataclass(frozen=True)
class LowPrecisionRecipe:
    """Recipe per GEMM (each one of `opengem.ops.fp8_gemm.RECIPES`) plus options.

    ``hadamard``: rotate both operands of the forward and input-gradient GEMMs by a random block
    Hadamard (size 128) along the contraction dim (skipped where that dim is not a multiple of 128).
    ``stochastic_rounding``: quantize the output gradient dy with stochastic rounding (fp8_rowwise).
    ``fast_accum``: cuBLAS fast accumulation for the forward GEMM (rowwise recipe on CUDA).
    """

    forward: str = "fp8_rowwise"
    grad_input: str = "fp8_rowwise"
    grad_weight: str = "bf16"
    hadamard: bool = False
    stochastic_rounding: bool = False
    fast_accum: bool = True

    def __post_init__(self) -> None:
        for field in ("forward", "grad_input", "grad_weight"):
            if getattr(self, field) not in RECIPES:
                raise ValueError(f"LowPrecisionRecipe.{field} must be one of {RECIPES}, got {getattr(self, field)!r}")

    @property
    def is_bf16(self) -> bool:
        return self.forward == self.grad_input == self.grad_weight == "bf16"


NAMED_RECIPES: dict[str, LowPrecisionRecipe] = {
    "bf16": LowPrecisionRecipe("bf16", "bf16", "bf16"),
    "fp8_rowwise": LowPrecisionRecipe("fp8_rowwise", "fp8_rowwise", "bf16"),
    "fp8_rowwise_all": LowPrecisionRecipe("fp8_rowwise", "fp8_rowwise", "fp8_rowwise"),
    "fp8_blockwise": LowPrecisionRecipe("fp8_blockwise", "fp8_blockwise", "bf16"),
    "fp8_blockwise_all": LowPrecisionRecipe("fp8_blockwise", "fp8_blockwise", "fp8_blockwise"),
    "mxfp8": LowPrecisionRecipe("mxfp8", "mxfp8", "bf16"),
}
BF16 = NAMED_RECIPES["bf16"]


def resolve_recipe(recipe: str | LowPrecisionRecipe) -> LowPrecisionRecipe:
    if isinstance(recipe, LowPrecisionRecipe):
        return recipe
    if recipe not in NAMED_RECIPES:
        raise ValueError(f"recipe must be a LowPrecisionRecipe or one of {sorted(NAMED_RECIPES)}, got {recipe!r}")
    return NAMED_RECIPES[recipe]


class _LowPrecisionLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                layer: LowPrecisionLinear) -> torch.Tensor:
        recipe = layer.recipe
        fused_wgrad = recipe.grad_weight != "bf16" and recipe.grad_weight == recipe.forward
        if recipe.forward == "bf16":
            y = F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
            qxt = None
        else:
            rot = layer.rotation(x, x.shape[1])
            if fused_wgrad and rot is None:  # one fused pass quantizes x for forward and x^T for wgrad
                qx, qxt = quantize_operand_with_transpose(x, recipe.forward)
            else:
                qx = quantize_operand(x if rot is None else hadamard_rotate(x, rot), recipe.forward)
                qxt = None
            fast = recipe.fast_accum and recipe.forward == "fp8_rowwise"
            qw = layer.quantized_weight("forward", recipe.forward, rot)
            y = scaled_gemm(qx, qw, x.dtype, fast_accum=fast, bias=bias)
        # the recipe is kept as of this forward: a monitor may switch the layer to BF16 before backward
        ctx.layer, ctx.recipe, ctx.has_bias = layer, recipe, bias is not None
        ctx.qxt = qxt
        ctx.save_for_backward(x if qxt is None else None, weight)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        layer, recipe = ctx.layer, ctx.recipe
        dy = dy.contiguous()
        qdyt, dx = None, None
        # input gradient: dx = dy W, contraction over out_features (skipped when x needs no gradient)
        if recipe.grad_input == "bf16" and ctx.needs_input_grad[0]:
            dx = dy @ weight.to(dy.dtype)
        elif recipe.grad_input != "bf16" and ctx.needs_input_grad[0]:
            rot = layer.rotation(dy, dy.shape[1])
            sr = recipe.stochastic_rounding
            if recipe.grad_weight == recipe.grad_input and rot is None and not sr:
                qdy, qdyt = quantize_operand_with_transpose(dy, recipe.grad_input)
            else:
                dy_in = dy if rot is None else hadamard_rotate(dy, rot)
                qdy = quantize_operand(dy_in, recipe.grad_input, stochastic=sr)
            dx = scaled_gemm(qdy, layer.quantized_weight("grad_input", recipe.grad_input, rot), dy.dtype)
        # weight gradient: dW = dy^T x, contraction over tokens
        if recipe.grad_weight == "bf16":
            dw = dy.t() @ x.to(dy.dtype)
        else:
            qxt = ctx.qxt if ctx.qxt is not None else quantize_operand(x.t(), recipe.grad_weight)
            qdyt = qdyt if qdyt is not None else quantize_operand(dy.t(), recipe.grad_weight)
            dw = scaled_gemm(qdyt, qxt, torch.float32)
        db = dy.sum(0).to(weight.dtype) if ctx.has_bias else None
        ctx.qxt = None
        return dx, dw.to(weight.dtype), db, None


def _hadamard_signs(seed: int) -> torch.Tensor:
    return (torch.randint(0, 2, (HADAMARD_SIZE,), generator=torch.Generator().manual_seed(seed)) * 2 - 1).to(torch.int8)


# Whether torch.compile traces the FP8 / MX linears (and the fused FP8 MLP) into its graphs. Off: they run
# eagerly, as graph breaks. Traced by torch 2.11's Dynamo, an FP8 linear's input gradient came back all
# zero on an H200 (session 11, `tests/gpu/test_low_precision_gpu.py::test_fp8_linears_under_torch_compile`)
# where eager is right; the likeliest cause (a quantizer given one tensor as two written kernel pointers)
# is fixed since. `benchmarks.diag.fp8_compile` checks both settings on the GPU; off until it passes traced.
TRACE_UNDER_COMPILE = False


@torch.compiler.disable
def _eager_low_precision_linear(
    x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: LowPrecisionLinear
) -> torch.Tensor:
    return _LowPrecisionLinearFn.apply(x2d, weight, bias, layer)


def low_precision_linear(
    x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer: LowPrecisionLinear
) -> torch.Tensor:
    """The FP8 / MX linear of ``layer``; a graph break under torch.compile unless `TRACE_UNDER_COMPILE`."""
    if TRACE_UNDER_COMPILE:
        return _LowPrecisionLinearFn.apply(x2d, weight, bias, layer)
    return _eager_low_precision_linear(x2d, weight, bias, layer)


class LowPrecisionLinear(nn.Linear):
    """`nn.Linear` whose GEMMs run in the precisions of ``recipe`` (a name of `NAMED_RECIPES` or a
    `LowPrecisionRecipe`). ``x [..., in_features]`` -> ``[..., out_features]`` in x's dtype.

    ``seed`` fixes the random signs of the optional Hadamard rotation.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 recipe: str | LowPrecisionRecipe = "fp8_rowwise", seed: int = 0,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = resolve_recipe(recipe)
        signs = _hadamard_signs(seed)
        self.register_buffer("hadamard_signs", signs if str(device) == "meta" else signs.to(device), persistent=False)
        self._weight_cache: dict[str, tuple[tuple, QuantizedOperand]] = {}

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: str | LowPrecisionRecipe, seed: int = 0) -> LowPrecisionLinear:
        """A layer sharing ``linear``'s parameters (same Parameter objects, so optimizers keep working)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, recipe, seed, device="meta")
        layer.weight = linear.weight
        layer.bias = linear.bias
        layer.hadamard_signs = _hadamard_signs(seed).to(linear.weight.device)
        return layer

    def rotation(self, like: torch.Tensor, contraction: int) -> torch.Tensor | None:
        """The Hadamard rotation [128, 128] in ``like``'s dtype, or None when off or K % 128 != 0."""
        if not self.recipe.hadamard or contraction % HADAMARD_SIZE:
            return None
        return hadamard_matrix(self.hadamard_signs.to(like.device)).to(like.dtype)

    def quantized_weight(self, role: str, recipe: str, rotation: torch.Tensor | None) -> QuantizedOperand:
        """W (forward, [out, in]) or W^T (grad_input, [in, out]) quantized along its last dim, cached
        until the weight's version, storage or the recipe changes. Not cached in a traced graph
        (`TRACE_UNDER_COMPILE`): dynamo rejects the mutation inside the autograd.Function (torch 2.11); the
        quantization is then part of the graph, run every step."""
        w = self.weight
        if torch.compiler.is_compiling():
            with torch.no_grad():
                return self._quantize_weight(role, recipe, rotation)
        key = (w._version, w.data_ptr(), w.device, recipe, rotation is not None)
        hit = self._weight_cache.get(role)
        if hit is not None and hit[0] == key:
            return hit[1]
        with torch.no_grad():
            other = self._weight_cache.get("forward" if role == "grad_input" else "grad_input")
            if recipe == "fp8_blockwise" and rotation is None and other is not None and other[0] == key:
                q = other[1].transpose()  # 128x128 blocks serve both directions
            else:
                q = self._quantize_weight(role, recipe, rotation)
        self._weight_cache[role] = (key, q)
        return q

    def _quantize_weight(self, role: str, recipe: str, rotation: torch.Tensor | None) -> QuantizedOperand:
        mat = self.weight if role == "forward" else self.weight.t()
        mat = mat if rotation is None else hadamard_rotate(mat.to(rotation.dtype), rotation)
        return quantize_operand(mat, recipe, weight=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recipe.is_bf16:
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self.weight.to(x.dtype), bias)
        x2d = x.reshape(-1, self.in_features)
        y = low_precision_linear(x2d, self.weight, self.bias, self)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"


HEAD_NAME = re.compile(r"(^|[._])(head|heads|lm_head|classifier|output|logits)([._]|$|\d)")


def default_filter(model: nn.Module, min_features: int = 512) -> Callable[[str, nn.Linear], bool]:
    """Convert a Linear unless it is a head (name matches head/classifier/output/logits), the model's last
    Linear, smaller than ``min_features`` in either dim (its GEMM is too small to gain from FP8), or not
    a multiple of 16 in either dim (cuBLAS FP8 alignment)."""
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    last = linears[-1] if linears else None

    def keep_low_precision(name: str, linear: nn.Linear) -> bool:
        if name == last or HEAD_NAME.search(name):
            return False
        dims = (linear.in_features, linear.out_features)
        return min(dims) >= min_features and all(d % 16 == 0 for d in dims)

    return keep_low_precision


def convert_to_low_precision(
    model: nn.Module,
    recipe: str | LowPrecisionRecipe = "fp8_rowwise",
    filter: Callable[[str, nn.Linear], bool] | None = None,
    **recipe_overrides: Any,
) -> list[str]:
    """Replace, in place, every ``nn.Linear`` of ``model`` that ``filter(name, linear)`` accepts (default:
    `default_filter`) by a `LowPrecisionLinear` sharing its parameters. ``recipe_overrides`` (e.g.
    ``hadamard=True``) replace fields of the recipe. Returns the converted module names.

    For ``precision="auto"`` convert with any FP8 recipe, then call `opengem.nn.numerics.select_precision`.
    """
    resolved = replace(resolve_recipe(recipe), **recipe_overrides) if recipe_overrides else resolve_recipe(recipe)
    keep = filter or default_filter(model)
    targets = [
        (name, m) for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and not isinstance(m, LowPrecisionLinear) and keep(name, m)
    ]
    for i, (name, linear) in enumerate(targets):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LowPrecisionLinear.from_linear(linear, resolved, seed=i))
    return [name for name, _ in targets]
