"""`opengem bench train`: steady-state speed of the whole training step, its MFU and where the time goes.

The learner is built exactly as the trainer builds it (``build_learner``, the GEM architecture of the
preset) and fed by the trainer's data stream. After ``warmup`` steps and one run of the window's own
batches (so that no batch shape in the window is met for the first time), ``steps`` steps run between two
timing points (CUDA events; the only synchronization of the window is at its end). FLOPs are the
analytic count of the batches actually drawn (`opengem.train.flops`). Then the window's first few batches
run again under the profiler for the phase split (`opengem.train.bench.phases`) and their kernel time, then
again under a kernels-only profile for where the GPU waited (`opengem.train.bench.kernels`), and the data
stream runs alone to check that the loader outpaces the step (GEM issue 10: >= 2x).
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from opengem.data.schema import Batch
from opengem.nn.embedding import trust_ids
from opengem.nn.low_precision import LowPrecisionLinear
from opengem.nn.low_precision_traced import compile_path
from opengem.train.bench.host_speed import format_host_speed, host_speed
from opengem.train.bench.kernels import family_split, idle_gaps, top_kernels
from opengem.train.bench.phases import DATA_RANGE, HOST_TO_DEVICE_RANGE, ForwardRange, phase_split_us
from opengem.train.bench.timing import FLOP_CONVENTION, WindowTimer, environment, synchronize, warm_until_settled
from opengem.train.bench.watch import allocator_counts, events_report, host_events
from opengem.train.config import LOW_PRECISION_MLPS, PRECISIONS, TrainConfig, load_config
from opengem.train.data_stream import train_batches
from opengem.train.flops import device_peak_flops, measured_matmul_peak, mfu, train_flops
from opengem.train.shadow_adamw import ShadowAdamW
from opengem.train.trainer import Learner, build_learner, resolve_device
from opengem.validation import check_optional_positive_finite, is_int, is_number, require_at_least


@dataclass(frozen=True)
class TrainBenchOptions:
    preset: str
    steps: int = 50
    warmup: int = 10
    # untimed steps on the window's restarted loader: its workers' start contends with the first steps' host
    # work (gem-small's first two timed steps took 290 and 213 ms against a 140.5 ms median, session 18)
    lead_steps: int = 3
    max_tuning_steps: int = 20  # after ``warmup``: more steps until it settles (``warm_until_settled``)
    precision: str | None = None  # TrainConfig.precision; None: an overrides precision=, else bf16 on CUDA, fp32 on CPU
    low_precision_mlp: str = "none"  # a recipe of opengem.nn.low_precision for the large Linear layers
    compile: bool = False
    device: str = "auto"
    batch_size: int | None = None
    num_workers: int | None = None
    profile_steps: int = 3
    loader_batches: int = 20
    peak_tflops: float | None = None  # the device's dense BF16 peak when it is not in DEVICE_PEAKS
    matmul_size: int | None = None  # measured-ceiling GEMM size; None: 8192 on CUDA, 512 on CPU
    overrides: tuple[str, ...] = ()  # further `--set key=value` settings of the TrainConfig
    trace: Path | None = None  # the profiled steps' CPU + GPU timeline (Chrome / Perfetto JSON; gzipped if .gz)

    def __post_init__(self) -> None:
        # a bool had passed as a count (steps=True: one step) and a float as one (2.5 steps in the messages)
        counts = ("steps", "profile_steps", "loader_batches", "warmup", "lead_steps", "max_tuning_steps")
        optional_counts = ("batch_size", "num_workers", "matmul_size")
        for name in counts + tuple(n for n in optional_counts if getattr(self, n) is not None):
            if not is_int(getattr(self, name)):
                raise ValueError(f"{name} must be an int, got {getattr(self, name)!r}")
        if self.peak_tflops is not None and not is_number(self.peak_tflops):
            raise ValueError(f"peak_tflops must be a number, got {self.peak_tflops!r}")
        require_at_least(self, ("steps", "profile_steps", "loader_batches"), 1)
        require_at_least(self, ("warmup", "lead_steps", "max_tuning_steps"), 0)
        # was refused only after the whole run; an infinite peak made every MFU 0
        check_optional_positive_finite(peak_tflops=self.peak_tflops)
        if self.matmul_size is not None:  # was a torch error after the whole run (-1), or 0 measured at 512
            require_at_least(self, ("matmul_size",), 1)
        if self.profile_steps > self.steps:  # the profiled steps replay the window's first batches
            raise ValueError(f"profile_steps ({self.profile_steps}) must be <= steps ({self.steps})")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.low_precision_mlp not in LOW_PRECISION_MLPS:
            raise ValueError(f"low_precision_mlp must be one of {LOW_PRECISION_MLPS}, got {self.low_precision_mlp!r}")


def bench_config(options: TrainBenchOptions) -> tuple[TrainConfig, torch.device, str]:
    """The preset's TrainConfig with the GEM architecture and the benchmark's settings; device; precision."""
    # --compile: build_learner compiles the blocks, as the trainer does (after the low-precision conversion and the
    # weight shadows), with the config's compile settings
    overrides = ["architecture=gem", f"device={options.device}", "baseline=false", f"compile={options.compile}",
                 f"low_precision_mlp={options.low_precision_mlp}"]  # converted by build_learner, before compiling
    if options.batch_size is not None:
        overrides.append(f"batch_size={options.batch_size}")
    if options.num_workers is not None:
        overrides.append(f"num_workers={options.num_workers}")
    steps = (options.warmup + options.max_tuning_steps + 2 * (options.lead_steps + options.steps)
             + options.profile_steps)
    overrides.append(f"steps={steps}")  # the LR schedule's length
    # The precision joins the overrides before the config is checked: a setting that needs bf16 (weight_shadows=true)
    # must see the benchmark's precision, not the preset's. --precision, else an explicit --set, else by device.
    settings = {key.strip(): value.strip() for key, _, value in (item.partition("=") for item in options.overrides)}
    device = resolve_device(settings.get("device", options.device))
    precision = options.precision if options.precision is not None else settings.get("precision")
    if precision is None:  # not `or`: an empty `--set precision=` must reach the config, which refuses it
        precision = "bf16" if device.type == "cuda" else "fp32"
    config = load_config(options.preset, overrides=[*overrides, *options.overrides, f"precision={precision}"])
    return config, device, precision


def require_file_name(path: Path, what: str) -> None:
    """Raise ``ValueError`` (naming ``what``, e.g. ``--out``) when ``path`` cannot be written as a file: it is an
    existing directory (a JSON write fails after the run; the profiler's trace lands in ``<path>.tmp`` without a
    word) or sits under a file. Call it before the run."""
    if path.is_dir():
        raise ValueError(f"{what} {path} is a directory; give a file name")
    parent = next((folder for folder in path.parents if folder.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ValueError(f"{what} {path}: {parent} is a file, not a directory")


def bench_train(options: TrainBenchOptions) -> dict[str, Any]:
    """Run the benchmark; returns the JSON payload (see `format_report` for what each figure is)."""
    config, device, precision = bench_config(options)
    if options.trace is not None:  # fail now, not after the run
        require_file_name(options.trace, "trace")
        options.trace.parent.mkdir(parents=True, exist_ok=True)
    speed = host_speed(device)  # before the loader's workers start: the machine's own pace
    torch.manual_seed(config.seed)
    learner = build_learner(config, config.model.history, device)
    model = learner.model
    trust_ids(model)  # synthetic ids: no id check, no sync per step
    converted = [name for name, module in model.named_modules() if isinstance(module, LowPrecisionLinear)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    stream = train_batches(config, start_step=0)
    # The warm-up runs the window's batches too (the window replays batches 0..lead+steps-1): a batch whose
    # shape meets new autotuner keys (a length bucket; 2.7 s on an H200 in session 12) is tuned before timing.
    tuning_steps = warm_until_settled(lambda: learner.step(next(stream).to(device, non_blocking=True)),
                                      options.warmup + options.lead_steps + options.steps,
                                      options.max_tuning_steps if device.type == "cuda" else 0,
                                      sync=lambda: synchronize(device))
    synchronize(device)
    _progress(f"warm after {options.warmup} + {options.lead_steps + options.steps} (the window's batches) + "
              f"{tuning_steps} steps")
    stream = train_batches(config, start_step=0)
    # The restarted loader's workers start now: its first batches run before the window, so the window does
    # not time their start (974 ms in the first timed step of gem-small, session 13); later waits are timed.
    for _ in range(options.lead_steps):
        learner.step(next(stream).to(device, non_blocking=True))
    waiting_batch: Batch | None = next(stream)  # (no sync: the window starts with the lead steps' work queued)

    timer, data_wait, lengths, loss = WindowTimer(device), 0.0, [], float("nan")
    events_before = host_events()
    step_events, compiled_in_step = events_before, []
    timer.start()
    for _ in range(options.steps):
        fetch = time.perf_counter()
        batch = next(stream) if waiting_batch is None else waiting_batch
        waiting_batch = None
        data_wait += time.perf_counter() - fetch
        lengths.append(batch.history_age.lengths_host())
        loss = learner.step(batch.to(device, non_blocking=True))
        timer.lap()
        # host counters, no sync: did this step tune or compile (a batch shape not met before)?
        now = host_events(allocator=False)
        compiled_in_step.append(now.compiled_since(step_events))
        step_events = now
    elapsed = timer.stop()
    step_events = step_events._replace(**allocator_counts())  # (nothing allocates in the stop's synchronization)
    while_timed, laps_ms = events_report(events_before, after=step_events), timer.laps_ms()
    calm_laps = [ms for ms, compiled in zip(laps_ms, compiled_in_step) if not compiled]
    untuned_ms = statistics.fmean(calm_laps) if calm_laps else None
    step_ms = 1e3 * elapsed / options.steps
    profiled_laps_ms = statistics.fmean(laps_ms[:options.profile_steps])  # the batches profiled below
    _progress(f"timed {options.steps} steps: {step_ms:.2f} ms each")

    stream = None  # stops its loader workers
    # The profiled steps replay the window's first batches: the kernel time of the very batches timed there. The
    # window's steps range 235-325 ms on gem-large (their token counts differ), so the kernel time of other
    # batches set against the window's mean says little about the GPU's idle time.
    replayed: list[Batch] = []  # kept for the kernels-only profile, which replays them once more
    replay = _recorded(_started(train_batches(config, start_step=options.lead_steps)), replayed)
    phases_ms, kernel_figures, profiled_step_ms = _profile_phases(
        learner, replay, device, options.profile_steps, options.trace)  # fmt: skip
    replay = None  # stops its loader workers
    gaps = _device_gaps(learner, iter(replayed), device, options.profile_steps)
    _progress(f"profiled {options.profile_steps} steps: {profiled_step_ms:.2f} ms each")
    loader_samples_per_s = _loader_rate(config, options.loader_batches)

    flops = [train_flops(model, n) for n in lengths]
    samples = options.steps * config.batch_size
    total_flops = sum(f.train for f in flops)
    flops_per_s = total_flops / elapsed
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    device_peak = None
    if device.type == "cuda" or options.peak_tflops is not None:
        device_peak = device_peak_flops(device_name, "bf16", options.peak_tflops)
    matmul_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    matmul_size = options.matmul_size if options.matmul_size is not None else 8192 if device.type == "cuda" else 512
    ceiling = measured_matmul_peak(device, matmul_dtype, matmul_size)
    results = {
        "step_ms": step_ms,
        "step_ms_each": laps_ms,  # each timed step's share of the window (a stall shows as an outlier)
        "step_ms_median": statistics.median(laps_ms),
        # the mean over the timed steps that tuned or compiled nothing: the rate once every shape was met
        "steps_that_tuned": sum(compiled_in_step),
        "step_ms_untuned": untuned_ms,
        "samples_per_s": samples / elapsed,
        "tokens_per_s": sum(int(n.sum()) for n in lengths) / elapsed,
        "train_flops_per_sample": total_flops / samples,
        "attention_share": sum(3.5 * f.attention for f in flops) / total_flops,
        "flops_per_s": flops_per_s,
        "device_peak_tflops": None if device_peak is None else device_peak / 1e12,
        "mfu": None if device_peak is None else mfu(flops_per_s, device_peak),
        "mfu_untuned": None if device_peak is None or untuned_ms is None else mfu(
            total_flops / options.steps / (1e-3 * untuned_ms), device_peak),
        "matmul_ceiling_tflops": ceiling / 1e12,
        "mfu_vs_matmul_ceiling": mfu(flops_per_s, ceiling),
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        # the allocator's reserve: well above the allocated peak, the jagged shapes fragment its segments (gem-large
        # b384 ran out of memory with 11 GiB reserved and unused, session 62)
        "peak_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else None,
        "data_wait_ms": 1e3 * data_wait / options.steps,
        "loader_samples_per_s": loader_samples_per_s,
        "loader_over_step_rate": loader_samples_per_s * elapsed / samples,
        "profiled_step_ms": profiled_step_ms,
        # the profiler slows the host, so its "idle" overstates the timed steps' idle: this is the timed one, the
        # laps of the profiled (replayed) batches less their kernel time
        "timed_ms_of_profiled_batches": profiled_laps_ms,
        "gpu_idle_ms_timed": (profiled_laps_ms - sum(kernel_figures["kernel_families_ms"].values())
                              if kernel_figures["kernel_families_ms"] else None),
        "last_loss": float(loss),
        "host_speed": speed,
    }
    shadow_adamw = isinstance(learner.optimizer, ShadowAdamW)
    settings = {
        **{k: v for k, v in dataclasses.asdict(options).items() if k != "overrides"},
        "overrides": list(options.overrides),
        "trace": None if options.trace is None else str(options.trace),
        "precision": precision,
        "compile": config.compile,  # --compile, or a `--set compile=...` after it
        "batch_size": config.batch_size,
        "num_workers": config.num_workers,
        # the config's recipe: a `--set low_precision_mlp=...` override wins over the option
        "low_precision_mlp": config.low_precision_mlp,
        "fp8_compile_path": compile_path() if config.low_precision_mlp != "none" else None,
        "low_precision_layers": converted,
        # as the run applied them (the config's auto resolved: opengem.train.config.shadow_settings)
        "weight_shadows": learner.weight_shadows is not None,
        "shadow_adamw": shadow_adamw,
        "shadow_adamw_moments": config.shadow_adamw_moments if shadow_adamw else None,
        "device": str(device),
        "tuning_steps": tuning_steps,  # warm-up steps past ``warmup + steps`` (something compiled, or slow steps)
        # any count > 0: seconds of host work (tuning, compiling, collecting) inside the timed steps
        "host_events_while_timed": while_timed,
    }
    return {
        "benchmark": "train",
        "preset": options.preset,
        "environment": environment(device),
        "settings": settings,
        "flop_convention": FLOP_CONVENTION,
        "results": results,
        "phases_ms": phases_ms,
        **kernel_figures,  # ``_kernel_figures``: by family, and the top kernels by time and by launches
        "idle_gaps": gaps,  # where the GPU waited in those batches (``_device_gaps``; empty on a CPU run)
    }


def _progress(message: str) -> None:
    """A line on stderr as each stage ends: a run cut short by a time limit shows where it was."""
    print(f"bench train: {message}", file=sys.stderr, flush=True)


def _started(stream: Iterator[Batch]) -> Iterator[Batch]:
    """``stream`` with its first batch already fetched: a restarted loader's worker start-up is not profiled."""
    first = next(stream)
    return itertools.chain([first], stream)


