"""`opengem bench layers`: each layer type of a GEM preset run alone, its local MFU (GEM_SPEC section 8).

One forward of the whole model on a real batch of the preset records the inputs of each layer type
(the first instance of the per-layer blocks); each layer then runs alone, forward + backward, on those
inputs (fresh leaves that require gradients, as inside the model). Its FLOPs are counted by
``torch.utils.flop_counter`` with our op formulas; since every layer of the model is covered once
with its instance count, the FLOPs weighted by the counts add up to the model's analytic step FLOPs
(reported as ``flops_coverage``, 1.0 when nothing is missed). The FLOP-weighted local MFU is
``sum(count * FLOPs) / sum(count * time) / peak``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from opengem.data.schema import Batch
from opengem.jagged import Jagged
from opengem.models.gem import GEM
from opengem.nn.wukong import unpadded_token_mixing
from opengem.train.bench.step import TrainBenchOptions, bench_config
from opengem.train.bench.timing import FLOP_CONVENTION, environment, time_ms
from opengem.train.data_stream import train_batches
from opengem.train.flops import batch_train_flops, device_peak_flops
from opengem.train.trainer import build_learner
from opengem.validation import is_int


@dataclass(frozen=True)
class LayerCase:
    name: str
    count: int  # instances in the model
    run: Callable[..., Any]
    inputs: tuple[Any, ...]  # as recorded in the model's forward (detached)


def bench_layers(options: TrainBenchOptions, repeats: int = 10) -> dict[str, Any]:
    """Time each layer type alone; ``options`` as for `bench train` (preset, batch size, precision, device)."""
    if not is_int(repeats) or repeats < 1:  # True had passed as one repeat
        raise ValueError(f"repeats must be >= 1 (the timed runs a layer's median is taken over), got {repeats}")
    config, device, precision = bench_config(options)
    if config.architecture != "gem":
        raise ValueError(f"bench layers covers the GEM architecture, got {config.architecture!r}")
    torch.manual_seed(config.seed)
    learner = build_learner(config, config.model.history, device)
    model = learner.model
    model.train()
    batch = next(train_batches(dataclasses.replace(config, num_workers=0), start_step=0)).to(device)  # one batch
    # the trainer's autocast (Learner.forward), around each layer's forward
    dtype = learner.compute_dtype
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)
    peak = None
    if device.type == "cuda" or options.peak_tflops is not None:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        peak = device_peak_flops(name, "bf16", options.peak_tflops)
    rows = []
    for case in layer_cases(model, batch):
        def step(case: LayerCase = case) -> None:
            inputs = tuple(_fresh_leaf(x) for x in case.inputs)
            with autocast:
                out = case.run(*inputs)
            _scalar(out).backward()

        with unpadded_token_mixing(model), FlopCounterMode(display=False) as counter:  # useful FLOPs only
            step()
        flops = int(counter.get_total_flops())
        ms = time_ms(step, device, warmup=3, repeats=repeats)
        rows.append({
            "layer": case.name, "count": case.count, "ms": ms, "gflop": flops / 1e9,
            "tflop_per_s": flops / ms / 1e9, "local_mfu": None if peak is None else flops / (ms / 1e3) / peak,
        })  # fmt: skip
    total_ms = sum(r["count"] * r["ms"] for r in rows)
    total_flops = sum(r["count"] * r["gflop"] * 1e9 for r in rows)
    for row in rows:
        row["time_share"] = row["count"] * row["ms"] / total_ms
    model_flops = batch_train_flops(model, batch).train
    return {
        "benchmark": "layers",
        "preset": options.preset,
        "environment": environment(device),
        "settings": {"batch_size": config.batch_size, "precision": precision, "device": str(device),
                     "history_tokens": batch.num_history_tokens(), "repeats": repeats},
        "flop_convention": FLOP_CONVENTION,
        "rows": rows,
        "layers_ms": total_ms,
        "flops_coverage": total_flops / model_flops,
        "local_mfu": None if peak is None else total_flops / (total_ms / 1e3) / peak,
        "device_peak_tflops": None if peak is None else peak / 1e12,
    }


def layer_cases(model: GEM, batch: Batch) -> list[LayerCase]:
    """The layer types of ``model`` with the inputs they receive on ``batch`` (one recording forward)."""
    first = model.layers[0]
    modules: dict[str, nn.Module | None] = {
        "embeddings": model.embeddings,
        "x_summary": first.x_summary,
        "pffn": first.pffn,
        "self_attention": first.self_attention,
        "sequence_summary": first.s_summary,
        "interaction": first.interaction,
        "final_summary": model.final_summary,
        "heads": next(iter(model.heads.values())),  # every task's head reads the same input
    }
    recorded: dict[str, tuple[Any, ...]] = {}
    embedded: dict[str, Any] = {}
    handles = [
        module.register_forward_pre_hook(lambda _, args, name=name: recorded.setdefault(name, _detach(args)))
        for name, module in modules.items() if module is not None
    ]  # fmt: skip
    handles.append(model.embeddings.register_forward_hook(lambda _, __, out: embedded.update(_detach(out))))
    handles.append(first.register_forward_pre_hook(lambda _, args: recorded.setdefault("layer_input", _detach(args))))
    try:
        with torch.no_grad():
            model(batch)
    finally:
        for handle in handles:
            handle.remove()

    def count(attribute: str) -> int:
        return sum(getattr(layer, attribute) is not None for layer in model.layers)

    def heads(hidden: torch.Tensor) -> list[torch.Tensor]:
        return [head(hidden) for head in model.heads.values()]

    x = recorded["layer_input"][0]
    cases = [
        LayerCase("embeddings", 1, model.embeddings, recorded["embeddings"]),
        # the model's own token builders (private methods: the layers that are not modules)
        LayerCase("feature_tokens", 1, lambda e: model._feature_tokens(batch, e), (embedded,)),
    ]
    if model.sequence_names:
        cases.append(LayerCase("sequence_tokens", 1, lambda e, x: model._sequence_tokens(batch, e, x), (embedded, x)))
    per_layer = {"x_summary": "x_summary", "pffn": "pffn", "self_attention": "self_attention",
                 "sequence_summary": "s_summary", "interaction": "interaction"}
    for name, attribute in per_layer.items():
        module = modules[name]
        if module is not None:
            # the sequence summary's S_sum (the sequence it hands on is its input's values, passed through)
            layer = (lambda s, summary=module: summary(s)[0]) if name == "sequence_summary" else module
            cases.append(LayerCase(name, count(attribute), layer, recorded[name]))
    cases.append(LayerCase("final_summary", 1, model.final_summary, recorded["final_summary"]))
    cases.append(LayerCase("heads", 1, heads, recorded["heads"]))
    return cases


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, Jagged):
        return value.with_values(value.values.detach())
    if isinstance(value, tuple):
        return tuple(_detach(v) for v in value)
    if isinstance(value, dict):
        return {k: _detach(v) for k, v in value.items()}
    return value


def _fresh_leaf(value: Any) -> Any:
    """A new leaf that requires grad for float tensors (as activations do inside the model)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().requires_grad_()
    if isinstance(value, Jagged) and value.values.is_floating_point():
        return value.with_values(value.values.detach().requires_grad_())
    if isinstance(value, dict):
        return {k: _fresh_leaf(v) for k, v in value.items()}
    return value


