"""Checkpoints: every learner's model and optimizer state, the step and RNG state, written atomically."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Protocol

import torch

from opengem.train.config import TrainConfig


class _Learner(Protocol):
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any


def save_checkpoint(path: Path, learners: dict[str, _Learner], step: int, config: TrainConfig) -> None:
    state = {
        "step": step,
        "config": dataclasses.asdict(config),
        "rng": torch.get_rng_state(),
        "learners": {
            name: {
                "model": learner.model.state_dict(),
                "optimizer": learner.optimizer.state_dict(),
                "scheduler": learner.scheduler.state_dict(),
            }
            for name, learner in learners.items()
        },
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # a crash mid-write never leaves a truncated checkpoint behind


def load_checkpoint(run_dir: Path, learners: dict[str, _Learner]) -> int:
    """Restore ``learners`` from ``run_dir/checkpoint.pt`` (or a file path); returns the step to continue from."""
    state = _read(run_dir)
    path = _checkpoint_path(run_dir)
    missing = set(learners) - set(state["learners"])
    if missing:
        raise ValueError(f"--resume: checkpoint {path} has no state for {sorted(missing)}")
    for name, learner in learners.items():
        saved = state["learners"][name]
        learner.model.load_state_dict(saved["model"])
        learner.optimizer.load_state_dict(saved["optimizer"])
        learner.scheduler.load_state_dict(saved["scheduler"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])


def checkpoint_config(run_dir: Path) -> dict[str, Any]:
    """The TrainConfig (as a dict) a checkpoint was written with."""
    return _read(run_dir)["config"]


def _checkpoint_path(run_dir: Path) -> Path:
    return run_dir / "checkpoint.pt" if run_dir.is_dir() else run_dir


def _read(run_dir: Path) -> dict[str, Any]:
    path = _checkpoint_path(run_dir)
    if not path.exists():
        raise ValueError(f"--resume: no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several types for truncated or foreign files
        raise ValueError(f"--resume: {path} is not a readable opengem checkpoint ({error})") from error
    if not isinstance(state, dict) or not {"step", "config", "learners"} <= set(state):
        raise ValueError(f"--resume: {path} is not an opengem checkpoint (missing step/config/learners)")
    return state
