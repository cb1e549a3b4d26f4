"""MovieLens-100K as per-user chronological item sequences with a leave-one-out split.

The interaction file is the one the ``recbole`` package ships in its example data
(``recbole/dataset_example/ml-100k/ml-100k.inter``; install it with ``pip install --no-deps recbole==1.2.1``).
MovieLens is GroupLens data for research use (F. M. Harper and J. A. Konstan, "The MovieLens Datasets:
History and Context", ACM TiiS 5(4), 2015); opengem does not redistribute it.

Conventions (the usual ones of sequential recommendation, e.g. SASRec / HSTU):

* every rating is an implicit interaction; a repeated (user, item) pair keeps its first occurrence;
* users and items are renumbered 1..N in the order of their original tokens (numerically when every
  token is an integer, else as strings); 0 is left free for padding;
* a user's sequence is sorted by timestamp, equal timestamps by the new item id (hence by the original
  item token): a fixed tie-break, so the split does not depend on the file's row order;
* users with fewer than ``MIN_INTERACTIONS`` interactions are dropped (the split needs a test item, a
  validation item and at least one training transition);
* leave-one-out: the last item is the test target, the second to last the validation target, the rest
  is the training sequence.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from opengem.data.layout import DataError

RECBOLE_INSTALL = "pip install --no-deps recbole==1.2.1"
MIN_INTERACTIONS = 3
_REQUIRED_FIELDS = ("user_id", "item_id", "timestamp")


@dataclass(frozen=True)
class Sequences:
    """Per-user chronological item sequences, stored flat: user ``u`` (0-based row) owns
    ``items[offsets[u]:offsets[u + 1]]``. Item ids are 1..``num_items``; ``user_tokens[u]`` and
    ``item_tokens[i - 1]`` are the original tokens of user row ``u`` and item id ``i``."""

    items: np.ndarray  # [T] int64, 1..num_items
    timestamps: np.ndarray  # [T] int64 (rounded; the order uses the file's exact values)
    offsets: np.ndarray  # [num_users + 1] int64
    user_tokens: list[str]
    item_tokens: list[str]

    @property
    def num_users(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_items(self) -> int:
        return len(self.item_tokens)

    def sequence(self, user: int) -> np.ndarray:
        return self.items[self.offsets[user] : self.offsets[user + 1]]

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


@dataclass(frozen=True)
class LeaveOneOut:
    """The leave-one-out split: ``train`` holds each user's sequence without its last two items;
    ``valid_target[u]`` and ``test_target[u]`` are the second to last and last items."""

    train: list[np.ndarray]
    valid_target: np.ndarray  # [num_users] int64
    test_target: np.ndarray  # [num_users] int64
    num_items: int

    def valid_history(self, user: int) -> np.ndarray:
        return self.train[user]

    def test_history(self, user: int) -> np.ndarray:
        return np.append(self.train[user], self.valid_target[user])


def recbole_inter_path() -> Path:
    """Path of ML-100K's interaction file inside the installed ``recbole`` package."""
    spec = importlib.util.find_spec("recbole")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"MovieLens-100K is read from the recbole package's example data, but recbole is not installed: "
            f"run `{RECBOLE_INSTALL}`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "dataset_example" / "ml-100k" / "ml-100k.inter"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed recbole; reinstall it with `{RECBOLE_INSTALL}`")
    return path


