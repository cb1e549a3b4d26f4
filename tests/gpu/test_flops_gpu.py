"""FLOP accounting and the training benchmarks on the GPU (Triton attention, CUDA events, CUDA profiler)."""

import dataclasses
import json

import pytest
import torch

from opengem.cli.main import main
from opengem.data.parquet import batches_from_table
from opengem.data.synthetic import SYNTHETIC_PRESETS, generate
from opengem.models.gem import GEM
from opengem.models.presets import GEM_PRESETS
from opengem.train.flops import batch_train_flops, device_peak_flops, measured_flops, measured_matmul_peak

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DATA = SYNTHETIC_PRESETS["gem-tiny"]
TINY = ["--preset", "gem-tiny", "--batch-size", "128", "--device", "cuda", "--precision", "bf16"]


@pytest.mark.parametrize("self_attention", ["jfa", "block"])
def test_analytic_flops_equal_the_flop_counter_on_the_triton_path(self_attention):
    batch = next(iter(batches_from_table(generate(DATA, 64, seed=2), 64))).to("cuda")
    config = dataclasses.replace(GEM_PRESETS["gem-tiny"].model, num_layers=2, num_experts=2,
                                 self_attention=self_attention, block_size=32)
    torch.manual_seed(0)
    model = GEM(DATA.feature_specs(), DATA.num_dense, config).cuda()
    assert batch_train_flops(model, batch).train == measured_flops(model, batch)


def test_this_device_is_in_the_table_and_its_matmul_ceiling_is_below_the_peak():
    peak = device_peak_flops(torch.cuda.get_device_name())
    ceiling = measured_matmul_peak("cuda", torch.bfloat16, size=8192)
    assert 0.4 * peak < ceiling < 1.05 * peak, (ceiling / 1e12, peak / 1e12)


def test_bench_train_on_the_gpu(tmp_path):
    out = tmp_path / "train.json"
    argv = ["bench", "train", *TINY, "--steps", "10", "--warmup", "3", "--num-workers", "2", "--loader-batches", "5",
            "--matmul-size", "4096", "--out", str(out)]
    assert main(argv) == 0
    payload = json.loads(out.read_text())
    results, phases = payload["results"], payload["phases_ms"]
    assert results["samples_per_s"] > 0 and 0 < results["mfu"] < 1
    assert results["peak_reserved_gb"] >= results["peak_memory_gb"] > 0
    for name in ("host_to_device", "forward", "embeddings", "backward", "optimizer"):
        assert phases[name] > 0, name
    device_ms = sum(v for k, v in phases.items() if k not in ("data", "idle"))
    assert device_ms <= 1.05 * results["profiled_step_ms"]
    assert phases["unattributed"] <= 0.1 * device_ms  # Triton launches are linked to their ops too
    # the replayed batches' kernel time fits inside their timed laps (idle >= 0, up to the profiler's own timing)
    kernel_ms = sum(payload["kernel_families_ms"].values())
    assert results["gpu_idle_ms_timed"] == pytest.approx(results["timed_ms_of_profiled_batches"] - kernel_ms)
    assert results["gpu_idle_ms_timed"] > -0.05 * results["timed_ms_of_profiled_batches"]
    gaps = payload["idle_gaps"]
    assert 0 <= gaps["spacing_ms_per_step"] <= gaps["idle_ms_per_step"] < results["profiled_step_ms"]
    assert all(g["ms_per_step"] > 0 and g["after"] and g["before"] for g in gaps["gaps"])


def test_bench_layers_on_the_gpu(tmp_path):
    out = tmp_path / "layers.json"
    assert main(["bench", "layers", *TINY, "--repeats", "5", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["flops_coverage"] == pytest.approx(1.0, rel=1e-9)
    assert 0 < payload["local_mfu"] < 1
