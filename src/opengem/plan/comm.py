"""Bytes each collective moves per step (the trainer's ``CommStats`` convention) and their time per tier.

Bytes (per rank and step; keys ``(mesh dim, collective)`` as in ``comm/<dim>/<collective>_bytes``):

- FSDP: ``opengem.parallel.fsdp.fsdp_step_bytes`` itself, on the units ``parallelize`` would build
  (computed from meta parameters, no process group: ``AbstractMesh`` stands in for the device mesh).
- Expert parallelism: per dense-experts layer, forward all-gathers the group's inputs and
  reduce-scatters the outputs (padded to the largest rank batch), backward mirrors both; one
  ``all_gather_sizes`` per forward. Recomputed forwards (activation checkpointing) repeat the forward's.
- Sparse exchange: ``all_gather_sizes`` and the all-to-all of lengths and ids (bytes sent by this rank).
- The loss: one all-reduce of 2 float64 totals plus one of the sample count (``world``).

Time: latency-bandwidth per tier. A group of ``size`` ranks ``stride`` apart spans ``size * stride``
consecutive ranks and uses the slowest tier it spans (``Cluster.tier_for_span``). Ring all-gather /
reduce-scatter of a B-byte buffer: ``ceil(log2 n) * latency + (n - 1) / n * B / bandwidth``;
all-reduce twice that; all-to-all of B bytes sent: the same as all-gather.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from opengem.parallel.fsdp import FSDPUnit, fsdp_step_bytes
from opengem.parallel.mesh import ParallelConfig
from opengem.plan.cluster import Cluster, Tier
from opengem.plan.workload import Workload

INDEX_BYTES = 8  # lengths, ids and batch sizes travel as int64
LOSS_ALL_REDUCE_BYTES = 2 * 8 + 8  # (loss sum, rows) in float64, then the sample count


@dataclass(frozen=True)
class AbstractMesh:
    """The shape of a device mesh (names and sizes), enough for ``fsdp_step_bytes``."""

    mesh_dim_names: tuple[str, ...]
    sizes: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    def size(self, dim: int = 0) -> int:
        return self.sizes[dim]


def _shard_mesh(replicate: int, shards: int, shard_dim: str) -> AbstractMesh:
    """As ``opengem.parallel.fsdp._shard_mesh``: 2D with replicas, else the 1D shard mesh."""
    if replicate > 1:
        return AbstractMesh(("replicate", shard_dim), (replicate, shards))
    return AbstractMesh((shard_dim,), (shards,))


def fsdp_units(workload: Workload, config: ParallelConfig) -> list[FSDPUnit]:
    """The FSDP units ``parallelize(model, meshes)`` creates for ``config`` (resolved), in order."""
    units = []
    expert_parallel = config.expert > 1
    dropped: set[int] = set()
    if expert_parallel:
        mesh = _shard_mesh(config.dense_replicate, config.dense_shard // config.expert, "expert_shard")
        for layer in workload.experts:
            units.append(FSDPUnit(layer.module, mesh, layer.expert_params, config.reshard_after_forward))  # type: ignore[arg-type]
            dropped.update(id(p) for p in layer.all_params)
    mesh = _shard_mesh(config.dense_replicate, config.dense_shard, "shard")
    last = len(workload.blocks) - 1
    for index, (name, params) in enumerate(workload.blocks):
        kept = tuple(p for p in params if id(p) not in dropped)
        units.append(FSDPUnit(name, mesh, kept, config.reshard_after_forward and index < last))  # type: ignore[arg-type]
    units.append(FSDPUnit("<root>", mesh, workload.root_params, False))  # type: ignore[arg-type]
    return units


def expert_bytes(workload: Workload, config: ParallelConfig, rank_batch: int, act_bytes: int) -> dict[tuple[str, str], int]:
    """Expert-parallel activation traffic of one step (every rank holding ``rank_batch`` samples)."""
    if config.expert <= 1:
        return {}
    forwards = 2 if config.activation_checkpointing else 1
    counts = {("expert", "all_gather"): 0, ("expert", "reduce_scatter"): 0, ("expert", "all_gather_sizes"): 0}
    for layer in workload.experts:
        gathered_in = config.expert * rank_batch * layer.input_elems * act_bytes
        gathered_out = config.expert * rank_batch * layer.output_elems * act_bytes
        counts[("expert", "all_gather")] += forwards * gathered_in + gathered_out  # backward: output grads
        counts[("expert", "reduce_scatter")] += forwards * gathered_out + gathered_in  # backward: input grads
        counts[("expert", "all_gather_sizes")] += forwards * config.expert * 2 * INDEX_BYTES  # size and checksum
    return counts


def sparse_index_bytes(
    config: ParallelConfig, rank_batch: int, ids_per_rank: Mapping[str, float], shards_per_table: Mapping[str, int],
    row_split: Mapping[str, bool],
) -> dict[tuple[str, str], float]:
    """Lengths and ids one rank sends to the sparse group, with its ``ids_per_rank`` ids per table.

    A row-split table routes each id to one shard; table- and column-wise shards receive every id.
    """
    pieces = sum(shards_per_table.values())
    ids = sum(n * (1 if row_split[t] else shards_per_table[t]) for t, n in ids_per_rank.items())
    return {
        ("sparse_group", "all_gather_sizes"): config.sparse_group * INDEX_BYTES,
        ("sparse_group", "all_to_all_lengths"): pieces * rank_batch * INDEX_BYTES,
        ("sparse_group", "all_to_all_ids"): ids * INDEX_BYTES,
    }


def loss_bytes() -> dict[tuple[str, str], int]:
    return {("world", "all_reduce"): LOSS_ALL_REDUCE_BYTES}


def predicted_step_bytes(workload: Workload, config: ParallelConfig, rank_batch: int, param_bytes: int,
                         act_bytes: int) -> dict[tuple[str, str], float]:
    """FSDP + expert + loss bytes of one step (the sparse exchange needs a sharding plan: ``sparse_index_bytes``)."""
    counts: dict[tuple[str, str], float] = dict(fsdp_step_bytes(fsdp_units(workload, config), param_bytes, 4))
    counts.update(expert_bytes(workload, config, rank_batch, act_bytes))
    counts.update(loss_bytes())
    return counts


# --- time ---------------------------------------------------------------------------------------------------


GROUPS = {  # mesh dim -> (size, stride) from the resolved config (opengem.parallel.mesh layout)
    "shard": lambda c: (c.dense_shard, 1),
    "replicate": lambda c: (c.dense_replicate, c.dense_shard),
    "expert": lambda c: (c.expert, 1),
    "expert_shard": lambda c: (c.dense_shard // c.expert, c.expert),
    "sparse_group": lambda c: (c.sparse_group, c.sparse_replicate),
    "sparse_replicate": lambda c: (c.sparse_replicate, 1),
    "world": lambda c: (c.dense_replicate * c.dense_shard, 1),
}


COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")  # names start with one of these


def group_tier(cluster: Cluster, config: ParallelConfig, dim: str) -> tuple[int, Tier]:
    if dim not in GROUPS:  # a bare KeyError before
        raise ValueError(f"unknown mesh dim {dim!r}; known: {', '.join(GROUPS)}")
    size, stride = GROUPS[dim](config)
    return size, cluster.tier_for_span(size * stride)


def collective_seconds(collective: str, nbytes: float, size: int, tier: Tier, calls: int = 1) -> float:
    """Latency-bandwidth time of ``calls`` collectives moving ``nbytes`` in total over ``size`` ranks."""
    if not collective.startswith(COLLECTIVE_KINDS):  # "allreduce" had been costed as an all-gather (half)
        raise ValueError(f"unknown collective {collective!r}; names start with one of {', '.join(COLLECTIVE_KINDS)}")
    if not nbytes >= 0:  # negative bytes had cost nothing; NaN too
        raise ValueError(f"{collective}: nbytes must be >= 0, got {nbytes}")
    if size <= 1 or nbytes == 0:
        return 0.0
    latency = math.ceil(math.log2(size)) * tier.latency_us * 1e-6 * calls
    transfer = (size - 1) / size * nbytes / tier.bytes_per_s
    factor = 2.0 if collective.startswith("all_reduce") else 1.0
    return factor * (latency + transfer)
