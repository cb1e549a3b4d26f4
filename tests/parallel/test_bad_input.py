"""Bad input to the parallel layer's entry points, on a 1-rank gloo group: each case was accepted silently, lost
data, or failed deep before (session 49's audit of opengem.parallel)."""

import pytest
import scenarios
import test_sparse_scenarios as sc
import torch
from torch import nn

from opengem.jagged import KeyedJagged
from opengem.nn.embedding import EmbeddingCollection
from opengem.parallel.checkpoint import ModelOptimizerState, load_distributed, save_distributed
from opengem.parallel.expert import all_gather_along_batch, reduce_scatter_along_batch
from opengem.parallel.fsdp import clip_grad_norm_, data_parallel_loss, parallelize
from opengem.parallel.mesh import ParallelConfig, ParallelMeshes, Topology, build_meshes, validate_layout
from opengem.parallel.sparse import ShardedEmbeddingCollection, shard_embeddings
from opengem.parallel.sparse_plan import Shard, ShardingPlan, TableSharding, plan_sharding, shard_table
from opengem.parallel.testing import run_distributed


def test_save_distributed_refuses_a_folder_that_is_not_a_checkpoint(single_process_group, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="exists and is not a distributed checkpoint"):  # it had been deleted
        save_distributed({"w": torch.zeros(3)}, run)
    assert (run / "metrics.jsonl").read_text() == "{}\n" and not (tmp_path / "run.partial").exists()
    with pytest.raises(ValueError, match="is a file, not a checkpoint directory"):
        save_distributed({"w": torch.zeros(3)}, run / "metrics.jsonl")
    # an empty folder, and a checkpoint (saved again at the same step), are replaced as before
    (tmp_path / "empty").mkdir()
    save_distributed({"w": torch.zeros(3)}, tmp_path / "empty")
    save_distributed({"w": torch.ones(3)}, tmp_path / "empty")
    loaded = {"w": torch.zeros(3)}
    load_distributed(loaded, tmp_path / "empty")
    assert torch.equal(loaded["w"], torch.ones(3))


def test_a_checkpoint_that_does_not_fit_raises_value_error(single_process_group, tmp_path):
    save_distributed({"w": torch.zeros(3)}, tmp_path / "ckpt")
    # DCP raises CheckpointException, a BaseException: `except Exception` (the CLI's too) let it through
    with pytest.raises(ValueError, match=r"does not load into this state \(rank 0\): .*Size mismatch"):
        load_distributed({"w": torch.zeros(4)}, tmp_path / "ckpt")


def test_clip_grad_norm_refuses_a_negative_or_nan_norm(single_process_group):
    model = nn.Linear(2, 2)
    model.weight.grad = torch.full((2, 2), 3.0)
    for bad in (-1.0, float("nan"), True, "1.0"):  # -1 had flipped the gradient's sign, NaN made it NaN, True clipped
        with pytest.raises(ValueError, match=f"max_norm must be a number >= 0, got {bad!r}"):  # to 1, "1.0" failed deep
            clip_grad_norm_(model, bad)
    assert torch.equal(model.weight.grad, torch.full((2, 2), 3.0))


@pytest.mark.parametrize(("loss", "count", "message"), [
    (torch.tensor(2.0), -4, "count must be a whole number of samples >= 0, got -4"),  # had flipped the loss
    (torch.tensor(2.0), 2.5, "count must be a whole number of samples >= 0, got 2.5"),
    (torch.tensor(2.0), float("nan"), "count must be a whole number of samples >= 0, got nan"),
    (torch.tensor(2.0), torch.tensor([1, 2]), r"count must be a scalar, got shape \(2,\)"),
    (torch.tensor([1.0, 2.0, 3.0]), 3, r"loss_sum must be a scalar .*got shape \(3,\)"),  # had returned [3]
    (torch.tensor(0.0), 0, "the global sample count is 0"),  # was a ZeroDivisionError
    (torch.tensor(2.0), True, "count must be a number or a tensor of samples, got True"),  # had counted 1
    (torch.tensor(2.0), "3", "count must be a number or a tensor of samples, got '3'"),  # failed inside torch
])
def test_data_parallel_loss_refuses_bad_counts(single_process_group, loss, count, message):
    with pytest.raises(ValueError, match=message):
        data_parallel_loss(loss, count)


def test_data_parallel_loss_takes_a_count_tensor(single_process_group):
    assert data_parallel_loss(torch.tensor(6.0), torch.tensor(3)).item() == 2.0


