import pytest
import scenarios
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from opengem.parallel.fsdp import FSDPUnit, fsdp_step_bytes, is_sparse, parallelize
from opengem.parallel.mesh import ParallelConfig, build_meshes

# fp32 on CPU: the distributed runs differ from the reference only in summation order.
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


def assert_same_training(result, reference, every_param=True):
    params = reference["params"]
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), **TOLERANCE)
    # the global gradient norm (clip_grad_norm_ across meshes and expert groups), clipped every step
    torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(reference["norms"]), **TOLERANCE)
    assert min(reference["norms"]) > scenarios.MAX_GRAD_NORM
    if every_param:
        assert result["params"].keys() == params.keys()
    for name, value in result["params"].items():
        torch.testing.assert_close(value, params[name], **TOLERANCE, msg=name)


@pytest.mark.parametrize("scenario", ["fsdp4", "hsdp2x2"])
def test_four_ranks_match_single_process(world4, reference, scenario):
    for result in world4:
        assert_same_training(result[scenario], reference)
        assert result[scenario]["table_is_plain"], "the sparse table must not be FSDP-wrapped"


def test_expert_parallel_with_fsdp_matches_single_process(world4, reference_experts):
    # Each rank holds the dense parameters and its own expert; together they hold every parameter.
    for result in world4:
        assert_same_training(result["ep2_fsdp2"], reference_experts, every_param=False)
    held = set().union(*(result["ep2_fsdp2"]["params"] for result in world4))
    assert held == reference_experts["params"].keys()
    assert "blocks.1.experts.experts.1.0.weight" not in world4[0]["ep2_fsdp2"]["params"]


def test_two_ranks_with_checkpointing_and_prefetch_match_single_process(world2, reference):
    for result in world2:
        assert_same_training(result["fsdp2_ac"], reference)


