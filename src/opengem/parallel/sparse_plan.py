"""Sharding plans for embedding tables (TorchRec's vocabulary) and a planner that balances cost and memory.

A ``ShardingPlan`` says, for every table, how it is split over the R ranks of one sharding group (group
ranks ``0..R-1``) and which rank holds each piece:

- ``table_wise``: the whole table on one rank.
- ``row_wise``: rows split evenly over the given ranks (each shard: all columns of a row range).
- ``column_wise``: columns split evenly (each shard: all rows, a column range).
- ``table_row_wise``: row-wise over the ranks of one host (the all-to-all stays on NVLink).
- ``replicated``: a full copy on every rank of the group (data parallel; see `opengem.parallel.sparse`).

A shard is ``(rank, rows [row_start, row_end), columns [col_start, col_end))``. The shards of one table
sit on distinct ranks and tile the table exactly (replicated: every shard is the whole table).

Cost model (the planner and ``explain``): a table's cost per step is its expected ids per step (pooling
factor x global batch) times its dim (elements read in forward and written in backward); a row-wise
shard gets the table's ids in proportion to its rows (uniform ids), a column-wise shard every id with its
share of the dim, a replicated copy every id of the group (it looks up the whole group's batch). Memory
per shard: weights (rows x dim x element size) plus optimizer state: 4 bytes per row for row-wise
Adagrad / Adam's second moment, plus 4 bytes per element for Adam's first moment.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from opengem.nn.embedding import EmbeddingOptimizer, EmbeddingTableConfig
from opengem.parallel.mesh import Topology
from opengem.validation import is_int, is_number

ShardingType = Literal["table_wise", "row_wise", "column_wise", "table_row_wise", "replicated"]
SHARDING_TYPES: tuple[str, ...] = ("table_wise", "row_wise", "column_wise", "table_row_wise", "replicated")
ROW_SPLIT_TYPES = ("row_wise", "table_row_wise")
SHARD_FIELDS = ("rank", "row_start", "row_end", "col_start", "col_end")


@dataclass(frozen=True)
class Shard:
    rank: int  # rank inside the sharding group
    row_start: int
    row_end: int
    col_start: int
    col_end: int

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start

    @property
    def dim(self) -> int:
        return self.col_end - self.col_start


@dataclass(frozen=True)
class TableSharding:
    sharding: ShardingType
    shards: tuple[Shard, ...]

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(s.rank for s in self.shards)


def _even_bounds(size: int, parts: int) -> list[int]:
    return [size * i // parts for i in range(parts + 1)]


def shard_table(table: EmbeddingTableConfig, sharding: ShardingType, ranks: Sequence[int]) -> TableSharding:
    """Split ``table`` the ``sharding`` way over ``ranks`` (one rank for table-wise), evenly, in rank order.

    Row and column splits give shard i ``size * i // n .. size * (i + 1) // n``.
    """
    ranks = tuple(ranks)
    rows, dim = table.num_embeddings, table.embedding_dim
    if sharding not in SHARDING_TYPES:
        raise ValueError(f"table {table.name!r}: sharding must be one of {SHARDING_TYPES}, got {sharding!r}")
    if not ranks or len(set(ranks)) != len(ranks):
        raise ValueError(f"table {table.name!r}: ranks must be distinct and non-empty, got {list(ranks)}")
    if not all(is_int(r) and r >= 0 for r in ranks):  # True and 1.0 had become shard ranks (1.0 fails as an index)
        raise ValueError(f"table {table.name!r}: ranks must be ints >= 0, got {list(ranks)}")
    if sharding == "table_wise":
        if len(ranks) != 1:
            raise ValueError(f"table {table.name!r}: table_wise takes exactly one rank, got {list(ranks)}")
        return TableSharding(sharding, (Shard(ranks[0], 0, rows, 0, dim),))
    if sharding == "replicated":
        return TableSharding(sharding, tuple(Shard(r, 0, rows, 0, dim) for r in ranks))
    if sharding == "column_wise":
        if len(ranks) > dim:
            raise ValueError(f"table {table.name!r}: {len(ranks)} column shards for dim {dim}")
        bounds = _even_bounds(dim, len(ranks))
        return TableSharding(sharding, tuple(Shard(r, 0, rows, bounds[i], bounds[i + 1]) for i, r in enumerate(ranks)))
    if len(ranks) > rows:
        raise ValueError(f"table {table.name!r}: {len(ranks)} row shards for {rows} rows")
    bounds = _even_bounds(rows, len(ranks))
    return TableSharding(sharding, tuple(Shard(r, bounds[i], bounds[i + 1], 0, dim) for i, r in enumerate(ranks)))


def state_bytes_per_row(dim: int, optimizer: EmbeddingOptimizer | None) -> int:
    """Optimizer state bytes of one row of ``dim`` columns (fp32 state)."""
    if optimizer is None or optimizer.kind == "sgd":
        return 0
    return 4 + (4 * dim if optimizer.kind == "rowwise_adam" else 0)


def shard_bytes(table: EmbeddingTableConfig, shard: Shard, optimizer: EmbeddingOptimizer | None) -> int:
    """Weights plus optimizer state of ``shard`` of ``table``. Row-wise state is per row of every column
    shard (each column shard keeps the full row's accumulator, kept identical; see `opengem.parallel.sparse`)."""
    return shard.rows * (shard.dim * table.dtype.itemsize + state_bytes_per_row(shard.dim, optimizer))


def shard_ids_per_step(table: EmbeddingTableConfig, sharding: TableSharding, shard: Shard, ids_per_step: float) -> float:
    """Expected ids a shard looks up per step (uniform ids over rows; see the module docstring)."""
    if sharding.sharding in ROW_SPLIT_TYPES:
        return ids_per_step * shard.rows / table.num_embeddings
    return ids_per_step


@dataclass(frozen=True)
class ShardingPlan:
    """Per table name, its sharding over a group of ``world_size`` ranks; see the module docstring."""

    world_size: int
    tables: Mapping[str, TableSharding] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not is_int(self.world_size) or self.world_size < 1:  # 0, 2.5 and True had made a plan
            raise ValueError(f"ShardingPlan: world_size must be an int >= 1, got {self.world_size!r}")

    def validate(self, tables: Sequence[EmbeddingTableConfig]) -> None:
        """Raise ``ValueError`` unless every table has a sharding whose shards tile it on distinct valid ranks."""
        names = [t.name for t in tables]
        missing = [n for n in names if n not in self.tables]
        extra = [n for n in self.tables if n not in names]
        if missing or extra:
            raise ValueError(f"plan does not match the tables: missing {missing}, unknown {extra}")
        for table in tables:
            sharding = self.tables[table.name]
            if not isinstance(sharding, TableSharding) or not all(isinstance(s, Shard) for s in sharding.shards):
                raise ValueError(f"table {table.name!r}: expected a TableSharding of Shards, got {sharding!r}")
            for shard in sharding.shards:  # compared equal to shard_table's ints, 0.0 / True slipped through
                if not all(is_int(getattr(shard, f)) for f in SHARD_FIELDS):
                    raise ValueError(f"table {table.name!r}: shard fields must be ints, got {shard}")
            ranks = sharding.ranks
            if len(set(ranks)) != len(ranks) or not all(0 <= r < self.world_size for r in ranks):
                raise ValueError(f"table {table.name!r}: shard ranks {list(ranks)} must be distinct and in [0, {self.world_size})")
            if sharding != shard_table(table, sharding.sharding, ranks):
                raise ValueError(f"table {table.name!r}: shards {sharding.shards} do not split it evenly {sharding.sharding}")

    def rank_bytes(self, tables: Sequence[EmbeddingTableConfig], optimizer: EmbeddingOptimizer | None) -> list[int]:
        """Weights + optimizer state bytes held by each rank of the group."""
        return self._every_rank(self._bytes_by_rank(tables, optimizer), 0)

    def rank_cost(self, tables: Sequence[EmbeddingTableConfig], ids_per_step: Mapping[str, float]) -> list[float]:
        """Estimated ids x dim per step on each rank."""
        return self._every_rank(self._cost_by_rank(tables, ids_per_step), 0.0)

    def max_rank_bytes(self, tables: Sequence[EmbeddingTableConfig], optimizer: EmbeddingOptimizer | None) -> int:
        """``max(rank_bytes(...))`` without a list of every rank (the planner asks for thousands of layouts, and a
        group may have a million ranks): ranks without a shard hold 0."""
        return max(self._bytes_by_rank(tables, optimizer).values(), default=0)

    def max_rank_cost(self, tables: Sequence[EmbeddingTableConfig], ids_per_step: Mapping[str, float]) -> float:
        """``max(rank_cost(...))``, as :meth:`max_rank_bytes` computes it."""
        return max(self._cost_by_rank(tables, ids_per_step).values(), default=0.0)

    def _bytes_by_rank(self, tables: Sequence[EmbeddingTableConfig],
                       optimizer: EmbeddingOptimizer | None) -> dict[int, int]:  # fmt: skip
        totals: dict[int, int] = {}
        for table in tables:
            for shard in self.tables[table.name].shards:
                totals[shard.rank] = totals.get(shard.rank, 0) + shard_bytes(table, shard, optimizer)
        return totals

    def _cost_by_rank(self, tables: Sequence[EmbeddingTableConfig],
                      ids_per_step: Mapping[str, float]) -> dict[int, float]:  # fmt: skip
        totals: dict[int, float] = {}
        for table in tables:
            sharding = self.tables[table.name]
            for shard in sharding.shards:
                ids = shard_ids_per_step(table, sharding, shard, ids_per_step.get(table.name, 0.0))
                totals[shard.rank] = totals.get(shard.rank, 0.0) + ids * shard.dim
        return totals

    def _every_rank(self, by_rank: Mapping[int, float], zero: float) -> list:
        totals = [zero] * self.world_size
        for rank, value in by_rank.items():
            totals[rank] = value
        return totals

    def explain(
        self,
        tables: Sequence[EmbeddingTableConfig],
        optimizer: EmbeddingOptimizer | None = EmbeddingOptimizer(),
        ids_per_step: Mapping[str, float] | None = None,
    ) -> str:
        """A readable table -> shards -> ranks listing with bytes and expected ids per step, then per-rank totals."""
        ids_per_step = ids_per_step or {}
        lines = []
        for table in tables:
            sharding = self.tables[table.name]
            ids = ids_per_step.get(table.name, 0.0)
            lines.append(
                f"table {table.name}: {table.num_embeddings} x {table.embedding_dim} "
                f"{str(table.dtype).removeprefix('torch.')}, {sharding.sharding}, {ids:.0f} ids/step"
            )
            for shard in sharding.shards:
                lines.append(
                    f"  rows [{shard.row_start}, {shard.row_end}) cols [{shard.col_start}, {shard.col_end}) -> rank {shard.rank}: "
                    f"{_format_bytes(shard_bytes(table, shard, optimizer))}, "
                    f"{shard_ids_per_step(table, sharding, shard, ids):.0f} ids/step"
                )
        costs = self.rank_cost(tables, ids_per_step)
        for rank, nbytes in enumerate(self.rank_bytes(tables, optimizer)):
            lines.append(f"rank {rank}: {_format_bytes(nbytes)}, cost {costs[rank]:.0f} id-elements/step")
        return "\n".join(lines)


def _format_bytes(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def _check_tables_and_counts(tables: Sequence[EmbeddingTableConfig], ids_per_step: Mapping[str, float]) -> None:
    """Unique table names, and ids per step keyed by them: a count keyed by feature name had been ignored, so the hot
    table cost nothing and was not split."""
    names = [t.name for t in tables]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"tables must have unique names; given more than once: {twice}")
    unknown = sorted(set(ids_per_step) - set(names))
    if unknown:
        raise ValueError(f"ids_per_step has keys that are not table names: {unknown} (tables: {sorted(names)})")
    bad = {name: count for name, count in ids_per_step.items()  # "5" had failed inside a comparison, True counted 1
           if not (is_number(count) and count >= 0 and math.isfinite(count))}
    if bad:
        raise ValueError(f"ids_per_step must be finite counts >= 0, got {bad}")


def plan_sharding(
    tables: Sequence[EmbeddingTableConfig],
    world_size: int,
    memory_budget: int,
    ids_per_step: Mapping[str, float],
    topology: Topology | None = None,
    optimizer: EmbeddingOptimizer | None = EmbeddingOptimizer(),
) -> ShardingPlan:
    """Choose a sharding and ranks per table so that every rank stays within ``memory_budget`` bytes
    (weights + optimizer state) while the estimated cost (ids per step x dim) is balanced.

    Greedy, most expensive table first (cost = ids_per_step[name] x dim, ties by bytes):

    1. A table that fits on no single rank (more bytes than the free budget of every rank) goes
       row-wise over the fewest ranks whose free memory holds an even row split: inside one host
       (``table_row_wise``, the ranks of the least loaded host) when a host suffices, else
       ``row_wise`` over the least loaded ranks.
    2. A "hot" table (cost above the per-rank average of the whole plan) is split column-wise over
       ``k = ceil(cost / average)`` ranks (at most the group, a divisor of its dim) so that no rank
       carries it alone.
    3. Otherwise table-wise on the rank with the lowest cost so far that has room.

    ``world_size`` is the sharding group's size (``ParallelConfig.sparse_group``); ``topology`` (hosts
    of ``gpus_per_host`` consecutive GROUP ranks) defaults to one host. With R sparse replicas the
    replicas of a shard share a host, so a host of H GPUs holds H / R ranks of a group: pass
    ``Topology(H // R)``. Raises ``ValueError`` when some
    table cannot be placed within the budget.
    """
    _check_tables_and_counts(tables, ids_per_step)
    if not is_int(world_size) or world_size < 1:  # before the topology, which divides by it; 2.0 failed deep
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not is_number(memory_budget) or not memory_budget > 0:  # NaN had read as 'does not fit', "1e6" failed deep
        raise ValueError(f"memory_budget must be a number of bytes > 0, got {memory_budget!r}")
    gpus_per_host = topology.clipped(world_size).gpus_per_host if topology is not None else world_size
    if world_size % gpus_per_host:
        raise ValueError(f"world_size {world_size} is not a whole number of hosts of {gpus_per_host} ranks (topology)")
    load = _Load(world_size, memory_budget)
    total_cost = sum(ids_per_step.get(t.name, 0.0) * t.embedding_dim for t in tables)
    average = total_cost / world_size
    chosen: dict[str, TableSharding] = {}

    def fits(sharding: TableSharding, table: EmbeddingTableConfig) -> bool:
        return all(shard_bytes(table, s, optimizer) <= load.free[s.rank] for s in sharding.shards)

    def commit(table: EmbeddingTableConfig, sharding: TableSharding) -> None:
        for s in sharding.shards:
            ids = shard_ids_per_step(table, sharding, s, ids_per_step.get(table.name, 0.0))
            load.place(s.rank, shard_bytes(table, s, optimizer), ids * s.dim)
        chosen[table.name] = sharding

    order = sorted(tables, key=lambda t: (ids_per_step.get(t.name, 0.0) * t.embedding_dim, t.num_embeddings * t.embedding_dim), reverse=True)
    for table in order:
        table_cost = ids_per_step.get(table.name, 0.0) * table.embedding_dim
        whole = shard_table(table, "table_wise", [0]).shards[0]
        whole_bytes = shard_bytes(table, whole, optimizer)
        fits_one_rank = whole_bytes <= load.most_free()
        sharding = None if fits_one_rank else _row_split(table, whole_bytes, gpus_per_host, load, fits)
        if fits_one_rank and average > 0 and table_cost > average and world_size > 1:
            wanted = min(world_size, math.ceil(table_cost / average))
            parts = max((k for k in range(2, wanted + 1) if table.embedding_dim % k == 0), default=None)
            if parts is not None:
                least_loaded = itertools.islice(_by_load(load), parts)
                candidate = shard_table(table, "column_wise", sorted(least_loaded))
                sharding = candidate if fits(candidate, table) else None
        if sharding is None and fits_one_rank:
            sharding = next((c for r in _by_load(load)
                             if fits(c := shard_table(table, "table_wise", [r]), table)), None)
        if sharding is None:
            raise ValueError(
                f"table {table.name!r} ({_format_bytes(whole_bytes)}) "
                "does not fit: " + (f"free bytes per rank {load.free}" if world_size <= 64 else
                                     f"the most free of the {world_size} ranks has {load.most_free()} bytes")
            )
        commit(table, sharding)
    return ShardingPlan(world_size, {t.name: chosen[t.name] for t in tables})


@dataclass
class _Load:
    """What :func:`plan_sharding` has placed so far: free bytes and cost per rank, and the ranks it changed (the
    others keep the whole ``budget`` and cost 0)."""

    world_size: int
    budget: int
    free: list[int] = field(init=False)
    cost: list[float] = field(init=False)
    changed: set[int] = field(default_factory=set, init=False)

    def __post_init__(self) -> None:
        self.free, self.cost = [self.budget] * self.world_size, [0.0] * self.world_size

    def place(self, rank: int, nbytes: int, cost: float) -> None:
        """A shard of ``nbytes`` and ``cost`` goes on ``rank`` (the one way the load changes, so ``changed`` holds)."""
        self.free[rank] -= nbytes
        self.cost[rank] += cost
        self.changed.add(rank)

    def most_free(self) -> int:
        """``max(free)`` without reading every rank."""
        if len(self.changed) < self.world_size:
            return self.budget
        return max(self.free[r] for r in self.changed)


def _by_load(load: _Load) -> Iterator[int]:
    """The ranks in the order of ``sorted(range(world_size), key=lambda r: (cost[r], -free[r]))``, lazily.

    A rank no table was placed on keeps cost 0 and the whole budget, the smallest key there is (costs and used bytes
    are >= 0); so the stable sort lists those ranks first, in index order, then the changed ones by key. The plan's
    callers take the first few, and a full sort of a million ranks a table made a 1M-GPU plan take hours.
    """
    free, cost, lowest = load.free, load.cost, (0.0, -load.budget)  # (the untouched ranks' key)
    moved = sorted((r for r in load.changed if (cost[r], -free[r]) != lowest), key=lambda r: (cost[r], -free[r], r))
    skipped = set(moved)
    yield from (r for r in range(load.world_size) if r not in skipped)
    yield from moved


def _row_split(
    table: EmbeddingTableConfig,
    table_bytes: int,
    gpus_per_host: int,
    load: _Load,
    fits: Callable[[TableSharding, EmbeddingTableConfig], bool],
) -> TableSharding | None:
    """Fewest ranks holding an even row split: inside the least loaded host first, else across hosts.

    The shards of a row split hold ``table_bytes`` between them (every shard keeps whole rows), so ranks whose free
    bytes sum to less cannot hold one: such hosts and rank counts are skipped without building the split, which
    changes no result (on a 65,536-GPU plan the host loop had built ~4M candidate splits, session 53).
    """
    free, cost = load.free, load.cost
    for first in _hosts_by_load(load, gpus_per_host):
        host = range(first, first + gpus_per_host)
        if sum(free[r] for r in host) >= table_bytes:
            candidate = _fewest_ranks(table, "table_row_wise", sorted(host, key=lambda r: (cost[r], -free[r])),
                                      table_bytes, free, fits)
            if candidate is not None:
                return candidate
    return _fewest_ranks(table, "row_wise", _by_load(load), table_bytes, free, fits)


def _hosts_by_load(load: _Load, gpus_per_host: int) -> list[int]:
    """The first ranks of the hosts in the order of a stable sort by their ranks' summed cost, keeping of the hosts
    no table was placed on only the first: they are alike (every rank free, cost 0), so where it fails all fail,
    and the sort puts it before the others (their sum, 0, is the least there is)."""
    touched = {r - r % gpus_per_host for r in load.changed}
    summed = {h: sum(load.cost[r] for r in range(h, h + gpus_per_host)) for h in touched}
    untouched = next((h for h in range(0, load.world_size, gpus_per_host) if h not in touched), None)
    idle = sorted([h for h, total in summed.items() if total == 0.0] + ([] if untouched is None else [untouched]))
    return idle + sorted((h for h, total in summed.items() if total > 0.0), key=lambda h: (summed[h], h))


def _fewest_ranks(table: EmbeddingTableConfig, sharding: ShardingType, by_load: Iterable[int], table_bytes: int,
                  free: list[int], fits: Callable[[TableSharding, EmbeddingTableConfig], bool]) -> TableSharding | None:
    """The row split over the first 2, 3, ... ranks of ``by_load`` that first fits, or None."""
    taken: list[int] = []
    held = 0
    for rank in by_load:
        taken.append(rank)
        held += free[rank]
        if len(taken) > table.num_embeddings:  # a row is not split: no more ranks can help
            return None
        if len(taken) < 2 or held < table_bytes:  # these ranks cannot hold the table between them
            continue
        candidate = shard_table(table, sharding, sorted(taken))
        if fits(candidate, table):
            return candidate
    return None


__all__ = [
    "SHARDING_TYPES",
    "Shard",
    "ShardingPlan",
    "ShardingType",
    "TableSharding",
    "plan_sharding",
    "shard_bytes",
    "shard_table",
]
