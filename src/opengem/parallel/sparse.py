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
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from opengem.jagged import Jagged, KeyedJagged
from opengem.nn.embedding import EmbeddingCollection, EmbeddingOptimizer, EmbeddingTableConfig
from opengem.ops.embedding import WEIGHT_DTYPES
from opengem.parallel.collectives import CommStats, all_gather_single, reduce_scatter_single
from opengem.parallel.sparse_exchange import (
    ColumnStateSync,
    ColumnSync,
    Exchange,
    OutputExchange,
    Piece,
    Routed,
    read_batch,
    route,
)
from opengem.parallel.sparse_plan import ROW_SPLIT_TYPES, Shard, ShardingPlan
from opengem.validation import is_int, is_positive_finite

GROUP_DIM, REPLICA_DIM = "sparse_group", "sparse_replicate"


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
        if not is_int(sync_every) or sync_every < 1:
            raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
        if not is_positive_finite(grad_scale):
            raise ValueError(f"grad_scale must be a finite number > 0, got {grad_scale!r}")  # NaN, -1, "0.5" passed
        if not isinstance(fully_sharded, bool):  # "false" had meant true (and 0 passed as a mode)
            raise ValueError(f"fully_sharded must be a bool, got {fully_sharded!r}")
        if not is_int(seed):  # 1.5 had failed inside torch's manual_seed, True seeded as 1
            raise ValueError(f"seed must be an int, got {seed!r}")
        if fully_sharded and self.replica_group is None:
            raise ValueError("fully_sharded needs a replica_group of more than one rank")
        has_columns = any(s.sharding == "column_wise" for s in plan.tables.values())
        if has_columns and optimizer is not None and optimizer.kind == "rowwise_adam" and optimizer.betas[1] <= 0:
            raise ValueError("rowwise_adam with column-wise shards needs betas[1] > 0")
        self.plan, self.optimizer, self.grad_scale, self.stats = plan, optimizer, grad_scale, stats
        self.sync_every, self.fully_sharded, self.backward_passes = sync_every, fully_sharded, 0
        self.pieces = tuple(
            Piece(feature, t, k, shard, plan.tables[config.name].sharding, config.pooling != "none", config.dtype)
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
        persistent = [(n, b) for n, b in local.named_buffers() if n not in local._non_persistent_buffers_set]
        return [(n.replace(".", "_"), t) for n, t in [*local.named_parameters(), *persistent]]

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
        names = {t.name for t in self.tables}
        if set(weights) != names:  # a missing table had been a bare KeyError, an unknown one ignored
            raise ValueError(f"weights must hold exactly the tables {sorted(names)}: missing "
                             f"{sorted(names - set(weights))}, unknown {sorted(set(weights) - names)}")
        # Every table, not only this rank's shards: a bad one then raises on every rank alike, before any copy.
        for config in self.tables:
            full = weights[config.name]
            if not isinstance(full, torch.Tensor) or not full.is_floating_point():  # int weights had been cast
                raise ValueError(f"table {config.name!r}: weights must be a floating-point tensor, got "
                                 f"{full.dtype if isinstance(full, torch.Tensor) else type(full).__name__}")
            if tuple(full.shape) != (config.num_embeddings, config.embedding_dim):
                raise ValueError(f"table {config.name!r}: weights have shape {tuple(full.shape)}, "
                                 f"expected {(config.num_embeddings, config.embedding_dim)}")
        if self.fully_sharded:
            self._materialize()
        local = self.local_collection
        with torch.no_grad():
            for t, k, shard in self._local_shards:
                config = self.tables[t]
                full = weights[config.name]
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
        batch = read_batch(features, self.features, self.feature_rows)
        sizes = self._batch_sizes(batch.batch_size, features.values.device)
        routed = {p: route(p, batch) for p in self.pieces}
        local_batch, counts = self._distribute_ids(routed, batch.batch_size, sizes)
        if self.fully_sharded:
            self._materialize()
        local_out = self._lookup(local_batch)
        anchor = torch.zeros(0, device=features.values.device, requires_grad=True)
        anchor, local_out = self._column_sync(anchor, local_out, local_batch)
        exchange = Exchange(self, sizes, counts, routed, anchor.device)
        flats = [
            torch.cat([local_out[p.local_name].reshape(-1) for p in self.pieces_on[self.rank] if p.dtype == d])
            if any(p.dtype == d for p in self.pieces_on[self.rank])
            else torch.zeros(0, dtype=d, device=anchor.device)
            for d in self.dtypes
        ]
        received = OutputExchange.apply(exchange, anchor, *flats)
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
        self, routed: dict[Piece, Routed], batch_size: int, sizes: list[int]
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
        sync = ColumnSync(self, local_batch, anchor.device)
        anchor, *values = ColumnStateSync.apply(sync, anchor, *(local_out[n] for n in names))
        return anchor, {**local_out, **dict(zip(names, values))}


def shard_embeddings(
    model: nn.Module, plan: ShardingPlan, group: dist.ProcessGroup | DeviceMesh | None = None, **options: Any
) -> dict[str, ShardedEmbeddingCollection]:
    """Replace every `EmbeddingCollection` inside ``model`` by a `ShardedEmbeddingCollection` of the same
    tables and optimizer, starting from its current weights (identical on every rank when the model was
    built from one seed); returns them by module path. ``options`` go to the constructor (``device``
    defaults to the collection's). ``plan`` must cover the tables of every collection it replaces.
    """
    collections = [(name, m) for name, m in model.named_modules() if type(m) is EmbeddingCollection]
    if not collections:
        raise ValueError("shard_embeddings: the model has no EmbeddingCollection to shard")
    plan.validate([t for _, m in collections for t in m.tables])  # a table the plan lacks had been a bare KeyError
    replaced = {}
    for name, module in collections:
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


__all__ = ["ShardedEmbeddingCollection", "shard_embeddings"]
