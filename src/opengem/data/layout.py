"""The one storage layout of opengem ad-impression data, its validation, and columnar row blocks.

Arrow / Parquet schema (one row = one ad impression; ``F`` = a feature name from the feature specs):

| column | Arrow type | meaning |
|---|---|---|
| ``sample_id`` | int64 | global index of the sample in its data set |
| ``timestamp`` | int64 | impression time, seconds since the Unix epoch |
| ``F`` (categorical) | int64 | one id in ``[0, num_embeddings)`` |
| ``F`` (multi_hot) | list<int32> | 0..k ids, each in ``[0, num_embeddings)`` |
| ``F`` (sequence) | list<int32> | one id per history event, oldest event first |
| ``hist_timestamp`` | list<int64> | time of each history event (seconds), ``<= timestamp`` |
| ``dense`` | fixed_size_list<float32>[num_dense] | dense features, names in the metadata; finite |
| ``click``, ``conversion`` | int8 | labels in {0, 1}; ``conversion <= click`` |
| ``oracle_click``, ``oracle_conversion`` | float32 | ground-truth P(click), P(click and conversion) in [0, 1] |

Every sequence column and ``hist_timestamp`` have the same length within a row. No column may hold
nulls. The schema metadata key ``opengem`` holds JSON ``{"format_version": 1, "features": [{"name",
"kind", "num_embeddings"}, ...], "dense_features": [...], "tasks": [...], "source": {...}}`` so that a
reader can range-check ids without any other file.

Invalid data raises :class:`DataError` naming the file, the row (within the file) and the column. The
reader never drops, clamps or repairs a row.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from opengem.data.schema import TASKS, Batch, FeatureSpec
from opengem.jagged import Jagged, KeyedJagged
from opengem.validation import is_int

FORMAT_VERSION = 1
METADATA_KEY = b"opengem"
HISTORY_TIME = "hist_timestamp"
LABEL_COLUMNS = tuple(TASKS)
ORACLE_COLUMNS = tuple(f"oracle_{task}" for task in TASKS)
ID_LIST_TYPE = pa.list_(pa.int32())


class DataError(ValueError):
    """Invalid input data; ``source``, ``row`` and ``column`` say where (row None = whole column/file)."""

    def __init__(self, source: str, row: int | None, column: str | None, problem: str):
        self.source, self.row, self.column, self.problem = source, row, column, problem
        where = [source]
        if row is not None:
            where.append(f"row {row}")
        if column is not None:
            where.append(f"column {column!r}")
        super().__init__(f"{', '.join(where)}: {problem}")


@dataclass(frozen=True)
class DataLayout:
    """Feature specs (sparse features first, then sequence features) plus the dense feature names."""

    features: tuple[FeatureSpec, ...]
    dense_features: tuple[str, ...]
    source_info: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def sparse_features(self) -> tuple[FeatureSpec, ...]:
        return tuple(f for f in self.features if f.kind != "sequence")

    @property
    def sequence_features(self) -> tuple[FeatureSpec, ...]:
        return tuple(f for f in self.features if f.kind == "sequence")

    def arrow_types(self) -> dict[str, pa.DataType]:
        types: dict[str, pa.DataType] = {"sample_id": pa.int64(), "timestamp": pa.int64()}
        for spec in self.features:
            types[spec.name] = pa.int64() if spec.kind == "categorical" else ID_LIST_TYPE
        types[HISTORY_TIME] = pa.list_(pa.int64())
        types["dense"] = pa.list_(pa.float32(), len(self.dense_features))
        types.update({name: pa.int8() for name in LABEL_COLUMNS})
        types.update({name: pa.float32() for name in ORACLE_COLUMNS})
        return types

    def metadata(self) -> dict[bytes, bytes]:
        payload = {
            "format_version": FORMAT_VERSION,
            "features": [{"name": f.name, "kind": f.kind, "num_embeddings": f.num_embeddings} for f in self.features],
            "dense_features": list(self.dense_features),
            "tasks": list(TASKS),
            "source": self.source_info,
        }
        return {METADATA_KEY: json.dumps(payload).encode()}

    def arrow_schema(self) -> pa.Schema:
        return pa.schema(list(self.arrow_types().items()), metadata=self.metadata())

    @classmethod
    def from_schema(cls, schema: pa.Schema, source: str) -> DataLayout:
        """Read the layout from the schema metadata and check every column's presence and type."""
        raw = (schema.metadata or {}).get(METADATA_KEY)
        if raw is None:
            raise DataError(source, None, None, "schema metadata has no 'opengem' entry (not an opengem data file)")
        try:
            payload = json.loads(raw)
            if payload["format_version"] != FORMAT_VERSION:
                raise DataError(source, None, None, f"format_version {payload['format_version']} is not supported")
            if list(payload["tasks"]) != list(TASKS):
                raise DataError(source, None, None, f"tasks {payload['tasks']} differ from {list(TASKS)}")
            layout = cls(
                tuple(_feature_spec(f, source) for f in payload["features"]),
                tuple(payload["dense_features"]),
                payload.get("source", {}),
            )
        except DataError:
            raise
        except (KeyError, TypeError, ValueError) as exc:  # includes json.JSONDecodeError, bad FeatureSpec
            raise DataError(source, None, None, f"malformed 'opengem' schema metadata: {exc!r}") from exc
        # A repeated name (or one of a fixed column) would make two features share one column; reading it failed
        # much later, in KeyedJagged, without the file's name.
        fixed = {"sample_id", "timestamp", HISTORY_TIME, "dense", *LABEL_COLUMNS, *ORACLE_COLUMNS}
        seen: set[str] = set()
        for spec in layout.features:
            if spec.name in seen or spec.name in fixed:
                problem = "is listed twice" if spec.name in seen else "is that of a fixed column"
                raise DataError(source, None, spec.name, f"feature name {problem} in the 'opengem' schema metadata")
            seen.add(spec.name)
        for name, expected in layout.arrow_types().items():
            index = schema.get_field_index(name)
            if index < 0:
                raise DataError(source, None, name, f"missing column (expected type {expected})")
            actual = schema.field(index).type
            if actual != expected:
                raise DataError(source, None, name, f"wrong type: expected {expected}, got {actual}")
        return layout


