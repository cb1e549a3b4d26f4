"""`opengem train --parallel` on one CUDA GPU with NCCL (world size 1): the distributed trainer unchanged.

On CUDA the distributed trainer keeps bf16 parameter copies for compute (FSDP mixed precision) and runs
the forward under bf16 autocast, so its losses match the fp32 single-process run only loosely.
"""

import json
import math
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TINY = [
    "batch_size=64", "eval_samples=256", "eval_every=4", "log_every=1", "warmup_steps=1", "baseline=false",
    "steps=4", "checkpoint_every=2", "device=cuda", "gem.num_experts=2",
]  # fmt: skip


def _losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss/model"] for r in records if "loss/model" in r}


@pytest.fixture
def torchrun_env(monkeypatch):
    """The variables torchrun sets for a 1-rank job (restored afterwards, so later tests run single-process)."""
    from opengem.parallel.testing import free_port

    variables = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for key, value in variables.items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize("architecture", ["gem", "sequence_ctr"])
def test_nccl_world_size_one_trains_and_resumes(tmp_path, torchrun_env, monkeypatch, architecture):
    import torch.distributed as dist

    from opengem.parallel import parse_parallel
    from opengem.parallel.testing import free_port
    from opengem.train.config import load_config
    from opengem.train.trainer import train

    config = load_config("gem-tiny", None, [*TINY, f"architecture={architecture}", f"out_dir={tmp_path}", "name=ddp"])
    summary = train(config, progress=False, parallel=parse_parallel(""))
    assert not dist.is_initialized()  # the trainer created the process group, and destroyed it
    losses = _losses(Path(summary["run_dir"]))
    assert list(losses) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses.values())
    assert summary["final"]["click/model/auc"] > 0

    # resume at step 2 (a new process group): the bf16 curve continues within bf16 noise
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    resumed = train(load_config("gem-tiny", None, [*TINY, f"architecture={architecture}", f"out_dir={tmp_path}",
                                                   "name=resumed"]),
                    resume=tmp_path / "ddp" / "checkpoints" / "step_00000002", progress=False,
                    parallel=parse_parallel(""))
    after = _losses(Path(resumed["run_dir"]))
    assert list(after) == [3, 4]
    for step in after:
        assert after[step] == pytest.approx(losses[step], rel=2e-2)

    # the fp32 single-process run of the same batches: same first loss up to bf16 rounding
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    single = train(load_config("gem-tiny", None, [*TINY, f"architecture={architecture}", f"out_dir={tmp_path}",
                                                  "name=single"]), progress=False)
    assert _losses(Path(single["run_dir"]))[1] == pytest.approx(losses[1], rel=2e-2)
