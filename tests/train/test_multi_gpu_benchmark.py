"""The multi-GPU benchmark's plumbing on gloo: gem-tiny, 2 warm-up + 3 timed steps per layout, on 2 ranks
(every layout and the collective timing) and on 1 rank (the single-process baseline and the scaling ratio)."""

import json

import pytest

from benchmarks.multi_gpu import ALL_LAYOUTS, layout_for, main
from opengem.parallel.testing import run_distributed

ARGS = ["--quick", "--preset", "gem-tiny", "--device", "cpu", "--peak-tflops", "1", "--batch-per-gpu", "8",
        "--set", "num_workers=0", "--set", "precision=fp32"]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    out = tmp_path_factory.mktemp("multi_gpu") / "world2.json"
    results = run_distributed(main, 2, [*ARGS, "--min-message-kib", "0", "--single-gpu-mfu", "0.002", "--out", str(out)])
    return results, json.loads(out.read_text())


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    out = tmp_path_factory.mktemp("multi_gpu") / "world1.json"
    run_distributed(main, 1, [*ARGS, "--layouts", "fsdp,hsdp", "--out", str(out)])
    return json.loads(out.read_text())


def test_every_layout_trains_and_reports(world2):
    results, payload = world2
    rows = {row["layout"]: row for row in payload["rows"]}
    assert list(rows) == list(ALL_LAYOUTS)
    assert payload["device_count"] == 2 and payload["device_type"] == "cpu" and payload["skipped"] == {}
    assert payload["collectives_env"]["NCCL_NVLS_ENABLE"] == "0"  # multicast off
    assert payload["compute_beside_collectives"] == []  # a CUDA measurement (GEMM beside all-gathers)
    for row in rows.values():
        assert row["world"] == 2 and row["batch_per_gpu"] == 8
        timed = row["host_events_while_timed"]  # no autotuner, no Triton kernel loads on CPU in the window
        assert timed["autotuner_keys"] == 0 and timed["kernels_loaded"] == 0
        assert len(row["step_ms_each"]) == 3 and all(ms > 0 for ms in row["step_ms_each"])  # --quick: 3 timed steps
        assert row["samples_per_s"] == pytest.approx(16 * 1e3 / row["step_ms"])
        assert row["samples_per_s_per_gpu"] == pytest.approx(row["samples_per_s"] / 2)
        assert row["e2e_mfu"] == pytest.approx(row["flops_per_s"] / 2e12)
        assert row["scaling_ratio"] == pytest.approx(row["e2e_mfu"] / 0.002)
    # same model, seed and batches: the first step's loss is the same in every layout (fp32 on gloo)
    assert rows["expert"]["loss_reference"] == "expert"
    assert all(r["first_loss_rel_err"] < 1e-5 for r in rows.values())
    assert rows["expert"]["first_loss"] != rows["fsdp"]["first_loss"]  # two experts: another model
    assert "comm/shard/all_gather_bytes" in rows["fsdp"]["comm_bytes_per_step"]
    assert "comm/replicate/all_reduce_bytes" in rows["hsdp"]["comm_bytes_per_step"]
    assert "comm/expert/all_gather_bytes" in rows["expert"]["comm_bytes_per_step"]
    assert "comm/sparse_replicate/all_reduce_bytes" in rows["sparse2d"]["comm_bytes_per_step"]
    assert results[1]["rows"][0]["step_ms"] == rows["fsdp"]["step_ms"]  # the slowest rank's time, on every rank


def test_collectives_are_timed_at_the_layouts_message_sizes(world2):
    _, payload = world2
    timed = {(r["layout"], r["dim"], r["kind"]) for r in payload["collective_rows"]}
    assert {("fsdp", "shard", "all_gather"), ("fsdp", "shard", "reduce_scatter"),
            ("fsdp", "sparse_group", "all_to_all"), ("expert", "expert", "all_gather")} <= timed
    for row in payload["collective_rows"]:
        assert row["ranks"] == 2 and row["gb_per_s"] == pytest.approx(row["message_bytes"] / row["us"] / 1e3)
    fsdp_gather = next(r for r in payload["collective_rows"] if r["layout"] == "fsdp" and r["collective"] == "all_gather")
    total = payload["rows"][0]["comm_bytes_per_step"]["comm/shard/all_gather_bytes"]
    assert fsdp_gather["message_bytes"] * fsdp_gather["calls_per_step"] == pytest.approx(total, rel=1e-3)