def _feature_spec(entry: dict[str, Any], source: str) -> FeatureSpec:
    """One metadata feature entry as a FeatureSpec; ``num_embeddings`` must be a JSON integer (``int()`` had
    truncated 50000.9 to 50000 and read ``true`` as 1)."""
    count = entry["num_embeddings"]
    if not is_int(count):
        problem = f"num_embeddings in the 'opengem' schema metadata must be an int, got {count!r}"
        raise DataError(source, None, entry["name"], problem)
    return FeatureSpec(entry["name"], entry["kind"], count)


@dataclass
class RowBlock:
    """Columns of N consecutive rows as numpy arrays, in storage form (jagged columns share offsets).

    ``multi_hot[name] = (offsets [N + 1] int64 from 0, ids int32)``; ``history[name]`` holds the values of
    every sequence feature (int32) and of ``hist_timestamp`` (int64), all on ``history_offsets``.
    """

    sample_id: np.ndarray
    timestamp: np.ndarray
    categorical: dict[str, np.ndarray]
    multi_hot: dict[str, tuple[np.ndarray, np.ndarray]]
    history_offsets: np.ndarray
    history: dict[str, np.ndarray]
    dense: np.ndarray
    labels: np.ndarray
    oracle: np.ndarray

    @property
    def num_rows(self) -> int:
        return int(self.sample_id.shape[0])

    def history_lengths(self) -> np.ndarray:
        return np.diff(self.history_offsets)

    def slice(self, start: int, stop: int) -> RowBlock:
        """Rows ``[start, stop)`` without copying token data."""
        h0, h1 = int(self.history_offsets[start]), int(self.history_offsets[stop])
        multi_hot = {}
        for name, (offsets, ids) in self.multi_hot.items():
            m0, m1 = int(offsets[start]), int(offsets[stop])
            multi_hot[name] = (offsets[start : stop + 1] - m0, ids[m0:m1])
        return RowBlock(
            self.sample_id[start:stop],
            self.timestamp[start:stop],
            {name: ids[start:stop] for name, ids in self.categorical.items()},
            multi_hot,
            self.history_offsets[start : stop + 1] - h0,
            {name: values[h0:h1] for name, values in self.history.items()},
            self.dense[start:stop],
            self.labels[start:stop],
            self.oracle[start:stop],
        )

    def take(self, rows: np.ndarray) -> RowBlock:
        """Rows in the order of ``rows`` (int64 indices), gathered with vectorized jagged indexing."""
        history_offsets, history_tokens = _gather_jagged(self.history_offsets, rows)
        multi_hot = {}
        for name, (offsets, ids) in self.multi_hot.items():
            new_offsets, tokens = _gather_jagged(offsets, rows)
            multi_hot[name] = (new_offsets, ids[tokens])
        return RowBlock(
            self.sample_id[rows],
            self.timestamp[rows],
            {name: ids[rows] for name, ids in self.categorical.items()},
            multi_hot,
            history_offsets,
            {name: values[history_tokens] for name, values in self.history.items()},
            self.dense[rows],
            self.labels[rows],
            self.oracle[rows],
        )

    @staticmethod
    def concat(blocks: Sequence[RowBlock]) -> RowBlock:
        if len(blocks) == 1:
            return blocks[0]
        first = blocks[0]
        return RowBlock(
            np.concatenate([b.sample_id for b in blocks]),
            np.concatenate([b.timestamp for b in blocks]),
            {name: np.concatenate([b.categorical[name] for b in blocks]) for name in first.categorical},
            {
                name: (
                    _concat_offsets([b.multi_hot[name][0] for b in blocks]),
                    np.concatenate([b.multi_hot[name][1] for b in blocks]),
                )
                for name in first.multi_hot
            },
            _concat_offsets([b.history_offsets for b in blocks]),
            {name: np.concatenate([b.history[name] for b in blocks]) for name in first.history},
            np.concatenate([b.dense for b in blocks]),
            np.concatenate([b.labels for b in blocks]),
            np.concatenate([b.oracle for b in blocks]),
        )

    def to_batch(self, layout: DataLayout) -> Batch:
        """Collate into a :class:`Batch` (int64 ids, float32 ages/dense/labels); vectorized, no row loop."""
        n = self.num_rows
        sparse_ids, sparse_lengths = [], []
        for spec in layout.sparse_features:
            if spec.kind == "categorical":
                sparse_ids.append(self.categorical[spec.name])
                sparse_lengths.append(np.ones(n, dtype=np.int64))
            else:
                offsets, ids = self.multi_hot[spec.name]
                sparse_ids.append(ids)
                sparse_lengths.append(np.diff(offsets))
        sequence_names = [spec.name for spec in layout.sequence_features]
        lengths = self.history_lengths()
        ages = np.repeat(self.timestamp, lengths) - self.history[HISTORY_TIME]
        offsets = torch.from_numpy(self.history_offsets.astype(np.int64, copy=False))
        return Batch(
            sparse=KeyedJagged(
                tuple(spec.name for spec in layout.sparse_features),
                torch.from_numpy(_concat_int64(sparse_ids, sum(len(ids) for ids in sparse_ids))),
                torch.from_numpy(_concat_int64(sparse_lengths, n * len(sparse_lengths))),
            ),
            sequence=KeyedJagged(
                tuple(sequence_names),
                torch.from_numpy(
                    _concat_int64([self.history[k] for k in sequence_names], len(ages) * len(sequence_names))
                ),
                torch.from_numpy(np.tile(lengths.astype(np.int64, copy=False), len(sequence_names))),
            ),
            history_age=Jagged.from_offsets(torch.from_numpy(ages.astype(np.float32)), offsets),
            dense=torch.from_numpy(np.array(self.dense, dtype=np.float32)),  # copies: Arrow buffers are read-only
            labels=torch.from_numpy(self.labels.astype(np.float32)),
            oracle=torch.from_numpy(np.array(self.oracle, dtype=np.float32)),
            sample_id=torch.from_numpy(np.array(self.sample_id, dtype=np.int64)),
        )


