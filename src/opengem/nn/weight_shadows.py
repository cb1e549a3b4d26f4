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
cast's own backward (bf16 -> fp32), so a training step is the same bit for bit: only where the cast runs moves. The
shadows are non-persistent buffers (not in ``state_dict``); refresh them after the parameters change and before they
are read (``opengem.train.trainer.Learner`` does at the start of each step).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

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


class ShadowedLinear(nn.Linear):
    """An ``nn.Linear`` with ``weight_shadow`` / ``bias_shadow`` buffers (made by :func:`shadow_linear_weights`)."""

    weight_shadow: torch.Tensor
    bias_shadow: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = compute_parameters(self)
        return F.linear(x, weight, bias)


def compute_parameters(linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight, bias)`` to compute with: a shadowed layer's shadows while :func:`shadows_in_use`, else its
    parameters (which autocast casts at the use)."""
    if not (_IN_USE and isinstance(linear, ShadowedLinear)):
        return linear.weight, linear.bias
    bias = None if linear.bias is None else _CastOnce.apply(linear.bias, linear.bias_shadow)
    return _CastOnce.apply(linear.weight, linear.weight_shadow), bias


def shadow_linear_weights(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> list[tuple[torch.Tensor, ...]]:
    """Makes every plain ``nn.Linear`` of ``model`` a :class:`ShadowedLinear` (in place: same parameters, same
    ``state_dict``) with ``dtype`` shadows; returns the ``(parameter, shadow)`` pairs for :func:`refresh_shadows`,
    already refreshed. Other Linear subclasses (the low-precision layers) keep their own weight handling."""
    pairs: list[tuple[torch.Tensor, ...]] = []
    for module in model.modules():
        if type(module) is not nn.Linear:
            continue
        module.__class__ = ShadowedLinear
        for name in ("weight", "bias"):
            parameter = getattr(module, name)
            shadow = None if parameter is None else torch.empty_like(parameter, dtype=dtype)
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
