"""Numeric-drift monitoring of low-precision layers and per-layer automatic recipe choice (LoKA's idea).

`NumericsMonitor`: every ``every`` steps, each `LowPrecisionLinear`'s output is compared with a BF16
shadow computation on the same input (forward hook), and so is each low-precision attention layer's (a module
with ``precision != "bf16"`` and a ``bf16_shadow`` method, as `opengem.nn.gem_layers.SequenceSelfAttention`:
its residual update against the same layer's in bf16); the relative errors go to the training metrics
(`TrainConfig.numerics_every`), a layer past ``bound`` triggers a warning and, with ``fallback``, is
switched to BF16 for the rest of the run.

`select_precision`: for each layer, measure every candidate recipe's forward error on a calibration batch
and keep the fastest recipe under the bound (per-shape timings on GPU, a static ordering on CPU).
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from opengem.nn.low_precision import (
    BF16,
    LowPrecisionLinear,
    LowPrecisionRecipe,
    convert_to_low_precision,
    resolve_recipe,
)
from opengem.ops.checks import check_bools
from opengem.validation import is_int, is_number

# Hopper speed ranking used where no GPU timing is possible: cuBLAS rowwise, Triton blockwise, MX emulation.
STATIC_SPEED_ORDER = ("fp8_rowwise", "fp8_blockwise", "mxfp8")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp32; inf when ``out`` has a non-finite value."""
    out32, ref32 = out.detach().float(), ref.detach().float()
    if not torch.isfinite(out32).all():
        return math.inf
    return float((out32 - ref32).norm() / ref32.norm().clamp_min(1e-30))


def low_precision_attention(module: nn.Module) -> bool:
    """An attention layer running in low precision that can compute its BF16 shadow (``bf16_shadow``)."""
    return hasattr(module, "bf16_shadow") and getattr(module, "precision", "bf16") != "bf16"