def _recorded(stream: Iterator[Batch], into: list[Batch]) -> Iterator[Batch]:
    """``stream``, each batch also appended to ``into`` as it is taken."""
    for batch in stream:
        into.append(batch)
        yield batch


def _device_gaps(learner: Learner, stream: Iterator[Batch], device: torch.device, steps: int) -> dict[str, object]:
    """:func:`~opengem.train.bench.kernels.idle_gaps` of ``steps`` steps profiled for their kernels only, a lighter
    profile than the phase split's; CUPTI's cost per launch still slows the host (gem-large: 40-62 ms of gaps a step
    where the timed steps idled 12-19, session 31), so the gaps say where the GPU waits, not how long it does in
    the timed steps (``benchmarks.diag.host_lead`` measures that without a profiler). Empty on a CPU run."""
    if device.type != "cuda":
        return {}
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(steps):
            learner.step(next(stream).to(device, non_blocking=True))
        synchronize(device)
    return idle_gaps(profiler.events(), steps)


def _profile_phases(
    learner: Learner, stream: Iterator[Batch], device: torch.device, steps: int, trace: Path | None = None
) -> tuple[dict[str, float], dict[str, Any], float]:
    """Milliseconds per step of each phase over ``steps`` profiled steps, plus ``idle`` (the step's time
    not covered by any phase: GPU idle, or host time outside any op on a CPU run); the kernel figures
    (``_kernel_figures``); and the step time. ``trace``: where to write the profiled steps' timeline, to see what
    the GPU waits for."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    model = learner.model
    learner.model = ForwardRange(model)
    try:
        with profile(activities=activities) as profiler:
            begin = time.perf_counter()
            for _ in range(steps):
                with record_function(DATA_RANGE):
                    batch: Batch = next(stream)
                with record_function(HOST_TO_DEVICE_RANGE):
                    batch = batch.to(device, non_blocking=True)
                learner.step(batch)
            synchronize(device)
            step_ms = 1e3 * (time.perf_counter() - begin) / steps
    finally:
        learner.model = model
    if trace is not None:
        profiler.export_chrome_trace(str(trace))  # torch gzips a path ending in .gz
        _progress(f"wrote the profiled steps' trace to {trace}")
    events = profiler.events()
    phases = {name: us / 1e3 / steps for name, us in phase_split_us(events, device).items()}
    phases["idle"] = max(0.0, step_ms - sum(phases.values()))
    return phases, _kernel_figures(events, steps, device), step_ms


def _kernel_figures(events: list, steps: int, device: torch.device) -> dict[str, Any]:
    """The payload's per-step kernel figures (``opengem.train.bench.kernels``), each empty on a CPU run: GPU
    milliseconds and launches by kernel family (the launches with a "total"), the kernels with the most GPU time,
    and the 30 launched most often."""
    if device.type != "cuda":
        return {"kernel_families_ms": {}, "kernel_launches_per_step": {}, "top_kernels": [],
                "most_launched_kernels": []}
    family_us, family_counts = family_split(events)
    launches = {name: count / steps for name, count in family_counts.items()}
    return {
        "kernel_families_ms": {name: us / 1e3 / steps for name, us in family_us.items()},
        "kernel_launches_per_step": {**launches, "total": sum(launches.values())},
        "top_kernels": top_kernels(events, steps),
        "most_launched_kernels": top_kernels(events, steps, 30, by="launches"),
    }


def _loader_rate(config: TrainConfig, batches: int) -> float:
    """Samples/s of the trainer's data stream alone (fresh samples, after two batches of worker start-up)."""
    stream = train_batches(config, start_step=1 << 20)
    for _ in range(2):
        next(stream)
    begin = time.perf_counter()
    for _ in range(batches):
        next(stream)
    return batches * config.batch_size / (time.perf_counter() - begin)


