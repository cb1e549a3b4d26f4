"""MovieLens loader on small hand-written .inter files (no recbole needed)."""

import argparse
import importlib.util
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from opengem.cli.movielens import add_movielens_parser, movielens_command
from opengem.data import movielens
from opengem.data.layout import DataError
from opengem.data.movielens import leave_one_out, load_sequences, read_inter, read_parquet, write_parquet

HEADER = "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"


def write_inter(path: Path, rows: list[str], header: str = HEADER) -> Path:
    path.write_text(header + "".join(row + "\n" for row in rows))
    return path


@pytest.fixture
def small(tmp_path: Path) -> Path:
    # user 7: items 30, 10, 20 at time 5 (tie, listed out of order), then 40 at 9, 50 at 1 (earliest)
    # user 3: 20 at 2, 30 at 1, 10 at 3; user 9 has two interactions only (dropped)
    return write_inter(tmp_path / "small.inter", [
        "7\t30\t4\t5", "3\t20\t1\t2", "7\t10\t5\t5", "9\t10\t3\t1", "7\t40\t2\t9",
        "3\t30\t3\t1", "7\t20\t4\t5", "3\t10\t5\t3", "7\t50\t1\t1", "9\t20\t2\t2",
    ])  # fmt: skip


def test_sequences_are_chronological_with_item_tie_break_and_contiguous_ids(small: Path) -> None:
    seq = read_inter(small)
    # users renumbered by token (3, 7; 9 dropped for < 3 interactions), items 10..50 -> 1..5
    assert seq.user_tokens == ["3", "7"]
    assert seq.item_tokens == ["10", "20", "30", "40", "50"]
    assert seq.num_items == 5
    assert seq.sequence(0).tolist() == [3, 2, 1]  # 30@1, 20@2, 10@3
    assert seq.sequence(1).tolist() == [5, 1, 2, 3, 4]  # 50@1, then the tie at 5 by item: 10, 20, 30; 40@9
    assert seq.timestamps[seq.offsets[1] : seq.offsets[2]].tolist() == [1, 5, 5, 5, 9]


def test_row_order_does_not_change_the_result(small: Path, tmp_path: Path) -> None:
    lines = small.read_text().splitlines(keepends=True)
    shuffled = tmp_path / "shuffled.inter"
    shuffled.write_text(lines[0] + "".join(reversed(lines[1:])))
    a, b = read_inter(small), read_inter(shuffled)
    assert np.array_equal(a.items, b.items) and np.array_equal(a.offsets, b.offsets)


def test_numeric_tokens_sort_numerically_and_repeats_keep_first(tmp_path: Path) -> None:
    path = write_inter(tmp_path / "r.inter", ["1\t100\t1\t1", "1\t9\t1\t2", "1\t100\t1\t3", "1\t20\t1\t4"])
    seq = read_inter(path)
    assert seq.item_tokens == ["9", "20", "100"]
    assert seq.sequence(0).tolist() == [3, 1, 2]  # the repeat of item 100 at time 3 is dropped


def test_fractional_timestamps_order_exactly(tmp_path: Path) -> None:
    path = write_inter(tmp_path / "f.inter", ["1\t10\t1\t1.7", "1\t20\t1\t1.2", "1\t30\t1\t2.0"])
    assert read_inter(path).sequence(0).tolist() == [2, 1, 3]  # 20 @ 1.2 before 10 @ 1.7


def test_leave_one_out(small: Path) -> None:
    split = leave_one_out(read_inter(small))
    assert [s.tolist() for s in split.train] == [[3], [5, 1, 2]]
    assert split.valid_target.tolist() == [2, 3]
    assert split.test_target.tolist() == [1, 4]
    assert split.test_history(1).tolist() == [5, 1, 2, 3]
    assert split.valid_history(1).tolist() == [5, 1, 2]


def test_parquet_round_trip_and_cli(small: Path, tmp_path: Path, capsys) -> None:
    parser = argparse.ArgumentParser()
    add_movielens_parser(parser.add_subparsers())
    out = tmp_path / "out"
    assert movielens_command(parser.parse_args(["movielens", "--out", str(out), "--inter", str(small)])) == 0
    printed = capsys.readouterr().out
    assert "users         2" in printed and "items         5" in printed
    back, original = read_parquet(out), read_inter(small)
    assert np.array_equal(back.items, original.items) and np.array_equal(back.timestamps, original.timestamps)
    assert np.array_equal(back.offsets, original.offsets)
    assert (back.user_tokens, back.item_tokens) == (original.user_tokens, original.item_tokens)
    assert np.array_equal(load_sequences(out).items, original.items)


@pytest.mark.parametrize(
    ("header", "row", "message"),
    [
        ("user_id:token\titem_id:token\trating:float\n", "1\t2\t3", "line 1: header has no column timestamp"),
        (HEADER, "1\t2\t3", "line 3: expected 4 tab-separated fields, got 3"),
        (HEADER, "1\t2\t3\tsoon", "line 3, column 4 (timestamp): not a number: 'soon'"),
        (HEADER, "1\t\t3\t4", "line 3, column 2 (item_id): empty token"),
        # non-finite timestamps had been stored as -2**63
        (HEADER, "1\t2\t3\tnan", "line 3, column 4 (timestamp): 'nan' is not a finite number of seconds"),
        (HEADER, "1\t2\t3\t-inf", "line 3, column 4 (timestamp): '-inf' is not a finite number of seconds"),
        (HEADER, "1\t2\t3\t1e300", "line 3, column 4 (timestamp): '1e300' is not a finite number of seconds within"),
    ],
)
def test_malformed_files_name_file_line_and_column(tmp_path: Path, header: str, row: str, message: str) -> None:
    path = write_inter(tmp_path / "bad.inter", ["1\t1\t1\t1", row], header=header)
    with pytest.raises(ValueError) as error:
        read_inter(path)
    assert str(path) in str(error.value) and message in str(error.value)


