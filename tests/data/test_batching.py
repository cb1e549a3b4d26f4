import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opengem.data.batching import (
    base_batch_shuffling,
    batch_costs,
    fixed_size_batches,
    shuffled_rows,
    token_budget_batches,
)
from opengem.data.layout import DataError
from opengem.data.parquet import batches_from_table
from opengem.data.synthetic import SYNTHETIC_PRESETS, generate_rows

TINY = SYNTHETIC_PRESETS["gem-tiny"]
ROWS = generate_rows(TINY, 3_000, seed=11)


def pieces(cuts: list[int]):
    """ROWS as consecutive blocks cut at the sorted positions ``cuts`` (empty blocks allowed)."""
    bounds = [0, *sorted(c % ROWS.num_rows for c in cuts), ROWS.num_rows]
    return [ROWS.slice(a, b) for a, b in zip(bounds, bounds[1:])]


def ids_of(batches) -> np.ndarray:
    return np.concatenate([b.sample_id for b in batches])


def assert_consistent(block):
    """Every jagged column of a batch still agrees with its rows (lengths add up, ages valid)."""
    assert block.history_offsets[0] == 0 and block.history_offsets[-1] == len(block.history["hist_item"])
    for values in block.history.values():
        assert len(values) == block.history_offsets[-1]
    assert (np.repeat(block.timestamp, block.history_lengths()) >= block.history["hist_timestamp"]).all()


@given(st.lists(st.integers(0, 10**6), max_size=6), st.integers(1, 700), st.booleans())
@settings(max_examples=15, deadline=None)
def test_fixed_size_keeps_every_row_once_in_order(cuts, batch_size, drop_last):
    batches = list(fixed_size_batches(pieces(cuts), batch_size, drop_last))
    sizes = [b.num_rows for b in batches]
    full = ROWS.num_rows // batch_size
    assert sizes[:full] == [batch_size] * full
    expected = full * batch_size if drop_last else ROWS.num_rows
    assert np.array_equal(ids_of(batches), ROWS.sample_id[:expected])
    for b in batches:
        assert_consistent(b)


@given(st.lists(st.integers(0, 10**6), max_size=6), st.integers(1, 400), st.sampled_from([None, 7, 50]))
@settings(max_examples=15, deadline=None)
def test_token_budget_is_respected_and_greedy(cuts, budget, max_rows):
    batches = list(token_budget_batches(pieces(cuts), budget, max_rows))
    assert np.array_equal(ids_of(batches), ROWS.sample_id)  # nothing lost, duplicated or reordered
    lengths = ROWS.history_lengths()
    start = 0
    for i, b in enumerate(batches):
        tokens = int(b.history_lengths().sum())
        assert tokens <= budget or b.num_rows == 1  # a row longer than the budget travels alone
        assert max_rows is None or b.num_rows <= max_rows
        end = start + b.num_rows
        if i < len(batches) - 1 and (max_rows is None or b.num_rows < max_rows):
            assert tokens + lengths[end] > budget  # greedy: the next row would not have fit
        start = end
        assert_consistent(b)


@given(st.lists(st.integers(0, 10**6), max_size=6), st.integers(1, 400), st.sampled_from([None, 7, 50]))
@settings(max_examples=15, deadline=None)
def test_token_budget_drop_last_drops_only_a_partial_last_batch(cuts, budget, max_rows):
    every = list(token_budget_batches(pieces(cuts), budget, max_rows))
    kept = list(token_budget_batches(pieces(cuts), budget, max_rows, drop_last=True))
    last = every[-1]
    full = last.history_lengths().sum() >= budget or last.num_rows == max_rows
    assert [b.num_rows for b in kept] == [b.num_rows for b in every][: len(every) - (not full)]
    assert np.array_equal(ids_of(kept), ROWS.sample_id[: sum(b.num_rows for b in kept)])


@pytest.mark.parametrize(("rows", "sizes"), [(1_000, [256] * 3), (3_000, [256] * 11), (255, [])])
def test_base_batch_shuffling_drop_last_gives_full_batches_only(rows, sizes):
    # windows of 4 batches of 4 sub-batches of 64 rows; the last window's short batches had been yielded
    batches = list(base_batch_shuffling([ROWS.slice(0, rows)], 256, 64, window_batches=4, drop_last=True))
    assert [b.num_rows for b in batches] == sizes
    ids = np.sort(np.concatenate([b.sample_id for b in batches] or [np.zeros(0, np.int64)]))
    assert np.array_equal(ids, ROWS.sample_id[: len(ids)])  # only the stream's tail is dropped


