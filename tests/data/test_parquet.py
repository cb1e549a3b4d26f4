import json
import os
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from opengem.data.layout import DataError
from opengem.data import parquet
from opengem.data.parquet import (
    ParquetDataset,
    batches_from_table,
    make_loader,
    parquet_write_options,
    resolve_paths,
    synthesize_to_parquet,
    validate_files,
)

from opengem.data.synthetic import SYNTHETIC_PRESETS

TINY = SYNTHETIC_PRESETS["gem-tiny"]

ROW_GROUP = 256


def test_round_trip_rows_and_batches(tiny_dir, tiny_table):
    files = resolve_paths(tiny_dir)
    assert [f.name for f in files] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert pq.read_table(files).combine_chunks().equals(tiny_table.combine_chunks())
    num_rows = tiny_table.num_rows
    assert validate_files(tiny_dir) == num_rows
    from_disk = list(make_loader(tiny_dir, batch_size=300))
    in_memory = list(batches_from_table(tiny_table, batch_size=300))
    assert len(from_disk) == len(in_memory) == -(-num_rows // 300)
    for a, b in zip(from_disk, in_memory):
        for x, y in [
            (a.sparse.values, b.sparse.values), (a.sparse.lengths, b.sparse.lengths),
            (a.sequence.values, b.sequence.values), (a.sequence.lengths, b.sequence.lengths),
            (a.history_age.values, b.history_age.values), (a.history_age.offsets, b.history_age.offsets),
            (a.dense, b.dense), (a.labels, b.labels), (a.oracle, b.oracle), (a.sample_id, b.sample_id),
        ]:
            assert torch.equal(x, y)


def test_batch_contents_match_the_table(tiny_table):
    batch = next(batches_from_table(tiny_table, batch_size=64))
    specs = TINY.feature_specs()
    assert batch.sparse.keys == tuple(s.name for s in specs if s.kind != "sequence")
    assert batch.sequence.keys == ("hist_item", "hist_event_type", "hist_category")
    assert batch.batch_size() == 64 and batch.sparse.stride == 64 and batch.sequence.stride == 64
    rows = tiny_table.slice(0, 64).to_pylist()
    for key in ("user_id", "ad_id", "surface"):
        assert batch.sparse[key].values.tolist() == [r[key] for r in rows]
    assert batch.sparse["user_declared_interests"].split()[5].tolist() == rows[5]["user_declared_interests"]
    lengths = [len(r["hist_item"]) for r in rows]
    assert batch.num_history_tokens() == sum(lengths)
    for key in batch.sequence.keys:
        jagged = batch.sequence[key]
        assert jagged.lengths().tolist() == lengths
        assert jagged.split()[9].tolist() == rows[9][key]
    ages = [rows[9]["timestamp"] - t for t in rows[9]["hist_timestamp"]]
    assert batch.history_age.split()[9].tolist() == pytest.approx(ages)
    assert batch.history_age.values.dtype == torch.float32 and (batch.history_age.values >= 0).all()
    assert batch.dense.shape == (64, TINY.num_dense) and batch.dense.dtype == torch.float32
    assert batch.labels[:, 0].tolist() == [r["click"] for r in rows]
    assert batch.oracle[:, 1].tolist() == pytest.approx([r["oracle_conversion"] for r in rows])
    moved = batch.to("cpu")
    assert torch.equal(moved.sequence.values, batch.sequence.values) and moved.num_history_tokens() == sum(lengths)


# ---------------------------------------------------------------- bad inputs


def write(table: pa.Table, path: Path) -> Path:
    pq.write_table(table, path, row_group_size=ROW_GROUP, **parquet_write_options(table.schema))
    return path


def replace_column(table: pa.Table, name: str, array: pa.Array) -> pa.Table:
    return table.set_column(table.schema.get_field_index(name), pa.field(name, array.type), array)


def set_scalar(table: pa.Table, name: str, row: int, value) -> pa.Table:
    values = table.column(name).to_pylist()
    values[row] = value
    return replace_column(table, name, pa.array(values, type=table.schema.field(name).type))


def set_list(table: pa.Table, name: str, row: int, edit) -> pa.Table:
    values = table.column(name).to_pylist()
    values[row] = edit(values[row])
    return replace_column(table, name, pa.array(values, type=table.schema.field(name).type))


def with_item(index: int, value):
    def edit(items):
        items[index] = value
        return items

    return edit


BAD_VALUES = {
    # case: (corrupt the table, row, column, words in the message)
    "negative categorical id": (lambda t: set_scalar(t, "ad_id", 7, -3), 7, "ad_id", "negative id -3"),
    "categorical id out of range": (
        lambda t: set_scalar(t, "user_age", 300, TINY.num_age_buckets), 300, "user_age", "id out of range"
    ),
    "sequence id out of range": (
        lambda t: set_list(t, "hist_item", 600, with_item(-1, TINY.num_items)), 600, "hist_item", "id out of range"
    ),
    "negative multi-hot id": (
        lambda t: set_list(t, "user_declared_interests", 11, lambda v: [*v, -1]), 11, "user_declared_interests",
        "negative id",
    ),
    "unequal sequence lengths": (
        lambda t: set_list(t, "hist_category", 513, lambda v: [*v, 0]), 513, "hist_category", "sequence length",
    ),
    "unequal timestamp length": (
        lambda t: set_list(t, "hist_timestamp", 2, lambda v: v[:-1]), 2, "hist_timestamp", "sequence length"
    ),
    "history after impression": (
        lambda t: set_list(t, "hist_timestamp", 40, with_item(-1, 2**40)), 40, "hist_timestamp", "after the impression"
    ),
    "null id": (lambda t: set_scalar(t, "surface", 19, None), 19, "surface", "null"),
    "null inside a list": (lambda t: set_list(t, "hist_item", 21, with_item(0, None)), 21, "hist_item", "null"),
    "label not binary": (lambda t: set_scalar(t, "click", 5, 2), 5, "click", "not 0 or 1"),
    "conversion without click": (
        lambda t: set_scalar(set_scalar(t, "click", 8, 0), "conversion", 8, 1), 8, "conversion", "without a click"
    ),
    "oracle outside [0, 1]": (lambda t: set_scalar(t, "oracle_click", 9, 1.5), 9, "oracle_click", "not in [0, 1]"),
    "non-finite dense": (
        lambda t: set_list(t, "dense", 270, with_item(2, float("nan"))), 270, "dense", "non-finite"
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_bad_values_name_file_row_and_column(case, tiny_table, tmp_path):
    corrupt, row, column, words = BAD_VALUES[case]
    path = write(corrupt(tiny_table.slice(0, 1_000)), tmp_path / "bad.parquet")
    for read in (validate_files, lambda p: list(make_loader(p, batch_size=100))):
        with pytest.raises(DataError) as error:
            read(path)
        message = str(error.value)
        assert str(path) in message and f"row {row}," in message and f"column {column!r}" in message, message
        assert words in message, message
        assert (error.value.row, error.value.column) == (row, column)


def test_rows_are_named_as_in_the_file_across_files_and_row_groups(tiny_table, tmp_path):
    good = write(tiny_table.slice(0, 600), tmp_path / "a.parquet")
    bad = write(set_scalar(tiny_table.slice(600, 900), "ad_id", 777, -1), tmp_path / "b.parquet")
    with pytest.raises(DataError, match=rf"{bad}, row 777, column 'ad_id'"):
        validate_files([good, bad])


SCHEMA_CASES = {
    "missing column": (lambda t: t.drop_columns(["hist_category"]), "hist_category", "missing column"),
    "wrong type": (lambda t: replace_column(t, "ad_id", pc.cast(t.column("ad_id"), pa.int32())), "ad_id", "wrong type"),
    "wrong list type": (
        lambda t: replace_column(t, "hist_item", pc.cast(t.column("hist_item"), pa.list_(pa.int64()))),
        "hist_item",
        "expected list<item: int32>",
    ),
    "no metadata": (lambda t: t.replace_schema_metadata(None), None, "no 'opengem' entry"),
    "malformed metadata": (lambda t: t.replace_schema_metadata({b"opengem": b"{not json"}), None, "malformed"),
    "unknown feature kind": (
        lambda t: t.replace_schema_metadata(
            {b"opengem": t.schema.metadata[b"opengem"].replace(b'"kind": "multi_hot"', b'"kind": "bag"')}
        ),
        None,
        "malformed",
    ),
    "empty file": (lambda t: t.slice(0, 0), None, "empty file"),
    # int() had truncated 50000.9 to 50000 and read true as 1
    "fractional num_embeddings": (
        lambda t: edit_features(t, lambda f: f[0].update(num_embeddings=50000.9)),
        "user_id",
        "num_embeddings in the 'opengem' schema metadata must be an int, got 50000.9",
    ),
    "boolean num_embeddings": (
        lambda t: edit_features(t, lambda f: f[1].update(num_embeddings=True)),
        "user_age",
        "num_embeddings in the 'opengem' schema metadata must be an int, got True",
    ),
    # passed validation, then iterating failed in KeyedJagged without the file's name
    "duplicate feature name": (
        lambda t: edit_features(t, lambda f: f.append(dict(f[2]))), "user_gender", "feature name is listed twice"
    ),
    "feature named like a fixed column": (
        lambda t: edit_features(t, lambda f: f[0].update(name="timestamp")),
        "timestamp",
        "feature name is that of a fixed column",
    ),
}


def edit_features(table: pa.Table, edit) -> pa.Table:
    """``table`` with ``edit`` applied to the feature entries of its 'opengem' schema metadata."""
    payload = json.loads(table.schema.metadata[b"opengem"])
    edit(payload["features"])
    return table.replace_schema_metadata({b"opengem": json.dumps(payload).encode()})


@pytest.mark.parametrize("case", sorted(SCHEMA_CASES))
def test_schema_problems_are_reported_before_reading(case, tiny_table, tmp_path):
    corrupt, column, words = SCHEMA_CASES[case]
    path = write(corrupt(tiny_table.slice(0, 300)), tmp_path / "bad.parquet")
    with pytest.raises(DataError) as error:
        make_loader(path, batch_size=10)  # raises at construction, before any batch
    message = str(error.value)
    assert str(path) in message and words in message, message
    if column is not None:
        assert f"column {column!r}" in message
    assert error.value.column == column
    with pytest.raises(DataError, match=re.escape(message)):
        validate_files(path)


def test_truncated_file(tiny_table, tmp_path):
    path = write(tiny_table.slice(0, 300), tmp_path / "cut.parquet")
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) // 2)
    with pytest.raises(DataError, match=rf"{path}: truncated or corrupt Parquet file"):
        make_loader(path, batch_size=10)


def test_corrupt_data_page_is_detected(tiny_table, tmp_path):
    path = write(tiny_table.slice(0, 1_000), tmp_path / "flip.parquet")
    column = pq.read_metadata(path).row_group(2).column(12)  # hist_item of rows 512..767
    assert column.path_in_schema == "hist_item.list.element"
    data = bytearray(path.read_bytes())
    middle = column.data_page_offset + column.total_compressed_size // 2
    data[middle : middle + 8] = bytes(255 - b for b in data[middle : middle + 8])
    path.write_bytes(bytes(data))
    loader = make_loader(path, batch_size=100)  # the footer is intact
    with pytest.raises(DataError, match=rf"{path}: corrupt row group 2 \(rows 512..767\)"):
        list(loader)


def test_files_with_different_feature_specs_are_rejected(tiny_table, tmp_path):
    a = write(tiny_table.slice(0, 100), tmp_path / "a.parquet")
    other = pq.read_table(a).replace_schema_metadata(
        {b"opengem": tiny_table.schema.metadata[b"opengem"].replace(b'"num_embeddings": 50000', b'"num_embeddings": 9')}
    )
    b = write(other, tmp_path / "b.parquet")
    with pytest.raises(DataError, match=rf"{b}: feature specs differ"):
        make_loader([a, b], batch_size=10)


def test_missing_paths():
    with pytest.raises(FileNotFoundError, match="no such file"):
        make_loader(["/nonexistent/x.parquet"], batch_size=1)


def test_synthesize_reports_bad_arguments(tmp_path):
    from opengem.data.parquet import synthesize_to_parquet

    with pytest.raises(ValueError, match="unknown preset"):
        synthesize_to_parquet(tmp_path, 10, "gem-huge")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="notes.txt' is a file, not a folder"):  # was a FileExistsError traceback
        synthesize_to_parquet(a_file, 10, "gem-tiny", progress=False)
    assert not list(tmp_path.glob("*.tmp"))
    assert np.array_equal(
        pq.read_table(synthesize_to_parquet(tmp_path, 10, "gem-tiny", progress=False)).column("sample_id").to_numpy(),
        np.arange(10),
    )


def test_synthesize_refuses_a_negative_seed_before_writing(tmp_path):
    # numpy's "expected non-negative integer" came mid-write and left part-00000.parquet.tmp behind
    with pytest.raises(ValueError, match="seed must be an int >= 0, got -1"):
        synthesize_to_parquet(tmp_path, 10, "gem-tiny", seed=-1, progress=False)
    assert not list(tmp_path.iterdir())


def test_a_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(parquet, "generate", broken)
    with pytest.raises(OSError, match="disk full"):
        synthesize_to_parquet(tmp_path, 10, "gem-tiny", progress=False)
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------- drop_last in every batching mode


def token_counts(batches) -> list[int]:
    return [b.num_history_tokens() for b in batches]


def test_drop_last_with_token_budget_drops_only_a_partial_last_batch(tiny_dir):
    budget = 3_000
    every = list(ParquetDataset(tiny_dir, token_budget=budget))
    kept = list(ParquetDataset(tiny_dir, token_budget=budget, drop_last=True))
    assert token_counts(every)[-1] < budget  # the data end in a partial batch (was still yielded)
    assert token_counts(kept) == token_counts(every)[:-1]  # the batches before it were closed by a row not fitting
    for cap, sizes in ((1_000, [1_000] * 5), (1_200, [1_200] * 4)):  # full by rows: the cap, of 5_000 rows
        capped = ParquetDataset(tiny_dir, token_budget=10**9, batch_size=cap, drop_last=True)
        assert [b.batch_size() for b in capped] == sizes


def test_drop_last_with_batch_shuffling_gives_only_full_batches(tiny_dir):
    kwargs = {"batch_size": 512, "sub_batch_size": 128, "batch_shuffling": True}
    assert min(b.batch_size() for b in ParquetDataset(tiny_dir, **kwargs)) < 512
    kept = list(ParquetDataset(tiny_dir, drop_last=True, **kwargs))
    assert [b.batch_size() for b in kept] == [512] * (5_000 // 512)  # was: short batches of the last window
    ids = np.concatenate([b.sample_id.numpy() for b in kept])
    assert len(np.unique(ids)) == len(ids)