def read_inter(path: str | Path | None = None) -> Sequences:
    """Read a RecBole ``.inter`` file (tab-separated, header ``name:type`` per column, needing ``user_id``,
    ``item_id`` and a numeric ``timestamp``) into sequences; ``None`` reads ML-100K from recbole."""
    path = Path(path) if path is not None else recbole_inter_path()
    users, items, times = _parse(path)
    user_tokens, user_ids = _renumber(users)
    item_tokens, item_ids = _renumber(items)
    order = np.lexsort((item_ids, times, user_ids))  # by user, then time, then item id (the tie-break)
    user_ids, item_ids, times = user_ids[order], item_ids[order], times[order]
    first = _first_occurrences(user_ids, item_ids)
    user_ids, item_ids, times = user_ids[first], item_ids[first], times[first]
    counts = np.bincount(user_ids, minlength=len(user_tokens))
    keep_user = counts >= MIN_INTERACTIONS
    if not keep_user.any():  # an empty data set had gone on to training without a word
        raise ValueError(
            f"{path}: no user has at least {MIN_INTERACTIONS} interactions with distinct items (the most is "
            f"{int(counts.max())}); the leave-one-out split needs {MIN_INTERACTIONS} per user"
        )
    rows = keep_user[user_ids]
    kept_tokens = [t for t, keep in zip(user_tokens, keep_user) if keep]
    offsets = np.concatenate([[0], np.cumsum(counts[keep_user])]).astype(np.int64)
    return Sequences(item_ids[rows] + 1, np.round(times[rows]).astype(np.int64), offsets, kept_tokens, item_tokens)


def leave_one_out(sequences: Sequences) -> LeaveOneOut:
    train = [sequences.sequence(u)[:-2] for u in range(sequences.num_users)]
    last = sequences.offsets[1:] - 1
    return LeaveOneOut(train, sequences.items[last - 1].copy(), sequences.items[last].copy(), sequences.num_items)


def stats(sequences: Sequences) -> dict[str, float]:
    lengths = sequences.lengths()
    return {
        "users": sequences.num_users,
        "items": sequences.num_items,
        "interactions": int(lengths.sum()),
        "density": float(lengths.sum()) / max(1, sequences.num_users * sequences.num_items),
        "min_length": int(lengths.min()) if len(lengths) else 0,
        "median_length": float(np.median(lengths)) if len(lengths) else 0.0,
        "max_length": int(lengths.max()) if len(lengths) else 0,
    }


