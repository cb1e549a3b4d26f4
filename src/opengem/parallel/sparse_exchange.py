"""The data movement of `opengem.parallel.sparse`: batch validation and id routing (input), the output
all-to-all and its backward, and the row-state exchange of column-wise shards. See that module's docstring
for the semantics; everything here is driven by a `ShardedEmbeddingCollection`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from opengem.jagged import Jagged, KeyedJagged, offsets_from_lengths
from opengem.nn.embedding import EmbeddingCollection
from opengem.ops.embedding import check_ids
from opengem.parallel.sparse_plan import ROW_SPLIT_TYPES, Shard

if TYPE_CHECKING:
    from opengem.parallel.sparse import ShardedEmbeddingCollection


@dataclass(frozen=True)
class Piece:
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


# --- input --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    batch_size: int
    ids: dict[str, torch.Tensor]  # feature -> int64 ids
    lengths: dict[str, torch.Tensor]  # feature -> int64 [B]
    lengths_host: dict[str, torch.Tensor]


def read_batch(features: KeyedJagged, needed: tuple[str, ...], rows: dict[str, int]) -> Batch:
    """Validate the batch (ids against the GLOBAL tables) and split it per feature."""
    if not isinstance(features, KeyedJagged):
        raise ValueError(f"features must be a KeyedJagged, got {type(features).__name__}")
    missing = [f for f in needed if f not in features.keys]
    if missing:
        raise ValueError(f"features is missing keys {missing}; it has {list(features.keys)}")
    if features.values.dtype not in (torch.int32, torch.int64):  # .long() below had truncated float ids
        raise ValueError(f"feature ids must be int32 or int64, got {features.values.dtype}")
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
    return Batch(batch_size, ids, lengths, host)


@dataclass(frozen=True)
class Routed:
    lengths: torch.Tensor  # [B] ids of each sample sent to the piece's shard
    ids: torch.Tensor  # shard-local ids
    positions: torch.Tensor | None  # row-split sequences: where each sent id sits among the feature's ids


def route(piece: Piece, batch: Batch) -> Routed:
    ids, lengths = batch.ids[piece.feature], batch.lengths[piece.feature]
    if piece.sharding not in ROW_SPLIT_TYPES:
        return Routed(lengths, ids, None)
    inside = (ids >= piece.shard.row_start) & (ids < piece.shard.row_end)
    sample = torch.repeat_interleave(torch.arange(batch.batch_size, device=ids.device), lengths, output_size=ids.numel())
    shard_lengths = torch.bincount(sample[inside], minlength=batch.batch_size)
    positions = None if piece.pooled else torch.nonzero(inside).flatten()
    return Routed(shard_lengths, ids[inside] - piece.shard.row_start, positions)


# --- output -------------------------------------------------------------------------------------------


def ranges(spans: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """Concatenated ``arange(start, start + size)`` of each (start, size), built on the host in one go."""
    starts = torch.tensor([s for s, _ in spans], dtype=torch.int64)
    sizes = torch.tensor([n for _, n in spans], dtype=torch.int64)
    total = int(sizes.sum()) if spans else 0
    shift = torch.repeat_interleave(starts - (torch.cumsum(sizes, 0) - sizes), sizes, output_size=total)
    return (torch.arange(total) + shift).to(device)


@dataclass(frozen=True)
class DtypeRoute:
    """The output exchange of the pieces of one weight dtype (see `Exchange`)."""

    local_numel: int  # this rank's local output of this dtype, flat
    send_index: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    own_index: torch.Tensor
    gather_index: torch.Tensor
    gather_splits: list[int]
    has_sharded: bool  # some rank has a non-replicated piece of this dtype: the all-to-all runs
    has_replicated: bool


class Exchange:
    """Index maps of the output all-to-all of one forward, per weight dtype (host bookkeeping).

    On the shard side the local output of dtype d is the flat concatenation of its pieces (in local
    order), each ``[rows, dim]`` with rows in source-rank order. ``send_index`` gathers it
    destination-major for the all-to-all; ``own_index`` picks this rank's rows of the replicated
    pieces; ``gather_index`` places every rank's replicated-row gradients back (source-major).
    """

    def __init__(
        self, module: ShardedEmbeddingCollection, sizes: list[int], counts: list[list[int]], routed: dict[Piece, Routed], device: torch.device
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

            send_index = ranges([span(j, s) for s in range(world) for j in sharded], device)
            send_splits = [sum(span(j, s)[1] for j in sharded) for s in range(world)]
            recv_splits = [
                sum(self._my_rows(p) * p.shard.dim for p in module.pieces_on[d] if p.dtype == dtype and not p.replicated)
                for d in range(world)
            ]
            own_index = ranges([span(j, rank) for j in replicated], device)
            gather_index = ranges([span(j, s) for s in range(world) for j in replicated], device)
            gather_splits = [sum(span(j, s)[1] for j in replicated) for s in range(world)]
            has_sharded = any(p.dtype == dtype and not p.replicated for p in module.pieces)
            has_replicated = any(p.dtype == dtype and p.replicated for p in module.pieces)
            self.per_dtype.append(
                DtypeRoute(offset, send_index, send_splits, recv_splits, own_index, gather_index, gather_splits, has_sharded, has_replicated)
            )

    def _my_rows(self, piece: Piece) -> int:
        return self.sizes[self.module.rank] if piece.pooled else self.routed[piece].ids.numel()

    def assemble(self, received: Sequence[torch.Tensor], batch: Batch) -> dict[str, torch.Tensor | Jagged]:
        """This rank's outputs per feature from the received (sharded) and own (replicated) rows."""
        module = self.module
        segments: dict[Piece, torch.Tensor] = {}
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

    def _combine(self, pieces: list[Piece], parts: list[torch.Tensor], batch: Batch) -> torch.Tensor | Jagged:
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