def add_scaling_ratio(payload: dict[str, Any], layers_payload: dict[str, Any]) -> None:
    """GEM_SPEC section 8: scaling ratio = E2E MFU / local MFU (each layer alone, FLOP-weighted)."""
    r = payload["results"]
    r["local_mfu"] = layers_payload["local_mfu"]
    r["scaling_ratio"] = None if r["mfu"] is None or not r["local_mfu"] else r["mfu"] / r["local_mfu"]


def _format_untuned(results: dict[str, Any]) -> str:
    tuned = results["steps_that_tuned"]
    if results["step_ms_untuned"] is None:
        return f"  untuned steps     none: each of the {tuned} timed steps tuned or compiled something"
    mfu_text = "" if results["mfu_untuned"] is None else f", E2E MFU {100 * results['mfu_untuned']:.1f} %"
    return (f"  untuned steps     {results['step_ms_untuned']:>12.2f} ms mean{mfu_text} (the timed steps less "
            f"{tuned} that tuned or compiled)")


def format_scaling(results: dict[str, Any]) -> str:
    """The report's line of `add_scaling_ratio`'s figures."""
    if results.get("scaling_ratio") is None:
        return f"  local MFU         n/a (layers alone: {results.get('local_mfu')}); no scaling ratio"
    return (f"  local MFU         {100 * results['local_mfu']:>12.1f} % (layers alone); scaling ratio "
            f"{results['scaling_ratio']:.2f}")