def block_bytes(shards: int) -> int:
    """Padded fp32 bytes of one scenarios.Block without experts: LayerNorm + two Linear layers."""
    pad = lambda rows: -(-rows // shards) * shards  # noqa: E731
    d, h = scenarios.DIM, scenarios.HIDDEN
    return 4 * (2 * pad(d) + pad(h) * d + pad(h) + pad(d) * h + pad(d))


def root_bytes(shards: int) -> int:
    """Padded fp32 bytes of the root's own parameters: in_proj and head (the sparse table is left out)."""
    pad = lambda rows: -(-rows // shards) * shards  # noqa: E731
    d = scenarios.DIM
    return 4 * (pad(d) * scenarios.IN_DIM + pad(d) + pad(scenarios.OUT_DIM) * d + pad(scenarios.OUT_DIM))


@pytest.mark.parametrize(
    ("scenario", "shards", "replicas"), [("fsdp4", 4, 1), ("hsdp2x2", 2, 2)]
)
def test_fsdp_bytes_match_the_collectives_issued(world4, scenario, shards, replicas):
    # 3 blocks, the first 2 resharded after forward (all-gathered again in backward), root not
    # resharded; the frozen head bias is gathered but has no gradient to reduce.
    frozen_bias = 4 * -(-scenarios.OUT_DIM // shards) * shards
    gathered = 5 * block_bytes(shards) + root_bytes(shards)
    reduced = 3 * block_bytes(shards) + root_bytes(shards) - frozen_bias
    expected = {("shard", "all_gather"): gathered, ("shard", "reduce_scatter"): reduced}
    if replicas > 1:
        expected[("replicate", "all_reduce")] = reduced // shards
    for result in world4:
        assert result[scenario]["analytic"] == expected
        assert result[scenario]["measured"] == expected


def test_expert_fsdp_bytes_match_the_collectives_issued(world4):
    for result in world4:
        measured = result["ep2_fsdp2"]["measured"]
        assert measured == result["ep2_fsdp2"]["analytic"]
        assert measured[("expert_shard", "all_gather")] > 0  # the expert unit shards over expert_shard


def test_uneven_batches_with_data_parallel_loss_match_single_process(world2, reference):
    # Rank 0 holds 3 rows, rank 1 holds 5: data_parallel_loss keeps the global mean's gradient.
    for result in world2:
        assert_same_training(result["uneven"], reference)


def test_single_shard_layouts_on_two_ranks(world2, reference, reference_experts):
    # Pure replication (HSDP with one shard) and EP 2 (with activation checkpointing) whose experts have no FSDP shard partner:
    # only the collectives that move data are issued, and the analytic count says so.
    for result in world2:
        assert_same_training(result["replicate_only"], reference)
        assert_same_training(result["ep2_no_shard_ac"], reference_experts, every_param=False)
        assert set(result["replicate_only"]["measured"]) == {("replicate", "all_reduce")}
        for scenario in ("replicate_only", "ep2_no_shard_ac"):
            assert result[scenario]["measured"] == result[scenario]["analytic"]


def test_world_size_one_runs_unchanged(single_process_group, reference):
    meshes = build_meshes(ParallelConfig())
    model = scenarios.make_model()
    units = parallelize(model, meshes, blocks=[scenarios.Block])
    assert [unit.name for unit in units] == ["blocks.0", "blocks.1", "blocks.2", "<root>"]
    assert isinstance(model.blocks[0], FSDPModule) and not isinstance(model.table, FSDPModule)
    opt = scenarios.optimizer(model)
    losses = []
    for step in range(scenarios.STEPS):
        with scenarios.recorded_collectives(meshes) as measured:
            losses.append(scenarios.forward_backward(model, step, 0, 1)[0].item())
        scenarios.clip_and_step(model, opt)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference["losses"]), **TOLERANCE)
    assert dict(measured.bytes) == fsdp_step_bytes(units, param_bytes=4, reduce_bytes=4)


def test_block_selection_by_predicate_and_sparse_types(single_process_group):
    meshes = build_meshes(ParallelConfig(reshard_after_forward=False))
    model = scenarios.make_model()
    model.table.opengem_sparse = False  # rely on sparse_types instead of the attribute
    units = parallelize(
        model, meshes, blocks=lambda name, module: name in ("in_proj", "head"), sparse_types=(scenarios.Table,)
    )
    assert [unit.name for unit in units] == ["in_proj", "head", "<root>"]
    assert all(not unit.reshard_after_forward for unit in units)
    assert type(model.table.weight) is nn.Parameter
    root = units[-1]
    assert {p.shape for p in root.params} == {p.shape for b in model.blocks for p in b.parameters()}
    assert fsdp_step_bytes(units, param_bytes=2, reduce_bytes=4) == {}  # one rank moves nothing


class StubMesh:
    """What fsdp_step_bytes reads from a DeviceMesh."""

    def __init__(self, names, sizes):
        self.mesh_dim_names, self.sizes, self.ndim = names, sizes, len(sizes)

    def size(self, dim):
        return self.sizes[dim]


def test_fsdp_step_bytes_formula():
    weight, bias, frozen = nn.Parameter(torch.zeros(5, 3)), nn.Parameter(torch.zeros(5)), nn.Parameter(torch.zeros(2))
    frozen.requires_grad_(False)
    hsdp = StubMesh(("replicate", "shard"), (2, 4))
    units = [
        FSDPUnit("block", hsdp, (weight, bias), reshard_after_forward=True),
        FSDPUnit("<root>", hsdp, (frozen,), reshard_after_forward=False),
        FSDPUnit("empty", hsdp, (), reshard_after_forward=True),
    ]
    # dim 0 padded to a multiple of 4: weight 8 x 3 = 24, bias 8, frozen 4 elements.
    assert fsdp_step_bytes(units, param_bytes=2, reduce_bytes=4) == {
        ("shard", "all_gather"): 2 * (2 * (24 + 8) + 4),
        ("shard", "reduce_scatter"): 4 * (24 + 8),
        ("replicate", "all_reduce"): 4 * (24 + 8) // 4,
    }


def test_is_sparse():
    assert is_sparse(scenarios.Table(3, 2))
    assert not is_sparse(nn.Linear(2, 2))
    assert is_sparse(nn.Linear(2, 2), sparse_types=(nn.Linear,))
