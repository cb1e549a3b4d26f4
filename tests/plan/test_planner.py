"""The cost model against a measurement, the planner's speed, bad cluster files."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from opengem.cli.main import main
from opengem.parallel.mesh import ParallelConfig
from opengem.plan.cluster import load_cluster
from opengem.plan.cost import Layout
from opengem.plan.planner import Planner

MEASURED_GEM_SMALL_MS = 167.8
MEASURED_GEM_LARGE_B512_MS = 359.1


def test_one_gpu_gem_small_step_within_15_percent_of_the_measurement():
    """Measured: 167.8 ms per step, gem-small, batch 2048, bf16, compiled, fresh batches, one H200
    (RESULTS.md, session 3). Predicted from the shipped H200 calibration, whose kernel rates and
    element-wise bytes were fitted on gem-small's own profile and whose host cost per launch was set so
    that this step's host time is at most its measured time: this checks the model's composition."""
    planner = Planner("gem-small", load_cluster("h200"), 1)
    prediction = planner.predict(Layout(ParallelConfig().resolved(1), 2048))
    assert prediction.fits
    assert prediction.step_s * 1e3 == pytest.approx(MEASURED_GEM_SMALL_MS, rel=0.15)


def test_one_gpu_gem_large_step_within_15_percent_of_the_measurement():
    """Out of sample: nothing in the shipped table was fitted on gem-large. Measured 359.1 ms per step at
    batch 512 on one H200 (RESULTS.md, session 3: `benchmarks.multi_gpu --layouts single`). The model
    says the GPU bounds this step (its device time over the host time). Not matched: batch 256, measured
    341 ms against 240 predicted, a step bound neither by the GPU nor by the host model (autotuning inside
    the timed window is the suspect; see NOTES.md)."""
    planner = Planner("gem-large", load_cluster("h200"), 1)
    prediction = planner.predict(Layout(ParallelConfig().resolved(1), 512))
    assert prediction.fits
    assert prediction.step_s * 1e3 == pytest.approx(MEASURED_GEM_LARGE_B512_MS, rel=0.15)
    assert prediction.device_s > prediction.host_s


def test_planning_gem_xl_on_4096_gpus_is_fast():
    start = time.perf_counter()
    plan = Planner("gem-xl", load_cluster("h100"), 4096).plan()
    elapsed = time.perf_counter() - start
    print(f"planned gem-xl on 4096 GPUs in {elapsed:.1f} s")
    assert elapsed < 90
    best = plan.best
    assert best.fits and best.memory_total <= load_cluster("h100").gpu.hbm_bytes
    assert 0 < best.e2e_mfu < best.local_mfu < 1
    assert [p.e2e_mfu for p in plan.ranked] == sorted((p.e2e_mfu for p in plan.ranked), reverse=True)


def test_plan_cli_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    assert main(["plan", "--preset", "gem-small", "--cluster", "h200", "--gpus", "16", "--out", str(out), "--plot", str(png)]) == 0
    assert "best: dense_replicate=" in capsys.readouterr().out
    assert out.stat().st_size > 0 and png.stat().st_size > 0


GOOD = (Path(__file__).resolve().parents[2] / "src/opengem/plan/clusters/h100.toml").read_text()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("hbm_gib = 80.0\n", ""), "[gpu]: missing key 'hbm_gib'"),
        (("gpus_per_host = 8", 'gpus_per_host = "8"'), "[topology]: gpus_per_host must be an integer"),
        (("gpus_per_host = 8", "gpus_per_host = 8.5"), "[topology]: gpus_per_host must be an integer"),
        (("bf16_tflops = 989.0", "bf16_tflops = -1.0"),
         "[gpu]: bf16_tflops must be a positive finite number, got -1.0"),
        (("latency_us = 8.0", "latency_us = 0"),
         "[network.intra_zone]: latency_us must be a positive finite number, got 0"),
        (("oversubscription = 4.0", "oversubscription = 0.5"), "[network.cross_zone]: oversubscription must be >= 1"),
        (("[network.nvlink]", "[network.nvlinks]"), "[network]: missing table [nvlink]"),
        (("name = \"h100\"", "name = "), "not valid TOML"),
    ],
)
def test_bad_cluster_files_name_the_key_and_file(tmp_path, edit, message):
    path = tmp_path / "bad.toml"
    assert edit[0] in GOOD
    path.write_text(GOOD.replace(edit[0], edit[1], 1))
    with pytest.raises(ValueError) as error:
        load_cluster(path)
    assert str(path) in str(error.value) and message in str(error.value)


def test_missing_cluster_file_and_cli_error(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="shipped clusters: h100, h200"):
        load_cluster(tmp_path / "none.toml")
    assert main(["plan", "--preset", "gem-small", "--gpus", "100000"]) == 2
    assert "the cluster h100 has 4096 GPUs" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--gpus", "--local-batch", "--sparse-sync-every", "--top"])
@pytest.mark.parametrize("value", ["0", "-5"])
def test_plan_cli_refuses_counts_below_one(flag, value, capsys):
    # 0 once meant "the default" for --gpus / --local-batch (a truthiness test), and -5 reached math.log
    assert main(["plan", "--preset", "gem-small", flag, value]) == 2
    assert f"{flag} must be >= 1, got {value}" in capsys.readouterr().err