# GPU idle above this share of the step: the host paced it (gem-large b256 on H100s: 3-20% in sessions 50-51, 29-34%
# on the two slowest hosts of session 50)
HOST_PACED_IDLE_SHARE = 0.2


def _format_idle(payload: dict[str, Any]) -> list[str]:
    r, gaps = payload["results"], payload.get("idle_gaps")
    if r.get("gpu_idle_ms_timed") is None:
        return []
    if "timed_ms_of_profiled_batches" not in r:  # before session 31: the window's mean less other batches' kernels
        return [f"  GPU idle in the timed steps {r['gpu_idle_ms_timed']:.2f} ms / step (timed step - kernel time)"]
    lines = [f"  GPU idle in the timed steps {r['gpu_idle_ms_timed']:.2f} ms / step (the profiled batches' timed laps, "
             f"{r['timed_ms_of_profiled_batches']:.2f} ms, less their kernel time)"]
    share = r["gpu_idle_ms_timed"] / r["timed_ms_of_profiled_batches"]
    if share > HOST_PACED_IDLE_SHARE:
        lines.append(f"  the host paced these steps (the GPU idled {100 * share:.0f}% of them): a slower or busier "
                     "host does that (docs/performance.md): compare with a baseline run on this machine, not another's")
    if gaps:
        lines.append(f"  idle gaps (the same batches, kernels-only profile) {gaps['idle_ms_per_step']:.2f} ms / "
                     f"step, {gaps['spacing_ms_per_step']:.2f} of it in gaps under {gaps['min_gap_us']:g} us; the "
                     "longer ones (ms / step, gaps / step, after -> before):")
        lines += [f"    {g['ms_per_step']:>8.3f} {g['gaps_per_step']:>6.1f}  {g['after'][:50]} -> {g['before'][:50]}"
                  for g in gaps["gaps"]]
    return lines


