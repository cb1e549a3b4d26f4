"""`opengem bench calibrate` on the CPU: the table it writes (from a fake run through the same writer) has the
shipped schema and drives the planner; the command itself refuses to run without CUDA."""

from __future__ import annotations

import dataclasses
import json
from importlib import resources

import pytest
import torch

from opengem.cli.main import main
from opengem.parallel.mesh import ParallelConfig
from opengem.plan.calibration import Measurements, load_calibration, table_from_measurements
from opengem.plan.cluster import load_cluster
from opengem.plan.cost import Layout
from opengem.plan.planner import Planner
from opengem.train.bench.calibrate import FULL, QUICK, gemm_shapes, nominal_hbm_gbps


def fake_run(launch_us: float = 6.0, norm_gbps: float = 3000.0, copy_gbps: float = 4000.0) -> Measurements:
    """What a run on an H200-like GPU could report (numbers near the shipped table's)."""
    return Measurements(
        device="NVIDIA H200", run="fake run for tests", peak_bf16_tflops=989.0, hbm_gbps=4800.0,
        gemm=[[m, n, k, 500.0 + i] for i, (m, n, k) in enumerate(gemm_shapes(FULL.gemm_rows))],
        jfa=[[128.5, 150.0, 120.0], [2048.5, 420.0, 330.0]], gdpa=[[8, 30.0, 12.0], [32, 90.0, 60.0]],
        block_attention_gbps=[4000.0, 2000.0], embedding_gbps=1800.0, copy_gbps=copy_gbps,
        raw={"launch_us": launch_us, "norm_gbps": norm_gbps, "h2d_gbps": 50.0, "embedding_forward_gbps": 2100.0},
        errors={"gemm": 1e-3, "jfa": 4e-3},
    )  # fmt: skip


def shipped_keys() -> set[str]:
    return set(json.loads(resources.files("opengem.plan").joinpath("calibrations", "h200.json").read_text()))


def test_written_table_has_the_shipped_schema_and_loads(tmp_path):
    base = load_calibration("h200")
    path = table_from_measurements(fake_run(), base, "h200").save(tmp_path / "calib.json")
    written = json.loads(path.read_text())
    assert set(written) == shipped_keys() | {"measured"}
    assert set(written["host"]) == set(dataclasses.asdict(base.host))
    assert set(written["attention"]) == {"jfa", "gdpa"}
    assert all(len(point) == 4 for point in written["gemm"]) and len(written["gemm"]) == len(
        gemm_shapes(FULL.gemm_rows)
    )
    assert written["measured"] == {
        "launch_us": 6.0,
        "norm_gbps": 3000.0,
        "h2d_gbps": 50.0,
        "embedding_forward_gbps": 2100.0,
        "copy_gbps": 4000.0,
    }
    table = load_calibration(path)
    assert table.attention["gdpa"] == [[8, 30.0, 12.0], [32, 90.0, 60.0]] and table.copy_gbps == 4000.0
    # the shipped table has no raw figures: the step-fitted entries come over unchanged, and the notes say so
    assert table.host == base.host and table.elementwise_bytes == base.elementwise_bytes
    assert "unchanged" in table.notes["step_fitted"] and "jfa 4.0e-03" in table.notes["checks"]


def test_step_fitted_entries_rescale_against_a_measured_base():
    base = table_from_measurements(fake_run(), load_calibration("h200"), "h200")
    slower_host = table_from_measurements(fake_run(launch_us=12.0, norm_gbps=1500.0), base, "first run")
    assert slower_host.host.launch_us == pytest.approx(2 * base.host.launch_us)
    assert slower_host.host.attention_call_us == pytest.approx(2 * base.host.attention_call_us)
    assert slower_host.host.launches_per_layer == base.host.launches_per_layer  # a count of the code, not a time
    # the norm reaches half the copy bandwidth it reached before: twice the bytes at copy bandwidth
    assert slower_host.elementwise_bytes == pytest.approx(2 * base.elementwise_bytes)
    assert "rescaled" in slower_host.notes["step_fitted"]


def test_a_bad_measurement_is_refused_before_writing():
    bad = dataclasses.replace(fake_run(), jfa=[[128.5, 0.0, 120.0]])
    with pytest.raises(ValueError, match="attention.jfa"):
        table_from_measurements(bad, load_calibration("h200"), "h200")


