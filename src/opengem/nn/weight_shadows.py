"""Linear layers that compute from bf16 copies of their weights made once a step, instead of a cast at each use.

Under bf16 autocast a plain ``nn.Linear`` casts its fp32 weight and bias to bf16 every time it runs. In a compiled GEM
block a cast can be a small kernel of its own: gem-large b512 launched 548 plain ``_to_copy`` kernels a step, most of
them the size of a weight (H200, session 30's ``benchmarks.diag.inductor_kernel_bytes``), and each kernel also costs a
few microseconds of gap on the GPU. Before Inductor (``benchmarks.diag.step_graph_ops``, CPU), gem-small's forward casts
parameters into GEMMs 230 times a step, and the shadows remove all of those; the backward's casts of the weight
gradients to fp32 stay. :func:`shadow_linear_weights` gives each plain Linear persistent bf16 *shadows* of its
parameters, :func:`refresh_shadows` fills them all in one multi-tensor copy, and while :func:`shadows_in_use` is
active a shadowed layer computes from them.

The shadow is the cast autocast would make (round to nearest even), and the weight's gradient comes back through the
cast's own backward (bf16 -> fp32), so an eager training step is the same bit for bit: only where the cast runs
moves. Compiled, each setting is its own graph whose fusions and GEMM kernels Inductor picks, so sums may run in
another order (on an H100, session 39: first losses 2e-6 apart relative). The
shadows are non-persistent buffers (not in ``state_dict``); refresh them after the parameters change and before they
are read (``opengem.train.trainer.Learner`` does at the start of each step).

With ``shadow_grads`` the shadows are autograd leaves the layers compute from directly: each weight's gradient stays
on its shadow in bf16, as the GEMM wrote it, and the fp32 parameter gets none; an optimizer that reads them and writes
the shadows as it updates (`opengem.train.shadow_adamw`) saves the gradient's cast and the next refresh.

With ``fp32_grads`` the shadowed layers' weight gradient comes from a GEMM that writes fp32 (``torch.mm(...,
out_dtype=torch.float32)`` on CUDA: bf16 operands, fp32 sums, as cuBLAS accumulates anyway) and the bias gradient from
an fp32 sum. That drops the bf16 rounding of both gradients and the cast kernel after each (one a weight and one a
bias a layer, each step), so training is no longer bit for bit autocast's: its gradients are the more exact ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from opengem.ops.checks import check_bools
from opengem.ops.fp32_gemm import fp32_product

SHADOW_DTYPES = (torch.bfloat16, torch.float16)  # the autocast dtypes the shadows stand in for
_IN_USE = False  # read inside compiled blocks: Dynamo guards on it (one graph for each value)


class _CastOnce(torch.autograd.Function):
    """``shadow`` (``master`` cast, made before) in the forward; the cast's backward for ``master``."""

    @staticmethod
    def forward(ctx: Any, master: torch.Tensor, shadow: torch.Tensor) -> torch.Tensor:
        ctx.master_dtype = master.dtype
        return shadow.view_as(shadow)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.master_dtype), None


