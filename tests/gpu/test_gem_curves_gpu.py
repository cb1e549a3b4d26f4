"""The gem_curves benchmark on a tiny GEM on the GPU: the launch hook sees every Triton kernel of the Triton
run (forward and backward of each family) and none of the reference runs; a short run, before the long one."""

import pytest
import torch

from benchmarks import common
from benchmarks.gem_curves import CurveOptions, run_curves

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_tiny_curves_dispatch_to_triton_and_to_the_reference(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    options = CurveOptions(preset="gem-tiny", steps=4, batch_size=32, smooth=2, num_workers=0, control=False)
    result = run_curves(options)
    runs = result["runs"]
    triton = runs["triton"]["dispatch"]
    assert triton["ok"], triton["problems"]
    expected = {
        "_fwd_kernel", "_dkdv_kernel", "_dq_kernel",  # JFA self-attention, forward and backward
        "gdpa_fwd_kernel", "gdpa_bwd_dkdv_kernel", "gdpa_bwd_dq_kernel",  # PFFN cross-attention
        "gdpa_bwd_dq_broadcast_kernel",  # seed pooling
        "_lookup_kernel", "_aggregate_update_kernel",  # embedding lookup and fused optimizer
    }  # fmt: skip
    assert expected <= set(triton["launches"]), triton["launches"]
    for name in ("reference", "reference_fp32"):
        assert runs[name]["dispatch"]["ok"] and runs[name]["dispatch"]["launches"] == {}, name
    assert result["same_initial_weights"] and result["finite_losses"]
    assert result["first_batch_logits_relative_error"]["triton_vs_reference"] < 2e-2  # bf16 kernels vs fp32 math
    assert result["verdict"] in ("PASS", "FAIL")  # 4 steps are too few to judge; the run must complete
