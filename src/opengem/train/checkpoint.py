"""Checkpoints that survive crashes: atomic, checksummed, the last K kept, bad ones skipped.

Layout: ``<run>/checkpoints/step_00000100/`` holding ``state.pt`` (every learner's model, optimizer
and scheduler state, the step, the config and the RNG state) and ``manifest.json`` (step, the
SHA-256 of ``state.pt`` and the config, so reading the settings never loads the state). Distributed
runs write the same folders with a DCP checkpoint inside (``opengem.train.distributed_checkpoint``);
their manifest says ``"format": "dcp"`` and lists every file's size and SHA-256. A checkpoint is written into a
temporary folder and renamed into place only when complete, so a crash or a full disk mid-save never leaves a
half-written checkpoint where the loader looks; the loader verifies the checksum and falls back to the previous
good checkpoint, with a warning, when the newest one is corrupt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Protocol

import torch

from opengem.train.config import TrainConfig
from opengem.validation import is_int

STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
DISTRIBUTED_FORMAT = "dcp"  # manifest "format" of checkpoints written by opengem.train.distributed


def is_distributed_checkpoint(folder: Path) -> bool:
    """Whether the (resolved) checkpoint ``folder`` was written by a distributed run."""
    return read_manifest(folder).get("format") == DISTRIBUTED_FORMAT


def read_manifest(folder: Path) -> dict[str, Any]:
    """``folder``'s manifest as a dict; ``ValueError`` naming the file when it is not JSON or not a JSON object (a
    list or a number there had failed as an AttributeError in whichever reader came first)."""
    path = folder / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: unreadable manifest ({error})") from error
    if not isinstance(manifest, dict):
        raise ValueError(f"{path}: the manifest must be a JSON object, got {type(manifest).__name__}")
    return manifest


def checkpoint_step(folder: Path) -> int:
    """The step a (resolved) checkpoint ``folder`` continues from, from its manifest."""
    step = read_manifest(folder).get("step")
    if not is_int(step) or step < 0:
        raise ValueError(f"{folder / MANIFEST_FILE}: 'step' must be an int >= 0, got {step!r}")
    return int(step)


class _Learner(Protocol):
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def save_checkpoint(
    run_dir: Path, learners: dict[str, _Learner], step: int, config: TrainConfig, keep: int
) -> Path:
    """Write ``step``'s checkpoint atomically and delete all but the newest ``keep``; returns its folder."""
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
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
        torch.save(state, tmp / STATE_FILE)
        manifest = {"step": step, "sha256": sha256_of(tmp / STATE_FILE), "config": state["config"]}
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # the previous checkpoints stay untouched
        raise
    for old in sorted(p for p in root.glob("step_*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path:
    """The newest checkpoint folder of a run whose checksum verifies (warning about each bad one)."""
    candidates = sorted((p for p in checkpoints_dir(run_dir).glob("step_*") if p.is_dir()), reverse=True)
    for candidate in candidates:
        problem = verify_checkpoint(candidate)
        if problem is None:
            return candidate
        warnings.warn(f"skipping checkpoint {candidate}: {problem}; trying the previous one", stacklevel=2)
    raise ValueError(f"--resume: no usable checkpoint under {checkpoints_dir(run_dir)}")


# folder -> the (name, size, mtime) of its files when last verified good: a resume resolves its checkpoint up to four
# times (the CLI, its settings, the trainer, the loader), and each verification hashes every state file
_VERIFIED: dict[Path, tuple[tuple[str, int, int], ...]] = {}


def verify_checkpoint(folder: Path) -> str | None:
    """None when ``folder`` holds a complete checkpoint whose state matches its manifest, else the reason. A folder
    verified good before is not hashed again while none of its files changed (size and modification time)."""
    key = folder.resolve()
    signature = _file_signature(key)
    if _VERIFIED.get(key) == signature:
        return None
    problem = _verify(folder)
    if problem is None:
        _VERIFIED[key] = signature
    return problem


def _file_signature(folder: Path) -> tuple[tuple[str, int, int], ...]:
    try:
        stats = [(p.name, p.stat()) for p in sorted(folder.iterdir()) if p.is_file()]
    except OSError:
        return ()
    return tuple((name, stat.st_size, stat.st_mtime_ns) for name, stat in stats)


def _verify(folder: Path) -> str | None:
    try:
        manifest = read_manifest(folder)
    except ValueError as error:
        return str(error).removeprefix(f"{folder / MANIFEST_FILE}: ")
    if manifest.get("format") == DISTRIBUTED_FORMAT:  # every rank's file, at the size and checksum written
        for section in ("files", "sha256"):  # a list there had failed as an AttributeError
            if not isinstance(manifest.get(section, {}), dict):
                return f"the manifest's {section!r} must be an object of file names, got {manifest[section]!r}"
        for name, size in manifest.get("files", {}).items():
            if not (folder / name).is_file() or (folder / name).stat().st_size != size:
                return f"{name} is missing or has the wrong size (truncated or corrupt)"
        for name, digest in manifest.get("sha256", {}).items():  # manifests before session 49 have sizes only
            if sha256_of(folder / name) != digest:
                return f"{name} does not match its checksum (corrupt)"
        return None
    if not (folder / STATE_FILE).exists():
        return f"{STATE_FILE} is missing"
    if sha256_of(folder / STATE_FILE) != manifest.get("sha256"):
        return f"{STATE_FILE} does not match its checksum (truncated or corrupt)"
    return None


def resolve_checkpoint(path: Path) -> Path:
    """A run folder (its newest good checkpoint), one checkpoint folder, or a file in one (verified)."""
    if not path.exists():
        raise ValueError(f"--resume: no checkpoint at {path}")
    if path.is_file():  # the checkpoint's state.pt or manifest: resume from its folder
        if not (path.parent / MANIFEST_FILE).is_file():  # was "no usable checkpoint under <its folder>/checkpoints"
            raise ValueError(f"--resume: {path} is a file outside any checkpoint folder (no {MANIFEST_FILE} beside "
                             "it); give a run folder, a checkpoint folder or a file in one")
        path = path.parent
    if (path / MANIFEST_FILE).exists():
        problem = verify_checkpoint(path)
        if problem is not None:
            raise ValueError(f"--resume: checkpoint {path} is not usable: {problem}")
        return path
    return latest_checkpoint(path)


def load_checkpoint(path: Path, learners: dict[str, _Learner]) -> int:
    """Restore ``learners`` from a run folder or checkpoint folder; returns the step to continue from."""
    folder = resolve_checkpoint(path)
    if is_distributed_checkpoint(folder):
        raise ValueError(f"--resume: {folder} was written by a distributed run; resume it with --parallel "
                         "(any layout and world size, 1 included)")
    state = _read(folder)
    missing = set(learners) - set(state["learners"])
    if missing:
        raise ValueError(f"--resume: checkpoint {folder} has no state for {sorted(missing)}")
    for name, learner in learners.items():
        saved = state["learners"][name]
        parts = {"model", "optimizer", "scheduler"}
        if not isinstance(saved, dict) or not parts <= set(saved):  # was a raw KeyError
            have = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
            raise ValueError(f"--resume: checkpoint {folder}: the {name!r} learner's state must hold "
                             f"{sorted(parts)}, got {have}")
        try:
            learner.model.load_state_dict(saved["model"])
            learner.optimizer.load_state_dict(saved["optimizer"])
        except (RuntimeError, ValueError) as error:  # torch's size and key mismatches
            raise ValueError(f"--resume: checkpoint {folder} does not fit the {name!r} learner built from the "
                             f"settings (did an override change its sizes?): {error}") from error
        learner.scheduler.load_state_dict(saved["scheduler"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])


def checkpoint_config(path: Path) -> dict[str, Any]:
    """The TrainConfig (as a dict) the checkpoint was written with, from its manifest."""
    folder = resolve_checkpoint(path)
    manifest = folder / MANIFEST_FILE
    config = read_manifest(folder).get("config")
    if not isinstance(config, dict):
        raise ValueError(f"{manifest} has no 'config' section (the settings the run was started with)")
    return config


def _read(folder: Path) -> dict[str, Any]:
    try:
        state = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several types for foreign files
        raise ValueError(f"--resume: {folder} is not a readable opengem checkpoint ({error})") from error
    if not isinstance(state, dict) or not {"step", "config", "learners"} <= set(state):
        raise ValueError(f"--resume: {folder} is not an opengem checkpoint (missing step/config/learners)")
    # checked before any learner is touched: a bad RNG state had raised a raw TypeError after the weights loaded
    rng = state.get("rng")
    if not isinstance(rng, torch.Tensor) or rng.dtype != torch.uint8:
        raise ValueError(f"--resume: {folder / STATE_FILE}: 'rng' must be a uint8 tensor (torch's RNG state), got "
                         f"{getattr(rng, 'dtype', type(rng).__name__)}")
    if not isinstance(state["learners"], dict) or not is_int(state["step"]):
        raise ValueError(f"--resume: {folder / STATE_FILE}: 'learners' must be a dict and 'step' an int")
    return state


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
