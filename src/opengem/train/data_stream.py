"""Where training batches come from: the synthetic generator streamed on the fly, or Parquet files.

The synthetic stream is a pure function of (seed, sample index): batch ``s`` holds samples
``[s * B, (s + 1) * B)``, so a resumed run sees exactly the batches it would have seen, and the
held-out set lives at a far index range the stream never reaches (``HOLDOUT_START``). The held-out set comes
from ``eval_dir`` when set, else from that range of the training data's world: files written by ``opengem data synth``
record their generator seed, which need not be the run's.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from opengem.data.layout import DataLayout, RowBlock
from opengem.data.parquet import batches_from_table, inspect_files, make_loader, read_unit, resolve_paths
from opengem.data.schema import Batch
from opengem.data.synthetic import HOLDOUT_START, SYNTHETIC_PRESETS, generate, generate_rows
from opengem.train.config import TrainConfig


def rank_slice(batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a global batch that data-parallel rank ``rank`` of ``world_size`` trains on."""
    return rank * batch_size // world_size, (rank + 1) * batch_size // world_size


class SyntheticBatches(IterableDataset):
    """Endless batches of fresh synthetic samples; DataLoader workers take every W-th batch in turn.

    With ``world_size`` data-parallel ranks, rank r yields only its slice (``rank_slice``) of each
    global batch, so the ranks together see exactly the single-process run's batches.
    """

    def __init__(self, config: TrainConfig, start_step: int, rank: int = 0, world_size: int = 1) -> None:
        self.data = SYNTHETIC_PRESETS[config.data_preset]
        self.batch_size = config.batch_size
        self.seed = config.seed
        self.start_step = start_step
        self.rows = rank_slice(config.batch_size, rank, world_size)

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        step = self.start_step + worker
        start, stop = self.rows
        while True:
            table = generate(self.data, stop - start, self.seed, start=step * self.batch_size + start)
            yield from batches_from_table(table, stop - start)
            step += workers


def train_batches(config: TrainConfig, start_step: int, rank: int = 0, world_size: int = 1) -> Iterator[Batch]:
    """Training batches from ``start_step`` on; rank ``rank`` of ``world_size`` gets its share of each.

    Parquet: each rank reads its own files, ``batch_size / world_size`` samples per batch, with Base
    Batch Shuffling per rank when distributed; a run longer than the files reads them again, pass after pass
    (a warning at each new pass). The files must hold ``data_preset``'s features, which the model is built for.
    """
    if config.data_dir:
        loader = make_loader(config.data_dir, batch_size=config.batch_size // world_size, num_workers=config.num_workers,
                             pin_memory=torch.cuda.is_available(), batch_shuffling=world_size > 1, seed=config.seed,
                             rank=rank, world_size=world_size)
        check_files_layout(config, loader.dataset.layout, "data_dir")
        batches = _passes(loader, config.data_dir, rank)
        for _ in range(start_step):  # exact resume: skip what the run already consumed
            next(batches)
        return batches
    dataset = SyntheticBatches(config, start_step, rank, world_size)
    loader = DataLoader(
        dataset,
        batch_size=None,
        num_workers=config.num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=config.num_workers > 0,
    )
    return iter(loader)


def _passes(loader: DataLoader, data_dir: str, rank: int) -> Iterator[Batch]:
    """The loader's batches pass after pass (pass ``e`` calls ``set_epoch(e)``, which reshuffles where the loader
    shuffles), for as many steps as the run takes; each new pass is announced with a warning."""
    epoch = 0
    while True:
        loader.dataset.set_epoch(epoch)
        count = 0
        for batch in loader:
            count += 1
            yield batch
        if count == 0:
            raise ValueError(f"data_dir {data_dir!r}: rank {rank} got no batch from its files")
        epoch += 1
        warnings.warn(f"data_dir {data_dir!r}: pass {epoch} ended after {count} batches (rank {rank}); "
                      f"reading the files again as pass {epoch + 1}", stacklevel=2)


def check_files_layout(config: TrainConfig, layout: DataLayout, setting: str) -> None:
    """The model is built for ``data_preset``'s features: refuse files (those of ``setting``, ``"data_dir"`` or
    ``"eval_dir"``) written with other features or sizes."""
    expected = SYNTHETIC_PRESETS[config.data_preset].layout(config.seed)  # the seed is not compared
    if layout == expected:
        return
    found = {f.name: f for f in layout.features}
    wanted = {f.name: f for f in expected.features}
    if found.keys() != wanted.keys():
        problem = (f"the files have features {sorted(found.keys() - wanted.keys())} the preset does not, and lack "
                   f"{sorted(wanted.keys() - found.keys())}")
    elif layout.dense_features != expected.dense_features:
        problem = f"dense features {list(layout.dense_features)} differ from {list(expected.dense_features)}"
    else:
        name = next(n for n in wanted if found[n] != wanted[n])
        problem = (f"feature {name!r} is {found[name].kind} with {found[name].num_embeddings} ids there and "
                   f"{wanted[name].kind} with {wanted[name].num_embeddings} in the preset")
    writer = layout.source_info.get("generator", {}).get("name")
    hint = f"; the files were written for data preset {writer!r}: set data_preset={writer}" if writer else ""
    raise ValueError(f"{setting} {getattr(config, setting)!r} does not hold data_preset {config.data_preset!r}'s "
                     f"features: {problem}{hint}")


