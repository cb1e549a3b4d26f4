"""Sharded embeddings on gloo: every sharding type at group sizes 4 and 2, 2D and fully sharded 2D, errors.

The distributed runs happen once per test session (see ``test_sparse_scenarios.py``); the unsharded
references are computed here. Loss: a sum over output rows, so the ranks' losses add up to the global
batch's and the sharded fused updates must equal the unsharded ones (one update per unique row per step).
"""

from __future__ import annotations

import dataclasses
import fcntl
from pathlib import Path
from typing import Any

import pytest
import test_sparse_scenarios as sc
import torch

from opengem.jagged import KeyedJagged
from opengem.nn.embedding import EmbeddingCollection, EmbeddingOptimizer
from opengem.parallel.sparse import ShardedEmbeddingCollection, shard_embeddings
from opengem.parallel.sparse_plan import SHARDING_TYPES, ShardingPlan, shard_table
from opengem.parallel.testing import run_distributed


@pytest.fixture(scope="session")
def sparse4(shared_dir: Path) -> list[dict[str, Any]]:
    """The one 4-rank session; under xdist the first worker runs it under a lock, the others load it
    (the pattern of ``conftest.run_once``, which a test module cannot import unambiguously)."""
    results = shared_dir / "sparse_world4.pt"
    with open(shared_dir / "sparse_world4.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not results.exists():
            torch.save(run_distributed(sc.session_world4, 4, str(shared_dir / "sparse_dcp")), results)
    return torch.load(results, weights_only=False)


def global_batches() -> list[KeyedJagged]:
    return [sc.batch(step) for step in range(sc.STEPS)]


def check_against_reference(runs: list[dict[str, Any]], edges: tuple[int, ...], optimizer: EmbeddingOptimizer) -> None:
    """Each rank's per-step outputs equal the unsharded outputs of its samples; the final tables are equal."""
    outputs, weights = sc.reference(optimizer, global_batches())
    full = [sc.batch(step) for step in range(sc.STEPS)]
    for rank, run in enumerate(runs):
        start, stop = edges[rank], edges[rank + 1]
        for step in range(sc.STEPS):
            for feature, got in run["outputs"][step].items():
                if feature == "tokens":  # sequence: this rank's ids' rows
                    offsets = full[step]["tokens"].offsets_host
                    expected = outputs[step][feature][int(offsets[start]) : int(offsets[stop])]
                else:
                    expected = outputs[step][feature][start:stop]
                torch.testing.assert_close(got, expected, msg=lambda m: f"rank {rank} step {step} {feature}: {m}")
        for name, table in weights.items():
            torch.testing.assert_close(run["weights"][name], table, msg=lambda m: f"rank {rank} table {name}: {m}")


def group_runs(sparse4: list[dict[str, Any]], size: int, key: str) -> list[list[dict[str, Any]]]:
    """The runs of each sharding group of ``size`` ranks, in group-rank order."""
    if size == 4:
        return [[r["world4"][key] for r in sparse4]]
    return [[sparse4[0]["world2"][key], sparse4[1]["world2"][key]], [sparse4[2]["world2"][key], sparse4[3]["world2"][key]]]


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("sharding", SHARDING_TYPES)
def test_sharding_type_matches_unsharded_lookup_and_training(sparse4, size, sharding):
    for runs in group_runs(sparse4, size, f"{sharding}/adagrad"):
        check_against_reference(runs, sc.bounds(size, uneven=size == 4), sc.ADAGRAD)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("key", ["mixed/adam", "column_wise/adam"])
def test_adam_with_weight_decay_and_column_shards_is_exact(sparse4, size, key):
    # column shards keep the full-row second moment through the row-sum exchange
    for runs in group_runs(sparse4, size, key):
        check_against_reference(runs, sc.bounds(size, uneven=size == 4), sc.ADAM)


def test_table_wise_input_traffic_is_lengths_and_ids_once(sparse4):
    # one forward: every (feature, shard) piece gets B_local lengths (int64) and each id goes to one rank
    pieces = len(sc.ROWS)
    for run in (r["world4"]["table_wise/adagrad"] for r in sparse4):
        local = run["local_batch"]
        assert run["first_forward_bytes"][("sparse_group", "all_to_all_lengths")] == 8 * local.stride * pieces
        assert run["first_forward_bytes"][("sparse_group", "all_to_all_ids")] == 8 * local.values.numel()
        assert run["first_forward_bytes"][("sparse_group", "all_gather_sizes")] == 8 * 4


def test_two_d_with_sync_every_step_equals_one_d_sgd(sparse4):
    # SGD: averaging the replica groups' steps = one step on the global batch with the loss / replicas
    _, weights = sc.reference(EmbeddingOptimizer("sgd", lr=sc.SGD.lr / 2), global_batches())
    for result in sparse4:
        for key in ("sgd_sync1", "sgd_fully"):
            for name, table in weights.items():
                torch.testing.assert_close(result["two_d"][key]["weights"][name], table)


def test_two_d_adagrad_equals_one_d_when_replicas_see_the_same_data(sparse4):
    # each replica group splits the whole global batch over its 2 ranks
    edges = sc.bounds(2, uneven=False)
    for replica in ((0, 2), (1, 3)):
        runs = [sparse4[r]["two_d"]["adagrad_same_data"] for r in replica]
        check_against_reference(runs, edges, sc.ADAGRAD)


def test_fully_sharded_two_d_equals_two_d_synced_every_step(sparse4):
    reference = sparse4[0]["two_d"]["adagrad_sync1"]["weights"]
    _, one_d = sc.reference(sc.ADAGRAD, global_batches())
    for result in sparse4:
        for name, table in result["two_d"]["adagrad_fully"]["weights"].items():
            torch.testing.assert_close(table, reference[name])
            torch.testing.assert_close(result["two_d"]["adagrad_sync1"]["weights"][name], reference[name])
    # the replicas saw different data: averaged Adagrad is not 1D Adagrad (the documented deviation)
    assert not torch.allclose(reference["users"], one_d["users"])


@pytest.mark.parametrize("scenario", ["world4/mixed/adam", "two_d/adagrad_fully"])
def test_distributed_checkpoint_round_trip(sparse4, scenario):
    # DCP save, load into a module initialized from another seed, then one more step on both
    group, key = scenario.split("/", 1)
    for result in sparse4:
        run = result[group][key]
        for name, table in run["weights"].items():
            torch.testing.assert_close(run["resumed_weights"][name], table, rtol=0, atol=0)
        original, resumed = run["next_step"]
        for feature in original:
            torch.testing.assert_close(resumed[feature], original[feature], rtol=0, atol=0)
        for name, table in run["next_weights"][0].items():
            torch.testing.assert_close(run["next_weights"][1][name], table, rtol=0, atol=0)


def test_sync_every_two_steps(sparse4):
    for result in sparse4:
        first, second = result["two_d"]["sync_every_2"]["after"]
        assert not torch.allclose(first[0]["users"], first[1]["users"])  # replicas drift between syncs
        for name in first[0]:
            torch.testing.assert_close(second[0][name], second[1][name])  # and agree after the sync


# --- one process: errors and the group of one -------------------------------------------------------


def test_group_of_one_matches_unsharded(single_process_group):
    plan = ShardingPlan(1, {t.name: shard_table(t, "row_wise", [0]) for t in sc.tables()})
    module = ShardedEmbeddingCollection(sc.tables(), plan, single_process_group, sc.ADAGRAD)
    module.load_full_weights(sc.full_weights())
    outputs = sc.train(module, global_batches())
    expected, weights = sc.reference(sc.ADAGRAD, global_batches())
    for got, want in zip(outputs, expected):
        for feature in got:
            torch.testing.assert_close(got[feature], want[feature])
    for name, table in module.full_weights().items():
        torch.testing.assert_close(table, weights[name])


def test_out_of_range_id_names_the_global_feature_and_id(single_process_group):
    plan = ShardingPlan(1, {t.name: shard_table(t, "row_wise", [0]) for t in sc.tables()})
    module = ShardedEmbeddingCollection(sc.tables(), plan, single_process_group, sc.ADAGRAD)
    good = sc.batch(0)
    values = good.values.clone()
    user_ids = int(good.lengths_per_key()[0])
    values[user_ids] = 9  # first id of "item" (9 rows)
    with pytest.raises(ValueError, match=r"feature 'item': id 9 at position 0 is out of range \[0, 9\)"):
        module(KeyedJagged(good.keys, values, good.lengths))
    values[user_ids] = -1
    with pytest.raises(ValueError, match="feature 'item': id -1"):
        module(KeyedJagged(good.keys, values, good.lengths))


def test_bad_batches_raise(single_process_group):
    plan = ShardingPlan(1, {t.name: shard_table(t, "table_wise", [0]) for t in sc.tables()})
    module = ShardedEmbeddingCollection(sc.tables(), plan, single_process_group, sc.ADAGRAD)
    good = sc.batch(0)
    mismatched = KeyedJagged._trusted(good.keys, good.values[:-1], good.lengths, None)
    with pytest.raises(ValueError, match=r"lengths sum to \d+ but there are \d+ ids"):
        module(mismatched)
    with pytest.raises(ValueError, match=r"missing keys \['tokens'\]"):
        module(KeyedJagged.from_dict({k: v for k, v in good.to_dict().items() if k != "tokens"}))


def test_bad_plans_raise(single_process_group):
    ts = sc.tables()
    with pytest.raises(ValueError, match="plan is for 2 ranks but the sharding group has 1"):
        ShardedEmbeddingCollection(ts, ShardingPlan(2, {t.name: shard_table(t, "table_wise", [0]) for t in ts}), single_process_group)
    with pytest.raises(ValueError, match=r"missing \['tokens'\]"):
        ShardedEmbeddingCollection(ts, ShardingPlan(1, {t.name: shard_table(t, "table_wise", [0]) for t in ts[:2]}), single_process_group)
    with pytest.raises(ValueError, match="fully_sharded needs a replica_group"):
        plan = ShardingPlan(1, {t.name: shard_table(t, "table_wise", [0]) for t in ts})
        ShardedEmbeddingCollection(ts, plan, single_process_group, fully_sharded=True)


def test_shard_embeddings_replaces_collections_in_a_model(single_process_group):
    model = torch.nn.Module()
    model.tower = torch.nn.Module()
    model.tower.embeddings = EmbeddingCollection(sc.tables(), sc.ADAGRAD)
    before = model.tower.embeddings(sc.batch(0))
    plan = ShardingPlan(1, {t.name: shard_table(t, "column_wise", [0]) for t in sc.tables()})
    replaced = shard_embeddings(model, plan, single_process_group)
    assert list(replaced) == ["tower.embeddings"] and model.tower.embeddings is replaced["tower.embeddings"]
    with torch.no_grad():
        after = model.tower.embeddings(sc.batch(0))
    for feature, value in before.items():
        torch.testing.assert_close(sc.as_tensor(after[feature]), sc.as_tensor(value))


def test_mixed_weight_dtypes_exchange_per_dtype(single_process_group):
    tables = [dataclasses.replace(t, dtype=d) for t, d in zip(sc.tables(), (torch.bfloat16, torch.float32, torch.float16))]
    plan = ShardingPlan(1, {t.name: shard_table(t, s, [0]) for t, s in zip(tables, ("column_wise", "table_wise", "replicated"))})
    module = ShardedEmbeddingCollection(tables, plan, single_process_group, sc.SGD)
    reference = EmbeddingCollection(tables, sc.SGD)
    full = {name: w.to(t.dtype) for (name, w), t in zip(sc.full_weights().items(), tables)}
    module.load_full_weights(full)
    with torch.no_grad():
        for name, weight in full.items():
            reference.embedding_weight(name).copy_(weight)
    for got, want in zip(sc.train(module, global_batches()), sc.train(reference, global_batches())):
        for feature in got:
            assert got[feature].dtype == want[feature].dtype
            torch.testing.assert_close(got[feature], want[feature])
    for name, table in module.full_weights().items():
        torch.testing.assert_close(table, reference.embedding_weight(name))


def test_grad_scale_scales_the_shards_gradients(single_process_group):
    plan = ShardingPlan(1, {t.name: shard_table(t, "row_wise", [0]) for t in sc.tables()})
    module = ShardedEmbeddingCollection(sc.tables(), plan, single_process_group, sc.SGD, grad_scale=0.25)
    module.load_full_weights(sc.full_weights())
    sc.train(module, global_batches())
    _, weights = sc.reference(EmbeddingOptimizer("sgd", lr=sc.SGD.lr * 0.25), global_batches())
    for name, table in module.full_weights().items():
        torch.testing.assert_close(table, weights[name])
