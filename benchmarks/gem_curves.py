"""gem-small loss curves: every Triton kernel against the fp32 PyTorch references, on the same data (issue 7).

    PYTHONPATH=src python -m benchmarks.gem_curves [--quick] [--steps N] [--batch-size B] [--no-control]

Acceptance: "gem-small trains on one GPU with every Triton kernel active; its loss curve matches the
reference-kernel run on the same data within bf16 noise for the first 200 steps".

Runs (same preset, seed, initial weights; the same pre-generated synthetic batches, in the same order;
eager mode, fp32 matmuls in IEEE fp32 (no TF32) wherever fp32 is computed):

* ``triton``: bf16 autocast, every attention on its Triton kernel (``attention_backend="triton"``) and
  the Triton embedding lookup + fused optimizer.
* ``reference``: the same with the fp32 PyTorch references (``attention_backend="reference"``,
  ``OPENGEM_EMBEDDING_BACKEND=reference``): bf16 inputs, fp32 arithmetic, outputs rounded to bf16.
* ``reference_fp32``: the reference run without autocast: every GEMM and attention in fp32.
* ``control`` (a power check, ``--no-control`` skips it): the Triton run with a deliberately wrong
  attention mask (self-attention window halved), i.e. a kernel bug the criterion should catch.

Noise floor. "bf16 noise" is measured literally: how far the reference run's curve moves when the same
model on the same data computes in bf16 instead of fp32 (``reference`` vs ``reference_fp32``). The
Triton kernels differ from the references by bf16 roundings inside the attention (P and dS rounded to
bf16 before their GEMMs) and by summation order, a perturbation of the same kind but confined to the
attention, whereas the noise pair rounds every GEMM's inputs (weights included) to bf16; so a correct
kernel set is expected well inside it. Not chosen: TF32 on/off (under bf16 autocast it only touches
the reference attention, at 2^-11 rather than bf16's 2^-8: a floor below the rounding the kernels are
allowed), and different data orders or seeds (not the same data).

Measure. Per step the training loss of each run (summed BCE of the tasks, before the step's update);
divergence of a pair = |difference| of the trailing moving averages over ``--smooth`` steps (default 20:
the per-batch spread of the loss is paired out, the step-to-step jitter of the difference is not), its
max and mean over steps 1..N; also the raw per-step figures, and the relative error of the logits of
the first batch at the initial weights (no training dynamics in it).

Judgement. PASS when the Triton runs' kernels really launched (Triton's launch hook counts every
opengem kernel family the model uses; the reference runs launch none) and both the max and the mean
divergence of ``triton`` vs ``reference`` are at most ``k`` (default 2) times those of the noise pair.
Why 2: each divergence is a single measurement of a chaotic process (two runs that differ by a rounding
drift apart at a rate set by the training dynamics), so the ratio of two of them scatters around its
expectation; a correct kernel set is expected at a ratio <= 1 (smaller perturbation, see above), and
2x leaves room for that scatter, while a wrong mask or gradient drifts systematically and keeps
growing; the control run shows whether such a bug exceeds the bound at this length.

Writes ``benchmarks/results/gem_curves.json`` after every run (a time-out keeps what finished; the
control runs last) and ``gem_curves.png`` when matplotlib is installed. Time on an H200 (estimates:
batch 128, mean history ~220 tokens, up to 4096): building gem-small (1.4B embedding rows' worth of
CPU initialization) ~10-15 s per run; the Triton run ~0.1-0.15 s/step (host-bound), the reference runs
~0.25-0.5 s/step (the reference attention pads every sample to L x L, one sample per group above
~1.4k tokens); ~4-6 minutes for 200 steps with the control. ``--quick``: 30 steps of batch 64, no
control, ~1-1.5 minutes. Progress lines give each run's median ms/step.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import os
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks import common
from benchmarks.kernel_dispatch import TritonLaunches, dispatch_report, kernel_names, required_families
from opengem.data.schema import Batch
from opengem.models.presets import GEM_PRESETS
from opengem.nn.embedding import trust_ids
from opengem.train.config import PRESETS, TrainConfig, load_config
from opengem.train.data_stream import train_batches
from opengem.train.trainer import build_learner

FAMILY = "gem_curves"
EMBEDDING_BACKEND_ENV = "OPENGEM_EMBEDDING_BACKEND"
TRITON_VS_REFERENCE = ("triton", "reference")
NOISE_PAIR = ("reference", "reference_fp32")
CONTROL_PAIR = ("control", "reference")


@dataclass(frozen=True)
class RunSpec:
    name: str
    backend: str  # the kernels: "triton" or "reference" (attention_backend and the embedding backend)
    precision: str  # "bf16" (autocast) or "fp32"
    window_divisor: int = 1  # the control run divides the self-attention window by this


@dataclass(frozen=True)
class CurveOptions:
    preset: str = "gem-small"
    steps: int = 200
    batch_size: int = 128
    smooth: int = 20
    k: float = 2.0
    seed: int = 0
    control: bool = True
    device: str = "cuda"
    num_workers: int = 4  # DataLoader workers that pre-generate the batches
    triton_backend: str = "triton"  # what the "triton" runs use; a CPU check of the plumbing passes "reference"

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "smooth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.k <= 0:
            raise ValueError(f"k must be > 0, got {self.k}")
        if self.triton_backend not in ("triton", "reference"):
            raise ValueError(f"triton_backend must be 'triton' or 'reference', got {self.triton_backend!r}")
        if self.triton_backend == "triton" and not self.device.startswith("cuda"):
            raise ValueError(f"the Triton runs need a CUDA device, got device {self.device!r}")

    def runs(self) -> list[RunSpec]:
        runs = [
            RunSpec("triton", self.triton_backend, "bf16"),
            RunSpec("reference", "reference", "bf16"),
            RunSpec("reference_fp32", "reference", "fp32"),
        ]
        if self.control:
            runs.append(RunSpec("control", self.triton_backend, "bf16", window_divisor=2))
        return runs


def train_config(options: CurveOptions, spec: RunSpec) -> TrainConfig:
    """The preset's TrainConfig with the GEM model, this run's kernels and precision; no baseline, no eval."""
    overrides = [
        "architecture=gem", "baseline=false", f"batch_size={options.batch_size}", f"steps={options.steps}",
        f"seed={options.seed}", f"device={options.device}", f"precision={spec.precision}",
        f"num_workers={options.num_workers}", "compile=false",  # eager: the kernels, not Inductor, are compared
    ]  # fmt: skip
    config = load_config(options.preset, overrides=overrides)
    gem = dataclasses.replace(GEM_PRESETS[options.preset].model, attention_backend=spec.backend)
    if spec.window_divisor != 1:
        gem = dataclasses.replace(gem, window=max(1, gem.window // spec.window_divisor))
    return dataclasses.replace(config, gem=gem)


def make_batches(config: TrainConfig, steps: int, pin: bool) -> list[Batch]:
    """The first ``steps`` batches of the trainer's synthetic stream, generated once for every run."""
    stream = train_batches(config, start_step=0)
    batches = [next(stream) for _ in range(steps)]
    del stream  # stops the loader workers
    return [b.pin_memory() for b in batches] if pin else batches