def test_header_only_file_is_an_error(tmp_path: Path) -> None:
    path = write_inter(tmp_path / "empty.inter", [])
    with pytest.raises(ValueError, match="no interactions after the header"):
        read_inter(path)


def test_no_user_with_enough_interactions_is_an_error(tmp_path: Path) -> None:
    # gave 0 users and no error; a repeated item does not count twice
    path = write_inter(tmp_path / "few.inter", ["1\t10\t5\t1", "1\t11\t5\t2", "1\t10\t5\t3", "2\t10\t3\t4"])
    with pytest.raises(ValueError, match=rf"{path}: no user has at least 3 interactions .*\(the most is 2\)"):
        read_inter(path)


def rewrite(path: Path, column: str, values: list, kind: pa.DataType | None = None) -> None:
    table = pq.read_table(path)
    index = table.schema.get_field_index(column)
    kind = kind or table.schema.field(column).type
    pq.write_table(table.set_column(index, pa.field(column, kind), pa.array(values, kind)), path)


SEQUENCE_PROBLEMS = {
    # case: (file, column, values, row, message after the column); small's users: row 0 = '3' (3 items), 1 = '7' (5)
    "padding id": ("sequences", "item_ids", [[3, 0, 1], [5, 1, 2, 3, 4]], 0, "user '3': item id 0 is not in 1..5"),
    "id past the items": ("sequences", "item_ids", [[3, 2, 1], [5, 1, 6, 3, 4]], 1, "user '7': item id 6 is not in"),
    "negative id": ("sequences", "item_ids", [[3, 2, 1], [5, -3, 2, 3, 4]], 1, "user '7': item id -3 is not in 1..5"),
    "fewer timestamps": ("sequences", "timestamps", [[1, 2, 3], [1, 5, 5, 9]], 1, "user '7': 4 timestamps for 5 items"),
    "short user": ("sequences", "item_ids", [[3, 2], [5, 1, 2, 3, 4]], 0, "user '3': 2 items; the leave-one-out"),
    "null id": ("sequences", "item_ids", [[3, 2, 1], [5, None, 2, 3, 4]], 1, "null value"),
    "items out of order": ("items", "item_id", [1, 3, 2, 4, 5], 1, "item id 3; the ids must be 1..5 in row order"),
    # the next four break what read_inter guarantees; leave_one_out had taken them as they were
    "repeated item": (
        "sequences", "item_ids", [[3, 2, 1], [5, 1, 2, 1, 4]], 1,
        "user '7': item id 1 appears twice (positions 1 and 3); each item may appear once per user",
    ),
    "time going back": (
        "sequences", "timestamps", [[1, 2, 3], [1, 5, 4, 5, 9]], 1,
        "user '7': timestamp 4 at position 2 is before the one preceding it, 5; each user's timestamps must not",
    ),
    "repeated user": ("sequences", "user_token", ["3", "3"], 1, "token '3' is also that of row 0; tokens must be"),
    "repeated item token": ("items", "item_token", ["10", "20", "10", "40", "50"], 2, "token '10' is also that of"),
}


@pytest.mark.parametrize("case", sorted(SEQUENCE_PROBLEMS))
def test_bad_parquet_sequences_name_file_row_and_user(small: Path, tmp_path: Path, case: str) -> None:
    # were accepted: leave_one_out then gave test target -3
    name, column, values, row, words = SEQUENCE_PROBLEMS[case]
    out = tmp_path / "out"
    write_parquet(read_inter(small), out)
    rewrite(out / f"{name}.parquet", column, values)
    if case == "short user":
        rewrite(out / "sequences.parquet", "timestamps", [[1, 2], [1, 5, 5, 5, 9]])  # as many as the items
    with pytest.raises(DataError, match=re.escape(f"{out / name}.parquet, row {row}, column {column!r}: {words}")):
        load_sequences(out)


def test_parquet_accepts_rounded_timestamps_that_tie_out_of_item_order(tmp_path: Path) -> None:
    # 20 @ 0.6 before 10 @ 1.4: both stored as 1, in an order the item-id tie-break would not give
    path = write_inter(tmp_path / "r.inter", ["1\t10\t1\t1.4", "1\t20\t1\t0.6", "1\t30\t1\t2"])
    write_parquet(read_inter(path), tmp_path / "out")
    back = read_parquet(tmp_path / "out")
    assert back.sequence(0).tolist() == [2, 1, 3] and back.timestamps.tolist() == [1, 1, 2]


def test_parquet_columns_of_the_wrong_type_are_named(small: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_parquet(read_inter(small), out)
    rewrite(out / "sequences.parquet", "item_ids", [[3.0, 2.0, 1.0], [5.5, 1, 2, 3, 4]], pa.list_(pa.float64()))
    with pytest.raises(DataError, match=r"sequences.parquet, column 'item_ids': wrong type: expected list<item: int64"):
        read_parquet(out)


def test_missing_recbole_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setattr(movielens.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps recbole==1\.2\.1"):
        read_inter()


@pytest.mark.skipif(importlib.util.find_spec("recbole") is None, reason="recbole (the ML-100K file) not installed")
def test_ml100k_from_recbole() -> None:
    seq = read_inter()
    assert (seq.num_users, seq.num_items, len(seq.items)) == (943, 1682, 100_000)
    assert seq.lengths().min() >= 20
    assert all(np.all(np.diff(seq.timestamps[a:b]) >= 0) for a, b in zip(seq.offsets[:-1], seq.offsets[1:]))
