"""Low-precision linear layers: `LowPrecisionLinear` (drop-in `nn.Linear`) and `convert_to_low_precision`.

A layer runs three GEMMs, each with its own recipe from `opengem.ops.fp8_gemm` (see `LowPrecisionRecipe`):
forward y = x W^T (contraction over in_features), input gradient dx = dy W (over out_features) and
weight gradient dW = dy^T x (over tokens; BF16 by default, the one most sensitive to rounding).
Each forward quantizes the weight once and its backward reuses that quantization (`new_forward`): a cache
kept across steps cannot tell a fused optimizer's update (torch's fused AdamW leaves ``_version`` alone).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from opengem.nn.low_precision_autograd import hadamard_rotation, low_precision_linear, quantize_weight
from opengem.nn.low_precision_recipe import BF16, NAMED_RECIPES, LowPrecisionRecipe, resolve_recipe
from opengem.ops.autocast import cast_inputs
from opengem.ops.checks import check_bools
from opengem.ops.fp8_gemm import HADAMARD_SIZE, QuantizedOperand
from opengem.validation import is_int

__all__ = ["BF16", "NAMED_RECIPES", "LowPrecisionLinear", "LowPrecisionRecipe", "convert_to_low_precision",
           "default_filter", "resolve_recipe"]


def _hadamard_signs(seed: int) -> torch.Tensor:
    return (torch.randint(0, 2, (HADAMARD_SIZE,), generator=torch.Generator().manual_seed(seed)) * 2 - 1).to(torch.int8)


class LowPrecisionLinear(nn.Linear):
    """`nn.Linear` whose GEMMs run in the precisions of ``recipe`` (a name of `NAMED_RECIPES` or a
    `LowPrecisionRecipe`). ``x [..., in_features]`` -> ``[..., out_features]`` in x's dtype.

    ``seed`` fixes the random signs of the optional Hadamard rotation.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 recipe: str | LowPrecisionRecipe = "fp8_rowwise", seed: int = 0,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        if not is_int(seed):  # 1.5 had failed in manual_seed ("expected a long") without naming the seed
            raise ValueError(f"LowPrecisionLinear: seed must be an int, got {seed!r}")
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
        return hadamard_rotation(self.hadamard_signs if self.recipe.hadamard else None, like, contraction)

    def quantized_weight(self, role: str, recipe: str, rotation: torch.Tensor | None) -> QuantizedOperand:
        """W (forward, [out, in]) or W^T (grad_input, [in, out]) quantized along its last dim, cached from
        one forward to its backward (`forward` empties the cache) unless the weight's version, storage or
        the recipe changes in between (eager only: under torch.compile the custom op quantizes the weight
        itself, `opengem.nn.low_precision_autograd`)."""
        w = self.weight
        key = (w._version, w.data_ptr(), w.device, recipe, rotation is not None)
        hit = self._weight_cache.get(role)
        if hit is not None and hit[0] == key:
            return hit[1]
        with torch.no_grad():
            other = self._weight_cache.get("forward" if role == "grad_input" else "grad_input")
            if recipe == "fp8_blockwise" and rotation is None and other is not None and other[0] == key:
                q = other[1].transpose()  # 128x128 blocks serve both directions
            else:
                q = quantize_weight(w, role, recipe, rotation)
        self._weight_cache[role] = (key, q)
        return q

    def new_forward(self) -> None:
        """Forget the weight quantizations of the previous forward (eager; compiled ops hold no cache): torch's
        fused AdamW updates the weight without bumping its version counter, so a cache kept across steps
        served the first step's weights (session 13)."""
        if not torch.compiler.is_compiling():
            self._weight_cache.clear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1:] != (self.in_features,) or not x.is_floating_point():  # was a reshape error, or int output
            raise ValueError(f"input must be floating point [..., {self.in_features}], got {x.dtype} {tuple(x.shape)}")
        if self.recipe.is_bf16:
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self.weight.to(x.dtype), bias)
        self.new_forward()
        # as nn.Linear: under autocast the input in the autocast dtype, so the layer returns that dtype and its
        # backward (outside autocast) runs the BF16 weight gradients in BF16; given a LayerNorm's fp32 output it
        # had run the whole layer, weight-gradient GEMMs included, in fp32 (GEM's FM MLPs, found in session 14)
        (x,), region = cast_inputs(x)
        with region:
            y = low_precision_linear(x.reshape(-1, self.in_features), self.weight, self.bias, self)
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
    fuse_mlps: bool = True,
    **recipe_overrides: Any,
) -> list[str]:
    """Replace, in place, every ``nn.Linear`` of ``model`` that ``filter(name, linear)`` accepts (default:
    `default_filter`) by a `LowPrecisionLinear` sharing its parameters. ``recipe_overrides`` (e.g.
    ``hadamard=True``) replace fields of the recipe. With ``fuse_mlps``, converted ``Sequential(Linear, GELU,
    Linear)`` blocks of a fused recipe then become `LowPrecisionMLP` (`fuse_low_precision_mlps`: the GELU
    fused into the quantizations; same state-dict keys and layer names). Returns the converted module names.

    For ``precision="auto"`` convert with any FP8 recipe, then call `opengem.nn.numerics.select_precision`.
    """
    check_bools("convert_to_low_precision", fuse_mlps=fuse_mlps)
    if filter is not None and not callable(filter):  # had failed at the first Linear as "object is not callable"
        raise ValueError(f"convert_to_low_precision: filter must be None or a callable (name, linear) -> bool, "
                         f"got {type(filter).__name__}")
    unknown = sorted(set(recipe_overrides) - {f.name for f in fields(LowPrecisionRecipe)})
    if unknown:  # a TypeError from the dataclass's __init__ had named no function of ours
        raise ValueError(f"convert_to_low_precision: unknown recipe fields {unknown}; the fields are "
                         f"{[f.name for f in fields(LowPrecisionRecipe)]}")
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
    if fuse_mlps:
        from opengem.nn.low_precision_mlp import fuse_low_precision_mlps  # it builds on this module

        fuse_low_precision_mlps(model)
    return [name for name, _ in targets]