class OutputExchange(torch.autograd.Function):
    """Forward: all-to-all of the sharded rows, own rows of the replicated pieces. Backward: reverse
    all-to-all, and the all-gather of the replicated pieces' gradients (every copy sees the whole batch)."""

    @staticmethod
    def forward(ctx, exchange: Exchange, anchor: torch.Tensor, *flats: torch.Tensor):  # type: ignore[override]
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


class ColumnSync:
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
            state, row_offset = row_state(local, f"{module.tables[t].name}@{k}")
            state.index_add_(0, unique + row_offset, delta)

    def _holders(self, table: int) -> set[int]:
        return set(self.module.plan.tables[self.module.tables[table].name].ranks)

    def _row_sums(self, table: int, shard_index: int, pieces: list[Piece], grad_of) -> tuple[torch.Tensor, torch.Tensor]:
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


def row_state(local: EmbeddingCollection, table_name: str) -> tuple[torch.Tensor, int]:
    """The row-wise state buffer holding ``table_name`` and the table's first row in it.

    Reads the collection's documented flat state layout (``row_state_<dtype>``, tables of one dtype in
    order) through its private group records rather than re-deriving the layout here.
    """
    index = next(i for i, t in enumerate(local.tables) if t.name == table_name)
    group = next(g for g in local._groups if index in g.tables)
    return getattr(local, f"row_state_{group.key}"), group.row_offsets[group.tables.index(index)]


class ColumnStateSync(torch.autograd.Function):
    """Identity in forward; in backward, corrects the column shards' row state before their fused update."""

    @staticmethod
    def forward(ctx, sync: ColumnSync, anchor: torch.Tensor, *values: torch.Tensor):  # type: ignore[override]
        ctx.sync = sync
        return (anchor.view_as(anchor), *(v.view_as(v) for v in values))

    @staticmethod
    def backward(ctx, grad_anchor: torch.Tensor, *grads: torch.Tensor):  # type: ignore[override]
        with torch.no_grad():
            ctx.sync.apply(grads)
        return (None, grad_anchor, *grads)
