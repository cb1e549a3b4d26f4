"""Parquet storage: sharded writer for the synthetic data, streaming validated reader, DataLoader.

Files follow the schema documented in :mod:`opengem.data.layout`. The reader opens every file up front
(footer, schema, metadata: missing column, wrong type, truncated / corrupt / empty file are reported
before any batch), then streams row groups; each decoded row group is value-checked (ids in range,
equal sequence lengths, ...) before its rows are batched. Errors name the file, row and column.
"""

from __future__ import annotations

import os
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from tqdm import tqdm

from opengem.data.batching import (
    CostKind,
    base_batch_shuffling,
    fixed_size_batches,
    shuffled_rows,
    token_budget_batches,
)
from opengem.data.layout import DataError, DataLayout, RowBlock, decode
from opengem.data.schema import Batch
from opengem.data.synthetic import SYNTHETIC_PRESETS, check_seed, generate
from opengem.validation import is_int

DEFAULT_ROWS_PER_FILE = 262_144
DEFAULT_ROW_GROUP_SIZE = 8_192


def synthesize_to_parquet(
    out_dir: str | os.PathLike,
    num_samples: int,
    preset: str,
    seed: int = 0,
    rows_per_file: int = DEFAULT_ROWS_PER_FILE,
    row_group_size: int = DEFAULT_ROW_GROUP_SIZE,
    progress: bool = True,
    first_sample: int = 0,
) -> list[Path]:
    """Write samples ``[first_sample, first_sample + num_samples)`` of ``preset`` as ``part-00000.parquet``, ...
    under ``out_dir`` (``first_sample=HOLDOUT_START``: the held-out samples training evaluates on).

    Each file is written to a temporary name and renamed when complete, so a crashed run never leaves a
    file that looks finished. Returns the file paths in order.
    """
    if preset not in SYNTHETIC_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; presets are {sorted(SYNTHETIC_PRESETS)}")
    if num_samples < 1 or rows_per_file < 1 or row_group_size < 1:
        raise ValueError("num_samples, rows_per_file and row_group_size must be >= 1")
    if first_sample < 0:
        raise ValueError(f"first_sample must be >= 0, got {first_sample}")
    check_seed(seed)  # before any file: numpy's own error came mid-write and left a .tmp file
    config = SYNTHETIC_PRESETS[preset]
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir {str(out)!r} is a file, not a folder")
    out.mkdir(parents=True, exist_ok=True)
    schema = config.layout(seed).arrow_schema()
    paths = []
    with tqdm(total=num_samples, unit="samples", desc=f"synth {preset}", disable=not progress) as bar:
        for file_index, file_start in enumerate(range(0, num_samples, rows_per_file)):
            path = out / f"part-{file_index:05d}.parquet"
            partial = path.with_suffix(".parquet.tmp")
            file_end = min(file_start + rows_per_file, num_samples)
            try:
                with pq.ParquetWriter(partial, schema, **parquet_write_options(schema)) as writer:
                    for start in range(file_start, file_end, row_group_size):
                        count = min(row_group_size, file_end - start)
                        table = generate(config, count, seed, first_sample + start)
                        writer.write_table(table, row_group_size=row_group_size)
                        bar.update(count)
                partial.replace(path)
            finally:
                partial.unlink(missing_ok=True)  # a failed write leaves no partial file behind
            paths.append(path)
    return paths


def parquet_write_options(schema: pa.Schema) -> dict:
    """Writer settings that favour fast decoding: integer list columns (ids, timestamps) use
    DELTA_BINARY_PACKED (small ids and increasing timestamps bit-pack tightly), no dictionary and no
    general-purpose compression (for gem-small as small as zstd, and about 3x faster to read). Pages
    carry CRC checksums so that a corrupted data page is detected instead of read as wrong ids."""
    delta = {
        f"{field.name}.list.element": "DELTA_BINARY_PACKED"
        for field in schema
        if pa.types.is_list(field.type) and pa.types.is_integer(field.type.value_type)
    }
    return {"compression": "none", "use_dictionary": False, "column_encoding": delta, "write_page_checksum": True}


