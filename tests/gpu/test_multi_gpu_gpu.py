"""`benchmarks.multi_gpu` on CUDA with NCCL: gem-tiny, quick. One GPU: the single-process baseline next to
FSDP at world size 1 (in process). Two GPUs or more: every layout and the collective timing under torchrun."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--quick", "--preset", "gem-tiny", "--batch-per-gpu", "64", "--set", "num_workers=0"]


def test_one_gpu_baseline_and_fsdp(tmp_path, monkeypatch):
    from benchmarks.multi_gpu import main
    from opengem.parallel.testing import free_port

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "multi_gpu.json"
    main([*ARGS, "--layouts", "fsdp", "--out", str(out)])
    payload = json.loads(out.read_text())
    rows = {row["layout"]: row for row in payload["rows"]}
    assert list(rows) == ["single", "fsdp"] and payload["device_count"] == 1
    assert payload["device_type"] == torch.cuda.get_device_name()
    assert 0 < rows["single"]["e2e_mfu"] < 1 and rows["single"]["scaling_ratio"] == pytest.approx(1.0)
    assert 0 < rows["fsdp"]["scaling_ratio"] < 2
    assert rows["fsdp"]["first_loss_rel_err"] < 0.05  # bf16 FSDP parameters vs the single process' fp32 weights
    assert rows["fsdp"]["peak_memory_gib"] > 0 and payload["collective_rows"] == []


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_every_layout_under_torchrun(tmp_path):
    out = tmp_path / "multi_gpu.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "benchmarks.multi_gpu",
               *ARGS, "--min-message-kib", "0", "--single-gpu-mfu", "0.01", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    finished = subprocess.run(command, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-4000:]
    payload = json.loads(out.read_text())
    assert [row["layout"] for row in payload["rows"]] == ["fsdp", "hsdp", "expert", "sparse1d", "sparse2d"]
    assert all(row["e2e_mfu"] > 0 and row["first_loss_rel_err"] < 0.05 for row in payload["rows"])
    kinds = {(row["kind"], row["route"]) for row in payload["collective_rows"]}
    assert {("all_gather", "nccl"), ("reduce_scatter", "nccl"), ("all_to_all", "nccl")} <= kinds
    assert all(row["gb_per_s"] > 0 for row in payload["collective_rows"])
    beside = {row["route"]: row for row in payload["compute_beside_collectives"]}
    assert "nccl" in beside and 0 < beside["nccl"]["throughput_kept"] <= 1.2
    assert 0 <= beside["nccl"]["sms_lost"] < beside["nccl"]["sms"]
