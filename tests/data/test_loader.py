import numpy as np
import pytest

from opengem.data.parquet import ParquetDataset, make_loader


def sample_ids(loader) -> np.ndarray:
    return np.concatenate([batch.sample_id.numpy() for batch in loader])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"batch_size": 200},
        {"token_budget": 1_500},
        {"batch_size": 256, "batch_shuffling": True, "shuffle_buffer": 700},
    ],
)
def test_two_workers_yield_every_sample_once(tiny_dir, tiny_table, kwargs):
    loader = make_loader(tiny_dir, num_workers=2, pin_memory=True, **kwargs)
    ids = sample_ids(loader)
    assert len(ids) == tiny_table.num_rows
    assert np.array_equal(np.sort(ids), np.arange(tiny_table.num_rows))


def test_workers_and_ranks_split_row_groups_deterministically(tiny_dir):
    dataset = ParquetDataset(tiny_dir, batch_size=10)
    assert len(dataset.units) == 10  # files of 2000, 2000, 1000 rows in row groups of <= 512
    everything = {(u.path, u.row_group) for u in dataset.units}
    split = [dataset.assigned_units(w, 3) for w in range(3)]
    assert split == [dataset.assigned_units(w, 3) for w in range(3)]
    assert [len(s) for s in split] == [4, 3, 3]
    assert set().union(*[{(u.path, u.row_group) for u in s} for s in split]) == everything
    ranks = [ParquetDataset(tiny_dir, batch_size=10, rank=r, world_size=2) for r in range(2)]
    rank_ids = [sample_ids(r) for r in ranks]
    assert not set(rank_ids[0]) & set(rank_ids[1])
    assert np.array_equal(np.sort(np.concatenate(rank_ids)), np.arange(dataset.num_rows))


def test_shuffle_changes_with_epoch_and_keeps_every_sample(tiny_dir):
    dataset = ParquetDataset(tiny_dir, batch_size=300, shuffle_buffer=1_000, seed=4)
    first = sample_ids(dataset)
    assert np.array_equal(first, sample_ids(dataset))  # same epoch, same order
    dataset.set_epoch(1)
    second = sample_ids(dataset)
    assert not np.array_equal(first, second)
    assert np.array_equal(np.sort(first), np.sort(second))
    assert np.array_equal(np.sort(first), np.arange(dataset.num_rows))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"batch_size": 8.0}, "batch_size must be an int, got 8.0"),  # failed deep in RowBlock.slice
    ({"token_budget": 7.5}, "token_budget must be an int, got 7.5"),
    ({"batch_size": 8, "shuffle_cost": "bogus"}, r"shuffle_cost must be one of \('tokens', 'squared'\), got 'bogus'"),
    # "slice indices must be integers" at iteration
    ({"batch_size": 8, "rank": 0.5, "world_size": 2}, "rank and world_size must be ints, got rank 0.5, world_size 2"),
    ({"batch_size": 8, "world_size": True}, "rank and world_size must be ints, got rank 0, world_size True"),
    ({"batch_size": 8, "rank": 2, "world_size": 2}, "need 0 <= rank < world_size, got rank 2, world_size 2"),
    ({"batch_size": 8, "seed": -1}, "seed must be an int >= 0, got -1"),  # numpy's error, inside a worker
    # the next four were caught only when iteration started, inside a DataLoader worker
    ({"batch_size": -1}, "batch_size must be >= 1, got -1"),
    ({"token_budget": 0}, "token_budget must be >= 1, got 0"),
    ({"token_budget": 500, "batch_size": 0}, "batch_size must be >= 1, got 0"),  # the row cap of a token budget
    ({"batch_size": 100, "batch_shuffling": True, "sub_batch_size": 64},
     "batch_size 100 must be a multiple of sub_batch_size 64"),
    ({"batch_size": 8, "shuffle_buffer": True}, "shuffle_buffer must be an int >= 0, got True"),  # was a 1-row buffer
    ({"batch_size": 8, "shuffle_buffer": -1}, "shuffle_buffer must be an int >= 0, got -1"),
    ({"batch_size": 8, "shuffle_buffer": 10.5}, "shuffle_buffer must be an int >= 0, got 10.5"),
    # checked with batch_shuffling off too, as torch checks timeout without workers
    ({"batch_size": 8, "sub_batch_size": 0}, "sub_batch_size must be an int >= 1, got 0"),
    ({"batch_size": 8, "sub_batch_size": 2.0}, "sub_batch_size must be an int >= 1, got 2.0"),
    # was dropped without a word where torch's DataLoader refuses it
    ({"batch_size": 8, "prefetch_factor": 4}, r"prefetch_factor=4 needs num_workers >= 1 \(got num_workers=0"),
    ({"batch_size": 8, "num_workers": 2, "prefetch_factor": 0}, "prefetch_factor must be an int >= 1 or None, got 0"),
    ({"batch_size": 8, "num_workers": -1}, "num_workers must be an int >= 0, got -1"),
    # tiny_dir holds 10 row groups: rank 10 had read 0 rows each epoch
    ({"batch_size": 8, "rank": 10, "world_size": 11},
     r"rank 10 of world_size 11 gets no rows: the 3 file\(s\) hold 10 non-empty row groups"),
])
def test_loader_options_of_the_wrong_kind_are_named(tiny_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_loader(tiny_dir, **kwargs)


def test_every_rank_up_to_the_number_of_row_groups_gets_rows(tiny_dir):
    last = ParquetDataset(tiny_dir, batch_size=1_000, rank=9, world_size=10)  # one row group each
    assert sum(batch.batch_size() for batch in last) == last.assigned_units()[0].num_rows > 0


def test_an_explicit_prefetch_factor_reaches_the_workers(tiny_dir):
    assert make_loader(tiny_dir, batch_size=8, num_workers=1, prefetch_factor=3).prefetch_factor == 3
    assert make_loader(tiny_dir, batch_size=8).prefetch_factor is None
