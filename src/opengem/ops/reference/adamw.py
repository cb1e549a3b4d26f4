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

With bf16 moments (``exp_avgs`` and ``exp_avg_sqs`` in bf16: 4 B a parameter less kept, 8 B less moved a step) the
moments are widened, updated in fp32 as above, and stored rounded stochastically (`opengem.ops.reference.rounding`):
rounded to nearest, ``beta2 * v`` with beta2 = 0.999 moves ``v`` by less than half a bf16 ulp (2 ** -9 relative), so
``v`` could never decay; rounded up with the probability of the discarded fraction it decays in expectation. The
random bits come from a counter hash of (seed, step, tensor, element) that the kernel computes alike, bit for bit, so
a resumed run rounds as the uninterrupted one did.
"""

from __future__ import annotations

import math

import torch

from opengem.ops.reference.rounding import paired_rounding_bits, rounding_key, stochastic_round_bf16


@torch.no_grad()
def shadow_adamw_update(
    params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor], shadows: list[torch.Tensor], steps: list[torch.Tensor], *, lr: float,
    beta1: float, beta2: float, eps: float, weight_decay: float, skip: torch.Tensor | None, rounding_seed: int = 0,
) -> None:
    """Updates ``params``, ``exp_avgs``, ``exp_avg_sqs`` and ``shadows`` in place; nothing when ``skip`` is set
    (a 0-d tensor, non-zero: the step is skipped; ``steps`` are the caller's). Moments in bf16 are rounded
    stochastically with bits keyed by ``rounding_seed``, the step and the tensor's place in the lists."""
    if skip is not None and bool(skip.item()):
        return
    lists = zip(params, grads, exp_avgs, exp_avg_sqs, shadows, steps)
    for place, (param, grad, exp_avg, exp_avg_sq, shadow, step) in enumerate(lists):
        count = float(step.item())
        widened = grad.float()
        first, second = exp_avg.float(), exp_avg_sq.float()  # fp32 moments: the tensors themselves, updated in place
        param.sub_(param * (lr * weight_decay))
        first.mul_(beta1).add_(widened, alpha=1 - beta1)
        second.mul_(beta2).addcmul_(widened, widened, value=1 - beta2)
        denom = second.sqrt() / math.sqrt(1 - beta2**count) + eps
        param.sub_(lr / (1 - beta1**count) * first / denom)
        shadow.copy_(param)
        if exp_avg.dtype == torch.bfloat16:
            key = rounding_key(rounding_seed, int(count), place)
            first_bits, second_bits = paired_rounding_bits(first.numel(), key, first.device)
            exp_avg.copy_(stochastic_round_bf16(first, first_bits))
            exp_avg_sq.copy_(stochastic_round_bf16(second, second_bits))