def test_one_rank_runs_the_single_process_baseline(world1):
    rows = {row["layout"]: row for row in world1["rows"]}
    assert list(rows) == ["single", "fsdp"] and "hsdp" in world1["skipped"]
    assert rows["single"]["scaling_ratio"] == pytest.approx(1.0)
    assert rows["fsdp"]["scaling_ratio"] == pytest.approx(rows["fsdp"]["e2e_mfu"] / rows["single"]["e2e_mfu"])
    assert rows["fsdp"]["first_loss_rel_err"] < 1e-5 and world1["collective_rows"] == []


@pytest.mark.parametrize(("name", "world", "message"), [
    ("hsdp", 3, "needs an even number of ranks"),
    ("single", 2, "1-GPU baseline"),
    ("pipeline", 2, "unknown layout 'pipeline'"),
])
def test_layouts_invalid_for_the_world_size_say_why(name, world, message):
    with pytest.raises(ValueError, match=message):
        layout_for(name, world)


def test_layouts_at_eight_ranks():
    assert layout_for("hsdp", 8).parallel == "dense_replicate=2,dense_shard=4"
    assert layout_for("expert", 8).overrides == ("gem.num_experts=2",)
    assert layout_for("sparse2d", 8).parallel == "sparse_group=4,sparse_replicate=2"


def test_loss_curves_of_one_and_two_ranks_agree(tmp_path):
    """--curve keeps every step's global-batch loss; the same global batch on 1 and 2 ranks gives the same
    curve (fp32 on gloo), and benchmarks.multi_gpu_curves judges it against a measured noise floor."""
    from benchmarks.multi_gpu_curves import main as compare_main

    curve = ["--curve", "--warmup", "1", "--steps", "5", "--set", "compile=false"]
    single, distributed = tmp_path / "single.json", tmp_path / "fsdp.json"
    run_distributed(main, 1, [*ARGS, *curve, "--layouts", "single", "--batch-per-gpu", "16", "--out", str(single)])
    run_distributed(main, 2, [*ARGS, *curve, "--layouts", "fsdp", "--out", str(distributed)])
    one = json.loads(single.read_text())["rows"][0]["losses"]
    two = json.loads(distributed.read_text())["rows"][0]["losses"]
    assert len(one) == len(two) == 6 and one != [one[0]] * 6  # training moves the loss
    assert two == pytest.approx(one, rel=1e-4)
    # a fake noise floor: the single curve shifted by a known amount, so the ratios are known
    noisy = tmp_path / "noisy.json"
    payload = json.loads(single.read_text())
    payload["rows"][0]["losses"] = [value + 0.01 for value in one]
    noisy.write_text(json.dumps(payload))
    result = compare_main(["--single", str(single), "--single-fp32", str(noisy), "--distributed", str(distributed),
                           "--smooth", "2", "--out", str(tmp_path / "cmp.json")])
    assert result["noise_bf16_vs_fp32"]["max_smoothed"] == pytest.approx(0.01, rel=1e-4)
    assert result["layouts"]["fsdp@2"]["ratio_max"] < 0.1 and result["passed"]


def test_curve_comparison_rejects_curves_of_different_lengths():
    from benchmarks.multi_gpu_curves import compare

    with pytest.raises(ValueError, match="different lengths"):
        compare([1.0, 0.9], [1.0, 0.9], {"fsdp@2": [1.0]}, window=2, k=2.0)
    far = compare([1.0, 0.9, 0.8], [1.0, 0.91, 0.81], {"fsdp@2": [1.2, 1.1, 1.0]}, window=1, k=2.0)
    assert not far["passed"] and far["layouts"]["fsdp@2"]["ratio_max"] == pytest.approx(20.0)
