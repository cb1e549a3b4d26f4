"""Bad input to distributed training, in this process as a 1-rank gloo job: settings that were dropped or ignored
silently, a launch environment that hung, failures that left a process group behind, and distributed checkpoints
that did not fit or were corrupt (session 49's audit)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import distributed_runs as runs
import pytest
import torch.distributed as dist

from opengem.cli.main import main
from opengem.parallel.mesh import ParallelConfig
from opengem.parallel.testing import free_port
from opengem.train.checkpoint import MANIFEST_FILE, latest_checkpoint, resolve_checkpoint
from opengem.train.distributed import DistributedRun
from opengem.train.trainer import train


@pytest.fixture
def port(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def _config(tmp_path: Path):
    return runs.tiny_config(str(tmp_path), "run", "gem")


def _left_as_before() -> bool:
    return not dist.is_initialized() and "WORLD_SIZE" not in os.environ and "RANK" not in os.environ


def test_activation_checkpointing_is_honoured_in_a_distributed_run(tmp_path, port):
    config = dataclasses.replace(_config(tmp_path), activation_checkpointing=True)
    run = DistributedRun(config, ParallelConfig())  # the setting had wrapped no block under torchrun
    try:
        assert run.layout.activation_checkpointing
    finally:
        run.close()
    assert _left_as_before()


def test_a_memory_budget_beside_the_layouts_checkpointing_is_refused(tmp_path, port):
    config = dataclasses.replace(_config(tmp_path), compile=True, activation_memory_budget=0.5)
    with pytest.raises(ValueError, match="activation_checkpointing recomputes whole blocks; activation_memory_budget"):
        DistributedRun(config, ParallelConfig(activation_checkpointing=True))
    assert _left_as_before()


def test_a_failed_start_leaves_no_process_group_behind(tmp_path, port):
    with pytest.raises(ValueError, match="dense_replicate \\* dense_shard = 1 \\* 2 = 2 != world size 1"):
        DistributedRun(_config(tmp_path), ParallelConfig(dense_shard=2))
    assert _left_as_before()  # a later plain train() had run distributed


@pytest.mark.parametrize(("environment", "message"), [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but RANK is not"),  # had waited for rank 1 for 30 minutes
    ({"RANK": "1"}, "RANK=1 is set but WORLD_SIZE is not"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, r"RANK=2 must be in \[0, WORLD_SIZE=2\)"),
    ({"RANK": "0", "WORLD_SIZE": "two"}, "environment variable WORLD_SIZE='two' must be an integer"),
])
def test_an_inconsistent_launch_environment_is_named(tmp_path, port, monkeypatch, environment, message):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        DistributedRun(_config(tmp_path), ParallelConfig())
    assert not dist.is_initialized()


def test_a_copy_engine_fallback_is_said(tmp_path, port):
    with pytest.warns(UserWarning, match="collectives=copy_engine: falling back to the default collectives: "
                                         "copy_engine needs NCCL; backend is gloo"):
        run = DistributedRun(_config(tmp_path), ParallelConfig(collectives="copy_engine"))
    run.close()


@pytest.fixture
def dcp_run(tmp_path, port) -> Path:
    config = dataclasses.replace(_config(tmp_path), steps=3, checkpoint_every=3, eval_every=3)
    return Path(train(config, progress=False, parallel=ParallelConfig())["run_dir"])


def test_resuming_a_distributed_checkpoint_with_other_sizes_is_named(dcp_run, capsys):
    # DCP's CheckpointException is a BaseException: it had escaped the CLI as a 58-line traceback
    assert main(["train", "--no-progress", "--parallel", "", "--resume", str(dcp_run), "--steps", "4",
                 "--set", "gem.d_model=32"]) == 2
    error = capsys.readouterr().err
    assert "does not fit the model built from the settings (did an override change its sizes?)" in error, error
    assert _left_as_before()


def test_a_corrupt_or_incomplete_distributed_checkpoint_is_named(dcp_run, capsys):
    checkpoint = latest_checkpoint(dcp_run)
    manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())
    (checkpoint / MANIFEST_FILE).write_text(json.dumps({k: v for k, v in manifest.items() if k != "scheduler"}))
    assert main(["train", "--no-progress", "--parallel", "", "--resume", str(checkpoint), "--steps", "4"]) == 2
    assert f"{checkpoint / MANIFEST_FILE} has no 'scheduler'" in capsys.readouterr().err  # was a KeyError, after
    (checkpoint / MANIFEST_FILE).write_text(json.dumps(manifest))
    shard = next(checkpoint.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: the sizes alone had let it load (one weight became 6.4e37)
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{shard.name} does not match its checksum"):
        resolve_checkpoint(checkpoint)
