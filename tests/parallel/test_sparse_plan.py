import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opengem.nn.embedding import EmbeddingOptimizer, EmbeddingTableConfig
from opengem.parallel.mesh import Topology
from opengem.parallel.sparse_plan import Shard, ShardingPlan, TableSharding, plan_sharding, shard_bytes, shard_table
from opengem.parallel.sparse_plan import _by_load, _fewest_ranks, _hosts_by_load, _Load


def table(name: str, rows: int, dim: int, dtype: torch.dtype = torch.float32) -> EmbeddingTableConfig:
    return EmbeddingTableConfig(name, rows, dim, (f"{name}_feature",), dtype=dtype)


def test_shard_table_splits_evenly():
    t = table("t", 10, 8)
    assert shard_table(t, "row_wise", [1, 3, 2]).shards == (
        Shard(1, 0, 3, 0, 8),
        Shard(3, 3, 6, 0, 8),
        Shard(2, 6, 10, 0, 8),
    )
    assert shard_table(t, "column_wise", [0, 1]).shards == (Shard(0, 0, 10, 0, 4), Shard(1, 0, 10, 4, 8))
    assert shard_table(t, "replicated", [0, 1]).shards == (Shard(0, 0, 10, 0, 8), Shard(1, 0, 10, 0, 8))
    assert shard_table(t, "table_wise", [2]).shards == (Shard(2, 0, 10, 0, 8),)


def test_bytes_count_weights_and_optimizer_state():
    shard = Shard(0, 0, 100, 0, 16)
    assert shard_bytes(table("f", 100, 16), shard, EmbeddingOptimizer("rowwise_adagrad")) == 100 * (16 * 4 + 4)
    assert shard_bytes(table("h", 100, 16, torch.bfloat16), shard, EmbeddingOptimizer("sgd")) == 100 * 16 * 2
    assert shard_bytes(table("a", 100, 16), shard, EmbeddingOptimizer("rowwise_adam")) == 100 * (16 * 4 + 4 + 16 * 4)


def test_equal_tables_go_table_wise_one_per_rank():
    tables = [table(f"t{i}", 100, 16) for i in range(4)]
    plan = plan_sharding(tables, 4, memory_budget=10**6, ids_per_step={t.name: 100.0 for t in tables})
    assert {s.sharding for s in plan.tables.values()} == {"table_wise"}
    assert sorted(s.ranks[0] for s in plan.tables.values()) == [0, 1, 2, 3]
    assert plan.rank_cost(tables, {t.name: 100.0 for t in tables}) == [1600.0] * 4


@pytest.mark.parametrize("gpus_per_host, expected", [(2, "row_wise"), (4, "table_row_wise")])
def test_table_over_budget_is_planned_row_wise_within_budget(gpus_per_host, expected):
    big = table("big", 1000, 64)  # 260,000 bytes with the Adagrad state: needs 3 ranks of 100 kB
    small = [table(f"s{i}", 50, 16) for i in range(3)]
    tables = [big, *small]
    ids = {"big": 50.0, **{t.name: 10.0 for t in small}}
    budget = 100_000
    plan = plan_sharding(tables, 4, memory_budget=budget, ids_per_step=ids, topology=Topology(gpus_per_host))
    assert plan.tables["big"].sharding == expected
    assert len(plan.tables["big"].shards) == 3
    per_rank = plan.rank_bytes(tables, EmbeddingOptimizer())
    assert max(per_rank) <= budget
    assert sum(per_rank) == sum(shard_bytes(t, s, EmbeddingOptimizer()) for t in tables for s in plan.tables[t.name].shards)
    plan.validate(tables)


def test_hot_table_is_split_column_wise():
    hot, cold = table("hot", 100, 64), [table(f"c{i}", 100, 8) for i in range(3)]
    ids = {"hot": 1000.0, **{t.name: 10.0 for t in cold}}
    plan = plan_sharding([hot, *cold], 4, memory_budget=10**6, ids_per_step=ids)
    assert plan.tables["hot"].sharding == "column_wise"
    costs = plan.rank_cost([hot, *cold], ids)
    assert max(costs) < 1000.0 * 64  # no rank carries the hot table alone


def test_infeasible_plan_raises():
    with pytest.raises(ValueError, match="table 'huge' .* does not fit"):
        plan_sharding([table("huge", 10_000, 64)], 2, memory_budget=100_000, ids_per_step={"huge": 1.0})


def test_explain_lists_table_shards_ranks_bytes_and_ids():
    t = table("items", 10, 4)
    plan = ShardingPlan(2, {"items": shard_table(t, "row_wise", [0, 1])})
    assert plan.explain([t], EmbeddingOptimizer(), {"items": 100.0}) == "\n".join(
        [
            "table items: 10 x 4 float32, row_wise, 100 ids/step",
            "  rows [0, 5) cols [0, 4) -> rank 0: 100 B, 50 ids/step",
            "  rows [5, 10) cols [0, 4) -> rank 1: 100 B, 50 ids/step",
            "rank 0: 100 B, cost 200 id-elements/step",
            "rank 1: 100 B, cost 200 id-elements/step",
        ]
    )


