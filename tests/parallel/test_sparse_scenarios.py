"""Tables, batches and per-rank scenarios of the sharded-embedding tests (no tests here; runs in the workers).

One 4-rank gloo session runs every scenario (spawning dominates the cost): sharding groups of 4 ranks
(the world) and of 2 ranks (the subgroups {0, 1} and {2, 3}, each running the 2-rank scenario on the
same global batch), plus the 2D layouts (groups of 2 x 2 replicas). Each scenario returns the outputs of
every step for this rank's samples and the final full tables; the tests compare them with an unsharded
`EmbeddingCollection` trained on the global batch in the test process.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from opengem.jagged import Jagged, KeyedJagged
from opengem.nn.embedding import EmbeddingCollection, EmbeddingOptimizer, EmbeddingTableConfig
from opengem.parallel import CommStats, ModelOptimizerState, ParallelConfig, build_meshes, load_distributed, save_distributed
from opengem.parallel.sparse import ShardedEmbeddingCollection
from opengem.parallel.sparse_plan import SHARDING_TYPES, ShardingPlan, shard_table

GLOBAL_BATCH, STEPS = 8, 3
UNEVEN_4 = (0, 1, 3, 3, 8)  # rank 2 of the 4-rank group has no samples
ADAGRAD = EmbeddingOptimizer("rowwise_adagrad", lr=0.1)
ADAM = EmbeddingOptimizer("rowwise_adam", lr=0.05, weight_decay=0.01)
SGD = EmbeddingOptimizer("sgd", lr=0.1)


def tables() -> list[EmbeddingTableConfig]:
    """Pooled sum, pooled mean shared by two features, and a sequence table; odd sizes on purpose."""
    return [
        EmbeddingTableConfig("users", 11, 4, ("user",), "sum"),
        EmbeddingTableConfig("items", 9, 6, ("item", "item_history"), "mean"),
        EmbeddingTableConfig("tokens", 13, 5, ("tokens",), "none"),
    ]


ROWS = {"user": 11, "item": 9, "item_history": 9, "tokens": 13}


def batch(step: int, batch_size: int = GLOBAL_BATCH) -> KeyedJagged:
    """Lengths 0-4 (empty bags included), ids with duplicates inside and across samples."""
    generator = torch.Generator().manual_seed(1000 + step)
    keys = tuple(ROWS)
    lengths = torch.randint(0, 5, (len(keys), batch_size), generator=generator)
    ids = [torch.randint(0, ROWS[k], (int(lengths[i].sum()),), generator=generator) for i, k in enumerate(keys)]
    return KeyedJagged(keys, torch.cat(ids), lengths.flatten())


def full_weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return {t.name: torch.randn(t.num_embeddings, t.embedding_dim, generator=generator) * 0.5 for t in tables()}


def bounds(group_size: int, uneven: bool) -> tuple[int, ...]:
    if uneven:
        return UNEVEN_4
    return tuple(GLOBAL_BATCH * i // group_size for i in range(group_size + 1))


def samples(kj: KeyedJagged, start: int, stop: int) -> KeyedJagged:
    """Samples ``start:stop`` of every feature."""
    parts = {}
    for key, jagged in kj.to_dict().items():
        lo, hi = int(jagged.offsets_host[start]), int(jagged.offsets_host[stop])
        parts[key] = Jagged.from_lengths(jagged.values[lo:hi], jagged.lengths()[start:stop])
    return KeyedJagged.from_dict(parts)


def as_tensor(value: torch.Tensor | Jagged) -> torch.Tensor:
    return value.values if isinstance(value, Jagged) else value


def loss_of(outputs: dict[str, torch.Tensor | Jagged]) -> torch.Tensor:
    """A sum over output rows (so the ranks' losses add up to the global batch's)."""
    return sum(0.5 * as_tensor(v).float().pow(2).sum() + 0.3 * as_tensor(v).float().sum() for v in outputs.values())


def train(module: torch.nn.Module, batches: list[KeyedJagged]) -> list[dict[str, torch.Tensor]]:
    """Forward, loss, backward (fused updates) per batch; returns each step's outputs."""
    seen = []
    for kj in batches:
        out = module(kj)
        seen.append({k: as_tensor(v).detach().clone() for k, v in out.items()})
        loss_of(out).backward()
    return seen


def reference(optimizer: EmbeddingOptimizer, batches: list[KeyedJagged]) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """The unsharded collection trained on ``batches``: per-step outputs and final tables."""
    module = EmbeddingCollection(tables(), optimizer)
    with torch.no_grad():
        for name, weight in full_weights().items():
            module.embedding_weight(name).copy_(weight)
    outputs = train(module, batches)
    return outputs, {t.name: module.embedding_weight(t.name).detach().clone() for t in tables()}


def plan_all(sharding: str, group_size: int) -> ShardingPlan:
    """Every table sharded the same way; table-wise puts table i on rank i mod the group."""
    return ShardingPlan(
        group_size,
        {
            t.name: shard_table(t, sharding, [i % group_size] if sharding == "table_wise" else range(group_size))
            for i, t in enumerate(tables())
        },
    )