def _concat_int64(parts: Sequence[np.ndarray], total: int) -> np.ndarray:
    """Concatenate id arrays into one preallocated int64 buffer (one conversion pass, no temporaries)."""
    out = np.empty(total, dtype=np.int64)
    position = 0
    for part in parts:
        out[position : position + len(part)] = part
        position += len(part)
    return out


def _gather_jagged(offsets: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """New offsets and the flat token indices of rows ``rows`` of a jagged column."""
    starts = offsets[rows]
    lengths = offsets[rows + 1] - starts
    new_offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_offsets[1:])
    tokens = np.repeat(starts - new_offsets[:-1], lengths) + np.arange(new_offsets[-1], dtype=np.int64)
    return new_offsets, tokens


def _concat_offsets(parts: Sequence[np.ndarray]) -> np.ndarray:
    shifts = np.cumsum([0] + [int(p[-1]) for p in parts[:-1]])
    return np.concatenate([parts[0][:1]] + [p[1:] + shift for p, shift in zip(parts, shifts)])


# ---------------------------------------------------------------- encode (numpy -> Arrow)


def encode(block: RowBlock, layout: DataLayout) -> pa.Table:
    """Arrow table of ``block`` in the storage schema, with the layout in the schema metadata."""
    if block.history_offsets[-1] >= 2**31:
        raise ValueError(
            f"{int(block.history_offsets[-1])} history events do not fit one Arrow list array (int32 offsets); "
            "encode fewer rows at a time"
        )
    history_offsets = pa.array(block.history_offsets.astype(np.int32))
    columns: dict[str, pa.Array] = {
        "sample_id": pa.array(block.sample_id.astype(np.int64)),
        "timestamp": pa.array(block.timestamp.astype(np.int64)),
    }
    for spec in layout.features:
        if spec.kind == "categorical":
            columns[spec.name] = pa.array(block.categorical[spec.name].astype(np.int64))
        elif spec.kind == "multi_hot":
            offsets, ids = block.multi_hot[spec.name]
            columns[spec.name] = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), ids.astype(np.int32))
        else:
            columns[spec.name] = pa.ListArray.from_arrays(history_offsets, block.history[spec.name].astype(np.int32))
    columns[HISTORY_TIME] = pa.ListArray.from_arrays(history_offsets, block.history[HISTORY_TIME].astype(np.int64))
    columns["dense"] = pa.FixedSizeListArray.from_arrays(
        block.dense.astype(np.float32).reshape(-1), len(layout.dense_features)
    )
    for index, name in enumerate(LABEL_COLUMNS):
        columns[name] = pa.array(block.labels[:, index].astype(np.int8))
    for index, name in enumerate(ORACLE_COLUMNS):
        columns[name] = pa.array(block.oracle[:, index].astype(np.float32))
    return pa.Table.from_pydict(columns, schema=layout.arrow_schema())


