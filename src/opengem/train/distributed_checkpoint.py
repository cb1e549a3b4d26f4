"""Checkpoints of distributed runs: DCP, layout-independent, atomic, the last K kept.

Layout: ``<run>/checkpoints/step_00000100/`` (the single-process trainer's folder names) holding a
``torch.distributed.checkpoint`` directory and ``manifest.json``. Every rank writes its shards into
``step_00000100.partial``; once all are done rank 0 adds the manifest and renames the folder
(``opengem.parallel.save_distributed``), so a folder with the final name is complete.

What is saved, independent of the layout it was written under:

- ``train``: the dense parameters and AdamW state by parameter name (FSDP / expert-parallel DTensors;
  DCP reshards them on load to any world size and layout);
- ``sparse``: every embedding table's full weights and fused-optimizer state
  (``opengem.parallel.sparse_state``), sliced again under the new sharding plan on load;
- ``rng``: the CPU RNG state (the same on every rank).

The manifest holds the step (the data position: the synthetic stream is keyed by step, the Parquet
stream skips that many batches), the config, the layout and world size it was written under, the
learning-rate schedule's state and every file's size and SHA-256 (checked before resuming).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from opengem.parallel.checkpoint import ModelOptimizerState, load_distributed, save_distributed
from opengem.parallel.mesh import ParallelConfig
from opengem.parallel.sparse import ShardedEmbeddingCollection
from opengem.parallel.sparse_state import empty_full_state, full_state, load_full_state
from opengem.train.checkpoint import (
    DISTRIBUTED_FORMAT,
    MANIFEST_FILE,
    checkpoints_dir,
    read_manifest,
    resolve_checkpoint,
    sha256_of,
)
from opengem.train.config import TrainConfig

STEP_FOLDER = re.compile(r"step_\d{8}")


def _state(learner: Any, sparse: dict[str, ShardedEmbeddingCollection], sparse_state: dict[str, Any]) -> dict[str, Any]:
    return {
        "train": ModelOptimizerState(learner.model, learner.optimizer, exclude=tuple(sparse)),
        "sparse": sparse_state,
        "rng": torch.get_rng_state(),
    }


def save_distributed_checkpoint(
    run_dir: Path,
    learner: Any,
    sparse: dict[str, ShardedEmbeddingCollection],
    step: int,
    config: TrainConfig,
    layout: ParallelConfig,
    keep: int,
) -> Path:
    """Write ``step``'s checkpoint (every rank calls this); rank 0 then deletes all but the newest ``keep``."""
    root = checkpoints_dir(run_dir)
    state = _state(learner, sparse, {path: full_state(module) for path, module in sparse.items()})

    def write_manifest(folder: Path) -> None:
        files = [p for p in sorted(folder.iterdir()) if p.is_file()]
        manifest = {
            "format": DISTRIBUTED_FORMAT,
            "step": step,
            "config": dataclasses.asdict(config),
            "layout": dataclasses.asdict(layout),
            "world_size": dist.get_world_size(),
            "scheduler": learner.scheduler.state_dict(),
            "files": {p.name: p.stat().st_size for p in files},
            # a same-size corruption passes the sizes: a flipped byte had loaded as a weight of 6.4e37
            "sha256": {p.name: sha256_of(p) for p in files},
        }
        (folder / MANIFEST_FILE).write_text(json.dumps(manifest))

    final = save_distributed(state, root / f"step_{step:08d}", on_complete=write_manifest)
    if dist.get_rank() == 0:
        finished = sorted(p for p in root.iterdir() if p.is_dir() and STEP_FOLDER.fullmatch(p.name))
        for old in finished[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load_distributed_checkpoint(path: Path, learner: Any, sparse: dict[str, ShardedEmbeddingCollection]) -> int:
    """Restore ``learner`` and the sharded tables from a run folder or checkpoint folder (every rank calls
    this, under any layout); returns the step to continue from."""
    folder = resolve_checkpoint(path)
    manifest = read_manifest(folder)
    if manifest.get("format") != DISTRIBUTED_FORMAT:
        raise ValueError(f"--resume: {folder} was written by a single-process run; resume it without --parallel")
    missing = sorted({"step", "scheduler"} - set(manifest))
    if missing:  # checked before the (long) load, not after it
        raise ValueError(f"--resume: {folder / MANIFEST_FILE} has no {', '.join(map(repr, missing))}")
    state = _state(learner, sparse, {name: empty_full_state(module) for name, module in sparse.items()})
    try:
        load_distributed(state, folder)
    except ValueError as error:  # other sizes or keys than the settings build (an override), or a corrupt shard
        raise ValueError(f"--resume: checkpoint {folder} does not fit the model built from the settings (did an "
                         f"override change its sizes?): {error}") from error
    for name, module in sparse.items():
        load_full_state(module, state["sparse"][name])
    torch.set_rng_state(state["rng"])
    learner.scheduler.load_state_dict(manifest["scheduler"])
    return int(manifest["step"])

