import pytest

from opengem.parallel.mesh import (
    ParallelConfig,
    Topology,
    check_whole_hosts,
    device_type_for_backend,
    parse_parallel,
    validate_layout,
)


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
        (ParallelConfig(dense_replicate=3), Topology(4), 4, "dense_shard=-1: dense_replicate=3 does not divide"),
        (ParallelConfig(), Topology(4), 6, "not a whole number of hosts"),
        (ParallelConfig(dense_replicate=3, dense_shard=4), Topology(2, 3), 12, "straddles two zones"),
        (ParallelConfig(dense_replicate=2, dense_shard=12), Topology(2, 4), 24, "multiple of the GPUs per zone"),
    ],
)
def test_impossible_layouts_raise(config, topology, world, message):
    with pytest.raises(ValueError, match=message):
        validate_layout(config, topology, world)


@pytest.mark.parametrize(("fields", "message"), [
    ({"dense_replicate": 0, "dense_shard": 4}, "dense_replicate must be >= 1"),
    ({"expert": 0}, "expert must be >= 1"),
    ({"expert": -1}, r"expert must be >= 1 \(or -1 where allowed\), got -1"),  # -1 fills dense_shard only
    ({"prefetch": -1}, "prefetch must be >= 0"),
    ({"collectives": "fast"}, "collectives must be one of"),
    # were accepted: "false" meant resharding on, a float degree failed inside torch's mesh
    ({"reshard_after_forward": "false"}, "reshard_after_forward must be a bool, got 'false'"),
    ({"activation_checkpointing": 1}, "activation_checkpointing must be a bool, got 1"),
    ({"dense_shard": 2.0}, "dense_shard must be an int, got 2.0"),
    ({"prefetch": True}, "prefetch must be an int, got True"),
])
def test_bad_settings_are_refused_when_made(fields, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**fields)


def test_a_topology_needs_a_gpu_a_host_and_a_host_a_zone():
    with pytest.raises(ValueError, match="gpus_per_host must be >= 1, got 0"):  # divided by zero in clipped()
        Topology(0)
    with pytest.raises(ValueError, match="hosts_per_zone must be >= 1, got -2"):
        Topology(8, -2)


@pytest.mark.parametrize("text", ["dense_shard=1_6", "dense_shard=\uff12", "prefetch=1.5"])
def test_parse_parallel_takes_plain_integers_only(text):
    with pytest.raises(ValueError, match="expected an integer"):  # int() took "1_6" as 16
        parse_parallel(text)


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


def test_whole_hosts_or_part_of_one():
    """A job fits inside one host or fills whole hosts; the planner and validate_layout share this rule."""
    for world_size in (1, 3, 8, 16, 64):
        check_whole_hosts(Topology(8, 4), world_size)
    for world_size in (9, 12, 20):
        with pytest.raises(ValueError, match=f"world size {world_size} is not a whole number of hosts of 8 GPUs"):
            check_whole_hosts(Topology(8, 4), world_size)