# ---------------------------------------------------------------- decode (Arrow -> numpy), validated


def decode(data: pa.Table | pa.RecordBatch, layout: DataLayout, source: str, first_row: int = 0) -> RowBlock:
    """Validate ``data`` (already known to match ``layout``'s schema) and return its rows as a RowBlock.

    ``first_row`` is the file row of ``data``'s row 0, so errors name rows as they are in the file.
    """
    if isinstance(data, pa.Table):
        batches = data.combine_chunks().to_batches()
        data = batches[0] if batches else pa.RecordBatch.from_pylist([], schema=data.schema)
    checker = _Checker(source, first_row)

    def column(name: str) -> pa.Array:
        array = data.column(name)
        checker.no_nulls(array, name)
        return array

    def plain(name: str) -> np.ndarray:
        return column(name).to_numpy(zero_copy_only=False)

    def listed(name: str) -> tuple[np.ndarray, np.ndarray]:
        array = column(name)
        offsets = array.offsets.to_numpy().astype(np.int64)
        values = array.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
        checker.no_nulls(values, name, offsets=offsets)
        return offsets - offsets[0], values.to_numpy(zero_copy_only=False)

    categorical, multi_hot, history = {}, {}, {}
    history_offsets = None
    history_owner = ""
    for spec in layout.features:
        if spec.kind == "categorical":
            categorical[spec.name] = plain(spec.name)
            checker.ids_in_range(categorical[spec.name], spec, None)
            continue
        offsets, ids = listed(spec.name)
        checker.ids_in_range(ids, spec, offsets)
        if spec.kind == "multi_hot":
            multi_hot[spec.name] = (offsets, ids)
            continue
        if history_offsets is None:
            history_offsets, history_owner = offsets, spec.name
        else:
            checker.same_lengths(history_offsets, offsets, history_owner, spec.name)
        history[spec.name] = ids
    time_offsets, history_time = listed(HISTORY_TIME)
    timestamp = plain("timestamp")
    if history_offsets is None:
        history_offsets = time_offsets
    else:
        checker.same_lengths(history_offsets, time_offsets, history_owner, HISTORY_TIME)
    history[HISTORY_TIME] = history_time
    checker.history_not_after_impression(timestamp, history_offsets, history_time)

    dense_array = column("dense")
    width = len(layout.dense_features)
    dense = dense_array.flatten()
    checker.no_nulls(dense, "dense", width=width)
    dense_np = dense.to_numpy(zero_copy_only=False).reshape(-1, width)
    checker.finite(dense_np, "dense")
    labels = np.stack([plain(name) for name in LABEL_COLUMNS], axis=1)
    checker.labels(labels)
    oracle = np.stack([plain(name) for name in ORACLE_COLUMNS], axis=1)
    checker.probabilities(oracle)
    return RowBlock(
        plain("sample_id"), timestamp, categorical, multi_hot, history_offsets, history, dense_np, labels, oracle
    )


