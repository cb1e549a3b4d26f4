"""Reference of ``opengem.ops.norm_linear``: ``linear(layer_norm(x))`` with the kernels' rounding points.

The norm runs in fp32 whatever ``x``'s dtype (as ``F.layer_norm`` does under autocast), its output is rounded to
the weight's dtype once, and the GEMM accumulates in fp32 and rounds its output to the weight's dtype. The
backward is written out (not autograd) so that the Triton kernels' formulas have a CPU twin to be tested against.
"""

from __future__ import annotations

import torch


def row_statistics(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 mean and reciprocal standard deviation (biased variance, as LayerNorm's) of each row of ``x [M, K]``."""
    rows = x.float()
    mean = rows.mean(dim=1)
    variance = (rows - mean[:, None]).square().mean(dim=1)
    return mean, torch.rsqrt(variance + eps)


def normalized(x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """``layer_norm(x)`` from its row statistics, in fp32 and then rounded to ``dtype``."""
    x_hat = (x.float() - mean[:, None]) * rstd[:, None]
    return (x_hat * gamma.float() + beta.float()).to(dtype)


def norm_linear_forward(
    x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y [M, N]`` in the weight's dtype, row mean, row rstd ``[M]`` fp32)."""
    mean, rstd = row_statistics(x, eps)
    out = normalized(x, mean, rstd, gamma, beta, weight.dtype).float() @ weight.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(weight.dtype), mean, rstd


def norm_linear_backward(
    dy: torch.Tensor, weight: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
    gamma: torch.Tensor, beta: torch.Tensor, d_pass: torch.Tensor | None, bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(dx`` in ``x``'s dtype with ``d_pass`` added, the normalized rows in the weight's dtype, ``d_gamma``,
    ``d_beta`` fp32 ``[K]``, ``d_bias`` fp32 ``[N]`` or None)."""
    d_normed = dy.float() @ weight.float()
    x_hat = (x.float() - mean[:, None]) * rstd[:, None]
    d_hat = d_normed * gamma.float()
    k = x.shape[1]
    grad = rstd[:, None] * (d_hat - d_hat.sum(1, keepdim=True) / k - x_hat * (d_hat * x_hat).sum(1, keepdim=True) / k)
    if d_pass is not None:
        grad = grad + d_pass.float()
    normed = normalized(x, mean, rstd, gamma, beta, weight.dtype)
    d_bias = dy.float().sum(0) if bias_grad else None
    return grad.to(x.dtype), normed, (d_normed * x_hat).sum(0), d_normed.sum(0), d_bias