def _format_shadows(settings: dict[str, Any]) -> str:
    """", weight shadows + shadow AdamW" and the like; empty for runs without them (or written before session 60)."""
    names = [name for key, name in (("weight_shadows", "weight shadows"), ("shadow_adamw", "shadow AdamW"))
             if settings.get(key)]
    if settings.get("shadow_adamw_moments") == "bf16":
        names[-1] += " (bf16 moments)"
    return f", {' + '.join(names)}" if names else ""


def format_report(payload: dict[str, Any]) -> str:
    r, s = payload["results"], payload["settings"]

    if r["mfu"] is None:
        e2e = "n/a: no dense peak for this device (pass --peak-tflops)"
    else:
        e2e = f"{100 * r['mfu']:.1f} % of the dense BF16 peak ({r['device_peak_tflops']:.0f} TFLOP/s)"
    memory = "n/a (CPU)" if r["peak_memory_gb"] is None else f"{r['peak_memory_gb']:.2f} GiB"
    if r.get("peak_reserved_gb") is not None:  # absent before session 62
        memory += f" ({r['peak_reserved_gb']:.2f} GiB reserved by the allocator)"
    fp8_path = "" if s.get("fp8_compile_path") is None else f" ({s['fp8_compile_path']})"  # absent before session 22
    lines = [
        (f"bench train {payload['preset']} on {payload['environment']['device']}: batch {s['batch_size']}, "
         f"{s['precision']}, low-precision MLP {s['low_precision_mlp']}{fp8_path}, compile {s['compile']}"
         f"{_format_shadows(s)}"),
        (f"  step              {r['step_ms']:>12.2f} ms   ({s['steps']} steps after {s['warmup']} + "
         f"{s.get('lead_steps', 0) + s['steps']} + {s['tuning_steps']} warm-up, the window's batches among them, "
         f"and {s.get('lead_steps', 0)} on the restarted loader)"),
        (f"  timed steps       {r['step_ms_median']:>12.2f} ms median, {min(r['step_ms_each']):.2f} min, "
         f"{max(r['step_ms_each']):.2f} max"),
        "  while timed       "
        + ", ".join(f"{k} {v}" for k, v in s["host_events_while_timed"].items() if k != "kernels"),
        _format_untuned(r),
        *format_host_speed(r.get("host_speed")),
        f"  samples/s         {r['samples_per_s']:>12,.0f}",
        f"  tokens/s          {r['tokens_per_s']:>12,.0f}",
        (f"  train FLOPs       {r['train_flops_per_sample'] / 1e9:>12.3f} GFLOP / sample "
        f"(attention {100 * r['attention_share']:.1f} %)"),
        f"  model FLOP/s      {r['flops_per_s'] / 1e12:>12.2f} TFLOP/s",
        f"  E2E MFU           {e2e}",
        (f"  vs matmul ceiling {100 * r['mfu_vs_matmul_ceiling']:>12.1f} % of {r['matmul_ceiling_tflops']:.3g} TFLOP/s "
        "measured"),
        *([format_scaling(r)] if r.get("scaling_ratio") is not None else []),
        f"  peak memory       {memory}",
        (f"  loader alone      {r['loader_samples_per_s']:>12,.0f} samples/s = {r['loader_over_step_rate']:.2f}x the "
        f"step rate (data wait {r['data_wait_ms']:.2f} ms / step)"),
        f"  phase split (ms / step over profiled steps of {r['profiled_step_ms']:.2f} ms):",
        *(f"    {name:<16}{ms:>10.3f}" for name, ms in payload["phases_ms"].items()),
        *(["  GPU ms per step by kernel family (kernels launched per step):"] if payload.get("kernel_families_ms")
          else []),
        *(f"    {name:<18}{ms:>8.3f} ({payload.get('kernel_launches_per_step', {}).get(name, 0):,.0f})"
          for name, ms in payload.get("kernel_families_ms", {}).items()),
        *([f"    {'launches, total':<18}{payload['kernel_launches_per_step']['total']:>8,.0f}"]
          if payload.get("kernel_launches_per_step") else []),
        *_format_idle(payload),
        *(["  top kernels (ms / step, calls / step):"] if payload.get("top_kernels") else []),
        *(f"    {k['ms_per_step']:>8.3f} {k['calls_per_step']:>6.1f}  {k['family']:<17} {k['name'][:90]}"
          for k in payload.get("top_kernels", [])),
        *(["  most launched kernels (calls / step, ms / step):"] if payload.get("most_launched_kernels") else []),
        *(f"    {k['calls_per_step']:>8.1f} {k['ms_per_step']:>8.3f}  {k['family']:<17} {k['name'][:90]}"
          for k in payload.get("most_launched_kernels", [])),
        f"  {payload['flop_convention']}",
    ]
    return "\n".join(lines)


def default_output(preset: str) -> Path:
    return Path("benchmarks/results") / f"train_{preset}.json"