def test_expert_parallelism_without_expert_modules_is_refused(single_process_group):
    meshes = build_meshes(ParallelConfig())
    # the layout asks for 2 experts per group; no module of the model matches expert_types
    two_experts = ParallelMeshes(ParallelConfig(expert=2, dense_shard=2), meshes.dense, meshes.dense, meshes.sparse)
    with pytest.raises(ValueError, match=r"config.expert=2 but the model has no module of expert_types=\(\)"):
        parallelize(scenarios.make_model(), two_experts, blocks=[scenarios.Block])


def _sharded(group, **options):
    plan = ShardingPlan(1, {t.name: shard_table(t, "table_wise", [0]) for t in sc.tables()})
    return ShardedEmbeddingCollection(sc.tables(), plan, group, sc.ADAGRAD, **options)


def test_sharded_embeddings_refuse_float_ids_and_bad_options(single_process_group):
    good = sc.batch(0)
    with pytest.raises(ValueError, match="feature ids must be int32 or int64, got torch.float32"):  # were truncated
        _sharded(single_process_group)(KeyedJagged(good.keys, good.values.float() + 0.5, good.lengths))
    for bad in (float("nan"), -1.0, "0.5"):
        with pytest.raises(ValueError, match="grad_scale must be a finite number > 0"):
            _sharded(single_process_group, grad_scale=bad)
    with pytest.raises(ValueError, match="sync_every must be an int >= 1, got 1.5"):
        _sharded(single_process_group, sync_every=1.5)
    module = _sharded(single_process_group)
    weights = sc.full_weights()
    with pytest.raises(ValueError, match=r"missing \[.users.\], unknown \[.user.\]"):  # a bare KeyError before
        module.load_full_weights({("user" if k == "users" else k): v for k, v in weights.items()})


def test_shard_embeddings_checks_the_plan_and_finds_a_collection(single_process_group):
    model = torch.nn.Module()
    model.embeddings = EmbeddingCollection(sc.tables(), sc.ADAGRAD)
    partial = ShardingPlan(1, {t.name: shard_table(t, "table_wise", [0]) for t in sc.tables()[:2]})
    with pytest.raises(ValueError, match=r"plan does not match the tables: missing \['tokens'\]"):  # was a KeyError
        shard_embeddings(model, partial, single_process_group)
    with pytest.raises(ValueError, match="the model has no EmbeddingCollection"):  # returned {} silently
        shard_embeddings(torch.nn.Linear(2, 2), partial, single_process_group)


def test_plan_sharding_refuses_counts_it_cannot_place():
    tables = sc.tables()
    # keyed by feature, not table: every table had cost 0 and the hot one was not split
    with pytest.raises(ValueError, match=r"ids_per_step has keys that are not table names: \['item_id'\]"):
        plan_sharding(tables, 2, 10**6, {"item_id": 1e6})
    with pytest.raises(ValueError, match="ids_per_step must be finite counts >= 0"):
        plan_sharding(tables, 2, 10**6, {tables[0].name: -5.0})
    with pytest.raises(ValueError, match="given more than once"):
        plan_sharding([tables[0], tables[0]], 2, 10**6, {})
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):  # a ZeroDivisionError (topology)
        plan_sharding(tables, 0, 10**6, {}, Topology(8))


def _unlike_tensors_and_negative_sizes() -> tuple[str, str]:
    """Rank 0 passes float32 [2, 6], rank 1 int32 [2, 3, 2] (the same bytes, another layout); then sizes [-1, 3],
    which sum to the 2 rows given."""
    rank = torch.distributed.get_rank()
    x = torch.ones(2, 6) if rank == 0 else torch.ones(2, 3, 2, dtype=torch.int32)
    messages = []
    for call in (lambda: all_gather_along_batch(x, torch.distributed.group.WORLD),
                 lambda: reduce_scatter_along_batch(torch.ones(2, 4), [-1, 3], torch.distributed.group.WORLD)):
        try:
            call()
            messages.append("accepted")
        except ValueError as error:
            messages.append(str(error))
    return messages[0], messages[1]


def test_unlike_tensors_and_negative_sizes_in_the_expert_collectives_raise_on_every_rank():
    # the fixed-size all-gather had reinterpreted the bytes (float32 ones arrived as 1.4e-45); [-1, 3] had failed
    # inside torch's split
    (first, negative), (second, _) = run_distributed(_unlike_tensors_and_negative_sizes, 2)
    assert first.startswith("rank 1 of the group passes a tensor of another trailing shape or dtype than rank 0's "
                            "[*, 6] torch.float32"), first
    assert second.startswith("rank 0 of the group passes a tensor of another trailing shape or dtype than rank 1's "
                             "[*, 3, 2] torch.int32"), second
    assert negative == "sizes must be ints >= 0, got [-1, 3]"


# --- session 70's audit: ints, bools and plans checked when made -------------------------------------------------


