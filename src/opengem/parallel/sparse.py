"""`ShardedEmbeddingCollection`: an `EmbeddingCollection` sharded over a group of ranks (1D), replicated
over replica groups (2D) or fully sharded over them (fully sharded 2D), on torch.distributed.

Data flow of one step on the G ranks of a sharding group (every rank calls forward with its OWN batch of
B_r samples and gets the same dict the unsharded module returns for those samples):

1. Input distribution: the batch sizes are all-gathered; each (feature, shard) pair ("piece") gets the
   lengths and ids of every rank's samples: one all-to-all of lengths, one of ids. Row-split shards get
   only the ids in their row range (shifted to shard-local rows; a bag's other ids count 0 there);
   column shards and replicated copies get all ids.
2. Each rank looks its pieces up in ONE local `EmbeddingCollection` of its shards, over the
   concatenated batch of all ranks (sum_r B_r samples, in rank order), so its fused optimizer applies
   exactly one update per unique row per step with the gradient summed over the whole group's samples,
   the same update the unsharded module makes on the global batch.
3. Output distribution: one all-to-all of embeddings (per weight dtype) sends each rank the rows of its
   own samples; row-split pooled partial sums are summed there (mean pooling: the shards pool by sum
   and the owner divides by the full bag length), column shards are concatenated along the dim, and
   row-split sequence rows are put back in id order. Replicated tables are looked up locally on the
   whole group's batch; each rank keeps its own samples' rows (no forward traffic).
4. Backward, in one autograd node: the reverse all-to-all of the output gradients to the shard owners,
   and, for replicated tables, an all-gather of every rank's output gradients so that every copy applies
   the identical update of the whole batch. The local fused optimizer then updates the shards in place.

Loss convention: the gradient a row receives is the sum over all ranks of their losses' gradients. So
each rank backpropagates its share of the global loss, e.g. ``loss_sum_over_local_samples /
global_batch`` for a global mean; ``grad_scale`` multiplies every incoming gradient (use ``1 / G`` when
each rank backpropagates the mean over its own equal-sized slice, the FSDP convention). Every rank must
run the backward of a loss that depends on the outputs (a rank with no samples too: ``0 * out.sum()``),
because the backward contains collectives.

Column-wise shards and row-wise optimizer state: row-wise Adagrad and Adam keep one accumulator per row,
updated with the mean of g**2 over the FULL row. Each column shard keeps its own copy of the row's
accumulator; before the local update, the column shards of a table exchange the per-row sums of g**2 of
the rows in the batch (one all-to-all) and pre-correct their accumulator by the difference between the
full-row mean and the local mean that the fused update will add, so the accumulators (and the weights)
stay identical to the unsharded module's (up to rounding). Dims of the shards can differ.

Precision: outputs travel in the table's dtype. For bf16 / fp16 row-split pooled features each shard's
partial sum is rounded to that dtype before the owner adds them in fp32 (one rounding more than the
unsharded module); every other case returns exactly the unsharded module's values up to summation order.

2D (``replica_group`` given, ``fully_sharded=False``): each sharding group holds a full sharded copy
and trains on its own ranks' batches; every ``sync_every`` backward passes the weights and the
optimizer state of every shard are averaged over the replica group (an all-reduce; TorchRec
DMPCollection's semantics). With ``sync_every=1`` and SGD this equals 1D training on the global batch
(all groups' samples) with the loss divided by the number of replicas R (the average of the groups'
SGD steps is one SGD step on the averaged gradient); with row-wise Adagrad / Adam it equals 1D training
when every replica group sees the same batch, and otherwise differs (the optimizer is non-linear).

Fully sharded 2D (``fully_sharded=True``): each rank persistently keeps 1/R of its group-shard's
weights and state (flattened, padded to a multiple of R). Forward all-gathers the shards inside the
replica group, the step runs as in 2D, and after backward the updated shards are reduce-scattered
(averaged) back and the gathered copy freed. The result equals 2D with ``sync_every=1`` exactly; the
persistent memory per rank is that of 1D sharding over all G x R ranks, plus one group-shard during the
step. In this mode the local collection is not a submodule (construct on the target device; the
state dict holds the owned chunks, buffers ``chunk_rank<g>_replica<j>_<name>``).

Checkpoints: the state dict holds this rank's shards under rank-unique names (``shards_rank<g>.`` +
the `EmbeddingCollection` layout of its shards), so ``opengem.parallel.save_distributed`` /
``load_distributed`` (DCP) round-trip it under the SAME plan and layout; replicas of a shard share
names (DCP keeps one copy: checkpoint at a sync step). To change the plan, go through
``full_weights`` / ``load_full_weights``.

Traffic is recorded in ``stats`` (`CommStats`) under mesh dims ``sparse_group`` (``all_to_all_*``: the
bytes sent by this rank, ``all_gather_sizes``) and ``sparse_replicate`` (``all_reduce``,
``all_gather``, ``reduce_scatter``, nccl-tests sizes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from opengem.jagged import Jagged, KeyedJagged, offsets_from_lengths
from opengem.nn.embedding import EmbeddingCollection, EmbeddingOptimizer, EmbeddingTableConfig
from opengem.ops.embedding import WEIGHT_DTYPES, check_ids
from opengem.parallel.collectives import CommStats, all_gather_single, reduce_scatter_single
from opengem.parallel.sparse_plan import ROW_SPLIT_TYPES, Shard, ShardingPlan

GROUP_DIM, REPLICA_DIM = "sparse_group", "sparse_replicate"


@dataclass(frozen=True)
class _Piece:
    """One feature of one shard: a feature of the local collection on ``shard.rank``."""

    feature: str
    table: int  # index into the configs
    shard_index: int
    shard: Shard
    sharding: str
    pooled: bool
    dtype: torch.dtype

    @property
    def local_name(self) -> str:
        return f"{self.feature}@{self.shard_index}"

    @property
    def replicated(self) -> bool:
        return self.sharding == "replicated"


def _local_table(config: EmbeddingTableConfig, sharding: str, index: int, shard: Shard) -> EmbeddingTableConfig:
    # A row shard sees only part of each bag: it pools by sum and the owner of the sample divides.
    pooling = "sum" if sharding in ROW_SPLIT_TYPES and config.pooling == "mean" else config.pooling
    return EmbeddingTableConfig(
        name=f"{config.name}@{index}",
        num_embeddings=shard.rows,
        embedding_dim=shard.dim,
        feature_names=tuple(f"{f}@{index}" for f in config.feature_names),
        pooling=pooling,
        dtype=config.dtype,
        init_std=config.init_std,
    )


class ShardedEmbeddingCollection(nn.Module):
    """See the module docstring.

    Args:
        tables: the configs of the unsharded `EmbeddingCollection`.
        plan: a `ShardingPlan` over the ranks of the sharding group (``plan.world_size`` = its size).
        group: the sharding group, or a ``DeviceMesh`` with dims (``sparse_group``, ``sparse_replicate``)
            (``ParallelMeshes.sparse``), which also gives ``replica_group``.
        optimizer: the fused optimizer of the local shards (``None``: plain parameters; replicated and
            2D averaging still apply to them).
        replica_group: the ranks holding the same shards in other sharding groups (2D); ``None``: 1D.
        sync_every: 2D weight/state averaging period in backward passes.
        fully_sharded: fully sharded 2D (needs ``replica_group``).
        grad_scale: multiplies the gradients arriving at the shards (see "Loss convention").
        seed: initialization seed; a shard's initial values depend only on (seed, table, shard), so
            replicas start identical without communication.
    """

    opengem_sparse = True  # `opengem.parallel.parallelize` (FSDP) leaves it alone

    def __init__(
        self,
        tables: Sequence[EmbeddingTableConfig],
        plan: ShardingPlan,
        group: dist.ProcessGroup | DeviceMesh | None = None,
        optimizer: EmbeddingOptimizer | None = EmbeddingOptimizer(),
        replica_group: dist.ProcessGroup | None = None,
        sync_every: int = 1,
        fully_sharded: bool = False,
        grad_scale: float = 1.0,
        stats: CommStats | None = None,
        device: torch.device | str | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if isinstance(group, DeviceMesh):
            group, replica_group = group.get_group(GROUP_DIM), group.get_group(REPLICA_DIM)
        self.group = group if group is not None else dist.group.WORLD
        self.replica_group = replica_group if replica_group is not None and dist.get_world_size(replica_group) > 1 else None
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.tables = tuple(tables)
        if plan.world_size != self.world:
            raise ValueError(f"plan is for {plan.world_size} ranks but the sharding group has {self.world}")
        plan.validate(self.tables)
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        if fully_sharded and self.replica_group is None:
            raise ValueError("fully_sharded needs a replica_group of more than one rank")
        has_columns = any(s.sharding == "column_wise" for s in plan.tables.values())
        if has_columns and optimizer is not None and optimizer.kind == "rowwise_adam" and optimizer.betas[1] <= 0:
            raise ValueError("rowwise_adam with column-wise shards needs betas[1] > 0")
        self.plan, self.optimizer, self.grad_scale, self.stats = plan, optimizer, grad_scale, stats
        self.sync_every, self.fully_sharded, self.backward_passes = sync_every, fully_sharded, 0
        self.pieces = tuple(
            _Piece(feature, t, k, shard, plan.tables[config.name].sharding, config.pooling != "none", config.dtype)
            for t, config in enumerate(self.tables)
            for feature in config.feature_names
            for k, shard in enumerate(plan.tables[config.name].shards)
        )
        self.features = tuple(f for config in self.tables for f in config.feature_names)
        self.feature_rows = {f: config.num_embeddings for config in self.tables for f in config.feature_names}
        self.pieces_on = [tuple(p for p in self.pieces if p.shard.rank == r) for r in range(self.world)]
        self.dtypes = tuple(d for d in WEIGHT_DTYPES if any(c.dtype == d for c in self.tables))
        local_shards = [
            (t, k, shard)
            for t, config in enumerate(self.tables)
            for k, shard in enumerate(plan.tables[config.name].shards)
            if shard.rank == self.rank
        ]
        local = EmbeddingCollection(
            [_local_table(self.tables[t], plan.tables[self.tables[t].name].sharding, k, s) for t, k, s in local_shards],
            optimizer,
            device,
            validate_ids=False,  # ids were checked against the global tables before routing
        )
        self._local_shards = tuple(local_shards)
        with torch.no_grad():
            for t, k, shard in local_shards:
                weight = local.embedding_weight(f"{self.tables[t].name}@{k}")
                _init_shard_(weight, self.tables[t], 0 if plan.tables[self.tables[t].name].sharding == "replicated" else k, seed, t)
        if fully_sharded:
            self._local = [local]  # not a submodule: its gathered tensors are transient (see module doc)
            self._chunk_layout(local)
        else:
            self._local = []
            self.add_module(self._state_prefix(), local)

    # --- the local collection and its state -----------------------------------------------------------

    @property
    def local_collection(self) -> EmbeddingCollection:
        return self._local[0] if self.fully_sharded else getattr(self, self._state_prefix())

    def _state_prefix(self) -> str:
        """Rank-unique names for the shard state, so that a distributed checkpoint (DCP, which keeps one
        copy of a name saved by several ranks) stores every shard; replicas of a shard share a name."""
        if self.fully_sharded:
            return f"rank{self.rank}_replica{dist.get_rank(self.replica_group)}"
        return f"shards_rank{self.rank}"

    def _state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        local = self.local_collection
        return [(n.replace(".", "_"), t) for n, t in [*local.named_parameters(), *local.named_buffers()]]

    def _chunk_name(self, name: str) -> str:
        return f"chunk_{self._state_prefix()}_{name}"

    def _chunk_layout(self, local: EmbeddingCollection) -> None:
        """Keep this rank's 1/R of every state tensor (flat, padded) and free the full tensors."""
        replicas, index = dist.get_world_size(self.replica_group), dist.get_rank(self.replica_group)
        for name, tensor in self._state_tensors():
            size = -(-tensor.numel() // replicas)
            chunk = torch.zeros(size, dtype=tensor.dtype, device=tensor.device)
            part = tensor.detach().reshape(-1)[index * size : (index + 1) * size]
            chunk[: part.numel()] = part
            if hasattr(self, self._chunk_name(name)):  # reloading
                delattr(self, self._chunk_name(name))
            self.register_buffer(self._chunk_name(name), chunk)
        self._materialized = True
        self._release()

    def _release(self) -> None:
        for _, tensor in self._state_tensors():
            tensor.untyped_storage().resize_(0)
        self._materialized = False

    def _materialize(self) -> None:
        """All-gather the replica group's chunks into the full local tensors (fully sharded 2D)."""
        if self._materialized:
            return
        replicas = dist.get_world_size(self.replica_group)
        for name, tensor in self._state_tensors():
            chunk = getattr(self, self._chunk_name(name))
            gathered = chunk.new_empty(chunk.numel() * replicas)
            all_gather_single(gathered, chunk, self.replica_group)
            self._record(REPLICA_DIM, "all_gather", gathered)
            tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
            with torch.no_grad():
                tensor.view(-1).copy_(gathered[: tensor.numel()])
        self._materialized = True

    def _reduce_scatter_and_release(self) -> None:
        replicas = dist.get_world_size(self.replica_group)
        for name, tensor in self._state_tensors():
            chunk = getattr(self, self._chunk_name(name))
            padded = torch.zeros(chunk.numel() * replicas, dtype=_reduce_dtype(tensor), device=tensor.device)
            padded[: tensor.numel()] = tensor.detach().reshape(-1)
            summed = padded.new_empty(chunk.numel())
            reduce_scatter_single(summed, padded, self.replica_group)
            self._record(REPLICA_DIM, "reduce_scatter", padded)
            chunk.copy_(_divide(summed, replicas))
        self._release()

    def _average_replicas(self) -> None:
        replicas = dist.get_world_size(self.replica_group)
        with torch.no_grad():
            for _, tensor in self._state_tensors():
                if not tensor.is_floating_point():
                    continue  # step counters: identical on every replica
                total = tensor.to(_reduce_dtype(tensor))
                dist.all_reduce(total, group=self.replica_group)
                self._record(REPLICA_DIM, "all_reduce", total)
                tensor.copy_(total / replicas)

    def _after_backward(self) -> None:
        """Runs once at the end of each backward pass (queued by the output exchange)."""
        self.backward_passes += 1
        if self.fully_sharded:
            self._reduce_scatter_and_release()
        elif self.backward_passes % self.sync_every == 0:
            self._average_replicas()

    def _record(self, dim: str, collective: str, tensor: torch.Tensor) -> None:
        if self.stats is not None:
            self.stats.record(dim, collective, tensor.numel() * tensor.element_size())

    # --- full tables (export, tests) ------------------------------------------------------------------

    def load_full_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy each table's full ``[rows, dim]`` weights (same on every rank) into this rank's shards."""
        if self.fully_sharded:
            self._materialize()
        local = self.local_collection
        with torch.no_grad():
            for t, k, shard in self._local_shards:
                config = self.tables[t]
                full = weights[config.name]
                if tuple(full.shape) != (config.num_embeddings, config.embedding_dim):
                    raise ValueError(f"table {config.name!r}: weights have shape {tuple(full.shape)}, expected {(config.num_embeddings, config.embedding_dim)}")
                local.embedding_weight(f"{config.name}@{k}").copy_(full[shard.row_start : shard.row_end, shard.col_start : shard.col_end])
        if self.fully_sharded:
            self._chunk_layout(local)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every table's full ``[rows, dim]`` weights on every rank of the group (CPU; object all-gather: small tables)."""
        if self.fully_sharded:
            self._materialize()
        local = self.local_collection
        mine = {(t, k): local.embedding_weight(f"{self.tables[t].name}@{k}").detach().cpu().clone() for t, k, _ in self._local_shards}
        if self.fully_sharded:
            self._release()
        everyone: list[dict] = [None] * self.world  # type: ignore[list-item]
        dist.all_gather_object(everyone, mine, group=self.group)
        out = {}
        for t, config in enumerate(self.tables):
            full = torch.empty(config.num_embeddings, config.embedding_dim, dtype=config.dtype)
            for k, shard in enumerate(self.plan.tables[config.name].shards):
                full[shard.row_start : shard.row_end, shard.col_start : shard.col_end] = everyone[shard.rank][(t, k)]
            out[config.name] = full
        return out

    # --- forward --------------------------------------------------------------------------------------

    def forward(self, features: KeyedJagged) -> dict[str, torch.Tensor | Jagged]:
        """One entry per feature: pooled -> ``[B_local, dim]``; sequence -> Jagged ``[T, dim]`` (this rank's samples)."""
        batch = _read_batch(features, self.features, self.feature_rows)
        sizes = self._batch_sizes(batch.batch_size, features.values.device)
        routed = {p: _route(p, batch) for p in self.pieces}
        local_batch, counts = self._distribute_ids(routed, batch.batch_size, sizes)
        if self.fully_sharded:
            self._materialize()
        local_out = self._lookup(local_batch)
        anchor = torch.zeros(0, device=features.values.device, requires_grad=True)
        anchor, local_out = self._column_sync(anchor, local_out, local_batch)
        exchange = _Exchange(self, sizes, counts, routed, anchor.device)
        flats = [
            torch.cat([local_out[p.local_name].reshape(-1) for p in self.pieces_on[self.rank] if p.dtype == d])
            if any(p.dtype == d for p in self.pieces_on[self.rank])
            else torch.zeros(0, dtype=d, device=anchor.device)
            for d in self.dtypes
        ]
        received = _OutputExchange.apply(exchange, anchor, *flats)
        if self.fully_sharded and not torch.is_grad_enabled():
            self._release()
        return exchange.assemble(received, batch)

    def _batch_sizes(self, batch_size: int, device: torch.device) -> list[int]:
        local = torch.tensor([batch_size], dtype=torch.int64, device=device)
        sizes = local.new_empty(self.world)
        all_gather_single(sizes, local, self.group)
        self._record(GROUP_DIM, "all_gather_sizes", sizes)
        return sizes.tolist()

    def _all_to_all(self, values: torch.Tensor, send_splits: list[int], recv_splits: list[int], what: str) -> torch.Tensor:
        out = values.new_empty(sum(recv_splits), *values.shape[1:])
        dist.all_to_all_single(out, values.contiguous(), recv_splits, send_splits, group=self.group)
        self._record(GROUP_DIM, f"all_to_all_{what}", values)
        return out

    def _distribute_ids(
        self, routed: dict[_Piece, _Routed], batch_size: int, sizes: list[int]
    ) -> tuple[KeyedJagged | None, list[list[int]]]:
        """All-to-all of lengths then ids; returns the local batch (pieces x all ranks' samples) and
        ``counts[s][j]``: ids of rank s for local piece j."""
        device = next(iter(routed.values())).ids.device if routed else torch.device("cpu")
        send = [routed[p] for r in range(self.world) for p in self.pieces_on[r]]
        mine = self.pieces_on[self.rank]
        send_lengths = torch.cat([x.lengths for x in send]) if send else torch.zeros(0, dtype=torch.int64, device=device)
        lengths = self._all_to_all(
            send_lengths, [len(self.pieces_on[r]) * batch_size for r in range(self.world)], [len(mine) * b for b in sizes], "lengths"
        )
        send_ids = torch.cat([x.ids for x in send]) if send else torch.zeros(0, dtype=torch.int64, device=device)
        per_source = [part.view(len(mine), b) for part, b in zip(lengths.split([len(mine) * b for b in sizes]), sizes)]
        counts = [part.sum(dim=1).tolist() for part in per_source]
        ids = self._all_to_all(
            send_ids,
            [sum(routed[p].ids.numel() for p in self.pieces_on[r]) for r in range(self.world)],
            [sum(c) for c in counts],
            "ids",
        )
        if not mine:
            return None, counts
        chunks = ids.split([c for source in counts for c in source])
        by_piece = [chunks[s * len(mine) + j] for j in range(len(mine)) for s in range(self.world)]
        local_lengths = torch.cat(per_source, dim=1).reshape(-1)
        return KeyedJagged(tuple(p.local_name for p in mine), torch.cat(by_piece), local_lengths), counts

    def _lookup(self, local_batch: KeyedJagged | None) -> dict[str, torch.Tensor]:
        if local_batch is None:
            return {}
        out = self.local_collection(local_batch)
        return {name: value.values if isinstance(value, Jagged) else value for name, value in out.items()}

    def _column_sync(
        self, anchor: torch.Tensor, local_out: dict[str, torch.Tensor], local_batch: KeyedJagged | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Insert the row-state correction of column shards into the graph (identity in forward)."""
        has_row_state = self.optimizer is not None and self.optimizer.kind != "sgd"
        if not has_row_state or not any(p.sharding == "column_wise" for p in self.pieces) or not torch.is_grad_enabled():
            return anchor, local_out
        names = [p.local_name for p in self.pieces_on[self.rank] if p.sharding == "column_wise"]
        sync = _ColumnSync(self, local_batch, anchor.device)
        anchor, *values = _ColumnStateSync.apply(sync, anchor, *(local_out[n] for n in names))
        return anchor, {**local_out, **dict(zip(names, values))}


def shard_embeddings(
    model: nn.Module, plan: ShardingPlan, group: dist.ProcessGroup | DeviceMesh | None = None, **options: Any
) -> dict[str, ShardedEmbeddingCollection]:
    """Replace every `EmbeddingCollection` inside ``model`` by a `ShardedEmbeddingCollection` of the same
    tables and optimizer, starting from its current weights (identical on every rank when the model was
    built from one seed); returns them by module path. ``options`` go to the constructor (``device``
    defaults to the collection's). ``plan`` must cover the tables of every collection it replaces.
    """
    replaced = {}
    for name, module in list(model.named_modules()):
        if type(module) is not EmbeddingCollection:
            continue
        weights = [*module.fused_parameters(), *module.parameters()]
        device = weights[0].device if weights else None
        sub_plan = ShardingPlan(plan.world_size, {t.name: plan.tables[t.name] for t in module.tables})
        sharded = ShardedEmbeddingCollection(
            module.tables, sub_plan, group, module.optimizer, **{"device": device, **options}
        )
        sharded.load_full_weights({t.name: module.embedding_weight(t.name).detach() for t in module.tables})
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, sharded)
        replaced[name] = sharded
    return replaced


def _init_shard_(weight: torch.Tensor, config: EmbeddingTableConfig, shard_key: int, seed: int, table: int) -> None:
    """Uniform(+-1/sqrt(GLOBAL rows)) or normal(init_std), from a generator keyed by (seed, table, shard)."""
    generator = torch.Generator(device=weight.device).manual_seed(seed * 1_000_003 + table * 1_009 + shard_key)
    values = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    if config.init_std is None:
        bound = config.num_embeddings**-0.5
        values.uniform_(-bound, bound, generator=generator)
    else:
        values.normal_(0.0, config.init_std, generator=generator)
    weight.copy_(values)


def _reduce_dtype(tensor: torch.Tensor) -> torch.dtype:
    return torch.float32 if tensor.is_floating_point() else tensor.dtype


def _divide(total: torch.Tensor, count: int) -> torch.Tensor:
    return total / count if total.is_floating_point() else total // count


# --- input --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Batch:
    batch_size: int
    ids: dict[str, torch.Tensor]  # feature -> int64 ids
    lengths: dict[str, torch.Tensor]  # feature -> int64 [B]
    lengths_host: dict[str, torch.Tensor]


def _read_batch(features: KeyedJagged, needed: tuple[str, ...], rows: dict[str, int]) -> _Batch:
    """Validate the batch (ids against the GLOBAL tables) and split it per feature."""
    if not isinstance(features, KeyedJagged):
        raise ValueError(f"features must be a KeyedJagged, got {type(features).__name__}")
    missing = [f for f in needed if f not in features.keys]
    if missing:
        raise ValueError(f"features is missing keys {missing}; it has {list(features.keys)}")
    batch_size = features.stride
    lengths_host = features.lengths.detach().cpu().long().view(len(features.keys), batch_size)
    if bool((lengths_host < 0).any()):
        raise ValueError("feature lengths must be non-negative")
    counts = lengths_host.sum(dim=1).tolist()
    if sum(counts) != features.values.numel():
        raise ValueError(f"lengths sum to {sum(counts)} but there are {features.values.numel()} ids")
    starts = [sum(counts[:i]) for i in range(len(counts))]
    ids, lengths, host = {}, {}, {}
    for name in needed:
        i = features.keys.index(name)
        ids[name] = features.values[starts[i] : starts[i] + counts[i]].long()
        lengths[name] = features.lengths.view(len(features.keys), batch_size)[i].long()
        host[name] = lengths_host[i]
    if features.values.numel():
        all_ids = torch.cat([ids[n] for n in needed])
        offsets = offsets_from_lengths(torch.cat([lengths[n] for n in needed]))
        check_ids(all_ids, offsets, batch_size, [rows[n] for n in needed], list(needed))
    return _Batch(batch_size, ids, lengths, host)


@dataclass(frozen=True)
class _Routed:
    lengths: torch.Tensor  # [B] ids of each sample sent to the piece's shard
    ids: torch.Tensor  # shard-local ids
    positions: torch.Tensor | None  # row-split sequences: where each sent id sits among the feature's ids


def _route(piece: _Piece, batch: _Batch) -> _Routed:
    ids, lengths = batch.ids[piece.feature], batch.lengths[piece.feature]
    if piece.sharding not in ROW_SPLIT_TYPES:
        return _Routed(lengths, ids, None)
    inside = (ids >= piece.shard.row_start) & (ids < piece.shard.row_end)
    sample = torch.repeat_interleave(torch.arange(batch.batch_size, device=ids.device), lengths, output_size=ids.numel())
    shard_lengths = torch.bincount(sample[inside], minlength=batch.batch_size)
    positions = None if piece.pooled else torch.nonzero(inside).flatten()
    return _Routed(shard_lengths, ids[inside] - piece.shard.row_start, positions)


# --- output -------------------------------------------------------------------------------------------


def _ranges(spans: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """Concatenated ``arange(start, start + size)`` of each (start, size), built on the host in one go."""
    starts = torch.tensor([s for s, _ in spans], dtype=torch.int64)
    sizes = torch.tensor([n for _, n in spans], dtype=torch.int64)
    total = int(sizes.sum()) if spans else 0
    shift = torch.repeat_interleave(starts - (torch.cumsum(sizes, 0) - sizes), sizes, output_size=total)
    return (torch.arange(total) + shift).to(device)


@dataclass(frozen=True)
class _DtypeRoute:
    """The output exchange of the pieces of one weight dtype (see `_Exchange`)."""

    local_numel: int  # this rank's local output of this dtype, flat
    send_index: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    own_index: torch.Tensor
    gather_index: torch.Tensor
    gather_splits: list[int]
    has_sharded: bool  # some rank has a non-replicated piece of this dtype: the all-to-all runs
    has_replicated: bool


class _Exchange:
    """Index maps of the output all-to-all of one forward, per weight dtype (host bookkeeping).

    On the shard side the local output of dtype d is the flat concatenation of its pieces (in local
    order), each ``[rows, dim]`` with rows in source-rank order. ``send_index`` gathers it
    destination-major for the all-to-all; ``own_index`` picks this rank's rows of the replicated
    pieces; ``gather_index`` places every rank's replicated-row gradients back (source-major).
    """

    def __init__(
        self, module: ShardedEmbeddingCollection, sizes: list[int], counts: list[list[int]], routed: dict[_Piece, _Routed], device: torch.device
    ) -> None:
        self.module, self.sizes, self.routed = module, sizes, routed
        rank, world = module.rank, module.world
        mine = module.pieces_on[rank]
        # rows[j][s] = (first row, rows) of source s in local piece j's output
        rows = []
        for j, piece in enumerate(mine):
            per_source = [sizes[s] if piece.pooled else counts[s][j] for s in range(world)]
            rows.append([(sum(per_source[:s]), per_source[s]) for s in range(world)])
        self.per_dtype = []
        for dtype in module.dtypes:
            offset, base = 0, {}
            for j, piece in enumerate(mine):
                if piece.dtype == dtype:
                    base[j] = offset
                    offset += sum(n for _, n in rows[j]) * piece.shard.dim
            sharded = [j for j in base if not mine[j].replicated]
            replicated = [j for j in base if mine[j].replicated]

            def span(j: int, s: int) -> tuple[int, int]:
                first, n = rows[j][s]
                return base[j] + first * mine[j].shard.dim, n * mine[j].shard.dim

            send_index = _ranges([span(j, s) for s in range(world) for j in sharded], device)
            send_splits = [sum(span(j, s)[1] for j in sharded) for s in range(world)]
            recv_splits = [
                sum(self._my_rows(p) * p.shard.dim for p in module.pieces_on[d] if p.dtype == dtype and not p.replicated)
                for d in range(world)
            ]
            own_index = _ranges([span(j, rank) for j in replicated], device)
            gather_index = _ranges([span(j, s) for s in range(world) for j in replicated], device)
            gather_splits = [sum(span(j, s)[1] for j in replicated) for s in range(world)]
            has_sharded = any(p.dtype == dtype and not p.replicated for p in module.pieces)
            has_replicated = any(p.dtype == dtype and p.replicated for p in module.pieces)
            self.per_dtype.append(
                _DtypeRoute(offset, send_index, send_splits, recv_splits, own_index, gather_index, gather_splits, has_sharded, has_replicated)
            )

    def _my_rows(self, piece: _Piece) -> int:
        return self.sizes[self.module.rank] if piece.pooled else self.routed[piece].ids.numel()

    def assemble(self, received: Sequence[torch.Tensor], batch: _Batch) -> dict[str, torch.Tensor | Jagged]:
        """This rank's outputs per feature from the received (sharded) and own (replicated) rows."""
        module = self.module
        segments: dict[_Piece, torch.Tensor] = {}
        for i, dtype in enumerate(module.dtypes):
            recv, own = received[2 * i], received[2 * i + 1]
            order = [p for d in range(module.world) for p in module.pieces_on[d] if p.dtype == dtype and not p.replicated]
            for piece, part in zip(order, recv.split([self._my_rows(p) * p.shard.dim for p in order])):
                segments[piece] = part.view(-1, piece.shard.dim)
            mine = [p for p in module.pieces_on[module.rank] if p.dtype == dtype and p.replicated]
            for piece, part in zip(mine, own.split([self._my_rows(p) * p.shard.dim for p in mine])):
                segments[piece] = part.view(-1, piece.shard.dim)
        out: dict[str, torch.Tensor | Jagged] = {}
        for feature in module.features:
            # a replicated table has a copy on every rank: this rank's own copy serves its samples
            pieces = [p for p in module.pieces if p.feature == feature and (not p.replicated or p.shard.rank == module.rank)]
            out[feature] = self._combine(pieces, [segments[p] for p in pieces], batch)
        return out

    def _combine(self, pieces: list[_Piece], parts: list[torch.Tensor], batch: _Batch) -> torch.Tensor | Jagged:
        first, feature = pieces[0], pieces[0].feature
        config = self.module.tables[first.table]
        if first.replicated:
            values = parts[0]
        elif first.sharding == "column_wise":
            values = torch.cat(parts, dim=1)
        elif first.sharding not in ROW_SPLIT_TYPES:
            values = parts[0]
        elif first.pooled:
            total = torch.stack(parts).float().sum(dim=0)
            if config.pooling == "mean":
                total = total / batch.lengths[feature].clamp(min=1)[:, None]
            values = total.to(config.dtype)
        else:
            positions = torch.cat([self.routed[p].positions for p in pieces])
            values = torch.cat(parts).index_select(0, torch.argsort(positions))
        if first.pooled:
            return values
        host = batch.lengths_host[feature]
        offsets_host = offsets_from_lengths(host)
        max_len = int(host.max()) if host.numel() else 0
        return Jagged(values, offsets_host.to(values.device), offsets_host, max_len)


class _OutputExchange(torch.autograd.Function):
    """Forward: all-to-all of the sharded rows, own rows of the replicated pieces. Backward: reverse
    all-to-all, and the all-gather of the replicated pieces' gradients (every copy sees the whole batch)."""

    @staticmethod
    def forward(ctx, exchange: _Exchange, anchor: torch.Tensor, *flats: torch.Tensor):  # type: ignore[override]
        ctx.exchange, ctx.device = exchange, anchor.device
        module, out = exchange.module, []
        for flat, route in zip(flats, exchange.per_dtype):
            if route.has_sharded:
                out.append(module._all_to_all(flat[route.send_index], route.send_splits, route.recv_splits, "embeddings"))
            else:
                out.append(flat.new_zeros(0))
            out.append(flat[route.own_index])
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        exchange = ctx.exchange
        module = exchange.module
        if module.replica_group is not None:
            torch.autograd.Variable._execution_engine.queue_callback(module._after_backward)
        result = []
        for i, route in enumerate(exchange.per_dtype):
            grad_recv, grad_own = grads[2 * i] * module.grad_scale, grads[2 * i + 1] * module.grad_scale
            grad = grad_recv.new_zeros(route.local_numel)
            if route.has_sharded:
                sent_back = module._all_to_all(grad_recv, route.recv_splits, route.send_splits, "embedding_grads")
                grad.index_copy_(0, route.send_index, sent_back)
            if route.has_replicated:  # every copy of a replicated table needs every rank's gradients
                copies = grad_own.repeat(module.world)
                everyone = module._all_to_all(copies, [grad_own.numel()] * module.world, route.gather_splits, "replicated_grads")
                grad.index_copy_(0, route.gather_index, everyone)
            result.append(grad)
        # a (zero) anchor gradient, so that the column sync's backward (a collective) runs on every rank
        return (None, torch.zeros(0, device=ctx.device), *result)


# --- column shards: exact row-wise optimizer state ----------------------------------------------------


class _ColumnSync:
    """Per-row sums of g**2 of the column shards of one backward, exchanged between a table's shards."""

    def __init__(self, module: ShardedEmbeddingCollection, local_batch: KeyedJagged | None, device: torch.device) -> None:
        self.module, self.local_batch, self.device = module, local_batch, device

    def apply(self, grads: Sequence[torch.Tensor]) -> None:
        module, rank = self.module, self.module.rank
        local = module.local_collection
        mine = [p for p in module.pieces_on[rank] if p.sharding == "column_wise"]
        grad_of = {p.local_name: g for p, g in zip(mine, grads)}
        tables = sorted({(p.table, p.shard_index) for p in mine})
        rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # table -> (unique rows, local sum of g**2)
        for t, k in tables:
            rows[t] = self._row_sums(t, k, [p for p in mine if p.table == t], grad_of)
        holders = {t: self._holders(t) for t, _ in tables}
        send = [[rows[t][1] for t, _ in tables if d != rank and d in holders[t]] for d in range(module.world)]
        flat = [torch.cat(parts) if parts else torch.zeros(0, device=self.device) for parts in send]
        received = module._all_to_all(
            torch.cat(flat), [f.numel() for f in flat], [f.numel() for f in flat], "column_row_sums"
        )  # peers hold the same unique rows: what we send to d has the size of what d sends us
        from_peer = dict(zip(range(module.world), received.split([f.numel() for f in flat])))
        taken = [0] * module.world
        opt = module.optimizer
        assert opt is not None
        for t, k in tables:
            unique, local_sum = rows[t]
            total = local_sum.clone()
            for d in sorted(holders[t] - {rank}):
                total += from_peer[d][taken[d] : taken[d] + unique.numel()]
                taken[d] += unique.numel()
            delta = total / module.tables[t].embedding_dim - local_sum / module.plan.tables[module.tables[t].name].shards[k].dim
            if opt.kind == "rowwise_adam":
                delta = delta * (1 - opt.betas[1]) / opt.betas[1]
            state, row_offset = _row_state(local, f"{module.tables[t].name}@{k}")
            state.index_add_(0, unique + row_offset, delta)

    def _holders(self, table: int) -> set[int]:
        return set(self.module.plan.tables[self.module.tables[table].name].ranks)

    def _row_sums(self, table: int, shard_index: int, pieces: list[_Piece], grad_of) -> tuple[torch.Tensor, torch.Tensor]:
        """Unique local rows of the table in this batch and the sum over columns of their aggregated g**2
        (g including weight decay, as the fused update defines it)."""
        batch = self.local_batch
        assert batch is not None
        ids, grads = [], []
        for piece in pieces:
            feature_ids = batch[piece.local_name]
            grad = grad_of[piece.local_name].float()
            if piece.pooled:
                lengths = feature_ids.lengths()
                if self.module.tables[table].pooling == "mean":
                    grad = grad / lengths.clamp(min=1)[:, None]
                grad = torch.repeat_interleave(grad, lengths, dim=0, output_size=feature_ids.num_values)
            ids.append(feature_ids.values)
            grads.append(grad)
        all_ids = torch.cat(ids)
        unique, inverse = torch.unique(all_ids, return_inverse=True)
        summed = torch.zeros(unique.numel(), grads[0].shape[1], device=all_ids.device).index_add_(0, inverse, torch.cat(grads))
        opt = self.module.optimizer
        if opt is not None and opt.weight_decay:
            weight = self.module.local_collection.embedding_weight(f"{self.module.tables[table].name}@{shard_index}")
            summed = summed + opt.weight_decay * weight.index_select(0, unique).float()
        return unique, summed.pow(2).sum(dim=1)


def _row_state(local: EmbeddingCollection, table_name: str) -> tuple[torch.Tensor, int]:
    """The row-wise state buffer holding ``table_name`` and the table's first row in it.

    Reads the collection's documented flat state layout (``row_state_<dtype>``, tables of one dtype in
    order) through its private group records rather than re-deriving the layout here.
    """
    index = next(i for i, t in enumerate(local.tables) if t.name == table_name)
    group = next(g for g in local._groups if index in g.tables)
    return getattr(local, f"row_state_{group.key}"), group.row_offsets[group.tables.index(index)]


class _ColumnStateSync(torch.autograd.Function):
    """Identity in forward; in backward, corrects the column shards' row state before their fused update."""

    @staticmethod
    def forward(ctx, sync: _ColumnSync, anchor: torch.Tensor, *values: torch.Tensor):  # type: ignore[override]
        ctx.sync = sync
        return (anchor.view_as(anchor), *(v.view_as(v) for v in values))

    @staticmethod
    def backward(ctx, grad_anchor: torch.Tensor, *grads: torch.Tensor):  # type: ignore[override]
        with torch.no_grad():
            ctx.sync.apply(grads)
        return (None, grad_anchor, *grads)


__all__ = ["ShardedEmbeddingCollection", "shard_embeddings"]
