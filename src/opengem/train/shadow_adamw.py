"""AdamW that takes the weight-shadowed layers' gradients in bf16 from their shadows and writes the shadows as it
updates (``TrainConfig.shadow_adamw``).

With ``opengem.nn.weight_shadows``' ``shadow_grads`` the shadowed Linear layers compute from their bf16 shadows as
autograd leaves, so each weight's bf16 gradient stays on its shadow (no cast to fp32) and the fp32 weight gets none.
:class:`ShadowAdamW` updates those weights from the shadows' gradients and writes the new shadows in the same pass
(`opengem.ops.adamw`), and runs ``torch.optim.AdamW`` for every other parameter. The arithmetic is AdamW's on
autocast's gradients (the bf16 gradient widened exactly), its state the same (``step``, ``exp_avg``,
``exp_avg_sq`` under each fp32 parameter), so checkpoints load into either optimizer. With ``moments_dtype=bfloat16``
(``TrainConfig.shadow_adamw_moments="bf16"``) the shadow-stepped parameters' moments are kept in bf16, rounded
stochastically (4 B a parameter less kept, 8 B less moved a step); a checkpoint of them loads into either optimizer
too (``torch.optim.Optimizer.load_state_dict`` widens them to the parameter's fp32, and this optimizer narrows them
back at its next step, exactly).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from opengem.nn.weight_shadows import refresh_shadows
from opengem.ops.adamw import (
    HALF_DTYPES,
    MOMENT_DTYPES,
    ShadowAdamWTensors,
    check_hyperparameters,
    check_rounding_seed,
    shadow_adamw_update,
)


_SETTINGS = ("lr", "betas", "eps", "weight_decay")
ADAMW_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}  # torch.optim.AdamW's


def _check_settings(settings: dict[str, object]) -> None:
    lr = settings["lr"]
    if isinstance(lr, torch.Tensor) and lr.numel() == 1 and lr.device.type == "cpu":  # torch allows a tensor lr
        settings = {**settings, "lr": lr.item()}  # (a host tensor: no device sync; `step` reads it with float())
    check_hyperparameters("ShadowAdamW", **settings)


def _check_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each pair an fp32 parameter and its contiguous bf16 / fp16 shadow of the same shape and device, each
    parameter once, checked at construction (metadata only): a repeated parameter had kept only its last shadow
    silently, and a mismatched shadow was refused only at the first step."""
    seen: set[torch.Tensor] = set()
    for i, pair in enumerate(pairs):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(isinstance(t, torch.Tensor) for t in pair):
            kinds = [type(t).__name__ for t in pair] if isinstance(pair, (tuple, list)) else type(pair).__name__
            raise ValueError(f"pairs[{i}] must be a (parameter, shadow) pair of tensors, got {kinds}")
        master, shadow = pair
        if master in seen:
            raise ValueError(f"pairs[{i}]: parameter of shape {tuple(master.shape)} is paired with a shadow twice")
        seen.add(master)
        if (master.dtype != torch.float32 or shadow.dtype not in HALF_DTYPES or shadow.shape != master.shape
                or shadow.device != master.device or not shadow.is_contiguous() or not master.is_contiguous()):
            raise ValueError(f"pairs[{i}] must be a contiguous fp32 parameter and its contiguous bf16 or fp16 shadow "
                             f"of the same shape on its device, got {master.dtype} {tuple(master.shape)} on "
                             f"{master.device} and {shadow.dtype} {tuple(shadow.shape)} on {shadow.device}"
                             f"{'' if shadow.is_contiguous() and master.is_contiguous() else ' (not contiguous)'}")


class ShadowAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW(params, **kwargs)``; ``pairs``: the ``(fp32 parameter, shadow)`` pairs of
    `opengem.nn.weight_shadows.shadow_linear_weights` (made with ``shadow_grads=True``), the parameters among
    ``params``. A parameter whose gradient reached the fp32 tensor instead (a bias handed to an attention op) is
    stepped by AdamW and its shadow refreshed after. ``moments_dtype``: the shadow-stepped parameters' moments, fp32
    or bf16 (rounded stochastically, keyed by ``rounding_seed`` in [0, 2 ** 32)); the AdamW-stepped ones keep fp32
    moments, as AdamW makes them."""

    def __init__(self, params: Iterable[torch.Tensor], pairs: list[tuple[torch.Tensor, torch.Tensor]],
                 moments_dtype: torch.dtype = torch.float32, rounding_seed: int = 0, **kwargs: object) -> None:
        if kwargs.get("amsgrad") or kwargs.get("maximize") or kwargs.get("capturable") or kwargs.get("differentiable"):
            raise ValueError("ShadowAdamW updates as plain AdamW: amsgrad, maximize, capturable and differentiable "
                             "are not supported")
        if moments_dtype not in MOMENT_DTYPES:
            raise ValueError(f"moments_dtype must be torch.float32 or torch.bfloat16, got {moments_dtype}")
        # before torch's own checks, which let inf through and fail on a str with a bare TypeError
        _check_settings({name: kwargs.get(name, ADAMW_DEFAULTS[name]) for name in _SETTINGS})
        check_rounding_seed("ShadowAdamW", rounding_seed)
        _check_pairs(pairs)
        super().__init__(params, **kwargs)  # type: ignore[arg-type]  (each group through add_param_group below)
        self._moments_dtype, self._rounding_seed = moments_dtype, rounding_seed
        self._shadow_of = {master: shadow for master, shadow in pairs}
        grouped = {p for group in self.param_groups for p in group["params"]}
        missing = [tuple(master.shape) for master in self._shadow_of if master not in grouped]
        if missing:
            raise ValueError(f"every shadowed parameter must be among params: {len(missing)} are not "
                             f"(shapes {missing[:4]})")
        self._tensors: list[ShadowAdamWTensors] | None = None  # a group's shadowed state, made at the first step
        self._kernel_stepped: set[torch.Tensor] = set()  # the parameters in those tensors
        self._versions: list[int] | None = None  # the shadowed parameters' versions when their shadows were written

    def add_param_group(self, param_group: dict) -> None:
        """AdamW's, with the group's settings checked first as `shadow_adamw_update` checks them: torch lets inf
        through (and a bool or a third beta), so the shadowed parameters' first step refused them only after
        ``super().step()`` had already stepped the other parameters with them."""
        _check_settings({name: param_group.get(name, self.defaults[name]) for name in _SETTINGS})
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for shadow in self._shadow_of.values():
            if shadow.grad is not None:
                if set_to_none:
                    shadow.grad = None
                else:
                    shadow.grad.zero_()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped_here = [(m, s) for m, s in self._shadow_of.items() if m.grad is not None]  # by AdamW, below
        both = [tuple(m.shape) for m, s in stepped_here if s.grad is not None]
        if both:
            raise RuntimeError(f"{len(both)} shadowed parameters got a gradient both on the fp32 tensor and on the "
                               f"shadow (shapes {both[:4]}): use each layer through its shadows only")
        tensors = self._shadowed_tensors(stepped_here)
        if self._moments_dtype != torch.float32:  # the two kinds of state cannot trade places
            moved = [tuple(m.shape) for m, s in self._shadow_of.items()
                     if (m.grad if m in self._kernel_stepped else s.grad) is not None]
            if moved:
                raise RuntimeError(f"{len(moved)} shadowed parameters (shapes {moved[:4]}) took their gradient on the "
                                   "other tensor (fp32 weight or shadow) than at the first step: with bf16 moments "
                                   "each must keep to one, as their moments' dtypes were chosen then")
        for group in self.param_groups:  # set after construction too (a scheduler, a user); torch's step below takes
            _check_settings({k: group[k] for k in _SETTINGS})  # inf and would step the other parameters with it
        super().step()  # the parameters whose gradients reached them (shadowed ones have none)
        skip = getattr(self, "found_inf", None)
        for group, group_tensors in zip(self.param_groups, tensors):
            shadow_adamw_update(group_tensors, [s.grad for s in group_tensors.shadows], lr=float(group["lr"]),
                                betas=(float(group["betas"][0]), float(group["betas"][1])), eps=group["eps"],
                                weight_decay=group["weight_decay"], skip=skip, rounding_seed=self._rounding_seed)
        refresh_shadows(stepped_here)
        self._versions = [m._version for m in self._shadow_of]
        return loss

    def shadows_fresh(self) -> bool:
        """Whether every shadow holds its parameter as this optimizer last wrote it. No step yet, or a parameter changed
        in place since (a loaded checkpoint: its version counter moved), says no; a write through ``.data`` is not
        seen (it leaves the counter), so refresh the shadows after one (`opengem.nn.weight_shadows.refresh_shadows`)."""
        return self._versions == [m._version for m in self._shadow_of]

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._tensors = None  # the loaded state tensors replace the ones the kernel's tables point at
        self._versions = None

    def _shadowed_tensors(self, adamw_stepped: list[tuple[torch.Tensor, torch.Tensor]]) -> list[ShadowAdamWTensors]:
        """Each group's shadowed parameters with their state, made (as ``torch.optim.AdamW`` makes it, in the moments'
        dtype) if missing. With bf16 moments, the pairs ``adamw_stepped`` now are left to AdamW and its fp32 state."""
        if self._tensors is None:
            self._tensors = []
            left = {m for m, _ in adamw_stepped} if self._moments_dtype != torch.float32 else set()
            self._kernel_stepped = {m for m in self._shadow_of if m not in left}
            for group in self.param_groups:
                masters = [p for p in group["params"] if p in self._kernel_stepped]
                for master in masters:
                    state = self.state[master]
                    if not state:
                        state["exp_avg"] = torch.zeros_like(master, dtype=self._moments_dtype)
                        state["exp_avg_sq"] = torch.zeros_like(master, dtype=self._moments_dtype)
                    for name in ("exp_avg", "exp_avg_sq"):  # a loaded state comes widened to the parameter's fp32
                        state[name] = state[name].to(self._moments_dtype)
                    state["step"] = state.get("step", torch.zeros(())).to(master.device, torch.float32)
                states = [self.state[m] for m in masters]
                self._tensors.append(ShadowAdamWTensors(
                    masters, [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states],
                    [self._shadow_of[m] for m in masters], [st["step"] for st in states]))
        return self._tensors
