"""``linear(layer_norm(x))`` as one op: the normalized rows stay on chip (``opengem.ops.triton.norm_linear``).

A pre-norm block reads its residual stream ``x`` twice: through the norm into a projection, and as the residual
itself. With ``pass_through=True`` the op also returns ``x`` (a view), and the block should use that view for the
residual: its gradient then arrives in this op's backward, whose kernel adds it to the norm's input gradient in
its epilogue instead of autograd adding the two ``[M, K]`` gradients in a pass of their own.

CUDA tensors with rows of up to 512 run the Triton kernels; anything else runs the reference
(``opengem.ops.reference.norm_linear``, the same arithmetic unfused). ``OPENGEM_NORM_LINEAR_BACKEND=triton`` or
``reference`` forces one (the CPU tests run the kernels in Triton's interpreter).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from torch.utils.flop_counter import register_flop_formula

from opengem.ops.autocast import autocast_dtype
from opengem.ops.reference import norm_linear as reference


def _use_triton(x: torch.Tensor) -> bool:
    backend = os.environ.get("OPENGEM_NORM_LINEAR_BACKEND")
    if backend in ("triton", "reference"):
        return backend == "triton"
    from opengem.ops.triton.norm_linear import MAX_ROW  # noqa: PLC0415 (CPU-only installs need no Triton)

    return x.is_cuda and x.shape[1] <= MAX_ROW


def _kernels(x: torch.Tensor) -> Any:
    if _use_triton(x):
        from opengem.ops.triton import norm_linear as triton_norm_linear  # noqa: PLC0415

        return triton_norm_linear
    return reference


@torch.library.custom_op("opengem::norm_linear_fwd", mutates_args=())
def _forward_op(
    x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _kernels(x).norm_linear_forward(x, gamma, beta, weight, bias, eps)


@_forward_op.register_fake
def _(x, gamma, beta, weight, bias, eps):
    rows = x.new_empty(x.shape[0], dtype=torch.float32)
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=weight.dtype), rows, torch.empty_like(rows)


@torch.library.custom_op("opengem::norm_linear_bwd", mutates_args=())
def _backward_op(
    dy: torch.Tensor, weight: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
    gamma: torch.Tensor, beta: torch.Tensor, d_pass: torch.Tensor | None, bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, normed, d_gamma, d_beta, d_bias = _kernels(x).norm_linear_backward(
        dy, weight, x, mean, rstd, gamma, beta, d_pass, bias_grad)
    return dx, normed, d_gamma, d_beta, d_bias if d_bias is not None else dy.new_empty(0, dtype=torch.float32)


@_backward_op.register_fake
def _(dy, weight, x, mean, rstd, gamma, beta, d_pass, bias_grad):
    columns = x.new_empty(x.shape[1], dtype=torch.float32)
    d_bias = dy.new_empty(weight.shape[0] if bias_grad else 0, dtype=torch.float32)
    return torch.empty_like(x), x.new_empty(x.shape, dtype=weight.dtype), columns, torch.empty_like(columns), d_bias


@register_flop_formula(torch.ops.opengem.norm_linear_fwd, get_raw=True)
def _forward_flops(x, gamma, beta, weight, bias, eps, *, out_val=None) -> int:
    """The GEMM's 2 M N K (GEM_SPEC section 8: the norm counts zero)."""
    return 2 * x.shape[0] * x.shape[1] * weight.shape[0]


@register_flop_formula(torch.ops.opengem.norm_linear_bwd, get_raw=True)
def _backward_flops(dy, weight, x, mean, rstd, gamma, beta, d_pass, bias_grad, *, out_val=None) -> int:
    """The input gradient's GEMM here (2 M N K); the weight gradient's is an ``mm`` the counter sees itself."""
    return 2 * x.shape[0] * x.shape[1] * weight.shape[0]


class _NormLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        y, mean, rstd = _forward_op(x, gamma, beta, weight, bias, eps)
        ctx.save_for_backward(x, gamma, beta, weight, mean, rstd)
        ctx.set_materialize_grads(False)  # an unused pass-through gets None, not a zero [M, K] tensor
        return x.view_as(x), y

    @staticmethod
    def backward(ctx: Any, d_pass: torch.Tensor | None, dy: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        x, gamma, beta, weight, mean, rstd = ctx.saved_tensors
        if dy is None:
            return d_pass, None, None, None, None, None
        bias_grad = ctx.needs_input_grad[4]
        dy = dy.to(weight.dtype).contiguous()
        dx, normed, d_gamma, d_beta, d_bias = _backward_op(dy, weight, x, mean, rstd, gamma, beta, d_pass, bias_grad)
        d_weight = dy.t().mm(normed) if ctx.needs_input_grad[3] else None
        return (dx, d_gamma.to(gamma.dtype), d_beta.to(beta.dtype), d_weight,
                d_bias.to(weight.dtype) if bias_grad else None, None)  # fmt: skip


def _check(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           eps: float) -> None:  # fmt: skip
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or not x.is_floating_point():
        raise ValueError(f"x must be a floating tensor [..., K], got {getattr(x, 'shape', type(x).__name__)}")
    k = x.shape[-1]
    for name, t in (("norm_weight", gamma), ("norm_bias", beta)):
        if t.shape != (k,):
            raise ValueError(f"{name} must have shape [{k}] (x's last dim), got {list(t.shape)}")
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"weight must have shape [N, {k}] (x's last dim), got {list(weight.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must have shape [{weight.shape[0]}] (weight's rows), got {list(bias.shape)}")
    tensors = (x, gamma, beta, weight) + (() if bias is None else (bias,))
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"x, the norm's and the linear's parameters must be on one device, got "
                         f"{sorted({str(t.device) for t in tensors})}")  # fmt: skip
    if not all(t.is_floating_point() for t in tensors):
        raise ValueError("the norm's and the linear's parameters must be floating tensors")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps!r}")


def norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    eps: float = 1e-5,
    pass_through: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``F.linear(F.layer_norm(x, (K,), norm_weight, norm_bias, eps), weight, bias)`` for ``x [..., K]``.

    The norm runs in fp32; its output is rounded once to the GEMM's dtype, which is the autocast dtype under
    autocast (the weight and bias cast as ``nn.Linear``'s are) and the weight's dtype otherwise; ``y`` comes
    in that dtype, as ``nn.Linear``'s. A bias passed detached is added without a gradient (an attention op
    that takes ``projection_bias`` computes it). With ``pass_through=True`` returns ``(x_view, y)``: use
    ``x_view`` for every other read of ``x`` (the residual) so its gradient is added inside this op's backward.
    """
    _check(x, norm_weight, norm_bias, weight, bias, eps)
    dtype = autocast_dtype(x)
    if dtype is not None:
        weight = weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # the kernels index rows and weights as dense row-major
    parameters = [t.contiguous() for t in (norm_weight, norm_bias, weight)]
    with torch.autocast(x.device.type, enabled=False) if dtype is not None else contextlib.nullcontext():
        view, y = _NormLinear.apply(rows, *parameters, bias, float(eps))
    y = y.view(*x.shape[:-1], weight.shape[0])
    return (view.view_as(x), y) if pass_through else y