def eval_batches(config: TrainConfig, rank: int = 0, world_size: int = 1) -> list[Batch]:
    """The held-out set in batches of ``batch_size``; rank ``rank`` of ``world_size`` gets its slice of each.

    From ``eval_dir``: its first ``eval_samples`` rows in file order (all of them, with a warning, when it holds
    fewer). Otherwise ``eval_samples`` synthetic samples from ``HOLDOUT_START`` on, generated with the seed of the
    training data's world: ``data_dir``'s recorded generator seed, or ``seed`` when streaming."""
    if config.eval_dir:
        rows, layout = _eval_dir_rows(config)
    else:
        data, seed = SYNTHETIC_PRESETS[config.data_preset], holdout_seed(config)
        rows, layout = generate_rows(data, config.eval_samples, seed, start=HOLDOUT_START), data.layout(seed)
    if rows.num_rows < world_size:
        raise ValueError(f"the held-out set has {rows.num_rows} samples, fewer than the {world_size} ranks that "
                         "evaluate it: raise eval_samples (or add samples to eval_dir)")
    batches = []
    for first in range(0, rows.num_rows, config.batch_size):
        size = min(config.batch_size, rows.num_rows - first)
        start, stop = rank_slice(size, rank, world_size)
        if stop > start:  # a last batch smaller than the world leaves some ranks without a row of it
            batches.extend(batches_from_table(rows.slice(first + start, first + stop), stop - start, layout=layout))
    return batches


def in_sample_order(parts: list[torch.Tensor], batch_size: int) -> torch.Tensor:
    """:func:`eval_batches`' slicing undone: rank r's part (its ``rank_slice`` of each held-out batch of
    ``batch_size``, batch after batch) put back with the other ranks' in the single-process order. The held-out
    set's size is the parts' total (an eval_dir may hold fewer than eval_samples)."""
    world, total = len(parts), sum(part.shape[0] for part in parts)
    sizes = [min(batch_size, total - first) for first in range(0, total, batch_size)]
    pieces = [part.split([stop - start for start, stop in (rank_slice(n, r, world) for n in sizes)])
              for r, part in enumerate(parts)]
    return torch.cat([pieces[r][i] for i in range(len(sizes)) for r in range(world)])


def holdout_seed(config: TrainConfig) -> int:
    """The generator seed of the training data's world: ``seed`` when streaming synthetic data, else the one
    ``data_dir``'s files record (``opengem data synth --seed``; a run's ``seed`` need not match it)."""
    if not config.data_dir:
        return config.seed
    layout, _ = inspect_files(resolve_paths(config.data_dir))
    seed = layout.source_info.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"data_dir {config.data_dir!r}: its files record no generator seed (not written by "
                         "`opengem data synth`), so no held-out samples of their world can be generated; set "
                         "eval_dir to a Parquet folder of held-out samples")
    return seed


def _eval_dir_rows(config: TrainConfig) -> tuple[RowBlock, DataLayout]:
    """The first ``eval_samples`` rows of ``eval_dir`` (read row group by row group, checked as they decode)."""
    if config.data_dir and Path(config.data_dir).resolve() == Path(config.eval_dir).resolve():
        raise ValueError(f"eval_dir {config.eval_dir!r} is data_dir: the held-out set would be training samples; "
                         "write one with `opengem data synth --holdout`")
    layout, units = inspect_files(resolve_paths(config.eval_dir))
    check_files_layout(config, layout, "eval_dir")
    blocks, count, files = [], 0, {}
    for unit in units:
        if count >= config.eval_samples:
            break
        blocks.append(read_unit(unit, layout, files))
        count += blocks[-1].num_rows
    rows = RowBlock.concat(blocks)
    if rows.num_rows < config.eval_samples:
        warnings.warn(f"eval_dir {config.eval_dir!r} holds {rows.num_rows} samples, fewer than eval_samples="
                      f"{config.eval_samples}: evaluating on all {rows.num_rows}", stacklevel=3)
        return rows, layout
    return rows.slice(0, config.eval_samples), layout