class _LinearWithFp32Grads(torch.autograd.Function):
    """``F.linear`` on the shadows; the fp32 ``weight`` and ``bias`` get their gradients from an fp32-output GEMM and
    an fp32 sum. ``bias`` None: the output still adds ``bias_shadow``, without a bias gradient from here."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, weight_shadow: torch.Tensor, bias: torch.Tensor | None,
        bias_shadow: torch.Tensor | None,
    ) -> torch.Tensor:
        compute = x.to(weight_shadow.dtype)  # what autocast's cast of x gives
        ctx.save_for_backward(compute, weight_shadow)
        ctx.input_dtype = x.dtype
        return F.linear(compute, weight_shadow, bias_shadow)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        compute, weight_shadow = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_weight = grad_bias = None
        # autocast off: a compiled region traces this backward inside the forward's autocast, which would round the
        # fp32 product to bf16 (an eager backward runs outside it)
        with torch.autocast(grad.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                grad_x = (grad @ weight_shadow).to(ctx.input_dtype)  # autocast's: a bf16 GEMM, cast to x's dtype
            if ctx.needs_input_grad[1]:
                grad_weight = fp32_product(rows.t(), compute.reshape(-1, compute.shape[-1]))
            if ctx.needs_input_grad[3]:
                grad_bias = rows.sum(0, dtype=torch.float32)
        return grad_x, grad_weight, None, grad_bias, None


class ShadowedLinear(nn.Linear):
    """An ``nn.Linear`` with ``weight_shadow`` / ``bias_shadow`` buffers (made by :func:`shadow_linear_weights`);
    ``fp32_grads``: its gradients in fp32 from the GEMM (the module docstring)."""

    weight_shadow: torch.Tensor
    bias_shadow: torch.Tensor | None
    fp32_grads: bool
    shadow_grads: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_forward(self, x)


def linear_forward(linear: nn.Linear, x: torch.Tensor, bias_gradient: bool = True) -> torch.Tensor:
    """``linear(x)``: from a shadowed layer's shadows while :func:`shadows_in_use`, else from its parameters (which
    autocast casts at the use). Without ``bias_gradient`` the bias is added but gets no gradient from here."""
    shadowed = _IN_USE and isinstance(linear, ShadowedLinear)
    if shadowed and linear.shadow_grads:
        if linear.bias_shadow is not None and not bias_gradient:
            return F.linear(x, linear.weight_shadow, linear.bias_shadow.detach())
        return F.linear(x, linear.weight_shadow, linear.bias_shadow)
    bias = linear.bias if bias_gradient or linear.bias is None else linear.bias.detach()
    if not shadowed:
        return F.linear(x, linear.weight, bias)
    if linear.fp32_grads:
        return _LinearWithFp32Grads.apply(x, linear.weight, linear.weight_shadow, bias, linear.bias_shadow)
    if bias is not None:
        bias = _CastOnce.apply(bias, linear.bias_shadow) if bias.requires_grad else linear.bias_shadow
    return F.linear(x, _CastOnce.apply(linear.weight, linear.weight_shadow), bias)


def shadow_linear_weights(
    model: nn.Module, dtype: torch.dtype = torch.bfloat16, fp32_grads: bool = False, shadow_grads: bool = False
) -> list[tuple[torch.Tensor, ...]]:
    """Makes every plain ``nn.Linear`` of ``model`` a :class:`ShadowedLinear` (in place: same parameters, same
    ``state_dict``) with ``dtype`` shadows (and ``fp32_grads`` or ``shadow_grads``: the module docstring); returns
    the ``(parameter, shadow)`` pairs for :func:`refresh_shadows`, already refreshed. Other Linear subclasses (the
    low-precision layers) keep their own weight handling."""
    check_bools("shadow_linear_weights", fp32_grads=fp32_grads, shadow_grads=shadow_grads)
    if dtype not in SHADOW_DTYPES:  # int8 had truncated every weight, a str failed inside empty_like
        raise ValueError(f"shadow_linear_weights: dtype must be one of {SHADOW_DTYPES}, got {dtype!r}")
    if fp32_grads and shadow_grads:
        raise ValueError("fp32_grads gives the fp32 parameters their gradients, shadow_grads gives them to the bf16 "
                         "shadows: choose one")
    pairs: list[tuple[torch.Tensor, ...]] = []
    for module in model.modules():
        if type(module) is not nn.Linear:
            continue
        module.__class__ = ShadowedLinear
        module.fp32_grads = fp32_grads
        module.shadow_grads = shadow_grads
        for name in ("weight", "bias"):
            parameter = getattr(module, name)
            shadow = None if parameter is None else torch.empty_like(parameter, dtype=dtype)
            if shadow is not None and shadow_grads:
                shadow.requires_grad_(parameter.requires_grad)
            module.register_buffer(f"{name}_shadow", shadow, persistent=False)
            if parameter is not None:
                pairs.append((parameter, shadow))
    refresh_shadows(pairs)
    return pairs


@torch.no_grad()
def refresh_shadows(pairs: list[tuple[torch.Tensor, ...]]) -> None:
    """Casts every parameter into its shadow (one multi-tensor copy a device and dtype pair on CUDA)."""
    if pairs:
        torch._foreach_copy_([shadow for _, shadow in pairs], [parameter for parameter, _ in pairs])


@contextmanager
def shadows_in_use() -> Iterator[None]:
    """Shadowed layers compute from their shadows inside the block (refreshed by the caller)."""
    global _IN_USE
    previous, _IN_USE = _IN_USE, True
    try:
        yield
    finally:
        _IN_USE = previous