def resolve_paths(paths_or_dir: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """A directory (all ``*.parquet`` in it, sorted), one file, or a list of files."""
    if isinstance(paths_or_dir, (str, os.PathLike)):
        root = Path(paths_or_dir)
        if root.is_dir():
            files = sorted(root.glob("*.parquet"))
            if not files:
                raise FileNotFoundError(f"{root}: no *.parquet files in this directory")
            return files
        paths = [root]
    else:
        paths = [Path(p) for p in paths_or_dir]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file")
    if not paths:
        raise FileNotFoundError("no input files given")
    return paths


@dataclass(frozen=True)
class RowGroupUnit:
    """One unit of reading work: row group ``row_group`` of ``path``, whose first row is ``first_row``."""

    path: Path
    row_group: int
    first_row: int
    num_rows: int


def inspect_files(paths: Sequence[Path]) -> tuple[DataLayout, list[RowGroupUnit]]:
    """Open every file's footer, check schema, metadata and non-emptiness; list the row groups."""
    layout: DataLayout | None = None
    units: list[RowGroupUnit] = []
    for path in paths:
        try:
            metadata = pq.read_metadata(path)
            schema = pq.read_schema(path)
        except (pa.ArrowException, OSError) as exc:
            raise DataError(str(path), None, None, f"truncated or corrupt Parquet file: {exc}") from exc
        file_layout = DataLayout.from_schema(schema, str(path))
        if layout is None:
            layout = file_layout
        elif file_layout != layout:
            raise DataError(str(path), None, None, f"feature specs differ from those of {paths[0]}")
        if metadata.num_rows == 0:
            raise DataError(str(path), None, None, "empty file (0 rows)")
        first_row = 0
        for group in range(metadata.num_row_groups):
            rows = metadata.row_group(group).num_rows
            if rows:
                units.append(RowGroupUnit(path, group, first_row, rows))
            first_row += rows
    assert layout is not None
    return layout, units


def read_unit(unit: RowGroupUnit, layout: DataLayout, files: dict[Path, pq.ParquetFile] | None = None) -> RowBlock:
    """Decode and validate one row group (``files`` caches open handles)."""
    where = str(unit.path)
    try:
        handle = files.get(unit.path) if files is not None else None
        if handle is None:
            handle = pq.ParquetFile(unit.path, page_checksum_verification=True)
            if files is not None:
                files[unit.path] = handle
        table = handle.read_row_group(unit.row_group, use_threads=False)  # one core per loader worker
    except (pa.ArrowException, OSError) as exc:
        last = unit.first_row + unit.num_rows - 1
        problem = f"corrupt row group {unit.row_group} (rows {unit.first_row}..{last}): {exc}"
        raise DataError(where, None, None, problem) from exc
    return decode(table, layout, where, unit.first_row)


def validate_files(paths_or_dir: str | os.PathLike | Sequence[str | os.PathLike]) -> int:
    """Fully decode and check every file; return the number of rows. Raises DataError on bad data."""
    layout, units = inspect_files(resolve_paths(paths_or_dir))
    files: dict[Path, pq.ParquetFile] = {}
    return sum(read_unit(unit, layout, files).num_rows for unit in units)


@dataclass(frozen=True)
class BatchingOptions:
    """How rows become batches. Exactly one of ``batch_size`` / ``token_budget`` drives the cut;
    with both, ``batch_size`` caps the rows of a token-budget batch.

    ``drop_last`` drops the stream's last batch when it is partial: with ``batch_size`` (also under
    ``batch_shuffling``) every batch then holds exactly ``batch_size`` rows; with ``token_budget`` the last
    batch is kept only if full, i.e. it holds at least ``token_budget`` history tokens or ``batch_size`` rows."""

    batch_size: int | None = None
    token_budget: int | None = None
    shuffle_buffer: int = 0
    batch_shuffling: bool = False
    sub_batch_size: int = 128
    shuffle_window_batches: int = 8
    shuffle_cost: CostKind = "tokens"
    drop_last: bool = False

    def __post_init__(self) -> None:
        # Everything is checked here, where the caller built the options: the batchers' own checks ran only at
        # iteration, inside a DataLoader worker. The shuffling settings are checked even where batch_shuffling is
        # off (as torch's DataLoader checks ``timeout`` without workers), so a bad value never waits for the flag.
        if self.batch_size is None and self.token_budget is None:
            raise ValueError("give batch_size or token_budget")
        for name in ("batch_size", "token_budget"):  # 8.0 failed deep in a row slice
            value = getattr(self, name)
            if value is not None and not is_int(value):
                raise ValueError(f"{name} must be an int, got {value!r}")
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        # is_int refuses bools: shuffle_buffer=True had been read as a 1-row buffer, i.e. no shuffling
        for name, low in (("shuffle_buffer", 0), ("sub_batch_size", 1), ("shuffle_window_batches", 1)):
            value = getattr(self, name)
            if not is_int(value) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if self.shuffle_cost not in typing.get_args(CostKind):
            raise ValueError(f"shuffle_cost must be one of {typing.get_args(CostKind)}, got {self.shuffle_cost!r}")
        if self.batch_shuffling:
            if self.token_budget is not None or self.batch_size is None:
                raise ValueError("batch_shuffling builds fixed-size batches: give batch_size and no token_budget")
            if self.batch_size % self.sub_batch_size:
                raise ValueError(
                    f"batch_shuffling deals whole sub-batches: batch_size {self.batch_size} must be a multiple of "
                    f"sub_batch_size {self.sub_batch_size}"
                )

    def batches(self, blocks: Iterator[RowBlock], rng: np.random.Generator) -> Iterator[RowBlock]:
        if self.shuffle_buffer:
            blocks = shuffled_rows(blocks, self.shuffle_buffer, rng)
        if self.batch_shuffling:
            assert self.batch_size is not None
            return base_batch_shuffling(
                blocks,
                self.batch_size,
                self.sub_batch_size,
                self.shuffle_window_batches,
                self.shuffle_cost,
                self.drop_last,
            )
        if self.token_budget is not None:
            return token_budget_batches(blocks, self.token_budget, self.batch_size, self.drop_last)
        assert self.batch_size is not None
        return fixed_size_batches(blocks, self.batch_size, self.drop_last)


class ParquetDataset(IterableDataset):
    """Streams :class:`Batch` objects from opengem Parquet files, one row group at a time.

    Row groups are dealt deterministically: first over distributed ranks (``rank::world_size``), then
    over DataLoader workers (``worker::num_workers``), so every row is read exactly once per epoch.
    With ``shuffle_buffer > 0`` the row-group order is permuted per epoch (seeded by ``seed`` and the
    epoch, identical on every worker) and rows are permuted within windows of ``shuffle_buffer`` rows.
    Batches are cut within each worker's stream; with several workers the last batch of each worker
    may be partial (``drop_last`` drops it: see :class:`BatchingOptions`).
    """

    def __init__(
        self,
        paths_or_dir: str | os.PathLike | Sequence[str | os.PathLike],
        batch_size: int | None = None,
        token_budget: int | None = None,
        shuffle_buffer: int = 0,
        batch_shuffling: bool = False,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        sub_batch_size: int = 128,
        shuffle_cost: CostKind = "tokens",
        drop_last: bool = False,
    ) -> None:
        super().__init__()
        if not (is_int(rank) and is_int(world_size)):  # rank 0.5 failed at iteration, in a list slice
            raise ValueError(f"rank and world_size must be ints, got rank {rank!r}, world_size {world_size!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank {rank}, world_size {world_size}")
        self.options = BatchingOptions(
            batch_size=batch_size,
            token_budget=token_budget,
            shuffle_buffer=shuffle_buffer,
            batch_shuffling=batch_shuffling,
            sub_batch_size=sub_batch_size,
            shuffle_cost=shuffle_cost,
            drop_last=drop_last,
        )
        check_seed(seed)
        self.paths = resolve_paths(paths_or_dir)
        self.layout, self.units = inspect_files(self.paths)
        # Units go to ranks as units[rank::world_size] (a shuffle only permutes them), so a rank past the number of
        # units would read nothing, every epoch; its training would stall or run on no data without a word.
        if rank >= len(self.units):
            raise ValueError(
                f"rank {rank} of world_size {world_size} gets no rows: the {len(self.paths)} file(s) hold "
                f"{len(self.units)} non-empty row groups, dealt one per rank in turn; use world_size <= "
                f"{len(self.units)}, or write the files with more, smaller row groups (row_group_size)"
            )
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def num_rows(self) -> int:
        return sum(unit.num_rows for unit in self.units)

    def assigned_units(self, worker: int = 0, num_workers: int = 1) -> list[RowGroupUnit]:
        units = list(self.units)
        if self.options.shuffle_buffer:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(units))
            units = [units[i] for i in order]
        return units[self.rank :: self.world_size][worker::num_workers]

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        units = self.assigned_units(worker, num_workers)
        rng = np.random.default_rng([self.seed, self.epoch, self.rank, worker, 1])
        files: dict[Path, pq.ParquetFile] = {}
        blocks = (read_unit(unit, self.layout, files) for unit in units)
        for block in self.options.batches(blocks, rng):
            yield block.to_batch(self.layout)


