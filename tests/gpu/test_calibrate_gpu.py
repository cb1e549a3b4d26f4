"""`opengem bench calibrate` on the GPU at small sizes (skipped without CUDA): every op matches its reference,
every figure is physically plausible, and the written table drives the planner."""

import dataclasses

import pytest
import torch

from opengem.plan.calibration import load_calibration, table_from_measurements
from opengem.plan.cluster import load_cluster
from opengem.plan.planner import Planner
from opengem.train.bench.calibrate import QUICK, TOLERANCE, measure

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SMALL = dataclasses.replace(
    QUICK,
    gemm_rows=(4096,),
    jfa_lengths=(256,),
    gdpa_short=(16,),
    tokens=1 << 15,
    history=512,
    embedding_batch=512,
    embedding_rows=100_000,
)


def test_small_calibration_is_correct_plausible_and_plannable(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENGEM_JFA_AUTOTUNE", "0")  # measure() would set them for the whole process
    monkeypatch.setenv("OPENGEM_GDPA_TUNE", "0")
    m = measure(SMALL)
    assert set(m.errors) == {"gemm", "jfa", "gdpa_cross", "gdpa_pooling", "block_attention", "embedding", "layer_norm"}
    assert all(error <= TOLERANCE for error in m.errors.values())
    for _, _, _, tflops in m.gemm:
        assert 1 < tflops < 1.05 * m.peak_bf16_tflops
    for family in (m.jfa, m.gdpa):
        for keys, fwd, bwd in family:
            assert keys > 0 and 0.1 < fwd < m.peak_bf16_tflops and 0.1 < bwd < m.peak_bf16_tflops
    for gbps in (*m.block_attention_gbps, m.copy_gbps, m.raw["norm_gbps"]):
        assert 10 < gbps < 1.3 * m.hbm_gbps  # small batches may partly hit L2
    assert 1 < m.raw["h2d_gbps"] < 200 and 0.5 < m.raw["launch_us"] < 200
    path = table_from_measurements(m, load_calibration("h200"), "h200").save(tmp_path / "calibration.json")
    plan = Planner("gem-small", load_cluster("h200"), 8, str(path)).plan((256,))
    assert plan.best.fits and 0 < plan.best.e2e_mfu < 1
