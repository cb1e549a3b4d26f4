"""Distributed checkpoints (``torch.distributed.checkpoint``): save under one layout, load under another.

DCP writes every rank's shards plus metadata describing the global tensors, so a checkpoint saved
with FSDP over 4 ranks loads into FSDP over 2 (or 1) ranks: each rank reads the slices it now owns.
``save_distributed`` writes into ``<dir>.partial`` and renames it to ``<dir>`` once every rank has
finished, so a directory named ``<dir>`` is always complete (a crash leaves only ``.partial``).
The directory must be on a filesystem all ranks share.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim import Optimizer

PARTIAL_SUFFIX = ".partial"
METADATA_FILE = ".metadata"  # DCP's index of a checkpoint: present once a save completed


class ModelOptimizerState(Stateful):
    """A model and (optionally) its optimizer as one DCP entry, keyed by parameter names.

    Uses ``get_state_dict`` / ``set_state_dict`` so that FSDP's sharded (DTensor) parameters and the
    optimizer state are saved by fully qualified parameter name, independent of the layout.
    ``exclude``: module-path prefixes whose entries are left out (e.g. sharded embedding collections,
    whose per-rank state names depend on the layout and are saved separately); loading then leaves
    those modules untouched.
    """

    def __init__(self, model: nn.Module, optimizer: Optimizer | None = None, exclude: tuple[str, ...] = ()) -> None:
        # A str had been split into one-letter prefixes ("emb" -> "e.", "m.", "b.") and excluded the wrong entries
        if isinstance(exclude, str) or not all(isinstance(prefix, str) and prefix for prefix in exclude):
            raise ValueError(f"ModelOptimizerState: exclude must be a tuple of module paths, got {exclude!r}")
        self.model = model
        self.optimizer = optimizer
        self.exclude = tuple(f"{prefix}." for prefix in exclude)

    def state_dict(self) -> dict[str, Any]:
        optimizers = [self.optimizer] if self.optimizer is not None else []
        model_state, optimizer_state = get_state_dict(self.model, optimizers)
        if self.exclude:
            # a misspelt path had excluded nothing (and the load then ran non-strict)
            unmatched = [p[:-1] for p in self.exclude if not any(k.startswith(p) for k in model_state)]
            if unmatched:
                raise ValueError(f"ModelOptimizerState: exclude {unmatched} names no entry of the model's state")
            model_state = {k: v for k, v in model_state.items() if not k.startswith(self.exclude)}
        return {"model": model_state, "optimizer": optimizer_state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        optimizers = [self.optimizer] if self.optimizer is not None else []
        set_state_dict(
            self.model,
            optimizers,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optimizer"],
            options=StateDictOptions(strict=not self.exclude),
        )


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_distributed(
    state: dict[str, Any], directory: str | Path, on_complete: Callable[[Path], None] | None = None
) -> Path:
    """Save ``state`` (tensors, DTensors, ``Stateful`` objects such as ``ModelOptimizerState``) to ``directory``.

    Every rank calls this. An existing ``directory`` is replaced only after the new one is complete, and only if it
    is a distributed checkpoint (or empty): any other folder or a file there is refused before anything is written
    (a run folder passed by mistake had been deleted). ``on_complete``: rank 0 calls it with the temporary directory
    once every rank has written its part, before the rename (e.g. to add a manifest). Returns the final path.
    """
    final = Path(directory)
    _check_replaceable(final)  # on the shared filesystem every rank sees the same, so all raise together
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    if _rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier()
    dcp.save(state, checkpoint_id=str(partial))
    _barrier()
    if _rank() == 0:
        if on_complete is not None:
            on_complete(partial)
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
    _barrier()
    return final


def _check_replaceable(final: Path) -> None:
    if final.is_dir() and any(final.iterdir()) and not (final / METADATA_FILE).is_file():
        raise ValueError(f"save_distributed: {final} exists and is not a distributed checkpoint (no {METADATA_FILE}); "
                         "refusing to replace it")
    if final.exists() and not final.is_dir():
        raise ValueError(f"save_distributed: {final} is a file, not a checkpoint directory")


def load_distributed(state: dict[str, Any], directory: str | Path) -> None:
    """Load ``directory`` into ``state`` in place, resharding to the current layout (every rank calls this).

    A checkpoint that does not fit ``state`` (other sizes or keys) or whose files are corrupt raises ``ValueError``
    with the first failing rank's reason: DCP raises a ``CheckpointException``, a ``BaseException`` that
    ``except Exception`` handlers (the CLI's among them) do not catch."""
    path = Path(directory)
    if not (path / METADATA_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a complete distributed checkpoint (no {METADATA_FILE})")
    try:
        dcp.load(state, checkpoint_id=str(path))
    except CheckpointException as error:
        rank, (cause, _) = min(error.failures.items())
        raise ValueError(f"{path} does not load into this state (rank {rank}): "
                         f"{type(cause).__name__}: {cause}") from error