def make_loader(
    paths_or_dir: str | os.PathLike | Sequence[str | os.PathLike],
    batch_size: int | None = None,
    token_budget: int | None = None,
    shuffle_buffer: int = 0,
    num_workers: int = 0,
    pin_memory: bool = False,
    batch_shuffling: bool = False,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    sub_batch_size: int = 128,
    shuffle_cost: CostKind = "tokens",
    drop_last: bool = False,
    prefetch_factor: int | None = None,
) -> DataLoader:
    """A DataLoader of :class:`Batch` over Parquet files (see :class:`ParquetDataset`).

    Batches are built inside the workers (no torch collate step); with ``pin_memory`` the loader's pin
    thread calls :meth:`Batch.pin_memory`. ``loader.dataset.set_epoch(e)`` reshuffles. ``prefetch_factor`` (batches
    each worker keeps ready; None: torch's default, 2) needs ``num_workers >= 1``, as in torch's DataLoader.
    """
    if not is_int(num_workers) or num_workers < 0:
        raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
    # Checked before the files are opened. It had been passed on only with workers, so a prefetch_factor given
    # with num_workers=0 was dropped without a word where torch's DataLoader refuses it.
    if prefetch_factor is not None and not num_workers:
        raise ValueError(
            f"prefetch_factor={prefetch_factor!r} needs num_workers >= 1 (got num_workers=0: batches are built in "
            "the main process, nothing is prefetched); leave prefetch_factor at None"
        )
    if prefetch_factor is not None and (not is_int(prefetch_factor) or prefetch_factor < 1):
        # 0 is refused by torch only when iteration starts
        raise ValueError(f"prefetch_factor must be an int >= 1 or None, got {prefetch_factor!r}")
    dataset = ParquetDataset(
        paths_or_dir,
        batch_size=batch_size,
        token_budget=token_budget,
        shuffle_buffer=shuffle_buffer,
        batch_shuffling=batch_shuffling,
        seed=seed,
        rank=rank,
        world_size=world_size,
        sub_batch_size=sub_batch_size,
        shuffle_cost=shuffle_cost,
        drop_last=drop_last,
    )
    return DataLoader(
        dataset,
        batch_size=None,
        num_workers=num_workers,
        pin_memory=pin_memory and torch.cuda.is_available(),
        prefetch_factor=prefetch_factor,
    )