def _scalar(out: Any) -> torch.Tensor:
    """Sum of every float output (the backward seed; its FLOPs count zero)."""
    if isinstance(out, torch.Tensor):
        return out.float().sum() if out.is_floating_point() else out.new_zeros((), dtype=torch.float32)
    if isinstance(out, Jagged):
        return _scalar(out.values)
    values = out.values() if isinstance(out, dict) else out
    return sum(_scalar(v) for v in values)


def format_report(payload: dict[str, Any]) -> str:
    settings = payload["settings"]
    lines = [
        (f"bench layers {payload['preset']} on {payload['environment']['device']}: batch {settings['batch_size']} "
        f"({settings['history_tokens']} history tokens), {settings['precision']}, forward + backward alone"),
        f"  {'layer':<18}{'count':>6}{'ms':>10}{'GFLOP':>10}{'TFLOP/s':>10}{'local MFU':>11}{'time':>8}",
    ]
    for row in payload["rows"]:
        local = "n/a" if row["local_mfu"] is None else f"{100 * row['local_mfu']:.1f} %"
        lines.append(f"  {row['layer']:<18}{row['count']:>6}{row['ms']:>10.3f}{row['gflop']:>10.3f}"
                     f"{row['tflop_per_s']:>10.2f}{local:>11}{100 * row['time_share']:>7.1f}%")
    local = "n/a (CPU; pass --peak-tflops)" if payload["local_mfu"] is None else f"{100 * payload['local_mfu']:.1f} %"
    lines += [
        f"  sum of count x ms: {payload['layers_ms']:.2f} ms per step; FLOP-weighted local MFU {local}",
        f"  layer FLOPs cover {100 * payload['flops_coverage']:.2f} % of the model's analytic step FLOPs",
        f"  {payload['flop_convention']}",
    ]
    return "\n".join(lines)


def default_output(preset: str) -> Path:
    return Path("benchmarks/results") / f"layers_{preset}.json"
