"""The gem_curves benchmark's plumbing on CPU: a tiny GEM, 3 steps, every run on the reference kernels
(it runs once on the GPU, so the data sharing, equal initial weights, JSON fields and verdict are checked here)."""

import json
import math
from collections import Counter

import pytest
import torch

from benchmarks import common, gem_curves
from benchmarks.gem_curves import CurveOptions, divergence, judge, moving_average
from benchmarks.kernel_dispatch import dispatch_report, kernel_names, required_families

NAMES = {
    "jagged_attention": {"_fwd_kernel", "_dq_kernel"},
    "block_attention": {"_block_attention_fwd"},
    "gdpa": {"gdpa_fwd_kernel"},
    "embedding": {"_lookup_kernel"},
}
FAMILIES = ["embedding", "jagged_attention", "gdpa"]


@pytest.fixture(scope="module")
def cpu_result(tmp_path_factory):
    results = tmp_path_factory.mktemp("results")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(common, "RESULTS_DIR", results)
        options = CurveOptions(
            preset="gem-tiny", steps=3, batch_size=8, smooth=2, device="cpu", num_workers=0, triton_backend="reference"
        )
        result = gem_curves.run_curves(options)
    return result, results


def test_cpu_run_writes_every_field(cpu_result):
    _, results = cpu_result
    saved = json.loads((results / "gem_curves.json").read_text())
    assert [row["step"] for row in saved["rows"]] == [1, 2, 3]
    assert set(saved["rows"][0]) == {"step", "triton", "reference", "reference_fp32", "control"}
    assert set(saved["divergence"]) == {
        "triton_vs_reference",
        "noise_reference_bf16_vs_fp32",
        "triton_vs_reference_fp32",
        "control_vs_reference",
    }
    for name in (
        "runs",
        "settings",
        "environment",
        "ratios_to_noise",
        "first_logits_ratio_to_noise",
        "control_ratios_to_noise",
        "first_batch_logits_relative_error",
        "verdict",
    ):
        assert name in saved, name
    assert saved["settings"]["steps"] == 3 and saved["k"] == 2.0
    assert saved["runs"]["control"]["window"] == saved["runs"]["triton"]["window"] // 2
    if gem_curves_plots():
        assert (results / "gem_curves.png").stat().st_size > 0


def gem_curves_plots() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_cpu_runs_share_data_and_weights(cpu_result):
    result, _ = cpu_result
    # "triton" ran the reference kernels here: same data, same weights, same arithmetic -> the same curve
    assert result["divergence"]["triton_vs_reference"]["max_raw"] == 0.0
    assert result["first_batch_logits_relative_error"]["triton_vs_reference"] == 0.0
    assert result["divergence"]["noise_reference_bf16_vs_fp32"]["max_raw"] > 0  # bf16 rounds differently
    assert 0 < result["first_batch_logits_relative_error"]["noise_reference_bf16_vs_fp32"] < 0.05
    assert result["divergence"]["control_vs_reference"]["max_raw"] > 0  # the halved window changes the model
    assert result["same_initial_weights"] and result["finite_losses"]
    assert result["dispatch_ok"]
    for run in result["runs"].values():
        assert sum(run["dispatch"]["launches_per_family"].values()) == 0
    assert result["verdict"] == "PASS"
    assert all(math.isfinite(row[name]) for row in result["rows"] for name in ("triton", "reference", "reference_fp32"))