def batches_from_table(
    table: pa.Table | RowBlock,
    batch_size: int | None = None,
    token_budget: int | None = None,
    shuffle: bool = False,
    seed: int = 0,
    batch_shuffling: bool = False,
    layout: DataLayout | None = None,
) -> Iterator[Batch]:
    """In-memory path (CPU demo): batches from an Arrow table in the storage schema (validated) or from
    a RowBlock (``layout`` required), without touching disk. ``shuffle`` permutes all rows with ``seed``."""
    if isinstance(table, pa.Table):
        layout = DataLayout.from_schema(table.schema, "<in-memory table>")
        rows = decode(table, layout, "<in-memory table>")
    elif layout is None:
        raise ValueError("batches_from_table needs layout= when given a RowBlock")
    else:
        rows = table
    if rows.num_rows == 0:  # as an empty file is refused: yielding nothing would hide the mistake
        raise DataError("<in-memory table>", None, None, "empty table (0 rows): nothing to batch")
    check_seed(seed)
    options = BatchingOptions(batch_size=batch_size, token_budget=token_budget, batch_shuffling=batch_shuffling)
    rng = np.random.default_rng([seed, 2])
    if shuffle:
        rows = rows.take(rng.permutation(rows.num_rows))
    for block in options.batches(iter([rows]), rng):
        yield block.to_batch(layout)
