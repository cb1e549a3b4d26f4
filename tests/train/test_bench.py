"""`opengem bench train | layers | plot` on the CPU: tiny config, a few steps, every figure present."""

import gzip
import json

import pytest
import torch

from opengem.cli.main import main
from opengem.models.presets import GEM_PRESETS
from opengem.train.bench.phases import DATA_RANGE, HOST_TO_DEVICE_RANGE, PHASES
from opengem.train.bench.step import TrainBenchOptions, bench_config, format_report
from opengem.train.config import load_config

TINY = ["--preset", "gem-tiny", "--batch-size", "24", "--device", "cpu", "--precision", "fp32"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def train_result(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("bench") / "train_tiny.json"
    argv = ["bench", "train", *TINY, "--steps", "3", "--warmup", "1", "--profile-steps", "2",
            "--loader-batches", "3", "--peak-tflops", "1", "--with-layers", "--out", str(out),
            "--trace", str(out.parent / "traces" / "tiny.json.gz")]
    assert main(argv) == 0
    return json.loads(out.read_text()), str(out)


def test_bench_train_writes_the_profiled_steps_trace(train_result):
    """--trace: the profiled steps' timeline, gzipped, with the phase ranges the split is made of (its folder
    created up front)."""
    payload, json_path = train_result
    path = payload["settings"]["trace"]
    assert path.endswith("traces/tiny.json.gz")
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    names = {e.get("name") for e in events}
    assert {DATA_RANGE, HOST_TO_DEVICE_RANGE} <= names
    assert sum(e.get("name") == DATA_RANGE for e in events) == 2  # one per profiled step


def test_bench_train_reports_every_figure(train_result):
    payload, _ = train_result
    results = payload["results"]
    assert payload["settings"]["batch_size"] == 24 and payload["settings"]["precision"] == "fp32"
    assert (payload["settings"]["weight_shadows"], payload["settings"]["shadow_adamw"]) == (False, False)  # fp32
    assert results["samples_per_s"] > 0 and results["tokens_per_s"] > results["samples_per_s"]
    assert results["step_ms"] == pytest.approx(1e3 * 24 / results["samples_per_s"])
    assert results["flops_per_s"] == pytest.approx(results["train_flops_per_sample"] * results["samples_per_s"])
    assert 0 < results["attention_share"] < 1
    assert results["device_peak_tflops"] == 1.0
    assert results["mfu"] == pytest.approx(results["flops_per_s"] / 1e12)
    assert results["matmul_ceiling_tflops"] > 0 and results["mfu_vs_matmul_ceiling"] > 0
    assert results["peak_memory_gb"] is None and results["peak_reserved_gb"] is None  # CPU
    assert results["loader_samples_per_s"] > 0
    assert results["loader_over_step_rate"] == pytest.approx(results["loader_samples_per_s"] / results["samples_per_s"])
    assert payload["environment"]["device"] == "cpu"
    speed = results["host_speed"]  # measured before the run: the machine's own pace, to compare runs by
    assert speed["launch_us"] > 0 and speed["python_ms"] > 0 and speed["cpus"] >= 1 and speed["cpu"]
    timed = payload["settings"]["host_events_while_timed"]  # no autotuner, no Triton kernel loads on CPU
    assert timed["autotuner_keys"] == 0 and timed["kernels_loaded"] == 0 and timed["kernels"] == []
    assert timed["gc_ms"] >= 0 and timed["device_mallocs"] == 0 and timed["alloc_retries"] == 0
    assert min(each := results["step_ms_each"]) <= results["step_ms_median"] <= max(each)
    each = results["step_ms_each"]  # one lap per timed step, adding up to (nearly) the whole window
    assert len(each) == 3 and all(ms > 0 for ms in each)
    assert sum(each) == pytest.approx(3 * results["step_ms"], rel=0.05)
    assert results["steps_that_tuned"] == 0  # nothing tunes on the CPU: every lap counts as untuned
    assert results["step_ms_untuned"] == pytest.approx(sum(each) / 3)
    assert results["mfu_untuned"] == pytest.approx(results["mfu"] * results["step_ms"] / results["step_ms_untuned"])
    # the profiled steps replay the window's first 2 batches; their timed laps are what the kernel time is set against
    assert results["timed_ms_of_profiled_batches"] == pytest.approx(sum(each[:2]) / 2)
    assert results["gpu_idle_ms_timed"] is None and payload["idle_gaps"] == {}  # CPU: no kernels
    assert payload["kernel_families_ms"] == {} and payload["kernel_launches_per_step"] == {}
    assert payload["top_kernels"] == [] and payload["most_launched_kernels"] == []


def test_report_gives_each_kernel_familys_launches(train_result):
    """A GPU run's report: each family's ms and its kernels launched per step, and the total launched."""
    payload = {**train_result[0], "kernel_families_ms": {"gemm": 81.66, "copy": 5.7},
               "kernel_launches_per_step": {"gemm": 412.0, "copy": 31.5, "total": 443.5}}  # fmt: skip
    lines = format_report(payload).splitlines()
    assert "  GPU ms per step by kernel family (kernels launched per step):" in lines
    assert "    gemm                81.660 (412)" in lines and "    copy                 5.700 (32)" in lines
    assert "    launches, total        444" in lines


def test_report_gives_the_allocators_reserve_beside_the_peak(train_result):
    """A GPU run's peak memory with what the caching allocator reserved (fragmentation shows as the gap)."""
    base = train_result[0]
    results = {**base["results"], "peak_memory_gb": 67.06, "peak_reserved_gb": 78.1}
    report = format_report({**base, "results": results})
    assert "67.06 GiB (78.10 GiB reserved by the allocator)" in report
    older = {key: value for key, value in results.items() if key != "peak_reserved_gb"}  # a JSON from before
    older_report = format_report({**base, "results": older})
    assert "67.06 GiB" in older_report and "reserved" not in older_report


def test_report_says_when_the_host_paced_the_steps(train_result):
    """A GPU idle above a fifth of the step is called out, with what can cause it; a small one is not."""


    base = train_result[0]

    def report(idle_ms: float) -> str:
        results = {**base["results"], "gpu_idle_ms_timed": idle_ms, "timed_ms_of_profiled_batches": 169.0}
        return format_report({**base, "idle_gaps": {}, "results": results})

    reports = {idle: report(idle) for idle in (76.2, 20.7)}
    assert "the host paced these steps (the GPU idled 45% of them)" in reports[76.2]
    assert "the host paced" not in reports[20.7]


def test_window_timer_laps_split_the_window(monkeypatch):
    """Each lap is the time from the previous mark; the window runs from start to the last lap (what follows the
    last step is not timed), or to stop without laps."""
    from opengem.train.bench import timing

    clock = iter([10.0, 10.5, 12.0, 12.25, 20.0, 21.5])
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    timer = timing.WindowTimer(torch.device("cpu"))
    timer.start()
    timer.lap()
    timer.lap()
    timer.lap()
    assert timer.stop() == pytest.approx(2.25)
    assert timer.laps_ms() == pytest.approx([500.0, 1500.0, 250.0])
    timer.start()  # 20.0
    assert timer.stop() == pytest.approx(1.5)


def test_autotuner_keys_tuned_while_timed_are_reported(monkeypatch, tmp_path):
    """Autotuner keys met inside the timed steps (seconds of candidate timing each) are reported, per step."""
    import itertools

    from opengem.ops.triton import tuning

    counter = itertools.count()
    monkeypatch.setattr(tuning, "tuned_keys", lambda: next(counter))  # one more key at every look
    out = tmp_path / "train.json"
    argv = ["bench", "train", *TINY, "--steps", "2", "--warmup", "1", "--profile-steps", "1",
            "--loader-batches", "2", "--peak-tflops", "1", "--out", str(out)]
    assert main(argv) == 0
    payload = json.loads(out.read_text())
    timed = payload["settings"]["host_events_while_timed"]
    assert timed["autotuner_keys"] == 2  # read before the window and after each of its 2 steps: +1 per step
    results = payload["results"]
    assert results["steps_that_tuned"] == 2 and results["step_ms_untuned"] is None and results["mfu_untuned"] is None


def test_timed_steps_replay_batches_the_warm_up_ran(monkeypatch, tmp_path):
    """Every batch of the timed window already ran in the warm-up, so no batch shape is met for the first time
    while timed (session 12: one such batch tuned 9 kernels inside the window, a 2.7 s step)."""
    from opengem.train.trainer import Learner

    seen: list[bytes] = []
    original = Learner.step
    monkeypatch.setattr(Learner, "step", lambda self, batch: (
        seen.append(batch.history_age.lengths_host().numpy().tobytes()), original(self, batch))[1])
    argv = ["bench", "train", *TINY, "--steps", "3", "--warmup", "2", "--lead-steps", "1", "--profile-steps", "1",
            "--loader-batches", "2", "--out", str(tmp_path / "train.json")]
    assert main(argv) == 0
    # warm-up (CPU: no extra tuning steps), the restarted loader's lead step, window, profiled step
    assert len(seen) == (2 + 1 + 3) + 1 + 3 + 1
    warm, lead, timed, profiled = seen[:6], seen[6], seen[7:10], seen[10]
    assert lead == warm[0] and timed == warm[1:4] and len(set(timed)) == 3
    assert profiled == timed[0]  # the profiled step replays the window's first batch: its kernel time is that one's


def test_bench_train_reports_the_scaling_ratio(train_result):
    """GEM_SPEC section 8: scaling ratio = E2E MFU / local MFU (the layers alone, FLOP-weighted)."""
    r = train_result[0]["results"]
    assert 0 < r["local_mfu"] and 0 < r["mfu"]
    assert r["scaling_ratio"] == pytest.approx(r["mfu"] / r["local_mfu"])


def test_bench_train_phases_cover_the_step(train_result):
    phases = train_result[0]["phases_ms"]
    assert set(phases) == {*PHASES, "idle"}
    for name in ("data", "forward", "embeddings", "backward", "optimizer"):
        assert phases[name] > 0, name
    step_ms = train_result[0]["results"]["profiled_step_ms"]
    assert sum(v for k, v in phases.items() if k != "idle") <= 1.05 * step_ms
    assert sum(phases.values()) == pytest.approx(step_ms, rel=0.05)


def test_bench_train_writes_the_png_and_plot_renders_it_again(train_result, tmp_path):
    _, json_path = train_result
    with open(json_path.replace(".json", ".png"), "rb") as png:
        assert png.read(8) == PNG_SIGNATURE
    out = tmp_path / "again.png"
    assert main(["bench", "plot", json_path, "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_SIGNATURE


def test_plot_rejects_a_file_that_is_not_a_train_result(tmp_path, capsys):
    bad = tmp_path / "layers.json"
    bad.write_text(json.dumps({"benchmark": "layers"}))
    assert main(["bench", "plot", str(bad)]) == 2
    assert "not an `opengem bench train` result" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "layers"])
def test_a_bad_peak_is_refused_before_anything_runs(command, capsys, monkeypatch):
    from opengem.train.bench import layers, step

    def must_not_run(*args, **kwargs):
        raise AssertionError("the benchmark ran before its options were checked")

    monkeypatch.setattr(step, "bench_train", must_not_run)
    monkeypatch.setattr(layers, "bench_layers", must_not_run)
    assert main(["bench", command, *TINY, "--peak-tflops", "-5"]) == 2
    assert "peak_tflops must be positive, got -5.0" in capsys.readouterr().err


@pytest.mark.parametrize("repeats", ["0", "-1"])
def test_bench_layers_refuses_no_timed_runs(repeats, capsys):
    assert main(["bench", "layers", *TINY, "--repeats", repeats]) == 2  # was an IndexError in the median
    assert f"repeats must be >= 1 (the timed runs a layer's median is taken over), got {repeats}" in (
        capsys.readouterr().err)


def test_bench_layers_cover_the_model_flops(tmp_path):
    out = tmp_path / "layers.json"
    assert main(["bench", "layers", *TINY, "--repeats", "2", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    rows = {row["layer"]: row for row in payload["rows"]}
    assert {"embeddings", "pffn", "self_attention", "sequence_summary", "interaction", "heads"} <= set(rows)
    assert rows["embeddings"]["gflop"] == 0 and rows["self_attention"]["gflop"] > 0
    assert all(row["ms"] > 0 for row in rows.values())
    assert payload["flops_coverage"] == pytest.approx(1.0, rel=1e-9)
    assert sum(row["time_share"] for row in rows.values()) == pytest.approx(1.0)
    assert payload["local_mfu"] is None  # no peak for a CPU


def test_bench_config_uses_the_gem_architecture_and_settings():
    config, device, precision = bench_config(TrainBenchOptions("gem-small", device="cpu", batch_size=64))
    assert (config.architecture, config.batch_size, device.type, precision) == ("gem", 64, "cpu", "fp32")
    assert config.gem == GEM_PRESETS["gem-small"].model
    assert bench_config(TrainBenchOptions("gem-tiny", device="cpu", precision="bf16"))[0].precision == "bf16"
    # a setting that needs bf16 is checked against the benchmark's precision, not the preset's (gem-tiny: fp32)
    shadows = bench_config(TrainBenchOptions("gem-tiny", device="cpu", precision="bf16",
                                             overrides=("weight_shadows=true",)))[0]
    assert (shadows.precision, shadows.weight_shadows) == ("bf16", True)
    assert bench_config(TrainBenchOptions("gem-tiny", device="cpu", overrides=("precision=bf16",)))[2] == "bf16"
    with pytest.raises(ValueError, match="weight_shadows holds bf16 copies"):
        bench_config(TrainBenchOptions("gem-tiny", device="cpu", overrides=("weight_shadows=true",)))
    large = load_config("gem-large")
    assert (large.architecture, large.data_preset, large.gem) == ("gem", "gem-large", GEM_PRESETS["gem-large"].model)
    with pytest.raises(ValueError, match="low_precision_mlp must be one of"):
        TrainBenchOptions("gem-small", low_precision_mlp="fp4")
    with pytest.raises(ValueError, match="steps must be >= 1"):
        TrainBenchOptions("gem-small", steps=0)


def test_bench_compile_is_the_configs_so_the_learner_compiles_the_blocks_once(monkeypatch):
    """``--compile`` sets the config's ``compile``: ``build_learner`` compiles the blocks once, with the config's
    settings, as the trainer does (the C++ wrapper and the memory budget included); a ``--set compile=...`` after it
    wins."""
    from opengem.train import trainer
    from opengem.train.bench import step

    asked = []
    monkeypatch.setattr(trainer, "compile_regions", lambda model, mode, cpp_wrapper, memory_budget: asked.append(
        (mode, cpp_wrapper, memory_budget)))
    overrides = ("compile_cpp_wrapper=true", "activation_memory_budget=0.4")
    config, device, _ = bench_config(TrainBenchOptions("gem-tiny", device="cpu", compile=True, overrides=overrides))
    assert config.compile and config.compile_cpp_wrapper
    step.build_learner(config, config.model.history, device)
    assert asked == [("default", True, 0.4)]
    plain = bench_config(TrainBenchOptions("gem-tiny", device="cpu"))[0]
    step.build_learner(plain, plain.model.history, device)
    assert not plain.compile and asked == [("default", True, 0.4)]
    assert bench_config(TrainBenchOptions("gem-tiny", device="cpu", overrides=("compile=true",)))[0].compile
    assert not bench_config(TrainBenchOptions("gem-tiny", device="cpu", compile=True,
                                              overrides=("compile=false",)))[0].compile


def test_gpu_busy_time_counts_overlaps_once():
    from opengem.train.bench.phases import _union_length

    assert _union_length([(0, 10), (5, 15), (5, 15), (20, 25), (21, 22)]) == 20
    assert _union_length([]) == 0


def test_cuda_kernels_go_to_the_phase_of_their_launch_call():
    """A synthetic CUDA trace whose kernels have no op links (as torch 2.11 gave on an H200): each kernel is
    placed by its launch call's correlation id and the innermost marker range holding that call."""
    import torch
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    from opengem.train.bench.phases import DATA_RANGE, FORWARD_RANGE, phase_split_us

    def cpu(id_, name, start, end, thread=1):
        return FunctionEvent(id_, name, thread, start, end)

    def kernel(id_, start, end):
        return FunctionEvent(id_, f"kernel_{id_}", 7, start, end, device_type=DeviceType.CUDA)

    events = [
        cpu(1, DATA_RANGE, 0, 10),
        cpu(2, FORWARD_RANGE, 10, 100),
        cpu(3, "opengem::embedding_lookup", 12, 20),
        cpu(4, "autograd::engine::evaluate_function: MmBackward0", 110, 150, thread=2),
        cpu(5, "Optimizer.step#AdamW.step", 160, 190),
        cpu(2, "cudaLaunchKernel", 14, 15),  # id 2: a correlation id equal to an op's id (the forward range)
        cpu(11, "cuLaunchKernelEx", 30, 31),
        cpu(12, "cudaLaunchKernel", 120, 121, thread=2),
        cpu(13, "cudaLaunchKernel", 170, 171),
        kernel(2, 20, 30), kernel(11, 31, 61), kernel(12, 121, 141), kernel(13, 171, 176),
        kernel(99, 200, 203),  # no launch call in the trace
        kernel(12, 121, 141),  # the profiler repeated one: counted once
        FunctionEvent(14, FORWARD_RANGE, 7, 20, 61, device_type=DeviceType.CUDA, is_user_annotation=True),
    ]
    phases = phase_split_us(events, torch.device("cuda"))
    assert phases["embeddings"] == 10 and phases["forward"] == 30 and phases["backward"] == 20
    assert phases["optimizer"] == 5 and phases["unattributed"] == 3 and phases["data"] == 10


def test_warm_up_runs_until_the_autotuners_are_quiet(monkeypatch):
    """At least ``min_steps``; then on while new tuning keys appear, until ``quiet_steps`` calm steps in a
    row or ``max_extra`` more steps; every rank follows the agreed flag."""
    from opengem.ops.triton import tuning
    from opengem.train.bench.timing import warm_until_settled

    keys = iter([0, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2])  # new keys at the first and third steps
    monkeypatch.setattr(tuning, "tuned_keys", lambda: next(keys))
    ran = []
    extra = warm_until_settled(lambda: ran.append(1), min_steps=2, max_extra=10, quiet_steps=3)
    assert len(ran) == 6 and extra == 4  # key 1 at step 1, key 2 at step 3, then 3 calm steps

    monkeypatch.setattr(tuning, "tuned_keys", lambda: len(ran))  # a new key every step: capped
    ran.clear()
    assert warm_until_settled(lambda: ran.append(1), min_steps=1, max_extra=4) == 4 and len(ran) == 5

    monkeypatch.setattr(tuning, "tuned_keys", lambda: 0)  # quiet here, but another rank tunes twice
    flags = iter([True, True, False, False, False])
    ran.clear()
    assert warm_until_settled(lambda: ran.append(1), 0, 10, agree=lambda _: next(flags)) == 5


def test_warm_up_runs_until_no_step_compiles(monkeypatch):
    """A step much slower than the fastest so far (a recompile, a Triton specialization) is not calm,
    even when no autotuner key is new; small jitter is."""
    from opengem.ops.triton import tuning
    from opengem.train.bench.timing import warm_until_settled

    monkeypatch.setattr(tuning, "tuned_keys", lambda: 0)
    durations = iter([30.0, 0.40, 0.45, 5.0, 0.38, 0.41, 0.52, 0.40, 9.0, 9.0])  # seconds per step
    now = [0.0]
    synced = []

    def step():
        now[0] += next(durations)

    extra = warm_until_settled(step, min_steps=2, max_extra=20, sync=lambda: synced.append(1),
                               clock=lambda: now[0])
    # runs: 30 (compile) 0.40 | 0.45 calm, 5.0 slow, 0.38 0.41 0.52 calm (0.52 < 1.5 x 0.38)
    assert extra == 5 and len(synced) == 2 * 7


def test_host_events_count_kernel_loads_graphs_and_collections():
    """Triton's load hook (a JIT specialization, an Inductor kernel) and collections are counted; only
    tuning and compiling make a step "compiled"."""
    import gc

    from triton import knobs

    from opengem.train.bench.watch import events_report, host_events

    before = host_events()
    knobs.runtime.kernel_load_end_hook(None, None, "_block_attention_bwd", None, "hash")  # as Triton calls it
    gc.collect()
    now = host_events()
    assert now.since(before).kernels_loaded == 1 and now.compiled_since(before)
    assert now.gc_ms > before.gc_ms and not now.compiled_since(now._replace(gc_ms=0.0))
    report = events_report(before)
    assert report["kernels"] == ["_block_attention_bwd"] and report["autotuner_keys"] == 0


def test_host_events_count_the_allocators_trips_to_the_driver(monkeypatch):
    """The CUDA caching allocator's segment allocations and retries, from its host-side counters (0 without
    CUDA), go into the timed window's report; they do not make a step "compiled"."""
    from opengem.train.bench.watch import events_report, host_events

    assert host_events().device_mallocs == 0 and host_events().alloc_retries == 0  # CPU
    stats = {"segment.all.allocated": 10, "num_alloc_retries": 0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: dict(stats))
    before = host_events()
    stats.update({"segment.all.allocated": 13, "num_alloc_retries": 1})
    after = host_events()
    report = events_report(before, after=after)
    assert report["device_mallocs"] == 3 and report["alloc_retries"] == 1
    assert not after.compiled_since(before)


def test_warm_up_waits_for_kernel_loads(monkeypatch):
    """A step that loads a kernel (e.g. a new divisibility specialization) is not calm, fast or not."""
    from triton import knobs

    from opengem.ops.triton import tuning
    from opengem.train.bench.timing import warm_until_settled

    monkeypatch.setattr(tuning, "tuned_keys", lambda: 0)
    ran = []

    def step():
        ran.append(1)
        if len(ran) in (2, 4):
            knobs.runtime.kernel_load_end_hook(None, None, "kernel", None, "hash")

    assert warm_until_settled(step, min_steps=1, max_extra=20, quiet_steps=2) == 5  # loads at 2 and 4: calm 5, 6


def test_tuned_keys_counts_settled_autotuner_configs(monkeypatch):
    from opengem.ops.triton import gdpa
    from opengem.ops.triton import jagged_attention as jfa
    from opengem.ops.triton.tuning import tuned_keys

    before = tuned_keys()
    monkeypatch.setitem(jfa._fwd_kernel.cache, ("fake", "key"), "config")
    monkeypatch.setitem(gdpa._TUNED, ("fake",), "config")
    assert tuned_keys() == before + 2


def test_tuned_key_names_name_the_kernel_and_key(monkeypatch):
    """A new key shows up under its kernel's name, the FP8 row quantizers (held in a dict) included, and a
    tuner reachable twice (module attribute and table entry) is counted once."""
    from opengem.ops.triton import fp8_gemm, gdpa
    from opengem.ops.triton import jagged_attention as jfa
    from opengem.ops.triton.tuning import tuned_key_names, tuned_keys

    names, count = tuned_key_names(), tuned_keys()
    monkeypatch.setitem(jfa._fwd_kernel.cache, ("fake", 1), "config")
    monkeypatch.setitem(fp8_gemm._ROW_TUNERS[1024].cache, (1000, "gelu"), "config")
    monkeypatch.setitem(gdpa._TUNED, ("dq", "fake"), "config")
    assert tuned_key_names() - names == {
        "jagged_attention._fwd_kernel: ('fake', 1)", "fp8_gemm._ROW_TUNERS[1024]: (1000, 'gelu')",
        "gdpa: ('dq', 'fake')"}
    assert tuned_keys() == count + 3


def test_gpu_time_by_kernel_family():
    """opengem's Triton kernels by the module that defines them, vendor GEMMs, Inductor's fused kernels,
    the optimizer and copies; a kernel listed twice counts once."""
    import torch
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    from opengem.train.bench.kernels import FAMILIES, family_split, kernel_family, top_kernels

    expected = {
        "_dkdv_kernel": "attention", "gdpa_fwd_kernel": "attention", "_block_attention_fwd": "attention",
        "_lookup_kernel": "embedding", "_blockwise_gemm_kernel": "low_precision",
        "nvjet_sm90_tst_128x288_64x4_2x1_v_bz_coopA_NNT": "gemm",
        "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>": "gemm",
        "triton_per_fused__to_copy_add_native_layer_norm_16": "fused_elementwise",
        "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>": "optimizer",
        "Memcpy HtoD (Pinned -> Device)": "copy",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "other",
    }  # fmt: skip
    assert {name: kernel_family(name) for name in expected} == expected

    def kernel(name, start, end):
        return FunctionEvent(0, name, 7, start, end, device_type=DeviceType.CUDA)

    events = [FunctionEvent(1, "aten::mm", 1, 0, 50), kernel("_dq_kernel", 0, 10),
              kernel("nvjet_sm90_x", 10, 40), kernel("nvjet_sm90_x", 10, 40), kernel("triton_poi_fused_add_0", 40, 45),
              FunctionEvent(0, "opengem.bench/forward", 7, 0, 45, device_type=DeviceType.CUDA,
                            is_user_annotation=True)]  # a record_function range seen on the GPU: not work
    split, launches = family_split(events)
    assert list(split) == list(FAMILIES) and sum(split.values()) == 45
    assert (split["attention"], split["gemm"], split["fused_elementwise"]) == (10, 30, 5)
    assert torch.cuda.is_available() or split["other"] == 0
    # launches: the GEMM listed twice launched once; the annotation launched nothing
    assert list(launches) == list(FAMILIES) and (launches["attention"], launches["gemm"]) == (1, 1)
    assert launches["fused_elementwise"] == 1 and sum(launches.values()) == 3
    ranked = top_kernels(events + [kernel("_dq_kernel", 50, 55)], steps=2, count=2)
    assert ranked == [{"name": "nvjet_sm90_x", "family": "gemm", "ms_per_step": 0.015, "calls_per_step": 0.5},
                      {"name": "_dq_kernel", "family": "attention", "ms_per_step": 0.0075, "calls_per_step": 1.0}]
    # by launches: the twice-launched _dq_kernel first, though the GEMM took more time
    assert [k["name"] for k in top_kernels(events + [kernel("_dq_kernel", 50, 55)], 2, 2, by="launches")] == [
        "_dq_kernel", "nvjet_sm90_x"]
    with pytest.raises(ValueError, match="'time' or 'launches'"):
        top_kernels(events, steps=1, by="calls")


def test_idle_gaps_name_the_kernels_the_gpu_waited_between():
    """Gaps between device work, per step: short ones are launch spacing, longer ones are ranked by the (previous,
    next) kernel pair; work that overlaps (another stream) leaves no gap, and a kernel listed twice counts once."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    from opengem.train.bench.kernels import idle_gaps

    def kernel(name, start, end):
        return FunctionEvent(0, name, 7, start, end, device_type=DeviceType.CUDA)

    events = [kernel("a", 0, 100), kernel("b", 102, 200), kernel("b", 102, 200),  # 2 us: spacing
              kernel("c", 150, 300),  # overlaps b: no gap, and it ends last
              kernel("d", 340, 400),  # 40 us after c
              kernel("e", 405, 500),  # 5 us: spacing
              kernel("d", 600, 700),  # 100 us after e
              kernel("c", 720, 800), kernel("d", 840, 900)]  # 20 us after d, then 40 us after c
    gaps = idle_gaps(events, steps=2, min_gap_us=10, count=2)
    assert gaps["idle_ms_per_step"] == pytest.approx((2 + 40 + 5 + 100 + 20 + 40) / 1e3 / 2)
    assert gaps["spacing_ms_per_step"] == pytest.approx(7 / 1e3 / 2)
    assert gaps["gaps"] == [
        {"after": "e", "before": "d", "ms_per_step": pytest.approx(0.05), "gaps_per_step": 0.5},
        {"after": "c", "before": "d", "ms_per_step": pytest.approx(0.04), "gaps_per_step": 1.0},
    ]  # (d -> c, 20 us) is third: left out by count
    assert idle_gaps([], steps=1)["gaps"] == []


def test_profiled_steps_cannot_outnumber_the_window():
    with pytest.raises(ValueError, match="profile_steps"):
        TrainBenchOptions(preset="gem-tiny", steps=2, profile_steps=3)


def test_bench_train_records_the_recipe_an_override_sets(tmp_path):
    """`--set low_precision_mlp=...` wins over `--low-precision-mlp`'s default, and the result says so (session 21's
    gem-large FP8 run was reported as `low-precision MLP none`)."""
    out = tmp_path / "train.json"
    argv = ["bench", "train", *TINY, "--steps", "1", "--warmup", "1", "--profile-steps", "1", "--loader-batches", "1",
            "--set", "low_precision_mlp=fp8_rowwise", "--out", str(out)]
    assert main(argv) == 0
    settings = json.loads(out.read_text())["settings"]
    assert settings["low_precision_mlp"] == "fp8_rowwise"  # gem-tiny has no layer large enough to convert
    assert settings["fp8_compile_path"] in ("custom_op", "inductor")


def test_bench_train_records_the_weight_shadows_the_run_applied(tmp_path):
    """The shadow settings as the run resolved them (auto on the CPU: off; here asked for), in the JSON and the
    report's first line."""
    out = tmp_path / "train.json"
    argv = ["bench", "train", *TINY, "--steps", "1", "--warmup", "1", "--profile-steps", "1", "--loader-batches", "1",
            "--precision", "bf16", "--set", "weight_shadows=true", "--set", "shadow_adamw_moments=bf16",
            "--out", str(out)]
    assert main(argv) == 0
    payload = json.loads(out.read_text())
    settings = payload["settings"]
    assert settings["weight_shadows"] is True and settings["shadow_adamw"] is True
    assert settings["shadow_adamw_moments"] == "bf16"
    assert format_report(payload).splitlines()[0].endswith(", weight shadows + shadow AdamW (bf16 moments)")
    fp32_moments = {**payload, "settings": {**settings, "shadow_adamw_moments": "fp32"}}
    assert format_report(fp32_moments).splitlines()[0].endswith(", weight shadows + shadow AdamW")


def test_environment_records_the_opengem_settings_of_an_ab_run(monkeypatch):
    from opengem.train.bench.timing import environment

    monkeypatch.setenv("OPENGEM_TRITON_LAUNCH", "triton")
    monkeypatch.setenv("OPENGEM_GIT_COMMIT", "abc1234")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("PYTORCH_NO_CUDA_MEMORY_CACHING", "0")  # a PyTorch variable it does not record
    env = environment(torch.device("cpu"))
    assert env["opengem_settings"]["OPENGEM_TRITON_LAUNCH"] == "triton"
    assert env["opengem_settings"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_NO_CUDA_MEMORY_CACHING" not in env["opengem_settings"]
    assert "OPENGEM_GIT_COMMIT" not in env["opengem_settings"] and env["git_commit"] == "abc1234"


def test_the_benchmarks_environment_records_the_same_opengem_settings(monkeypatch):
    from benchmarks.common import environment as benchmark_environment

    monkeypatch.setenv("OPENGEM_TRITON_LAUNCH", "triton")
    assert benchmark_environment()["opengem_settings"]["OPENGEM_TRITON_LAUNCH"] == "triton"