@contextlib.contextmanager
def embedding_backend(backend: str) -> Iterator[None]:
    """Run the embedding lookup and its fused optimizer on ``backend`` (the op reads the variable per call)."""
    previous = os.environ.get(EMBEDDING_BACKEND_ENV)
    os.environ[EMBEDDING_BACKEND_ENV] = backend
    try:
        yield
    finally:
        if previous is None:
            del os.environ[EMBEDDING_BACKEND_ENV]
        else:
            os.environ[EMBEDDING_BACKEND_ENV] = previous


def weights_fingerprint(model: torch.nn.Module) -> list[float]:
    """Sum and sum of squares (fp64) over every floating tensor of the state: equal initial weights check.

    In chunks: gem-small's tables hold 1.4B fp32 values, whose fp64 copy would take 11 GB at once.
    """
    total = squares = 0.0
    for tensor in model.state_dict().values():
        if tensor.is_floating_point():
            for chunk in tensor.detach().flatten().split(1 << 26):
                values = chunk.double()
                total += float(values.sum())
                squares += float(values.square().sum())
    return [total, squares]


def train_run(spec: RunSpec, options: CurveOptions, batches: list[Batch], names: dict[str, set[str]]) -> dict[str, Any]:
    """Train one run over ``batches``; returns its losses, timing, first-batch logits and kernel launches."""
    config = train_config(options, spec)
    device = torch.device(options.device)
    with embedding_backend(spec.backend), TritonLaunches() as launches:
        torch.manual_seed(config.seed)
        learner = build_learner(config, config.model.history, device)
        trust_ids(learner.model)  # synthetic ids: skip the per-step id check (a sync on the GPU)
        fingerprint = weights_fingerprint(learner.model)
        with torch.no_grad():
            first_logits = learner.forward(batches[0].to(device)).cpu()
        losses, step_s = [], []
        begin = time.perf_counter()
        for step, batch in enumerate(batches, start=1):
            start = time.perf_counter()
            losses.append(float(learner.step(batch.to(device, non_blocking=True))))  # reading the loss synchronizes
            step_s.append(time.perf_counter() - start)
            if step % max(1, options.steps // 10) == 0 or step == options.steps:
                print(
                    f"  [{spec.name}] step {step}/{options.steps} loss {losses[-1]:.4f} "
                    f"({1e3 * statistics.median(step_s):.0f} ms/step median)",
                    flush=True,
                )
        seconds = time.perf_counter() - begin
    del learner
    gc.collect()  # free this run's tables (GBs on gem-small) before the next run builds its own
    if device.type == "cuda":
        torch.cuda.empty_cache()
    report = dispatch_report(spec.backend, launches.counts, required_families(config.gem), names, launches.available)
    return {
        **dataclasses.asdict(spec),
        "window": config.gem.window,
        "losses": losses,
        "seconds": seconds,
        "median_step_ms": 1e3 * statistics.median(step_s),
        "weights_fingerprint": fingerprint,
        "first_logits": first_logits,
        "dispatch": report,
    }


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def divergence(a: Sequence[float], b: Sequence[float], window: int) -> dict[str, float]:
    raw = [abs(x - y) for x, y in zip(a, b)]
    smoothed = [abs(x - y) for x, y in zip(moving_average(a, window), moving_average(b, window))]
    return {
        "max_smoothed": max(smoothed), "mean_smoothed": statistics.fmean(smoothed),
        "max_raw": max(raw), "mean_raw": statistics.fmean(raw),
    }  # fmt: skip


def ratio(value: float, floor: float) -> float:
    if floor > 0:
        return value / floor
    return 0.0 if value == 0 else math.inf


def judge(runs: dict[str, dict[str, Any]], window: int, k: float) -> dict[str, Any]:
    """Divergences of the pairs present in ``runs`` and, once the three main runs exist, the verdict."""
    pairs = {
        "triton_vs_reference": TRITON_VS_REFERENCE, "noise_reference_bf16_vs_fp32": NOISE_PAIR,
        "triton_vs_reference_fp32": ("triton", "reference_fp32"), "control_vs_reference": CONTROL_PAIR,
    }  # fmt: skip
    divergences, logits_error = {}, {}
    for label, (a, b) in pairs.items():
        if a in runs and b in runs:
            divergences[label] = divergence(runs[a]["losses"], runs[b]["losses"], window)
            logits_error[label] = common.relative_error(runs[a]["first_logits"], runs[b]["first_logits"])
    result: dict[str, Any] = {
        "k": k,
        "smooth_window": window,
        "divergence": divergences,
        "first_batch_logits_relative_error": logits_error,
    }
    if "triton_vs_reference" not in divergences or "noise_reference_bf16_vs_fp32" not in divergences:
        return {**result, "verdict": "INCOMPLETE"}
    measured, noise = divergences["triton_vs_reference"], divergences["noise_reference_bf16_vs_fp32"]
    ratios = {stat: ratio(measured[stat], noise[stat]) for stat in ("max_smoothed", "mean_smoothed")}
    fingerprints = {name: run["weights_fingerprint"] for name, run in runs.items()}
    same_weights = all(f == fingerprints["triton"] for f in fingerprints.values())
    dispatch_ok = all(run["dispatch"]["ok"] for run in runs.values())
    finite = all(math.isfinite(x) for run in runs.values() if run["name"] != "control" for x in run["losses"])
    within = all(r <= k for r in ratios.values())
    result.update(
        ratios_to_noise=ratios, same_initial_weights=same_weights, dispatch_ok=dispatch_ok, finite_losses=finite
    )
    # informational, not in the verdict (the acceptance is about the curves): the same comparison without
    # training dynamics, one forward at the initial weights
    result["first_logits_ratio_to_noise"] = ratio(
        logits_error["triton_vs_reference"], logits_error["noise_reference_bf16_vs_fp32"]
    )
    if "control_vs_reference" in divergences:
        control = divergences["control_vs_reference"]
        control_ratios = {stat: ratio(control[stat], noise[stat]) for stat in ratios}
        result["control_ratios_to_noise"] = control_ratios
        result["control_detected"] = any(r > k for r in control_ratios.values())
    result["verdict"] = "PASS" if within and same_weights and dispatch_ok and finite else "FAIL"
    return result


def payload_of(options: CurveOptions, runs: dict[str, dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The JSON rows (one per step: every run's loss) and the rest of the results."""
    rows = [
        {"step": step, **{name: run["losses"][step - 1] for name, run in runs.items()}}
        for step in range(1, options.steps + 1)
    ]
    summary = {
        name: {key: value for key, value in run.items() if key not in ("losses", "first_logits")}
        for name, run in runs.items()
    }
    extra = {
        "settings": {**dataclasses.asdict(options), "float32_matmul_precision": torch.get_float32_matmul_precision()},
        "loss": "summed BCE over the tasks, per step before its update",
        "runs": summary,
        **judge(runs, options.smooth, options.k),
    }
    return rows, extra


def print_summary(extra: dict[str, Any]) -> None:
    rows = [
        {"pair": label, **values, "first_logits_rel_err": extra["first_batch_logits_relative_error"][label]}
        for label, values in extra["divergence"].items()
    ]
    common.print_table(rows, ["pair", "max_smoothed", "mean_smoothed", "max_raw", "mean_raw", "first_logits_rel_err"])
    for name, run in extra["runs"].items():
        dispatch = run["dispatch"]
        state = "ok" if dispatch["ok"] else "PROBLEM: " + "; ".join(dispatch["problems"])
        print(
            f"{name:<15} {run['median_step_ms']:8.1f} ms/step  Triton launches per family "
            f"{dispatch['launches_per_family']}  dispatch {state}"
        )
    if "ratios_to_noise" in extra:
        print(
            f"triton-vs-reference / noise: {extra['ratios_to_noise']} (k = {extra['k']}); first-batch logits "
            f"{extra['first_logits_ratio_to_noise']:.3g}; same initial weights {extra['same_initial_weights']}, "
            f"dispatch ok {extra['dispatch_ok']}"
        )
    if "control_ratios_to_noise" in extra:
        print(
            f"control (window halved) / noise: {extra['control_ratios_to_noise']}; detected: {extra['control_detected']}"
        )
    print(f"verdict: {extra['verdict']}")


def plot_curves(rows: list[dict[str, Any]], extra: dict[str, Any], window: int, out: Path) -> Path:
    """Top: every run's smoothed loss; bottom: |smoothed difference| of each pair against the reference."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    steps = [row["step"] for row in rows]
    names = [key for key in rows[0] if key != "step"]
    curves = {name: moving_average([row[name] for row in rows], window) for name in names}
    colors = {"triton": "tab:blue", "reference": "tab:orange", "reference_fp32": "tab:green", "control": "tab:red"}
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for name in names:
        top.plot(steps, curves[name], label=name, linewidth=1.2, color=colors[name])
    top.set_ylabel(f"training loss ({window}-step mean)")
    top.legend()
    for a, b in (TRITON_VS_REFERENCE, NOISE_PAIR, CONTROL_PAIR):
        if a in curves and b in curves:
            difference = [abs(x - y) for x, y in zip(curves[a], curves[b])]
            color = colors["reference_fp32" if b == "reference_fp32" else a]
            bottom.plot(steps, difference, label=f"|{a} - {b}|", color=color)
    bottom.set_yscale("log")
    bottom.set_xlabel("step")
    bottom.set_ylabel("|difference|")
    bottom.legend()
    figure.suptitle(f"{extra['settings']['preset']}: Triton vs reference kernels, bf16 ({extra['verdict']})")
    figure.tight_layout()
    figure.savefig(out, dpi=120)
    plt.close(figure)
    return out


def run_curves(options: CurveOptions) -> dict[str, Any]:
    """Every run in turn; the JSON is rewritten after each. Returns the final results (``rows`` included)."""
    torch.set_float32_matmul_precision("highest")  # fp32 means fp32: no TF32 in the references or the fp32 run
    device = torch.device(options.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA device")
    specs = options.runs()
    begin = time.perf_counter()
    batches = make_batches(train_config(options, specs[0]), options.steps, pin=device.type == "cuda")
    tokens = sum(b.num_history_tokens() for b in batches) / len(batches)
    print(
        f"{options.steps} batches of {options.batch_size} ({tokens:.0f} history tokens each on average) in "
        f"{time.perf_counter() - begin:.1f} s",
        flush=True,
    )
    names = kernel_names()
    runs: dict[str, dict[str, Any]] = {}
    for spec in specs:
        print(f"run {spec.name}: {spec.backend} kernels, {spec.precision}", flush=True)
        runs[spec.name] = train_run(spec, options, batches, names)
        rows, extra = payload_of(options, runs)
        path = common.write_results(FAMILY, rows, extra)
    print_summary(extra)
    print(f"wrote {path}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib not installed: no plot")
    else:
        print(f"wrote {plot_curves(rows, extra, options.smooth, path.with_suffix('.png'))}")
    return {"rows": rows, **extra}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 30 steps of batch 64, no control")
    parser.add_argument("--preset", default="gem-small", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=int, default=None, help="default 200 (--quick: 30)")
    parser.add_argument("--batch-size", type=int, default=None, help="default 128 (--quick: 64)")
    parser.add_argument("--smooth", type=int, default=None, help="moving-average window, default 20 (--quick: 10)")
    parser.add_argument("--k", type=float, default=2.0, help="allowed ratio of divergence to the noise floor")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-control", action="store_true", help="skip the wrong-mask control run")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-workers", type=int, default=4)
    args = parser.parse_args(argv)
    options = CurveOptions(
        preset=args.preset, steps=args.steps or (30 if args.quick else 200),
        batch_size=args.batch_size or (64 if args.quick else 128), smooth=args.smooth or (10 if args.quick else 20),
        k=args.k, seed=args.seed, control=not (args.no_control or args.quick),
        device=args.device, num_workers=args.num_workers,
    )  # fmt: skip
    return run_curves(options)


if __name__ == "__main__":
    main()
