"""Layout-independent state of a `ShardedEmbeddingCollection`: full tables and their optimizer state.

The collection's own state dict names its shards per rank (``shards_rank<g>.``), so a distributed
checkpoint of it only loads back under the same plan and layout. ``full_state`` assembles, for every
table, the tensors the unsharded `EmbeddingCollection` would hold:

- ``<table>.weight``     ``[rows, dim]`` in the table's dtype;
- ``<table>.row_state``  fp32 ``[rows]`` (row-wise Adagrad / Adam; absent for SGD);
- ``<table>.elem_state`` fp32 ``[rows, dim]`` (row-wise Adam's first moment; absent otherwise);
- ``<table>.step``       int64 ``[1]``, the fused optimizer's step counter;

identical on every rank of the sharding group, and ``load_full_state`` copies each rank's slices back
under whatever plan the module now has. Column shards each keep a copy of a row's accumulator (see
``opengem.parallel.sparse``), so the copies are equal and any one of them is the table's.

Cost: every rank briefly holds every full table (an object all-gather over the group, on the host).
That suits checkpoints of tables up to a few GB; larger tables need shard-wise DCP entries instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from opengem.nn.embedding import EmbeddingCollection, EmbeddingTableConfig
from opengem.parallel.sparse import ShardedEmbeddingCollection
from opengem.parallel.sparse_exchange import row_state


def _group_of(local: EmbeddingCollection, table_name: str) -> tuple[str, int, int]:
    """(dtype group key, first element, first row) of ``table_name`` in the local collection's flat buffers."""
    index = next(i for i, t in enumerate(local.tables) if t.name == table_name)
    group = next(g for g in local._groups if index in g.tables)
    position = group.tables.index(index)
    return group.key, group.weight_offsets[position], group.row_offsets[position]


def _local_pieces(module: ShardedEmbeddingCollection) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """This rank's shard tensors, keyed by (table index, shard index), as CPU copies."""
    local = module.local_collection
    kind = module.optimizer.kind if module.optimizer is not None else None
    pieces = {}
    for t, k, shard in module._local_shards:
        name = f"{module.tables[t].name}@{k}"
        key, start, _ = _group_of(local, name)
        piece = {"weight": local.embedding_weight(name).detach().cpu().clone()}
        if kind is not None:
            piece["step"] = getattr(local, f"step_{key}").detach().cpu().clone()
        if kind in ("rowwise_adagrad", "rowwise_adam"):
            buffer, first = row_state(local, name)
            piece["row_state"] = buffer[first : first + shard.rows].detach().cpu().clone()
        if kind == "rowwise_adam":
            flat = getattr(local, f"elem_state_{key}")
            piece["elem_state"] = flat[start : start + shard.rows * shard.dim].view(shard.rows, shard.dim).cpu().clone()
        pieces[(t, k)] = piece
    return pieces


def _empty_table(config: EmbeddingTableConfig, kind: str | None) -> dict[str, torch.Tensor]:
    rows, dim = config.num_embeddings, config.embedding_dim
    out = {"weight": torch.zeros(rows, dim, dtype=config.dtype)}
    if kind is not None:
        out["step"] = torch.zeros(1, dtype=torch.int64)
    if kind in ("rowwise_adagrad", "rowwise_adam"):
        out["row_state"] = torch.zeros(rows)
    if kind == "rowwise_adam":
        out["elem_state"] = torch.zeros(rows, dim)
    return out


def empty_full_state(module: ShardedEmbeddingCollection) -> dict[str, torch.Tensor]:
    """Zero tensors of ``full_state``'s names and shapes (the buffers a checkpoint loads into)."""
    kind = module.optimizer.kind if module.optimizer is not None else None
    return {f"{c.name}.{n}": v for c in module.tables for n, v in _empty_table(c, kind).items()}


def full_state(module: ShardedEmbeddingCollection) -> dict[str, torch.Tensor]:
    """Every table's full weight and optimizer state (CPU), identical on every rank of the group.

    Every rank of the sharding group calls this (collective). See the module docstring for the names.
    """
    if module.fully_sharded:
        module._materialize()
    mine = _local_pieces(module)
    if module.fully_sharded:
        module._release()
    everyone: list[dict] = [None] * module.world  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine, group=module.group)
    kind = module.optimizer.kind if module.optimizer is not None else None
    out = {}
    for t, config in enumerate(module.tables):
        table = _empty_table(config, kind)
        for k, shard in enumerate(module.plan.tables[config.name].shards):
            piece = everyone[shard.rank][(t, k)]
            rows, cols = slice(shard.row_start, shard.row_end), slice(shard.col_start, shard.col_end)
            table["weight"][rows, cols] = piece["weight"]
            if "step" in table:
                table["step"] = torch.maximum(table["step"], piece["step"])
            if "row_state" in table:
                table["row_state"][rows] = piece["row_state"]
            if "elem_state" in table:
                table["elem_state"][rows, cols] = piece["elem_state"]
        out.update({f"{config.name}.{n}": v for n, v in table.items()})
    return out


def load_full_state(module: ShardedEmbeddingCollection, state: dict[str, torch.Tensor]) -> None:
    """Copy this rank's slices of ``full_state`` output (same on every rank) into its shards."""
    expected = empty_full_state(module)
    for name, empty in expected.items():
        if name not in state:
            raise ValueError(f"sparse state has no {name!r}; it holds {sorted(state)}")
        if state[name].shape != empty.shape:
            raise ValueError(f"sparse state {name!r} has shape {tuple(state[name].shape)}, expected {tuple(empty.shape)}")
    module.load_full_weights({c.name: state[f"{c.name}.weight"] for c in module.tables})
    if module.optimizer is None:
        return
    if module.fully_sharded:
        module._materialize()
    local = module.local_collection
    kind = module.optimizer.kind
    with torch.no_grad():
        for t, k, shard in module._local_shards:
            config = module.tables[t]
            name = f"{config.name}@{k}"
            key, start, _ = _group_of(local, name)
            getattr(local, f"step_{key}").copy_(state[f"{config.name}.step"])  # equal for the tables of a group
            rows, cols = slice(shard.row_start, shard.row_end), slice(shard.col_start, shard.col_end)
            if kind in ("rowwise_adagrad", "rowwise_adam"):
                buffer, first = row_state(local, name)
                buffer[first : first + shard.rows].copy_(state[f"{config.name}.row_state"][rows])
            if kind == "rowwise_adam":
                flat = getattr(local, f"elem_state_{key}")
                flat[start : start + shard.rows * shard.dim].view(shard.rows, shard.dim).copy_(
                    state[f"{config.name}.elem_state"][rows, cols]
                )
    if module.fully_sharded:
        module._chunk_layout(local)