def test_oversized_rows_get_their_own_batch():
    budget = int(np.sort(ROWS.history_lengths())[-5]) - 1  # the 5 longest rows exceed it
    batches = list(token_budget_batches([ROWS], budget))
    oversized = [b for b in batches if b.history_lengths().sum() > budget]
    assert len(oversized) == int((ROWS.history_lengths() > budget).sum()) >= 5
    assert all(b.num_rows == 1 for b in oversized)


@pytest.mark.parametrize("cost", ["tokens", "squared"])
def test_base_batch_shuffling_balances_cost_and_keeps_rows(cost):
    batch_size, window = 512, 4
    rows = generate_rows(TINY, 8_192 + 300, seed=12)
    blocks = [rows.slice(0, 1_000), rows.slice(1_000, rows.num_rows)]
    shuffled = list(base_batch_shuffling(blocks, batch_size, 128, window, cost))
    plain = list(fixed_size_batches([rows], batch_size))
    ids = ids_of(shuffled)
    assert np.array_equal(np.sort(ids), rows.sample_id)  # a permutation: no row lost or duplicated
    assert len(shuffled) == len(plain) and all(b.num_rows <= batch_size for b in shuffled)
    assert all(b.num_rows == batch_size for b in shuffled[:-window])  # only the last window holds the tail
    for b in shuffled:
        assert_consistent(b)

    def spread(batches) -> float:
        """Mean over full windows of (max - min) batch cost / mean batch cost."""
        costs = np.array([batch_costs(b, cost) for b in batches[: (len(batches) // window) * window]])
        per_window = costs.reshape(-1, window)
        return float(((per_window.max(1) - per_window.min(1)) / per_window.mean(1)).mean())

    assert spread(shuffled) < 0.5 * spread(plain), (spread(shuffled), spread(plain))


def test_base_batch_shuffling_rejects_bad_sizes():
    with pytest.raises(ValueError, match="multiple of sub_batch_size"):
        list(base_batch_shuffling([ROWS], 200, 128))


def test_shuffled_rows_is_a_seeded_permutation():
    out = ids_of(shuffled_rows(pieces([100, 1000, 2500]), 1_200, np.random.default_rng(0)))
    again = ids_of(shuffled_rows(pieces([100, 1000, 2500]), 1_200, np.random.default_rng(0)))
    assert np.array_equal(out, again) and not np.array_equal(out, ROWS.sample_id)
    assert np.array_equal(np.sort(out), ROWS.sample_id)


def test_take_gathers_jagged_rows():
    order = np.array([5, 0, 2999, 5, 17])
    taken = ROWS.take(order)
    assert_consistent(taken)
    for position, row in enumerate(order):
        a, b = ROWS.history_offsets[row], ROWS.history_offsets[row + 1]
        c, d = taken.history_offsets[position], taken.history_offsets[position + 1]
        assert np.array_equal(taken.history["hist_item"][c:d], ROWS.history["hist_item"][a:b])
        offsets, ids = taken.multi_hot["user_declared_interests"]
        source_offsets, source_ids = ROWS.multi_hot["user_declared_interests"]
        expected = source_ids[source_offsets[row] : source_offsets[row + 1]]
        assert np.array_equal(ids[offsets[position] : offsets[position + 1]], expected)


def test_in_memory_batches_every_mode(tiny_table):
    num_rows = tiny_table.num_rows
    for kwargs in (
        {"batch_size": 500, "shuffle": True},
        {"token_budget": 3_000},
        {"batch_size": 512, "batch_shuffling": True, "shuffle": True, "seed": 3},
    ):
        batches = list(batches_from_table(tiny_table, **kwargs))
        ids = np.concatenate([b.sample_id.numpy() for b in batches])
        assert np.array_equal(np.sort(ids), np.arange(num_rows)), kwargs
    with pytest.raises(ValueError, match="batch_size or token_budget"):
        list(batches_from_table(tiny_table))
    with pytest.raises(ValueError, match="batch_shuffling"):
        list(batches_from_table(tiny_table, token_budget=100, batch_shuffling=True))


def test_in_memory_batches_refuse_an_empty_table(tiny_table):
    # yielded nothing, where an empty file is an error
    with pytest.raises(DataError, match=r"<in-memory table>: empty table \(0 rows\)"):
        list(batches_from_table(tiny_table.slice(0, 0), batch_size=8))
    with pytest.raises(DataError, match=r"<in-memory table>: empty table \(0 rows\)"):
        list(batches_from_table(ROWS.slice(0, 0), batch_size=8, layout=TINY.layout(11)))