def write_parquet(sequences: Sequences, out: str | Path) -> list[Path]:
    """Write ``sequences.parquet`` (one row per user: user_id, user_token, item_ids, timestamps),
    ``items.parquet`` (item_id, item_token) and ``stats.json`` under ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    splits = sequences.offsets[1:-1]
    table = pa.table({
        "user_id": pa.array(np.arange(1, sequences.num_users + 1), pa.int64()),
        "user_token": pa.array(sequences.user_tokens, pa.string()),
        "item_ids": pa.array(np.split(sequences.items, splits), pa.list_(pa.int64())),
        "timestamps": pa.array(np.split(sequences.timestamps, splits), pa.list_(pa.int64())),
    })  # fmt: skip
    items = pa.table({
        "item_id": pa.array(np.arange(1, sequences.num_items + 1), pa.int64()),
        "item_token": pa.array(sequences.item_tokens, pa.string()),
    })  # fmt: skip
    paths = [out / "sequences.parquet", out / "items.parquet", out / "stats.json"]
    pq.write_table(table, paths[0])
    pq.write_table(items, paths[1])
    paths[2].write_text(json.dumps(stats(sequences), indent=2) + "\n")
    return paths


def read_parquet(folder: str | Path) -> Sequences:
    """Read what :func:`write_parquet` wrote, checked as :func:`read_inter` builds it: ``items.parquet`` lists the
    item ids 1..N in order with distinct tokens; each ``sequences.parquet`` row has a user token of its own, item ids
    in 1..N (0 is padding), each at most once, as many timestamps as items, not decreasing, and at least
    ``MIN_INTERACTIONS`` items. Raises :class:`DataError` naming the file, the row (0-based) with its user token, and
    the column.

    The tie-break of equal timestamps (by item id) is not checked: read_inter orders by the exact timestamps and
    stores them rounded, so two rounded-equal timestamps may keep any item order."""
    folder = Path(folder)
    sequences_path, items_path = folder / "sequences.parquet", folder / "items.parquet"
    users = _read_columns(sequences_path, _SEQUENCE_TYPES)
    items = _read_columns(items_path, _ITEM_TYPES)
    item_id = items["item_id"].to_numpy()
    num_items = len(item_id)
    if (row := _first(item_id != np.arange(1, num_items + 1))) is not None:  # Sequences maps ids to tokens by row
        problem = f"item id {int(item_id[row])}; the ids must be 1..{num_items} in row order"
        raise DataError(str(items_path), row, "item_id", problem)
    _check_distinct(items["item_token"], items_path, "item_token")  # two ids for one item split its interactions
    user_tokens = users["user_token"].to_pylist()
    if not user_tokens:
        raise DataError(str(sequences_path), None, None, "no users (0 rows)")
    _check_distinct(users["user_token"], sequences_path, "user_token")

    def fail(row: int, column: str, problem: str) -> NoReturn:
        raise DataError(str(sequences_path), row, column, f"user {user_tokens[row]!r}: {problem}")

    item_ids, timestamps = users["item_ids"], users["timestamps"]
    lengths = item_ids.value_lengths().to_numpy().astype(np.int64)
    time_lengths = timestamps.value_lengths().to_numpy()
    if (row := _first(lengths != time_lengths)) is not None:
        fail(row, "timestamps", f"{time_lengths[row]} timestamps for {lengths[row]} items")
    if (row := _first(lengths < MIN_INTERACTIONS)) is not None:  # leave_one_out would take another user's items
        fail(row, "item_ids", f"{lengths[row]} items; the leave-one-out split needs at least {MIN_INTERACTIONS}")
    flat = item_ids.flatten().to_numpy()
    parent = item_ids.value_parent_indices().to_numpy()  # the row of every flat position
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)  # a row's first flat position
    if (token := _first((flat < 1) | (flat > num_items))) is not None:
        problem = f"item id {flat[token]} is not in 1..{num_items} (the items of {items_path.name})"
        fail(int(parent[token]), "item_ids", problem)
    # read_inter keeps a user's first interaction with an item: a repeat would be a target also seen in the history
    order = np.lexsort((flat, parent))  # stable: by row, then item id, then position
    repeat = (parent[order[1:]] == parent[order[:-1]]) & (flat[order[1:]] == flat[order[:-1]])
    if (hit := _first(repeat)) is not None:
        first, second = int(order[hit]), int(order[hit + 1])
        row = int(parent[first])
        positions = f"positions {first - starts[row]} and {second - starts[row]}"
        fail(row, "item_ids", f"item id {flat[first]} appears twice ({positions}); each item may appear once per user")
    # read_inter sorts each user by time: the leave-one-out split takes the last items as the latest
    times = timestamps.flatten().to_numpy()
    if (hit := _first((times[1:] < times[:-1]) & (parent[1:] == parent[:-1]))) is not None:
        row = int(parent[hit + 1])
        problem = f"timestamp {times[hit + 1]} at position {hit + 1 - starts[row]} is before the one preceding it"
        fail(row, "timestamps", f"{problem}, {times[hit]}; each user's timestamps must not decrease")
    return Sequences(
        items=flat.astype(np.int64),
        timestamps=times.astype(np.int64),
        offsets=starts,
        user_tokens=user_tokens,
        item_tokens=items["item_token"].to_pylist(),
    )


_SEQUENCE_TYPES = {"user_token": pa.string(), "item_ids": pa.list_(pa.int64()), "timestamps": pa.list_(pa.int64())}
_ITEM_TYPES = {"item_id": pa.int64(), "item_token": pa.string()}


def _read_columns(path: Path, types: dict[str, pa.DataType]) -> dict[str, pa.Array]:
    """The columns ``types`` of ``path`` (others are ignored), each of its type, without nulls (at any depth)."""
    table = pq.read_table(path)
    columns = {}
    for name, expected in types.items():
        if name not in table.column_names:
            raise DataError(str(path), None, name, f"missing column (expected type {expected})")
        array = table[name].combine_chunks()
        if array.type != expected:
            raise DataError(str(path), None, name, f"wrong type: expected {expected}, got {array.type}")
        nulls = np.array(array.is_null())
        if pa.types.is_list(expected):  # a null inside a list counts against its row
            inner = array.flatten().is_null().to_numpy(zero_copy_only=False)
            nulls[array.value_parent_indices().to_numpy()[inner]] = True
        if (row := _first(nulls)) is not None:
            raise DataError(str(path), row, name, "null value (nulls are not allowed)")
        columns[name] = array
    return columns


def _check_distinct(tokens: pa.Array, path: Path, column: str) -> None:
    """Raise :class:`DataError` at the first row whose token an earlier row already has (read_inter's tokens are
    distinct)."""
    codes = tokens.dictionary_encode().indices.to_numpy()  # codes count up in order of first appearance
    _, first_rows = np.unique(codes, return_index=True)
    repeated = np.ones(len(codes), dtype=bool)
    repeated[first_rows] = False
    if (row := _first(repeated)) is not None:
        earlier = int(first_rows[codes[row]])
        problem = f"token {tokens[row].as_py()!r} is also that of row {earlier}; tokens must be distinct"
        raise DataError(str(path), row, column, problem)


def _first(mask: np.ndarray) -> int | None:
    """Index of the first True of ``mask``, None if none."""
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else None


def load_sequences(source: str | Path | None = None) -> Sequences:
    """A folder written by :func:`write_parquet`, a ``.inter`` file, or (``None`` / empty) ML-100K from recbole."""
    if source and Path(source).is_dir():
        return read_parquet(source)
    return read_inter(source or None)


def _parse(path: Path) -> tuple[list[str], list[str], np.ndarray]:
    with path.open(encoding="utf-8") as handle:
        header = handle.readline().rstrip("\n").split("\t")
        names = [column.split(":", 1)[0] for column in header]
        missing = [name for name in _REQUIRED_FIELDS if name not in names]
        if missing:
            raise ValueError(
                f"{path}, line 1: header has no column {', '.join(missing)} (expected tab-separated "
                f"name:type columns including user_id, item_id and timestamp; got {header})"
            )
        user_col, item_col, time_col = (names.index(name) for name in _REQUIRED_FIELDS)
        users: list[str] = []
        items: list[str] = []
        times: list[float] = []
        for line_number, line in enumerate(handle, start=2):
            line = line.rstrip("\n")
            if not line:
                continue
            fields = line.split("\t")
            if len(fields) != len(header):
                raise ValueError(
                    f"{path}, line {line_number}: expected {len(header)} tab-separated fields, got {len(fields)}"
                )
            for name, column in zip(_REQUIRED_FIELDS[:2], (user_col, item_col)):
                if not fields[column]:
                    raise ValueError(f"{path}, line {line_number}, column {column + 1} ({name}): empty token")
            try:
                time = float(fields[time_col])
            except ValueError:
                raise ValueError(
                    f"{path}, line {line_number}, column {time_col + 1} (timestamp): not a number: {fields[time_col]!r}"
                ) from None
            if not abs(time) < 2.0**63:  # nan, inf and the like had been stored as -2**63 (int64 seconds)
                raise ValueError(
                    f"{path}, line {line_number}, column {time_col + 1} (timestamp): {fields[time_col]!r} is not a "
                    "finite number of seconds within the int64 range"
                )
            times.append(time)
            users.append(fields[user_col])
            items.append(fields[item_col])
    if not users:
        raise ValueError(f"{path}: no interactions after the header")
    return users, items, np.asarray(times, dtype=np.float64)


def _renumber(tokens: list[str]) -> tuple[list[str], np.ndarray]:
    """Distinct tokens in order (numeric when all are integers) and each token's 0-based index."""
    distinct = sorted(set(tokens))
    if all(t.lstrip("-").isdigit() for t in distinct):
        distinct.sort(key=int)
    index = {token: i for i, token in enumerate(distinct)}
    return distinct, np.fromiter((index[t] for t in tokens), dtype=np.int64, count=len(tokens))


def _first_occurrences(user_ids: np.ndarray, item_ids: np.ndarray) -> np.ndarray:
    """Sorted row indices keeping the first row of each (user, item) pair (rows are in time order)."""
    pairs = user_ids * (int(item_ids.max()) + 1) + item_ids
    _, first = np.unique(pairs, return_index=True)
    return np.sort(first)
