"""Diagnostic: where one GEM training step spends its time on the GPU (throughput, MFU, syncs, top kernels).

    python -m benchmarks.step_profile --runs PRESET:BATCH:PRECISION[:FLAG...],... --out DIR

Flags of a run: ``compile``, ``fresh`` (new batches every step), ``host`` (cProfile of the host side of three
steps), ``noprofile`` (no kernel table), ``lp=RECIPE`` (``low_precision_mlp``, e.g. ``lp=fp8_rowwise``),
``set=KEY=VALUE`` (a training setting, e.g. ``set=gem.sequence_dtype=compute`` as issue 10's runs set it; repeatable).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from opengem.data.synthetic import SYNTHETIC_PRESETS
from opengem.models.presets import GEM_PRESETS, gem_flops
from opengem.nn.embedding import trust_ids
from opengem.train.config import apply_overrides, load_config
from opengem.train.data_stream import SyntheticBatches
from opengem.train.trainer import build_learner

PEAK_BF16 = 989e12  # H100 SXM / H200 dense BF16


def config_for(preset: str, batch_size: int, precision: str, compile_: bool = False, low_precision_mlp: str = "none",
               overrides: tuple[str, ...] = ()):
    base = "gem-small" if preset == "gem-small" else "gem-tiny"
    config = load_config(base, overrides=[f"batch_size={batch_size}", "architecture=gem", f"precision={precision}",
                                          "baseline=false", "num_workers=0", f"data_preset={preset}",
                                          f"compile={str(compile_).lower()}", f"low_precision_mlp={low_precision_mlp}"])
    import dataclasses
    return apply_overrides(dataclasses.replace(config, gem=GEM_PRESETS[preset].model), overrides)


def syncs_in_step(learner, batch) -> list[str]:
    found: list[str] = []
    original = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        stack = [f for f in traceback.format_stack() if "/opengem/" in f]
        found.append(str(message)[:30] + " @ " + " | ".join(s.strip().splitlines()[0] for s in stack[-3:]))

    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            learner.step(batch)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = original
    return found


def run(preset: str, batch_size: int, precision: str, compile_: bool, fresh: bool, steps: int, profile: bool,
        host_profile: bool = False, low_precision_mlp: str = "none", overrides: tuple[str, ...] = ()) -> dict:
    config = config_for(preset, batch_size, precision, compile_, low_precision_mlp, overrides)
    device = torch.device("cuda")
    torch.manual_seed(0)
    learner = build_learner(config, config.model.history, device)
    trust_ids(learner.model)  # synthetic ids: no id check (one sync) per step
    dataset = iter(SyntheticBatches(config, 0))
    # fresh batches (as in training: new layouts every step) unless FRESH is off: then 6 batches cycle
    count = 6 + steps + 3 if fresh else 6
    host_batches = [next(dataset) for _ in range(count)]
    batches = [b.pin_memory().to(device, non_blocking=True) for b in host_batches]
    data = SYNTHETIC_PRESETS[preset]
    flops = []
    for b in host_batches:
        lengths = b.history_age.lengths().tolist()
        f = gem_flops(config.gem, data, lengths)
        flops.append(3 * f["gemm"] + 3.5 * f["attention"])
    t0 = time.perf_counter()
    for i in range(6):  # warm-up: compiles and autotunes
        learner.step(batches[i % len(batches)])
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    total_flops = 0.0
    for i in range(6, 6 + steps):
        learner.step(batches[i % len(batches)])
        total_flops += flops[i % len(batches)]
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    result = {
        "preset": preset, "batch_size": batch_size, "precision": precision, "compile": compile_, "fresh": fresh, "steps": steps,
        "low_precision_mlp": low_precision_mlp, "overrides": list(overrides),
        "warmup_s": warm_s, "step_ms": 1e3 * elapsed / steps, "samples_per_s": steps * batch_size / elapsed,
        "tflops": total_flops / elapsed / 1e12, "mfu_vs_989": total_flops / elapsed / PEAK_BF16,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9,
        "train_flops_per_sample": sum(flops) / len(flops) / batch_size,
    }
    if host_profile:  # where the host time of a step goes, by Python function
        import cProfile
        import io
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        for i in range(6 + steps, 6 + steps + 3):
            learner.step(batches[i % len(batches)])
        torch.cuda.synchronize()
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(45)
        result["host_top"] = text.getvalue()
        print(result["host_top"], flush=True)
    syncs = syncs_in_step(learner, batches[0])
    result["syncs"] = {site: syncs.count(site) for site in dict.fromkeys(syncs)}
    if profile:
        from torch.profiler import ProfilerActivity, profile as prof
        with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            for i in range(6 + steps, 6 + steps + 3):
                learner.step(batches[i % len(batches)])
            torch.cuda.synchronize()
        events = p.key_averages()
        result["top_cuda"] = events.table(sort_by="self_cuda_time_total", row_limit=35, max_name_column_width=70)
        result["top_cpu"] = events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=70)
        cuda_total = sum(e.self_device_time_total for e in events) / 3 / 1e3
        result["gpu_busy_ms_per_step"] = cuda_total
    print(json.dumps({k: v for k, v in result.items() if not k.startswith(("top", "host_top"))}, indent=1), flush=True)
    if profile:
        print(result["top_cuda"], flush=True)
        print(result["top_cpu"], flush=True)
    del learner, batches
    torch.cuda.empty_cache()
    return result


def loader_rate(preset: str, batch_size: int, workers: int, batches: int = 40) -> float:
    config = config_for(preset, batch_size, "bf16")
    loader = DataLoader(SyntheticBatches(config, 0), batch_size=None, num_workers=workers, pin_memory=True)
    it = iter(loader)
    for _ in range(workers + 2):
        next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    rate = batches * batch_size / (time.perf_counter() - t0)
    del it
    return rate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", default="gem-small:512:bf16,gem-small:2048:bf16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--loader-workers", default="")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    results = {"device": torch.cuda.get_device_name(), "runs": [], "loader": []}
    out = Path(args.out) / "step_profile.json"
    for spec in args.runs.split(","):
        preset, batch_size, precision, *flags = spec.split(":")
        recipe = next((flag.removeprefix("lp=") for flag in flags if flag.startswith("lp=")), "none")
        overrides = tuple(flag.removeprefix("set=") for flag in flags if flag.startswith("set="))
        try:
            results["runs"].append(run(preset, int(batch_size), precision, "compile" in flags, "fresh" in flags, args.steps,
                                       profile="noprofile" not in flags, host_profile="host" in flags,
                                       low_precision_mlp=recipe, overrides=overrides))
        except Exception as error:  # keep going: the other runs still tell us something
            traceback.print_exc()
            results["runs"].append({"spec": spec, "error": repr(error)})
        out.write_text(json.dumps(results, indent=1))
    for workers in (int(w) for w in args.loader_workers.split(",") if w):
        rate = loader_rate("gem-small", 2048, workers)
        results["loader"].append({"workers": workers, "batch_size": 2048, "samples_per_s": rate})
        print(f"loader gem-small workers={workers}: {rate:.0f} samples/s", flush=True)
        out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
