"""Plain PyTorch specification of the AdamW update that reads low-precision gradients and writes low-precision
weight copies (`opengem.ops.adamw`).

One tensor's update, in fp32, in the order of PyTorch's fused AdamW (``torch.optim.AdamW(fused=True)``)::

    step      += 1                                        (done by the caller, before the update)
    param     *= 1 - lr * weight_decay
    exp_avg    = beta1 * exp_avg + (1 - beta1) * grad
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
    param     -= lr / (1 - beta1 ** step) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2 ** step) + eps)
    shadow     = param rounded to the shadow's dtype (to nearest even, as ``Tensor.to`` rounds)

``grad`` is the bf16 / fp16 gradient widened exactly to fp32.
"""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def shadow_adamw_update(
    params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor], shadows: list[torch.Tensor], steps: list[torch.Tensor], *, lr: float,
    beta1: float, beta2: float, eps: float, weight_decay: float, skip: torch.Tensor | None,
) -> None:
    """Updates ``params``, ``exp_avgs``, ``exp_avg_sqs`` and ``shadows`` in place; nothing when ``skip`` is set
    (a 0-d tensor, non-zero: the step is skipped; ``steps`` are the caller's)."""
    if skip is not None and bool(skip.item()):
        return
    for param, grad, exp_avg, exp_avg_sq, shadow, step in zip(params, grads, exp_avgs, exp_avg_sqs, shadows, steps):
        count = float(step.item())
        widened = grad.float()
        param.sub_(param * (lr * weight_decay))
        exp_avg.mul_(beta1).add_(widened, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(widened, widened, value=1 - beta2)
        denom = exp_avg_sq.sqrt() / math.sqrt(1 - beta2**count) + eps
        param.sub_(lr / (1 - beta1**count) * exp_avg / denom)
        shadow.copy_(param)