@dataclass
class _Checker:
    """Vectorized checks that locate the first offending row for the error message."""

    source: str
    first_row: int

    def fail(self, local_row: int | None, column: str, problem: str) -> None:
        row = None if local_row is None else self.first_row + int(local_row)
        raise DataError(self.source, row, column, problem)

    def no_nulls(self, array: pa.Array, name: str, offsets: np.ndarray | None = None, width: int = 1) -> None:
        if array.null_count == 0:
            return
        first = int(np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))[0])
        if offsets is not None:
            first = int(np.searchsorted(offsets, first + offsets[0], side="right") - 1)
        self.fail(first // width, name, "null value (nulls are not allowed)")

    def ids_in_range(self, ids: np.ndarray, spec: FeatureSpec, offsets: np.ndarray | None) -> None:
        if ids.size == 0:
            return
        bad = (ids < 0) | (ids >= spec.num_embeddings)
        if not bad.any():
            return
        token = int(np.flatnonzero(bad)[0])
        row = token if offsets is None else int(np.searchsorted(offsets, token, side="right") - 1)
        kind = "negative id" if ids[token] < 0 else "id out of range"
        self.fail(row, spec.name, f"{kind} {int(ids[token])} (valid ids are 0..{spec.num_embeddings - 1})")

    def same_lengths(self, reference: np.ndarray, offsets: np.ndarray, reference_name: str, name: str) -> None:
        ref_lengths, lengths = np.diff(reference), np.diff(offsets)
        if np.array_equal(ref_lengths, lengths):
            return
        row = int(np.flatnonzero(ref_lengths != lengths)[0])
        self.fail(
            row, name, f"sequence length {int(lengths[row])} differs from {reference_name!r} ({int(ref_lengths[row])})"
        )

    def history_not_after_impression(self, timestamp: np.ndarray, offsets: np.ndarray, times: np.ndarray) -> None:
        after = times > np.repeat(timestamp, np.diff(offsets))
        if after.any():
            token = int(np.flatnonzero(after)[0])
            row = int(np.searchsorted(offsets, token, side="right") - 1)
            self.fail(row, HISTORY_TIME, f"history event at {int(times[token])} is after the impression")

    def finite(self, values: np.ndarray, name: str) -> None:
        bad = ~np.isfinite(values)
        if bad.any():
            self.fail(int(np.flatnonzero(bad.any(axis=1))[0]), name, "non-finite value")

    def labels(self, labels: np.ndarray) -> None:
        for index, name in enumerate(LABEL_COLUMNS):
            bad = (labels[:, index] != 0) & (labels[:, index] != 1)
            if bad.any():
                row = int(np.flatnonzero(bad)[0])
                self.fail(row, name, f"label {int(labels[row, index])} is not 0 or 1")
        orphan = labels[:, 1] > labels[:, 0]
        if orphan.any():
            self.fail(int(np.flatnonzero(orphan)[0]), LABEL_COLUMNS[1], "conversion = 1 without a click")

    def probabilities(self, oracle: np.ndarray) -> None:
        for index, name in enumerate(ORACLE_COLUMNS):
            bad = ~((oracle[:, index] >= 0) & (oracle[:, index] <= 1))
            if bad.any():
                row = int(np.flatnonzero(bad)[0])
                self.fail(row, name, f"probability {float(oracle[row, index])} is not in [0, 1]")
