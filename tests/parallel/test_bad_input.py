"""Bad input to the parallel layer's entry points, on a 1-rank gloo group: each case was accepted silently, lost
data, or failed deep before (session 49's audit of opengem.parallel)."""

import pytest
import scenarios
import test_sparse_scenarios as sc
import torch
from torch import nn

from opengem.jagged import KeyedJagged
from opengem.nn.embedding import EmbeddingCollection
from opengem.parallel.checkpoint import load_distributed, save_distributed
from opengem.parallel.expert import all_gather_along_batch, reduce_scatter_along_batch
from opengem.parallel.fsdp import clip_grad_norm_, data_parallel_loss, parallelize
from opengem.parallel.mesh import ParallelConfig, ParallelMeshes, Topology, build_meshes
from opengem.parallel.sparse import ShardedEmbeddingCollection, shard_embeddings
from opengem.parallel.sparse_plan import ShardingPlan, plan_sharding, shard_table
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
    for bad in (-1.0, float("nan")):  # -1 had flipped the gradient's sign, NaN made it NaN
        with pytest.raises(ValueError, match=f"max_norm must be >= 0, got {bad}"):
            clip_grad_norm_(model, bad)
    assert torch.equal(model.weight.grad, torch.full((2, 2), 3.0))


@pytest.mark.parametrize(("loss", "count", "message"), [
    (torch.tensor(2.0), -4, "count must be a whole number of samples >= 0, got -4"),  # had flipped the loss
    (torch.tensor(2.0), 2.5, "count must be a whole number of samples >= 0, got 2.5"),
    (torch.tensor(2.0), float("nan"), "count must be a whole number of samples >= 0, got nan"),
    (torch.tensor(2.0), torch.tensor([1, 2]), r"count must be a scalar, got shape \(2,\)"),
    (torch.tensor([1.0, 2.0, 3.0]), 3, r"loss_sum must be a scalar .*got shape \(3,\)"),  # had returned [3]
    (torch.tensor(0.0), 0, "the global sample count is 0"),  # was a ZeroDivisionError
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
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):  # a ZeroDivisionError with a topology
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
    assert negative == "sizes must be >= 0, got [-1, 3]"
