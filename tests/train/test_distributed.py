"""`opengem train` distributed (gloo, CPU): same losses as one process, resume under another layout, bytes.

The rank sessions live in ``distributed_runs.py``; each world size is spawned once per test run.
"""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path
from typing import Any

import distributed_runs as runs
import pytest
import torch.distributed as dist

from opengem.cli.main import main
from opengem.parallel.testing import free_port, run_once
from opengem.train.trainer import train

RTOL = 1e-4


@pytest.fixture(scope="session")
def out_dir(shared_dir: Path) -> Path:
    return shared_dir / "distributed_train"


@pytest.fixture(scope="session")
def world4(shared_dir: Path, out_dir: Path) -> dict[str, Any]:
    return run_once(shared_dir, "train_world4", runs.session_world4, 4, str(out_dir))[0]


@pytest.fixture(scope="session")
def world2(shared_dir: Path, out_dir: Path, world4: dict[str, Any]) -> dict[str, Any]:
    return run_once(shared_dir, "train_world2", runs.session_world2, 2, str(out_dir))[0]


@functools.cache
def single_process(architecture: str) -> tuple[dict[int, float], dict[str, Any]]:
    """The single-process run of the same config: (losses by step, final held-out metrics)."""
    with tempfile.TemporaryDirectory() as out:
        summary = train(runs.tiny_config(out, architecture, architecture), progress=False)
        return runs.losses(Path(summary["run_dir"])), summary["final"]


def assert_close(actual: dict[int, float], expected: dict[int, float]) -> None:
    assert actual.keys() == expected.keys()
    for step, loss in expected.items():
        assert actual[step] == pytest.approx(loss, rel=RTOL), step


@pytest.mark.parametrize("architecture", ["gem", "sequence_ctr"])
def test_distributed_run_equals_single_process(world4, architecture):
    """GEM: HSDP 2 x 2 with 2-way expert parallelism; SequenceCTR: FSDP 4; tables sharded over 4 ranks.

    Same losses at every step, and the same held-out metrics (predictions gathered from all ranks).
    """
    expected_losses, expected_final = single_process(architecture)
    assert list(expected_losses) == list(range(1, runs.STEPS + 1))
    assert_close(world4[architecture]["losses"], expected_losses)
    final = world4[architecture]["final"]
    assert final.keys() == expected_final.keys()
    for key, value in expected_final.items():
        assert final[key] == pytest.approx(value, rel=1e-3, abs=1e-6), key


def test_checkpoint_at_world_4_resumes_at_world_2(world4, world2):
    """Saved under HSDP 2 x 2 + EP 2 at step 3, resumed under FSDP 2: the loss curve continues."""
    assert world4["checkpoints"] == [f"step_{runs.SAVE_AFTER:08d}", f"step_{runs.STEPS:08d}"]
    resumed = world2["resumed"]["losses"]
    uninterrupted = world4["gem"]["losses"]
    assert list(resumed) == list(range(runs.SAVE_AFTER + 1, runs.STEPS + 1))
    assert_close(resumed, {step: uninterrupted[step] for step in resumed})


def test_reported_fsdp_bytes_match_the_analytic_count(world4):
    record = next(r for r in world4["gem"]["records"] if r.get("step") == 2 and "loss/model" in r)
    analytic = world4["gem_fsdp_bytes"]
    # HSDP 2 x 2; the experts' mesh has an expert_shard dim of 1: replicated, so only all-reduced
    assert set(analytic) == {"comm/shard/all_gather_bytes", "comm/shard/reduce_scatter_bytes",
                             "comm/replicate/all_reduce_bytes"}
    for key, nbytes in analytic.items():
        assert record[key] == nbytes, key
    # traffic recorded at run time: expert-parallel activations and the sparse exchange
    assert record["comm/expert/all_gather_bytes"] > 0
    assert record["comm/expert/reduce_scatter_bytes"] == record["comm/expert/all_gather_bytes"]
    assert record["comm/sparse_group/all_to_all_ids_bytes"] > 0


def test_impossible_layout_is_reported(world2):
    assert "dense_replicate * dense_shard = 1 * 3 = 3 != world size 2" in world2["layout_error"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("dense_shards=2", "unknown key 'dense_shards'"),
        ("dense_shard=two", "dense_shard='two': expected an integer"),
        ("expert", "'expert' is not of the form key=value"),
        ("activation_checkpointing=yes", "activation_checkpointing='yes': expected 0, 1, true or false"),
        ("expert=2,expert=2", "'expert' given twice"),
        ("collectives=nvls", "collectives='nvls': expected one of default, copy_engine"),
    ],
)
def test_cli_rejects_bad_parallel_strings(capsys, spec, message):
    assert main(["train", "--parallel", spec, "--steps", "1"]) == 2
    error = capsys.readouterr().err
    assert "--parallel" in error and message in error


def test_resuming_a_distributed_checkpoint_in_one_process(world4, out_dir, tmp_path, monkeypatch):
    """No torchrun, no --parallel: a DCP checkpoint resumes as a 1-rank gloo job, then the process is as before."""
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    config = runs.tiny_config(str(tmp_path), "resumed_world1", "gem")
    summary = train(config, resume=out_dir / "gem_world4" / "checkpoints" / f"step_{runs.SAVE_AFTER:08d}",
                    progress=False)
    resumed = runs.losses(Path(summary["run_dir"]))
    assert_close(resumed, {step: world4["gem"]["losses"][step] for step in resumed})
    assert list(resumed) == [4, 5]
    assert not dist.is_initialized() and "WORLD_SIZE" not in os.environ