def test_topologies_world_sizes_and_plans_take_ints():
    for bad in (2.0, True, 1.5):  # 2.0 and True had been accepted; 1.5 failed as 'expert=1 must divide ...'
        with pytest.raises(ValueError, match=f"Topology: gpus_per_host must be an int, got {bad!r}"):
            Topology(bad)
    with pytest.raises(ValueError, match=r"world_size must be an int >= 1, got 4\.0"):  # had passed as 4 ranks
        validate_layout(ParallelConfig(dense_replicate=2, dense_shard=2, sparse_group=4), Topology(4), 4.0)
    for bad in (0, 2.5, True):  # had made a plan
        with pytest.raises(ValueError, match=f"ShardingPlan: world_size must be an int >= 1, got {bad!r}"):
            ShardingPlan(bad, {})


def test_plan_validate_refuses_shards_that_only_compare_equal():
    table = sc.tables()[0]
    rows, dim = table.num_embeddings, table.embedding_dim
    for shard in (Shard(True, 0, rows, 0, dim), Shard(0, 0.0, float(rows), 0, dim)):  # equal to shard_table's ints
        with pytest.raises(ValueError, match=f"table '{table.name}': shard fields must be ints"):
            ShardingPlan(2, {table.name: TableSharding("table_wise", (shard,))}).validate([table])
    with pytest.raises(ValueError, match=f"table '{table.name}': expected a TableSharding"):  # an AttributeError
        ShardingPlan(2, {table.name: "table_wise"}).validate([table])
    with pytest.raises(ValueError, match=r"ranks must be ints >= 0, got \[1\.0\]"):
        shard_table(table, "table_wise", [1.0])


def test_plan_sharding_refuses_bad_sizes_budgets_and_counts():
    tables = sc.tables()
    with pytest.raises(ValueError, match=r"world_size must be an int >= 1, got 2\.0"):  # a TypeError inside
        plan_sharding(tables, 2.0, 10**6, {})
    for bad in (float("nan"), "1000000", 0):  # NaN had read as 'does not fit', the str failed inside a comparison
        with pytest.raises(ValueError, match="memory_budget must be a number of bytes > 0"):
            plan_sharding(tables, 2, bad, {})
    for bad in ("5", True):
        with pytest.raises(ValueError, match="ids_per_step must be finite counts >= 0"):
            plan_sharding(tables, 2, 10**6, {tables[0].name: bad})
    with pytest.raises(ValueError, match="world_size 12 is not a whole number of hosts of 8 ranks"):
        plan_sharding(tables, 12, 10**6, {}, Topology(8))


def test_sharded_embeddings_refuse_non_bool_modes_float_seeds_and_bad_weights(single_process_group):
    for bad in ("false", 0):  # "false" had meant true
        with pytest.raises(ValueError, match=f"fully_sharded must be a bool, got {bad!r}"):
            _sharded(single_process_group, fully_sharded=bad)
    for bad in (1.5, True):  # 1.5 failed inside manual_seed
        with pytest.raises(ValueError, match=f"seed must be an int, got {bad!r}"):
            _sharded(single_process_group, seed=bad)
    module = _sharded(single_process_group)
    weights = sc.full_weights()
    name = sc.tables()[0].name
    with pytest.raises(ValueError, match=f"table '{name}': weights must be a floating-point tensor, got torch.int64"):
        module.load_full_weights({**weights, name: weights[name].long()})  # had been cast
    with pytest.raises(ValueError, match=f"table '{name}': weights must be a floating-point tensor, got list"):
        module.load_full_weights({**weights, name: weights[name].tolist()})  # an AttributeError


def test_expert_collectives_refuse_sizes_that_are_not_ints(single_process_group):
    with pytest.raises(ValueError, match=r"sizes must be ints >= 0, got \[2\.0\]"):  # a TypeError inside torch
        all_gather_along_batch(torch.ones(2, 3), single_process_group, [2.0])
    with pytest.raises(ValueError, match=r"sizes must be ints >= 0, got \[True\]"):
        reduce_scatter_along_batch(torch.ones(1, 3), [True], single_process_group)


def test_model_optimizer_state_refuses_a_str_or_unknown_exclude(single_process_group):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match="exclude must be a tuple of module paths, got '0'"):  # had been split
        ModelOptimizerState(model, exclude="0")
    with pytest.raises(ValueError, match=r"exclude \['2'\] names no entry of the model's state"):  # excluded nothing
        ModelOptimizerState(model, exclude=("2",)).state_dict()
    assert list(ModelOptimizerState(model, exclude=("0",)).state_dict()["model"]) == ["1.weight", "1.bias"]
