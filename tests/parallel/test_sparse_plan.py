import pytest
import torch

from opengem.nn.embedding import EmbeddingOptimizer, EmbeddingTableConfig
from opengem.parallel.mesh import Topology
from opengem.parallel.sparse_plan import Shard, ShardingPlan, TableSharding, plan_sharding, shard_bytes, shard_table


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
