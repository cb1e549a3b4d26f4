"""Per-rank work of the distributed trainer tests (runs inside the gloo workers; no tests here).

One 4-rank and one 2-rank session: the 4-rank one trains GEM under HSDP 2 x 2 with 2-way expert
parallelism (checkpointing at step 3) and SequenceCTR under FSDP 4; the 2-rank one resumes the GEM
checkpoint under plain FSDP 2 (another world size, no expert parallelism) and checks a layout error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from opengem.nn.wukong import DenseExperts
from opengem.parallel import build_meshes, fsdp_step_bytes, parallelize, parse_parallel
from opengem.train.config import TrainConfig, load_config
from opengem.train.trainer import build_model, train

STEPS, SAVE_AFTER = 5, 3
TINY = [
    "batch_size=16", "eval_samples=40", "eval_every=5", "log_every=1", "warmup_steps=1", "baseline=false",
    f"steps={STEPS}", f"checkpoint_every={SAVE_AFTER}", "device=cpu",
    "model.d_model=16", "model.embedding_dim=8", "model.num_layers=1", "model.mlp_dims=32,16",
    "gem.d_model=16", "gem.embedding_dim=8", "gem.wukong_hidden=32", "gem.head_dims=32,16", "gem.num_experts=2",
]  # fmt: skip
GEM_LAYOUT = "dense_replicate=2,dense_shard=2,expert=2"


def tiny_config(out_dir: str, name: str, architecture: str) -> TrainConfig:
    return load_config("gem-tiny", None, [*TINY, f"out_dir={out_dir}", f"name={name}", f"architecture={architecture}"])


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss/model"] for r in records(run_dir) if "loss/model" in r}


def analytic_fsdp_bytes(config: TrainConfig, spec: str) -> dict[str, int]:
    """``fsdp_step_bytes`` of the model parallelized on its own, as the trainer's metrics should report it."""
    model = build_model(config, config.model.history, torch.device(config.device))
    units = parallelize(model, build_meshes(parse_parallel(spec)), expert_types=(DenseExperts,))
    return {f"comm/{dim}/{collective}_bytes": n for (dim, collective), n in fsdp_step_bytes(units, 4, 4).items()}


def _train(config: TrainConfig, spec: str, resume: Path | None = None) -> dict[str, Any]:
    summary = train(config, resume=resume, progress=False, parallel=parse_parallel(spec))
    dist.barrier()  # rank 0 has written the metrics
    run_dir = Path(summary["run_dir"])
    return {"losses": losses(run_dir), "records": records(run_dir), "final": summary["final"]}


def session_world4(out_dir: str) -> dict[str, Any]:
    gem = tiny_config(out_dir, "gem_world4", "gem")
    sequence = tiny_config(out_dir, "sequence_world4", "sequence_ctr")
    return {
        "gem": _train(gem, GEM_LAYOUT),
        "gem_fsdp_bytes": analytic_fsdp_bytes(gem, GEM_LAYOUT),
        "sequence_ctr": _train(sequence, "dense_shard=4"),
        "checkpoints": sorted(p.name for p in (Path(out_dir) / "gem_world4" / "checkpoints").iterdir()),
    }


def session_world2(out_dir: str) -> dict[str, Any]:
    resumed = tiny_config(out_dir, "gem_resumed_world2", "gem")
    checkpoint = Path(out_dir) / "gem_world4" / "checkpoints" / f"step_{SAVE_AFTER:08d}"
    try:
        train(resumed, progress=False, parallel=parse_parallel("dense_shard=3"))
        layout_error = ""
    except ValueError as error:
        layout_error = str(error)
    return {"resumed": _train(resumed, "dense_shard=2", resume=checkpoint), "layout_error": layout_error}