def test_dispatch_report_requires_every_family_on_triton_and_none_on_reference():
    launches = Counter({"_fwd_kernel": 4, "_lookup_kernel": 2, "triton_poi_fused_add_0": 7})
    triton = dispatch_report("triton", launches, FAMILIES, NAMES, available=True)
    assert not triton["ok"] and triton["problems"] == ["no Triton kernel of gdpa launched"]
    assert triton["launches_per_family"]["jagged_attention"] == 4 and triton["other_triton_launches"] == 7
    complete = dispatch_report("triton", launches + Counter({"gdpa_fwd_kernel": 1}), FAMILIES, NAMES, True)
    assert complete["ok"] and complete["launches"] == {"_fwd_kernel": 4, "_lookup_kernel": 2, "gdpa_fwd_kernel": 1}
    reference = dispatch_report("reference", Counter({"_lookup_kernel": 1}), FAMILIES, NAMES, True)
    assert not reference["ok"] and "launched opengem Triton kernels" in reference["problems"][0]
    assert dispatch_report("reference", Counter({"triton_poi_fused_add_0": 3}), FAMILIES, NAMES, True)["ok"]
    assert not dispatch_report("reference", Counter(), FAMILIES, NAMES, available=False)["ok"]


def test_required_families_follow_the_model_config():
    from opengem.models.gem import GEMConfig

    assert required_families(GEMConfig()) == ["embedding", "jagged_attention", "gdpa"]
    assert required_families(GEMConfig(self_attention="block", use_pffn=False, use_pooling=False)) == [
        "embedding",
        "block_attention",
    ]
    assert required_families(GEMConfig(use_sequence=False)) == ["embedding"]


def test_kernel_names_include_the_launched_kernels():
    names = kernel_names()
    assert {"_fwd_kernel", "_dkdv_kernel", "_dq_kernel"} <= names["jagged_attention"]
    assert {"gdpa_fwd_kernel", "gdpa_bwd_dkdv_kernel", "gdpa_bwd_dq_broadcast_kernel"} <= names["gdpa"]
    assert {"_lookup_kernel", "_aggregate_update_kernel"} <= names["embedding"]
    assert "_block_attention_bwd" in names["block_attention"]


def test_moving_average_and_divergence():
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    d = divergence([1.0, 1.0, 1.0, 1.0], [1.0, 3.0, 1.0, 3.0], window=2)
    assert d["max_raw"] == 2.0 and d["mean_raw"] == 1.0
    assert d["max_smoothed"] == 1.0 and d["mean_smoothed"] == pytest.approx(0.75)  # |1 - (1, 2, 2, 2)|


def _run(name: str, losses: list[float], fingerprint=(1.0, 2.0), ok: bool = True) -> dict:
    return {
        "name": name,
        "losses": losses,
        "weights_fingerprint": list(fingerprint),
        "dispatch": {"ok": ok},
        "first_logits": torch.tensor([1.0, 2.0]),
    }


def test_judge_compares_to_k_times_the_noise():
    base = [1.0, 0.9, 0.8, 0.7]
    runs = {
        "triton": _run("triton", [x + 0.03 for x in base]),
        "reference": _run("reference", base),
        "reference_fp32": _run("reference_fp32", [x + 0.02 for x in base]),
    }
    assert judge(runs, window=2, k=2.0)["verdict"] == "PASS"  # ratio 1.5
    assert judge(runs, window=2, k=1.0)["verdict"] == "FAIL"
    assert judge(runs, window=2, k=2.0)["ratios_to_noise"]["mean_smoothed"] == pytest.approx(1.5)
    runs["triton"] = _run("triton", [x + 0.01 for x in base], fingerprint=(1.0, 2.5))
    assert judge(runs, window=2, k=2.0)["verdict"] == "FAIL"  # different initial weights
    runs["triton"] = _run("triton", [x + 0.01 for x in base], ok=False)
    assert judge(runs, window=2, k=2.0)["verdict"] == "FAIL"  # the kernels did not dispatch as promised
    del runs["reference_fp32"]
    assert judge(runs, window=2, k=2.0)["verdict"] == "INCOMPLETE"


def test_bad_options_raise():
    with pytest.raises(ValueError, match="steps must be >= 1"):
        CurveOptions(steps=0)
    with pytest.raises(ValueError, match="k must be > 0"):
        CurveOptions(k=0)
    with pytest.raises(ValueError, match="triton_backend must be"):
        CurveOptions(triton_backend="auto")
    with pytest.raises(ValueError, match="the Triton runs need a CUDA device, got device 'cpu'"):
        CurveOptions(device="cpu")