def test_bad_shardings_raise():
    t = table("t", 10, 4)
    with pytest.raises(ValueError, match="table_wise takes exactly one rank"):
        shard_table(t, "table_wise", [0, 1])
    with pytest.raises(ValueError, match="distinct and non-empty"):
        shard_table(t, "row_wise", [0, 0])
    with pytest.raises(ValueError, match="5 column shards for dim 4"):
        shard_table(t, "column_wise", range(5))
    with pytest.raises(ValueError, match="sharding must be one of"):
        shard_table(t, "diagonal", [0])  # type: ignore[arg-type]
    uneven = TableSharding("row_wise", (Shard(0, 0, 2, 0, 4), Shard(1, 2, 10, 0, 4)))
    with pytest.raises(ValueError, match="do not split it evenly row_wise"):
        ShardingPlan(2, {"t": uneven}).validate([t])
    with pytest.raises(ValueError, match=r"must be distinct and in \[0, 2\)"):
        ShardingPlan(2, {"t": shard_table(t, "table_wise", [2])}).validate([t])


# ---------------------------------------------------------------- the planner's scale (session 53)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.data())
def test_lazy_load_orders_are_the_stable_sorts_of_every_rank_and_host(world_size, data):
    load = _Load(world_size, 100)
    for rank in data.draw(st.lists(st.integers(0, world_size - 1), max_size=60)):
        # 0 bytes and cost 0: placed, yet its key unchanged
        load.place(rank, data.draw(st.integers(0, 3)), data.draw(st.sampled_from([0.0, 0.5, 1.0, 2.0])))
    want = sorted(range(world_size), key=lambda r: (load.cost[r], -load.free[r]))
    assert list(_by_load(load)) == want
    assert load.most_free() == max(load.free)
    for gpus_per_host in (1, 2, 4):
        if world_size % gpus_per_host == 0:
            hosts = sorted(range(0, world_size, gpus_per_host), key=lambda h: sum(load.cost[h:h + gpus_per_host]))
            idle = [h for h in hosts if not load.changed & set(range(h, h + gpus_per_host))]
            kept = [h for h in hosts if h not in idle[1:]]  # of the hosts nothing was placed on, the first
            assert _hosts_by_load(load, gpus_per_host) == kept


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=12), st.integers(12, 60))
def test_fewest_ranks_skips_only_rank_sets_too_small_for_the_table(free, rows):  # (rows >= ranks: a row each)
    t = table("t", rows, 1)  # 4 bytes a row, no optimizer state
    fits = lambda sharding, tbl: all(shard_bytes(tbl, s, None) <= free[s.rank] for s in sharding.shards)  # noqa: E731
    by_load = list(range(len(free)))
    brute = next((c for parts in range(2, len(free) + 1)
                  if fits(c := shard_table(t, "row_wise", by_load[:parts]), t)), None)
    assert _fewest_ranks(t, "row_wise", by_load, 4 * rows, free, fits) == brute


def test_most_loaded_rank_without_a_list_of_every_rank():
    tables = [table("a", 100, 16), table("b", 10, 8)]
    plan = ShardingPlan(6, {"a": shard_table(tables[0], "row_wise", [0, 2]),
                            "b": shard_table(tables[1], "table_wise", [2])})
    ids = {"a": 10.0, "b": 3.0}
    assert plan.max_rank_bytes(tables, None) == max(plan.rank_bytes(tables, None)) == 50 * 64 + 10 * 32
    assert plan.max_rank_cost(tables, ids) == max(plan.rank_cost(tables, ids)) == 5.0 * 16 + 3.0 * 8
    assert plan.rank_bytes(tables, None)[1] == 0 and plan.rank_cost(tables, ids)[5] == 0.0


def test_a_million_rank_group_is_planned_on_its_least_loaded_ranks():
    tables = [table(f"t{i}", 1000, 16) for i in range(6)] + [table("huge", 10**6, 16)]
    ids = {t.name: 10.0 * (i + 1) for i, t in enumerate(tables)}
    plan = plan_sharding(tables, 2**20, memory_budget=2 * 10**6, ids_per_step=ids, topology=Topology(8))
    plan.validate(tables)
    # 68 bytes a row (row-wise Adagrad's state included): 68 MB takes 35 ranks of 2 MB in an even row split
    assert plan.tables["huge"].sharding == "row_wise" and len(plan.tables["huge"].shards) == 35
    placed = sorted(r for s in plan.tables.values() for r in s.ranks)
    assert placed == list(range(len(placed)))  # each table on the next least loaded (untouched) ranks


def test_a_table_no_split_can_hold_is_named_with_the_room_there_is():
    most_free = r"table 'big' \(680 B\) does not fit: the most free of the 128 ranks has 4 bytes"
    with pytest.raises(ValueError, match=most_free):
        plan_sharding([table("big", 10, 16)], 128, memory_budget=4, ids_per_step={"big": 1.0})
    with pytest.raises(ValueError, match=r"does not fit: free bytes per rank \[4, 4\]"):
        plan_sharding([table("big", 10, 16)], 2, memory_budget=4, ids_per_step={"big": 1.0})
    with pytest.raises(ValueError, match=r"table 'row' \(68 B\) does not fit: free bytes per rank \[40, 40, 40\]"):
        plan_sharding([table("row", 1, 16)], 3, memory_budget=40, ids_per_step={"row": 1.0})  # one row, not split