def mixed_plan(group_size: int) -> ShardingPlan:
    ts = tables()
    return ShardingPlan(
        group_size,
        {
            "users": shard_table(ts[0], "row_wise", range(group_size)),
            "items": shard_table(ts[1], "column_wise", range(group_size)),
            "tokens": shard_table(ts[2], "table_wise", [group_size - 1]),
        },
    )


def run_sharded(
    plan: ShardingPlan,
    group: Any,
    optimizer: EmbeddingOptimizer,
    my_samples: tuple[int, int],
    checkpoint: str | None = None,
    **options: Any,
) -> dict[str, Any]:
    """3 training steps; with ``checkpoint`` (a directory), also save, then resume into a fresh module
    (another seed) and train one more step next to the original."""
    stats = CommStats()
    module = ShardedEmbeddingCollection(tables(), plan, group, optimizer, stats=stats, **options)
    module.load_full_weights(full_weights())
    batches = [samples(batch(step), *my_samples) for step in range(STEPS)]
    with torch.no_grad():
        stats.reset()
        module(batches[0])
        first_forward = dict(stats.bytes)
    outputs = train(module, batches)
    result = {"outputs": outputs, "weights": module.full_weights(), "first_forward_bytes": first_forward, "local_batch": batches[0]}
    if checkpoint is not None:
        save_distributed({"embeddings": ModelOptimizerState(module)}, checkpoint)
        resumed = ShardedEmbeddingCollection(tables(), plan, group, optimizer, seed=1, **options)
        load_distributed({"embeddings": ModelOptimizerState(resumed)}, checkpoint)
        result["resumed_weights"] = resumed.full_weights()
        next_batch = samples(batch(STEPS), *my_samples)
        result["next_step"] = [train(m, [next_batch])[0] for m in (module, resumed)]
        result["next_weights"] = [m.full_weights() for m in (module, resumed)]
    return result


def one_d(group_size: int, group: Any, group_rank: int, checkpoint: str | None = None) -> dict[str, Any]:
    """``checkpoint``: a directory for the DCP round trip (only where the group is the whole world:
    DCP coordinates over the default group)."""
    uneven = group_size == 4
    edges = bounds(group_size, uneven)
    mine = (edges[group_rank], edges[group_rank + 1])
    results = {f"{s}/adagrad": run_sharded(plan_all(s, group_size), group, ADAGRAD, mine) for s in SHARDING_TYPES}
    results["mixed/adam"] = run_sharded(mixed_plan(group_size), group, ADAM, mine, checkpoint and f"{checkpoint}/mixed")
    results["column_wise/adam"] = run_sharded(plan_all("column_wise", group_size), group, ADAM, mine)
    return results


def two_d(rank: int, checkpoint: str) -> dict[str, Any]:
    """Groups of 2 (ranks {0, 2} and {1, 3}) x 2 replicas ({0, 1} and {2, 3}) on 4 ranks."""
    meshes = build_meshes(ParallelConfig(sparse_group=2, sparse_replicate=2))
    group_rank = meshes.sparse.get_local_rank("sparse_group")
    global_slice = (rank * GLOBAL_BATCH // 4, (rank + 1) * GLOBAL_BATCH // 4)  # every rank its own data
    same_slice = (group_rank * GLOBAL_BATCH // 2, (group_rank + 1) * GLOBAL_BATCH // 2)  # replicas see the same data
    plan = mixed_plan(2)
    return {
        "sgd_sync1": run_sharded(plan, meshes.sparse, SGD, global_slice),
        "adagrad_same_data": run_sharded(plan, meshes.sparse, ADAGRAD, same_slice),
        "adagrad_sync1": run_sharded(plan, meshes.sparse, ADAGRAD, global_slice),
        "adagrad_fully": run_sharded(plan, meshes.sparse, ADAGRAD, global_slice, f"{checkpoint}/fully", fully_sharded=True),
        "sgd_fully": run_sharded(plan, meshes.sparse, SGD, global_slice, fully_sharded=True),
        "sync_every_2": sync_every_two(meshes.sparse, plan, global_slice),
    }


def sync_every_two(mesh: Any, plan: ShardingPlan, my_samples: tuple[int, int]) -> dict[str, Any]:
    """Replicas' tables after each of two steps with sync_every=2 (all-gathered over the replica group)."""
    module = ShardedEmbeddingCollection(tables(), plan, mesh, ADAGRAD, sync_every=2)
    module.load_full_weights(full_weights())
    replica_group = mesh.get_group("sparse_replicate")
    after = []
    for step in range(2):
        loss_of(module(samples(batch(step), *my_samples))).backward()
        weights = module.full_weights()
        gathered: list[Any] = [None] * dist.get_world_size(replica_group)
        dist.all_gather_object(gathered, weights, group=replica_group)
        after.append(gathered)
    return {"after": after}


def session_world4(checkpoint: str) -> dict[str, Any]:
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    return {
        "world4": one_d(4, dist.group.WORLD, rank, checkpoint),
        "world2": one_d(2, pairs[rank // 2], rank % 2),
        "two_d": two_d(rank, checkpoint),
    }
