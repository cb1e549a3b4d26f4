"""AdamW on low-precision gradients that also writes the low-precision copies of the weights the next step reads.

Under bf16 autocast a Linear layer's weight gradient comes out of its GEMM in bf16 and is cast to fp32 for the
optimizer, and the next forward casts the updated fp32 weight back to bf16. With the copies kept as tensors of their
own (`opengem.nn.weight_shadows`), :func:`shadow_adamw_update` reads each copy's bf16 gradient where autograd left it,
updates the fp32 weight and moments, and writes the new copy in the same pass: per parameter 28 B moved instead of
AdamW's 28 plus the two casts' 12. The gradient is widened exactly, so the update is AdamW's on autocast's gradient.
The moments may be bf16 instead of fp32 (4 B a parameter less kept, 8 B less moved a step): computed in fp32,
stored rounded stochastically, so that they stay unbiased (`opengem.ops.reference.adamw`).

Formula: `opengem.ops.reference.adamw`. CUDA tensors run the Triton kernel (one launch for all tensors), CPU
tensors the reference; ``backend="triton"`` (or ``OPENGEM_ADAMW_BACKEND=triton``) forces the kernel, e.g. under
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import math

import torch

from opengem.jagged.host import to_device
from opengem.ops.backend import triton_chosen
from opengem.ops.reference.adamw import shadow_adamw_update as shadow_adamw_reference
from opengem.validation import SEED_LIMIT, is_int, is_number

HALF_DTYPES = (torch.bfloat16, torch.float16)
MOMENT_DTYPES = (torch.float32, torch.bfloat16)


def check_hyperparameters(fn: str, *, lr: object, betas: object, eps: object, weight_decay: object) -> None:
    """AdamW's settings as Python numbers: lr, eps, weight_decay finite and >= 0, betas a pair in [0, 1). True had
    run as lr 1, a third beta was dropped silently, and a str failed inside math.isfinite. Host scalars only."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{fn}: betas must be a pair (beta1, beta2), got {betas!r}")
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay), ("betas[0]", betas[0]),
                        ("betas[1]", betas[1])):
        is_beta = name.startswith("betas")
        if not is_number(value) or not math.isfinite(value) or value < 0 or (is_beta and value >= 1):
            raise ValueError(f"{fn}: {name} must be finite and >= 0{' and < 1' if is_beta else ''} (a number), "
                             f"got {value!r}")


def check_rounding_seed(fn: str, rounding_seed: object) -> None:
    """An int in [0, 2 ** 32) (1.5 and True had been accepted as seeds)."""
    if not is_int(rounding_seed) or not 0 <= rounding_seed < SEED_LIMIT:  # the seeds' one range
        raise ValueError(f"{fn}: rounding_seed must be in [0, 2 ** 32) (an int), got {rounding_seed!r}")


class ShadowAdamWTensors:
    """What :func:`shadow_adamw_update` updates: fp32 ``params`` with their moments (all fp32 or all bf16), their
    low-precision ``shadows`` (bf16 or fp16, one dtype) and 0-d fp32 ``steps`` counters, one of each a parameter, all
    contiguous on one device. Checked once here; the kernel's address tables are made once and kept (the tensors must
    stay the same objects: make a new instance after replacing any, e.g. after loading a checkpoint)."""

    def __init__(
        self, params: list[torch.Tensor], exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
        shadows: list[torch.Tensor], steps: list[torch.Tensor],
    ) -> None:
        lists = {"params": params, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "shadows": shadows, "steps": steps}
        if len({len(tensors) for tensors in lists.values()}) != 1:
            raise ValueError(f"one of each a parameter: got {', '.join(f'{len(v)} {k}' for k, v in lists.items())}")
        devices = {t.device for tensors in lists.values() for t in tensors}
        if len(devices) > 1:
            raise ValueError(f"every tensor must be on one device, got {sorted(map(str, devices))}")
        half = {s.dtype for s in shadows}
        if len(half) > 1 or not half <= set(HALF_DTYPES):
            raise ValueError(f"shadows must all be bf16 or all fp16, got {sorted(map(str, half))}")
        moments = {m.dtype for m in exp_avgs + exp_avg_sqs}
        if len(moments) > 1 or not moments <= set(MOMENT_DTYPES):
            raise ValueError(f"the moments must all be fp32 or all bf16, got {sorted(map(str, moments))}")
        moment_dtype = moments.pop() if moments else torch.float32
        for i, (param, exp_avg, exp_avg_sq, shadow, step) in enumerate(zip(*lists.values())):
            for name, tensor, dtype in (("params", param, torch.float32), ("exp_avgs", exp_avg, moment_dtype),
                                        ("exp_avg_sqs", exp_avg_sq, moment_dtype), ("shadows", shadow, shadow.dtype)):
                if tensor.dtype != dtype or tensor.shape != param.shape or not tensor.is_contiguous():
                    raise ValueError(f"{name}[{i}] must be a contiguous {dtype} tensor of params[{i}]'s shape "
                                     f"{tuple(param.shape)}, got {tensor.dtype} {tuple(tensor.shape)}"
                                     f"{'' if tensor.is_contiguous() else ' (not contiguous)'}")
            if step.dtype != torch.float32 or step.dim() != 0:
                raise ValueError(f"steps[{i}] must be a 0-d fp32 tensor, got {step.dtype} {tuple(step.shape)}")
        self.params, self.exp_avgs, self.exp_avg_sqs = params, exp_avgs, exp_avg_sqs
        self.shadows, self.steps = shadows, steps
        self.device = devices.pop() if devices else torch.device("cpu")
        self.half_dtype = half.pop() if half else torch.bfloat16
        self.moment_dtype = moment_dtype
        self._launch_plans: dict[tuple[bool, ...], tuple] = {}  # by which tensors have a gradient
        self._log2_betas: tuple[tuple[float, float], torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.params)

    def log2_betas(self, betas: tuple[float, float]) -> torch.Tensor:
        """fp64 ``[log2(beta1), log2(beta2)]`` on the device for the kernel's bias corrections (made once a pair)."""
        if self._log2_betas is None or self._log2_betas[0] != betas:
            values = [math.log2(b) if b > 0 else -math.inf for b in betas]
            self._log2_betas = (betas, to_device(torch.tensor(values, dtype=torch.float64), self.device))
        return self._log2_betas[1]

    def launch_plan(self, present: tuple[bool, ...]) -> tuple:
        """The kernel's work list and address tables for the tensors marked present (made on first use)."""
        if present not in self._launch_plans:
            from opengem.ops.triton.adamw import address_table, work_items  # triton only where the kernel runs

            kept = [i for i, here in enumerate(present) if here]
            numels = [self.params[i].numel() for i in kept]
            tables = {name: address_table([tensors[i] for i in kept], self.device) for name, tensors in (
                ("param", self.params), ("exp_avg", self.exp_avgs), ("exp_avg_sq", self.exp_avg_sqs),
                ("shadow", self.shadows), ("step", self.steps))}
            # the step counters are read as scalars: their alignment does not matter
            aligned = all(table_aligned for name, (_, table_aligned) in tables.items() if name != "step")
            sizes = to_device(torch.tensor(numels, dtype=torch.int64), self.device)
            self._launch_plans[present] = (work_items(numels, self.device), sizes,
                                           {name: table for name, (table, _) in tables.items()}, aligned)
        return self._launch_plans[present]


