"""The 5D device mesh: which rank holds which slice of the dense and the sparse parameters.

Five degrees describe a layout (GEM_SPEC section 7):

- dense side: ``dense_replicate`` x ``dense_shard`` ranks. FSDP shards dense parameters over the
  ``shard`` dimension (all-gather params, reduce-scatter grads; hosts in a zone) and replicates the
  shards over ``replicate`` (all-reduce of the sharded grads; across zones). ``expert`` is a
  sub-dimension of ``shard``: ``shard = expert_shard x expert`` with the expert ranks adjacent, so
  that an expert-parallel group (all-gather activations, reduce-scatter outputs) stays inside a host.
- sparse side: ``sparse_group`` x ``sparse_replicate`` ranks. Tables are sharded over the ranks of a
  group (all-to-all, across hosts); the replicas of one shard are adjacent ranks (inside a host).

Ranks are numbered host by host (torchrun's default), so "adjacent ranks" means "same host". Every
mesh below is a row-major reshape of ``range(world_size)``: the last dimension varies fastest.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from opengem.validation import is_int, require_at_least

FILL = -1
"""A degree of ``-1`` (allowed for ``dense_shard`` and ``sparse_group``) means "the rest of the world"."""

DEVICE_TYPE_BY_BACKEND = {"gloo": "cpu", "nccl": "cuda"}
DEGREE_NAMES = ("dense_replicate", "dense_shard", "expert", "sparse_group", "sparse_replicate")
FILLABLE_NAMES = ("dense_shard", "sparse_group")
BOOL_NAMES = ("reshard_after_forward", "activation_checkpointing")
COLLECTIVES_CHOICES = ("default", "copy_engine")


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel degrees and FSDP options; see the module docstring for the layout.

    dense_replicate * dense_shard == world size == sparse_group * sparse_replicate; ``expert`` divides
    ``dense_shard``. ``reshard_after_forward`` frees gathered parameters after each block's forward
    (re-gathered in backward: less memory, one more all-gather). ``prefetch`` is how many blocks ahead
    FSDP all-gathers (0 disables explicit prefetching). ``activation_checkpointing`` recomputes each
    block's activations in backward. ``collectives`` is ``"default"`` or ``"copy_engine"`` (see
    ``opengem.parallel.collectives``). The defaults (``dense_shard`` and ``sparse_group`` = -1, "the
    rest") give plain FSDP over all ranks and sparse tables sharded over all ranks at any world size.
    """

    dense_replicate: int = 1
    dense_shard: int = FILL
    expert: int = 1
    sparse_group: int = FILL
    sparse_replicate: int = 1
    reshard_after_forward: bool = True
    prefetch: int = 1
    activation_checkpointing: bool = False
    collectives: str = "default"

    def __post_init__(self) -> None:
        """Types and ranges when made (``"false"`` had meant true, a float degree failed inside torch's mesh)."""
        for name in (*DEGREE_NAMES, "prefetch"):
            value = getattr(self, name)
            if not is_int(value):
                raise ValueError(f"ParallelConfig: {name} must be an int, got {value!r}")
        for name in BOOL_NAMES:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ParallelConfig: {name} must be a bool, got {getattr(self, name)!r}")
        for name in DEGREE_NAMES:
            value = getattr(self, name)
            if value < 1 and not (value == FILL and name in FILLABLE_NAMES):
                raise ValueError(f"{name} must be >= 1 (or -1 where allowed), got {value}")
        require_at_least(self, ("prefetch",), 0)
        if self.collectives not in COLLECTIVES_CHOICES:
            raise ValueError(f"collectives must be one of {COLLECTIVES_CHOICES}, got {self.collectives!r}")

    def resolved(self, world_size: int) -> ParallelConfig:
        """Replace a ``-1`` in ``dense_shard`` / ``sparse_group`` by what makes the product ``world_size``."""
        changes = {}
        for fill_name, other_name in (("dense_shard", "dense_replicate"), ("sparse_group", "sparse_replicate")):
            if getattr(self, fill_name) == FILL:
                other = getattr(self, other_name)
                if other < 1 or world_size % other:
                    raise ValueError(
                        f"{fill_name}=-1: {other_name}={other} does not divide the world size {world_size}"
                    )
                changes[fill_name] = world_size // other
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Topology:
    """The machine: ``gpus_per_host`` ranks share a host (NVLink), ``hosts_per_zone`` hosts a zone."""

    gpus_per_host: int
    hosts_per_zone: int = 1

    def __post_init__(self) -> None:
        # 2.0 and True had passed; 1.5 failed later as "expert=1 must divide the GPUs per host (1.5)"
        for name in ("gpus_per_host", "hosts_per_zone"):
            if not is_int(getattr(self, name)):
                raise ValueError(f"Topology: {name} must be an int, got {getattr(self, name)!r}")
        require_at_least(self, ("gpus_per_host", "hosts_per_zone"), 1)  # 0 had divided by zero in clipped()

    def clipped(self, world_size: int) -> Topology:
        """The topology seen by a job of ``world_size`` ranks (a 1-rank job on an 8-GPU host has 1 GPU per host)."""
        gpus = min(self.gpus_per_host, world_size)
        hosts = max(1, min(self.hosts_per_zone, world_size // gpus))
        return Topology(gpus, hosts)


def parse_parallel(spec: str) -> ParallelConfig:
    """Parse ``--parallel`` text such as ``"dense_shard=2,expert=2"`` (empty text: all defaults).

    Keys are the ``ParallelConfig`` fields; degrees and ``prefetch`` are integers, the booleans take
    ``0/1/true/false``, ``collectives`` takes ``default`` or ``copy_engine``.
    """
    fields = {f.name: f for f in dataclasses.fields(ParallelConfig)}
    values: dict[str, object] = {}
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        key, sep, text = (s.strip() for s in item.partition("="))
        if not sep or not text:
            raise ValueError(f"--parallel: {item!r} is not of the form key=value")
        if key not in fields:
            raise ValueError(f"--parallel: unknown key {key!r}; valid keys: {', '.join(fields)}")
        if key in values:
            raise ValueError(f"--parallel: {key!r} given twice")
        values[key] = _parse_value(key, text)
    return ParallelConfig(**values)


def _parse_value(key: str, text: str) -> object:
    if key in BOOL_NAMES:
        lowered = text.lower()
        if lowered not in ("0", "1", "true", "false"):
            raise ValueError(f"--parallel: {key}={text!r}: expected 0, 1, true or false")
        return lowered in ("1", "true")
    if key == "collectives":
        if text not in COLLECTIVES_CHOICES:
            raise ValueError(f"--parallel: collectives={text!r}: expected one of {', '.join(COLLECTIVES_CHOICES)}")
        return text
    if not re.fullmatch(r"[+-]?[0-9]+", text):  # int() also takes "1_6" (16) and non-ASCII digits
        raise ValueError(f"--parallel: {key}={text!r}: expected an integer")
    return int(text)


def check_whole_hosts(topology: Topology, world_size: int) -> None:
    """``ValueError`` unless ``world_size`` ranks fit in one host of ``topology`` or fill whole hosts (every layout
    needs that; the planner refuses such a GPU count before searching)."""
    if world_size % topology.clipped(world_size).gpus_per_host:
        raise ValueError(f"world size {world_size} is not a whole number of hosts of {topology.gpus_per_host} GPUs")


def validate_layout(config: ParallelConfig, topology: Topology, world_size: int) -> ParallelConfig:
    """Check that ``config`` fits ``world_size`` ranks on ``topology``; return it with ``-1`` degrees resolved.

    Raises ``ValueError`` naming the degree and the rule it breaks.
    """
    if not is_int(world_size) or world_size < 1:  # 4.0 and True had been accepted as 4 and 1 ranks
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    config = config.resolved(world_size)  # ParallelConfig checked each degree's range when made
    dense = config.dense_replicate * config.dense_shard
    if dense != world_size:
        raise ValueError(
            f"dense_replicate * dense_shard = {config.dense_replicate} * {config.dense_shard} = {dense} "
            f"!= world size {world_size}"
        )
    sparse = config.sparse_group * config.sparse_replicate
    if sparse != world_size:
        raise ValueError(
            f"sparse_group * sparse_replicate = {config.sparse_group} * {config.sparse_replicate} = {sparse} "
            f"!= world size {world_size}"
        )
    if config.dense_shard % config.expert:
        raise ValueError(f"expert={config.expert} must divide dense_shard={config.dense_shard} (EP is a sub-dimension of the FSDP shard)")
    check_whole_hosts(topology, world_size)
    local = topology.clipped(world_size)
    if local.gpus_per_host % config.expert:
        raise ValueError(
            f"expert={config.expert} must divide the GPUs per host ({local.gpus_per_host}): an expert group stays inside a host"
        )
    if local.gpus_per_host % config.sparse_replicate:
        raise ValueError(
            f"sparse_replicate={config.sparse_replicate} must divide the GPUs per host ({local.gpus_per_host}): "
            "the replicas of a sparse shard stay inside a host"
        )
    zone = local.gpus_per_host * local.hosts_per_zone
    if config.dense_shard <= zone and zone % config.dense_shard:
        raise ValueError(
            f"dense_shard={config.dense_shard} must divide the GPUs per zone ({zone}) so that no shard group straddles two zones"
        )
    if config.dense_shard > zone and config.dense_shard % zone:
        raise ValueError(f"dense_shard={config.dense_shard} spans zones and must then be a multiple of the GPUs per zone ({zone})")
    return config


@dataclass(frozen=True)
class ParallelMeshes:
    """The named meshes of one rank.

    ``dense``: (``replicate``, ``shard``), FSDP/HSDP of the dense parameters.
    ``expert``: (``replicate``, ``expert_shard``, ``expert``) or ``None`` when ``expert == 1``; the
    ``expert`` dimension is the EP group, ``mesh["replicate", "expert_shard"]`` the ranks holding the
    same expert (over which its parameters are FSDP-sharded).
    ``sparse``: (``sparse_group``, ``sparse_replicate``).
    """

    config: ParallelConfig
    dense: DeviceMesh
    expert: DeviceMesh | None
    sparse: DeviceMesh

    @property
    def device_type(self) -> str:
        return self.dense.device_type


def device_type_for_backend(backend: str) -> str:
    """``"cpu"`` for gloo, ``"cuda"`` for NCCL."""
    if backend not in DEVICE_TYPE_BY_BACKEND:
        raise ValueError(f"backend {backend!r} not supported; expected one of {sorted(DEVICE_TYPE_BY_BACKEND)}")
    return DEVICE_TYPE_BY_BACKEND[backend]


def build_meshes(config: ParallelConfig, topology: Topology | None = None) -> ParallelMeshes:
    """Build the meshes of ``config`` on the initialized default process group (all ranks call this).

    ``topology`` defaults to one host holding every rank. The device type follows the backend.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_meshes needs torch.distributed initialized (torchrun / init_process_group)")
    world_size = dist.get_world_size()
    topology = topology or Topology(gpus_per_host=world_size)
    config = validate_layout(config, topology, world_size)
    device_type = device_type_for_backend(dist.get_backend())
    dense = init_device_mesh(
        device_type, (config.dense_replicate, config.dense_shard), mesh_dim_names=("replicate", "shard")
    )
    expert = None
    if config.expert > 1:
        expert = init_device_mesh(
            device_type,
            (config.dense_replicate, config.dense_shard // config.expert, config.expert),
            mesh_dim_names=("replicate", "expert_shard", "expert"),
        )
    sparse = init_device_mesh(
        device_type, (config.sparse_group, config.sparse_replicate), mesh_dim_names=("sparse_group", "sparse_replicate")
    )
    return ParallelMeshes(config=config, dense=dense, expert=expert, sparse=sparse)


def init_distributed(
    config: ParallelConfig, topology: Topology | None = None, backend: str | None = None
) -> ParallelMeshes:
    """Initialize torch.distributed from torchrun's environment and build the meshes (every rank calls this).

    ``backend`` defaults to NCCL with one GPU per rank (``LOCAL_RANK``) when CUDA is available, gloo
    otherwise (pass ``"gloo"`` to keep a CPU run on CPU on a GPU machine). The
    collective environment (``opengem.parallel.collectives.setup_environment``: multicast off, the
    zero-CTA policy when ``config.collectives == "copy_engine"`` allows it) is set before the
    communicators are created. Without torchrun's variables this is a 1-rank job. ``topology``
    defaults to hosts of ``LOCAL_WORLD_SIZE`` ranks (torchrun) and one host per zone.
    """
    from opengem.parallel.collectives import probe_capabilities, setup_environment

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    setup_environment(config.collectives, probe_capabilities(backend))
    if not dist.is_initialized():
        _check_launch_environment()
        for key, default in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
            os.environ.setdefault(key, default)
        device_id = None
        if backend == "nccl":
            device_id = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device_id)
        dist.init_process_group(backend, device_id=device_id)
    if topology is None:  # torchrun's LOCAL_WORLD_SIZE: the ranks of one host
        topology = Topology(gpus_per_host=_environment_int("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return build_meshes(config, topology)


def _environment_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"environment variable {name}={text!r} must be an integer") from None


def _check_launch_environment() -> None:
    """torchrun sets RANK and WORLD_SIZE together: one alone (left over from another tool) made a world whose
    ranks wait for each other until the store's 30 min timeout."""
    given = [name for name in ("RANK", "WORLD_SIZE") if name in os.environ]
    if len(given) == 1:
        other = "WORLD_SIZE" if given == ["RANK"] else "RANK"
        raise ValueError(f"{given[0]}={os.environ[given[0]]} is set but {other} is not: launch with torchrun, or unset "
                         f"{given[0]} for a 1-rank job")
    if given:
        rank, world = _environment_int("RANK", 0), _environment_int("WORLD_SIZE", 1)
        if not 0 <= rank < world:
            raise ValueError(f"RANK={rank} must be in [0, WORLD_SIZE={world})")