def _bf16_shadow(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    bias = None if layer.bias is None else layer.bias.to(torch.bfloat16)
    return F.linear(x.to(torch.bfloat16), layer.weight.to(torch.bfloat16), bias)


def _runs_low_precision(layer: nn.Module) -> bool:
    """A watched layer that still computes in low precision (not fallen back to, or chosen as, BF16)."""
    return not layer.recipe.is_bf16 if isinstance(layer, LowPrecisionLinear) else low_precision_attention(layer)


def _error_against_bf16(layer: nn.Module, inputs: tuple[Any, ...], output: Any) -> tuple[float, str]:
    """The layer's relative error against its BF16 shadow on the same inputs, and its recipe's name: a linear's
    output, an attention layer's own comparison (its residual update)."""
    if isinstance(layer, LowPrecisionLinear):
        return relative_error(output, _bf16_shadow(layer, inputs[0])), layer.recipe.forward
    return relative_error(*layer.bf16_shadow(inputs, output)), layer.precision


def _fall_back_to_bf16(layer: nn.Module) -> None:
    if isinstance(layer, LowPrecisionLinear):
        layer.recipe = BF16
    else:
        layer.precision = "bf16"


class NumericsMonitor:
    """Watch every `LowPrecisionLinear` of ``model``. Call `step()` once per training step (before the
    forward); on steps divisible by ``every`` the hooks measure each layer's first forward of the step.

    ``stats``: {layer name: {"rel_error", "max_rel_error", "recipe", "fell_back"}}; `metrics()` flattens
    it to {"numerics/<layer>/rel_error": float} for the training logger.

    With ``hooks=False`` nothing is attached to the model; `measure` attaches the hooks for one forward of
    its own. That is the mode for compiled models (the trainer's): a hook inside a compiled block would be
    traced into its graph.
    """

    def __init__(
        self, model: nn.Module, every: int = 100, bound: float = 0.1, fallback: bool = False, hooks: bool = True
    ) -> None:
        if not is_int(every) or every < 1:  # 1.5 had measured at steps 0, 3, 6, ...; True ran as 1
            raise ValueError(f"every must be an int >= 1, got {every!r}")
        _check_bound("NumericsMonitor", bound)
        check_bools("NumericsMonitor", fallback=fallback, hooks=hooks)  # "no" had been taken as True
        self.every, self.bound, self.fallback = every, bound, fallback
        self.steps = 0
        self._current_step = 0  # the step a measurement reports (the last `step()`, or `measure`'s argument)
        self.stats: dict[str, dict[str, Any]] = {}
        self._model = model
        self._measured: set[str] = set()
        self._active = False
        self._handles = self._attach() if hooks else []

    def _attach(self) -> list[torch.utils.hooks.RemovableHandle]:
        return [m.register_forward_hook(self._hook_for(name)) for name, m in self._model.named_modules()
                if isinstance(m, LowPrecisionLinear) or low_precision_attention(m)]

    def step(self) -> None:
        self._active = self.steps % self.every == 0
        self._measured.clear()
        self._current_step = self.steps
        self.steps += 1

    def measure(self, forward: Callable[[], Any], step: int) -> dict[str, float]:
        """Run ``forward()`` once with every layer measured and return `metrics()`: no gradients, the model in
        eval mode, compiled regions run eagerly (so the hooks fire), and the RNG state left as it was (a
        measured run draws the same dropout masks as an unmeasured one). ``step`` labels warnings."""
        handles = self._attach() if not self._handles else []
        training = self._model.training
        self._active, self._current_step = True, step
        self._measured.clear()
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        try:
            self._model.eval()
            with torch.random.fork_rng(devices=devices), torch.no_grad(), torch.compiler.set_stance("force_eager"):
                forward()
        finally:
            self._model.train(training)
            self._active = False
            for handle in handles:
                handle.remove()
        return self.metrics()

    def _hook_for(self, name: str) -> Callable[..., None]:
        def hook(layer: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            if not self._active or name in self._measured or not _runs_low_precision(layer):
                return  # (also an attention layer's inner forward of its own shadow: measured already)
            self._measured.add(name)
            with torch.no_grad():
                err, recipe = _error_against_bf16(layer, inputs, output)
            previous = self.stats.get(name, {})
            entry = {
                "rel_error": err,
                "max_rel_error": max(err, previous.get("max_rel_error", 0.0)),
                "recipe": recipe,
                "fell_back": False,
            }
            if err > self.bound:
                action = "falling back to BF16" if self.fallback else "keeping its recipe"
                warnings.warn(
                    f"low-precision layer {name!r} ({recipe}): output relative error {err:.3g} "
                    f"vs BF16 exceeds the bound {self.bound:.3g} at step {self._current_step}; {action}",
                    RuntimeWarning,
                    stacklevel=2,
                )
                if self.fallback:
                    _fall_back_to_bf16(layer)
                    entry["fell_back"] = True
            self.stats[name] = entry

        return hook

    def metrics(self) -> dict[str, float]:
        return {f"numerics/{name}/rel_error": s["rel_error"] for name, s in self.stats.items()}

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _check_bound(fn: str, bound: object) -> None:
    """A number above 0 (inf: never exceeded, as ``TrainConfig.numerics_bound`` allows); NaN and negatives had made
    every layer fail the bound silently (select_precision chose BF16 everywhere), a str failed in a comparison."""
    if not is_number(bound) or not bound > 0:
        raise ValueError(f"{fn}: bound must be a number > 0, got {bound!r}")


def _check_selection(fn: str, calibration: object, bound: object) -> None:
    if not callable(calibration):  # had failed as "'NoneType' object is not callable"
        raise ValueError(f"{fn}: calibration must be a callable (e.g. one forward of a real batch), got "
                         f"{type(calibration).__name__}")
    _check_bound(fn, bound)


def _forward_ms(layer: LowPrecisionLinear, x: torch.Tensor, repeats: int = 5) -> float:
    with torch.no_grad():
        layer(x)  # warm-up (and weight quantization, cached afterwards)
        torch.cuda.synchronize(x.device)
        start = time.perf_counter()
        for _ in range(repeats):
            layer(x)
        torch.cuda.synchronize(x.device)
    return (time.perf_counter() - start) * 1e3 / repeats


def select_precision(
    model: nn.Module,
    calibration: Callable[[], Any],
    bound: float = 0.05,
    candidates: tuple[str | LowPrecisionRecipe, ...] = STATIC_SPEED_ORDER,
) -> dict[str, dict[str, Any]]:
    """Set each `LowPrecisionLinear`'s recipe to the fastest candidate whose forward relative error (vs
    fp32, on the input the layer sees while ``calibration()`` runs, e.g. one forward of a real batch) is
    at most ``bound``; BF16 when none qualifies. Speed: per-shape timing on CUDA, `STATIC_SPEED_ORDER`
    (the candidates' given order) on CPU. Returns {layer: {"recipe", "errors": {recipe: error}}}.
    """
    _check_selection("select_precision", calibration, bound)
    # a str had been iterated as its characters ("got 'f'"); none at all chose BF16 everywhere silently
    if isinstance(candidates, str) or not isinstance(candidates, (tuple, list)) or not candidates:
        raise ValueError(f"select_precision: candidates must be a non-empty tuple of recipes, got {candidates!r}")
    layers = {name: m for name, m in model.named_modules() if isinstance(m, LowPrecisionLinear)}
    inputs: dict[str, torch.Tensor] = {}

    def capture(name: str) -> Callable[..., None]:
        def hook(layer: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            inputs.setdefault(name, args[0].detach())

        return hook

    handles = [m.register_forward_hook(capture(name)) for name, m in layers.items()]
    try:
        with torch.no_grad():
            calibration()
    finally:
        for handle in handles:
            handle.remove()
    recipes = {c if isinstance(c, str) else f"{c.forward}/{c.grad_input}/{c.grad_weight}": resolve_recipe(c)
               for c in candidates}
    report: dict[str, dict[str, Any]] = {}
    for name, layer in layers.items():
        if name not in inputs:
            continue  # not reached by the calibration batch: leave as is
        x = inputs[name]
        with torch.no_grad():
            ref = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
        errors, times = {}, {}
        for label, recipe in recipes.items():
            layer.recipe = recipe
            with torch.no_grad():
                errors[label] = relative_error(layer(x), ref)
            times[label] = _forward_ms(layer, x) if x.is_cuda else float(len(times))
        passing = [label for label in recipes if errors[label] <= bound]
        chosen = min(passing, key=times.__getitem__) if passing else "bf16"
        layer.recipe = recipes[chosen] if passing else BF16
        report[name] = {"recipe": chosen, "errors": errors, "ms": times if x.is_cuda else None}
    return report


def convert_with_precision(
    model: nn.Module,
    precision: str,
    calibration: Callable[[], Any] | None = None,
    bound: float = 0.05,
    filter: Callable[[str, nn.Linear], bool] | None = None,
) -> dict[str, str]:
    """The ``--precision`` switch: a name of `NAMED_RECIPES` converts the eligible Linears to it;
    ``"auto"`` converts them and runs `select_precision` on ``calibration``. Returns {layer: recipe}."""
    if precision != "auto":
        return {name: precision for name in convert_to_low_precision(model, precision, filter)}
    if calibration is None:
        raise ValueError("precision='auto' needs a calibration callable (e.g. one forward of a real batch)")
    _check_selection("convert_with_precision", calibration, bound)  # before the model is converted
    convert_to_low_precision(model, STATIC_SPEED_ORDER[0], filter)
    return {name: r["recipe"] for name, r in select_precision(model, calibration, bound).items()}