def test_planner_and_plan_command_use_a_written_table(tmp_path, capsys):
    path = table_from_measurements(fake_run(), load_calibration("h200"), "h200").save(tmp_path / "calib.json")
    layout = Layout(ParallelConfig().resolved(1), 2048)
    shipped = Planner("gem-small", load_cluster("h200"), 1).predict(layout)
    measured = Planner("gem-small", load_cluster("h200"), 1, str(path)).predict(layout)
    assert measured.fits and measured.kernels_s != shipped.kernels_s  # the file's rates, not the shipped ones
    # gem-small's GEMMs saturate M: shipped 460800 x 768 x 256 at 388 TFLOP/s, the fake 65536 x 768 x 256 at 503
    assert measured.kernel_times["gemm"] == pytest.approx(shipped.kernel_times["gemm"] * 388.0 / 503.0)
    assert main(["plan", "--preset", "gem-small", "--cluster", "h200", "--gpus", "8", "--calibration", str(path),
                 "--top", "1"]) == 0  # fmt: skip
    assert "gem-small" in capsys.readouterr().out


def test_sizes_cover_every_preset_width_and_quick_is_smaller():
    shapes = gemm_shapes(FULL.gemm_rows)
    assert {k for _, _, k in shapes} >= {256, 512, 1024}
    assert (65536, 3 * 1024, 1024) in shapes and (65536, 3 * 1024, 1024) in gemm_shapes(QUICK.gemm_rows)
    assert len(gemm_shapes(QUICK.gemm_rows)) < len(shapes) and len(QUICK.jfa_lengths) < len(FULL.jfa_lengths)
    assert nominal_hbm_gbps("NVIDIA H200") == 4800.0 and nominal_hbm_gbps("NVIDIA H100 80GB HBM3") == 3350.0
    with pytest.raises(ValueError, match="--hbm-gbps"):
        nominal_hbm_gbps("Some GPU")


def test_calibrate_without_cuda_fails_clearly(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "calib.json"
    assert main(["bench", "calibrate", "--quick", "--out", str(out)]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert not out.exists()


def test_measured_host_times_replace_the_launch_model(tmp_path):
    """A run with the host probe: the table keeps its step_ms / layer_ms and the planner's host term is
    step_ms + layer_ms x layers (x 4/3 per layer under activation checkpointing)."""
    run = fake_run()
    run = dataclasses.replace(run, raw={**run.raw, "host_step_ms": 50.0, "host_layer_ms": 10.0})
    table = table_from_measurements(run, load_calibration("h200"), "h200")
    assert (table.host.step_ms, table.host.layer_ms) == (50.0, 10.0) and "host" in table.notes
    path = table.save(tmp_path / "calib.json")
    planner = Planner("gem-small", load_cluster("h200"), 1, str(path))  # 8 layers
    plain = planner.predict(Layout(ParallelConfig().resolved(1), 2048))
    checkpointed = planner.predict(Layout(ParallelConfig(activation_checkpointing=True).resolved(1), 2048))
    assert plain.host_s == pytest.approx(0.050 + 8 * 0.010)
    assert checkpointed.host_s == pytest.approx(0.050 + 8 * 0.010 * 4 / 3)
    # a later run without the probe, based on this table: the measured host times carried, rescaled
    slower = table_from_measurements(fake_run(launch_us=12.0), table, "first run")
    assert slower.host.step_ms == pytest.approx(100.0) and slower.host.layer_ms == pytest.approx(20.0)


def test_host_times_come_in_pairs(tmp_path):
    data = load_calibration("h200").to_json()
    data["host"]["step_ms"] = 40.0
    path = tmp_path / "half.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"half.json: host.step_ms and host.layer_ms come together"):
        load_calibration(path)


def test_host_probe_runs_a_model_at_two_depths_on_the_cpu():
    """The probe's plumbing on the CPU (gem-tiny, eager): two depths, a per-step and a per-layer figure."""
    from opengem.train.bench.host_probe import HostProbe, measure_host

    host = measure_host(HostProbe(preset="gem-tiny", depths=(1, 2), batch_size=8, steps=2, compile=False),
                        torch.device("cpu"))
    assert set(host) == {"host_step_ms", "host_layer_ms"}
    assert host["host_step_ms"] >= 0 and host["host_layer_ms"] >= 0
    assert host["host_step_ms"] + 2 * host["host_layer_ms"] > 0
    with pytest.raises(ValueError, match="two increasing layer counts"):
        HostProbe(depths=(4, 2))