def shadow_adamw_update(
    tensors: ShadowAdamWTensors, grads: list[torch.Tensor | None], *, lr: float, betas: tuple[float, float],
    eps: float, weight_decay: float, skip: torch.Tensor | None = None, backend: str | None = None,
    rounding_seed: int = 0,
) -> None:
    """One AdamW step of every parameter of ``tensors`` whose ``grads`` entry (its shadow's gradient: the shadow's
    dtype and shape) is not None; the others are left as they are, their step counters too (as ``torch.optim.AdamW``
    leaves parameters without a gradient). Each updated step counter is incremented first and the bias corrections
    read it. ``skip``: a one-element tensor on the device; where non-zero, nothing changes (steps included), decided
    on the device without a host sync (``torch.optim.AdamW``'s ``found_inf``). ``rounding_seed`` (0 to 2 ** 32 - 1)
    keys the stochastic rounding of bf16 moments, with the step and the tensor: a run that passes the same seed
    rounds the same way, resumed or not."""
    if len(grads) != len(tensors):
        raise ValueError(f"one gradient (or None) a parameter: got {len(grads)} for {len(tensors)} parameters")
    check_hyperparameters("shadow_adamw_update", lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    check_rounding_seed("shadow_adamw_update", rounding_seed)
    if skip is not None and (skip.numel() != 1 or skip.device != tensors.device or skip.dtype == torch.bool):
        # a bool flag had failed in `1 - skip` inside torch
        raise ValueError(f"skip must be one element on {tensors.device} (not bool), got {skip.dtype} "
                         f"{tuple(skip.shape)} on {skip.device}")
    triton = triton_chosen(tensors.device, backend, "OPENGEM_ADAMW_BACKEND")
    present = tuple(g is not None for g in grads)
    kept = [i for i, here in enumerate(present) if here]
    for i in kept:
        grad, shadow = grads[i], tensors.shadows[i]
        if grad.dtype != shadow.dtype or grad.shape != shadow.shape or grad.device != shadow.device:
            raise ValueError(f"grads[{i}] must be the gradient of shadows[{i}] ({shadow.dtype} "
                             f"{tuple(shadow.shape)} on {shadow.device}), got {grad.dtype} {tuple(grad.shape)} on "
                             f"{grad.device}")
    if not kept:
        return
    steps = [tensors.steps[i] for i in kept]
    # one multi-tensor add: 1, or 1 - skip (0 on a skipped step) without reading the flag on the host
    torch._foreach_add_(steps, 1.0 if skip is None else 1 - skip.reshape(()))
    hyper = {"lr": lr, "beta1": betas[0], "beta2": betas[1], "eps": eps, "weight_decay": weight_decay}
    kept_grads = [grads[i].contiguous() for i in kept]  # kept alive until the kernel is queued: the table holds
    # their addresses (autograd's gradients follow the shadows' contiguous layout, so this copies nothing)
    if not triton:
        shadow_adamw_reference([tensors.params[i] for i in kept], kept_grads,
                               [tensors.exp_avgs[i] for i in kept], [tensors.exp_avg_sqs[i] for i in kept],
                               [tensors.shadows[i] for i in kept], steps, skip=skip, rounding_seed=rounding_seed,
                               **hyper)
        return
    from opengem.ops.triton.adamw import address_table, hyperparameters, shadow_adamw_launch

    items, numels, tables, aligned = tensors.launch_plan(present)
    grad_table, grads_aligned = address_table(kept_grads, tensors.device)
    shadow_adamw_launch(items, numels, tables, grad_table, skip, tensors.log2_betas(betas),
                        hyperparameters(**hyper, device=tensors.device),
                        half_is_bf16=tensors.half_dtype == torch.bfloat16,
                        moments_bf16=tensors.moment_dtype == torch.bfloat16, rounding_seed=rounding_seed,
                        aligned=aligned and grads_aligned)
