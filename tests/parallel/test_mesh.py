import pytest

from opengem.parallel.mesh import ParallelConfig, Topology, device_type_for_backend, parse_parallel, validate_layout


def test_parse_parallel_reads_every_kind_of_value():
    config = parse_parallel(" dense_shard=2, expert=2 ,activation_checkpointing=true,prefetch=0,collectives=copy_engine")
    assert config == ParallelConfig(
        dense_shard=2, expert=2, activation_checkpointing=True, prefetch=0, collectives="copy_engine"
    )
    assert parse_parallel("") == ParallelConfig()
    assert parse_parallel("reshard_after_forward=0").reshard_after_forward is False


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("dense_shards=2", "unknown key 'dense_shards'"),
        ("dense_shard", "not of the form key=value"),
        ("dense_shard=", "not of the form key=value"),
        ("expert=two", "expert='two': expected an integer"),
        ("expert=2,expert=2", "'expert' given twice"),
        ("activation_checkpointing=yes", "expected 0, 1, true or false"),
        ("collectives=nvls", "collectives='nvls'"),
    ],
)
def test_parse_parallel_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_parallel(spec)


def test_defaults_fill_the_world():
    config = validate_layout(ParallelConfig(), Topology(8), world_size=4)
    assert (config.dense_replicate, config.dense_shard, config.sparse_group, config.sparse_replicate) == (1, 4, 4, 1)
    single = validate_layout(ParallelConfig(), Topology(gpus_per_host=8, hosts_per_zone=4), world_size=1)
    assert (single.dense_shard, single.sparse_group, single.expert) == (1, 1, 1)


def test_valid_layout_across_hosts_and_zones():
    config = ParallelConfig(dense_replicate=2, dense_shard=16, expert=2, sparse_group=8, sparse_replicate=4)
    assert validate_layout(config, Topology(gpus_per_host=8, hosts_per_zone=2), world_size=32) == config


@pytest.mark.parametrize(
    ("config", "topology", "world", "message"),
    [
        (ParallelConfig(dense_replicate=2, dense_shard=4), Topology(8), 4, r"2 \* 4 = 8 != world size 4"),
        (ParallelConfig(sparse_group=3, sparse_replicate=1), Topology(8), 4, r"sparse_group \* sparse_replicate = 3"),
        (ParallelConfig(dense_shard=4, expert=3), Topology(8), 4, "expert=3 must divide dense_shard=4"),
        (ParallelConfig(dense_shard=8, expert=8), Topology(4, 2), 8, r"expert=8 must divide the GPUs per host \(4\)"),
        (ParallelConfig(sparse_group=2, sparse_replicate=4), Topology(2, 4), 8, "sparse_replicate=4 must divide"),
        (ParallelConfig(dense_replicate=0, dense_shard=4), Topology(4), 4, "dense_replicate must be >= 1"),
        (ParallelConfig(dense_replicate=3), Topology(4), 4, "dense_shard=-1: dense_replicate=3 does not divide"),
        (ParallelConfig(expert=0), Topology(4), 4, "expert must be >= 1"),
        (ParallelConfig(prefetch=-1), Topology(4), 4, "prefetch must be >= 0"),
        (ParallelConfig(), Topology(4), 6, "not a whole number of hosts"),
        (ParallelConfig(dense_replicate=3, dense_shard=4), Topology(2, 3), 12, "straddles two zones"),
        (ParallelConfig(dense_replicate=2, dense_shard=12), Topology(2, 4), 24, "multiple of the GPUs per zone"),
        (ParallelConfig(), Topology(0), 4, "topology degrees must be >= 1"),
    ],
)
def test_impossible_layouts_raise(config, topology, world, message):
    with pytest.raises(ValueError, match=message):
        validate_layout(config, topology, world)


def test_device_type_follows_backend():
    assert device_type_for_backend("gloo") == "cpu"
    assert device_type_for_backend("nccl") == "cuda"
    with pytest.raises(ValueError, match="backend 'mpi' not supported"):
        device_type_for_backend("mpi")


def test_mesh_dimensions_group_the_right_ranks(world4):
    # Layout of scenarios.LAYOUT_4 on 4 ranks of one host: inner dimensions are adjacent ranks.
    expected_by_rank = {
        "dense.replicate": lambda r: [r % 2, r % 2 + 2],
        "dense.shard": lambda r: [r - r % 2, r - r % 2 + 1],
        "expert.replicate": lambda r: [r % 2, r % 2 + 2],
        "expert.expert_shard": lambda r: [r],
        "expert.expert": lambda r: [r - r % 2, r - r % 2 + 1],
        "sparse.sparse_group": lambda r: [r % 2, r % 2 + 2],
        "sparse.sparse_replicate": lambda r: [r - r % 2, r - r % 2 + 1],
    }
    for rank, result in enumerate(world4):
        layout = result["layout"]
        assert layout.pop("device_type") == "cpu"
        assert layout == {key: ranks(rank) for key, ranks in expected_by_rank.items()}


def test_init_distributed_without_torchrun_is_one_rank(monkeypatch):
    import torch.distributed as dist

    from opengem.parallel.mesh import init_distributed
    from opengem.parallel.testing import free_port

    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST"):
        monkeypatch.setenv(key, "")  # so that monkeypatch restores the original state afterwards
        monkeypatch.delenv(key)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    meshes = init_distributed(ParallelConfig(expert=1))
    try:
        assert dist.get_backend() == "gloo" and dist.get_world_size() == 1
        assert meshes.device_type == "cpu" and meshes.expert is None
        assert meshes.dense.mesh_dim_names == ("replicate", "shard")
        assert meshes.sparse.mesh_dim_names == ("sparse_group", "sparse_replicate")
        assert (meshes.config.dense_shard, meshes.config.sparse_group) == (1, 1)
        assert __import__("os").environ["NCCL_NVLS_ENABLE"] == "0"
    finally:
        dist.destroy_process_group()
