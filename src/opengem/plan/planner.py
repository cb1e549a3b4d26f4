"""Enumerate the 5D layouts of a preset on a cluster, predict each (``opengem.plan.cost``), rank by E2E MFU.

Search space: every ``ParallelConfig`` that ``validate_layout`` accepts for the GPU count (dense
replicate x shard, expert degree 1 or the preset's expert count, sparse replicas dividing a host,
sparse 2D or fully sharded 2D), activation checkpointing on/off, SM-free (copy-engine) collectives
or not, resharding after forward or not, and the per-GPU batch (the global batch grows with the GPU
count: weak scaling). Embedding tables are placed by ``plan_sharding`` for each sparse group size and
memory budget (cached).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path

from opengem.parallel.fsdp import fsdp_step_bytes
from opengem.parallel.mesh import ParallelConfig, Topology, check_whole_hosts, validate_layout
from opengem.parallel.sparse_plan import ROW_SPLIT_TYPES, ShardingPlan, plan_sharding, state_bytes_per_row
from opengem.plan.calibration import SHIPPED as SHIPPED_CALIBRATIONS, Calibration, Rates, load_calibration
from opengem.plan.cluster import Cluster
from opengem.plan.comm import expert_bytes, fsdp_units, sparse_index_bytes
from opengem.plan.cost import BF16, FRAMEWORK_RESERVE, Layout, Prediction, SparseCost, dense_memory, estimate
from opengem.plan.workload import Workload, workload
from opengem.validation import is_int

LOCAL_BATCHES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
BUDGET_STEP = 4 * 2**30  # embedding budgets are rounded down to this, so sharding plans are shared


def _cluster_calibration(cluster: Cluster) -> Calibration:
    """The table the cluster file names (``load_cluster`` already pointed a relative path at its folder)."""
    try:
        return load_calibration(cluster.calibration)
    except FileNotFoundError:
        folder = Path(cluster.source).parent
        looked = "" if Path(cluster.calibration).is_absolute() else f"looked in {folder} and the current directory; "
        raise FileNotFoundError(f"{cluster.source}: calibration = {cluster.calibration!r} not found "
                                f"({looked}shipped: {', '.join(SHIPPED_CALIBRATIONS)})") from None


def _plan_key(group: int, replicas: int, budget: float) -> tuple[int, int, int]:
    """Layouts whose sparse group, replicas and embedding budget (rounded down to BUDGET_STEP) agree share a plan."""
    return group, replicas, int(budget // BUDGET_STEP)


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass
class Plan:
    preset: str
    cluster: Cluster
    gpus: int
    ranked: list[Prediction]  # feasible, best first
    evaluated: int
    infeasible: int

    @property
    def best(self) -> Prediction:
        return self.ranked[0]


class Planner:
    def __init__(self, preset: str, cluster: Cluster, gpus: int, calibration: str | None = None) -> None:
        if not is_int(gpus):
            raise ValueError(f"--gpus must be an integer, got {gpus!r}")
        if gpus < 1 or gpus > cluster.total_gpus:
            raise ValueError(f"--gpus {gpus}: the cluster {cluster.name} has {cluster.total_gpus} GPUs")
        try:  # validate_layout's host rule: every layout would fail it
            check_whole_hosts(cluster.topology, gpus)
        except ValueError:
            host = cluster.gpus_per_host
            raise ValueError(f"--gpus {gpus}: not a whole number of hosts of {host} GPUs (cluster {cluster.name}); "
                             f"use a multiple of {host} or at most {host}") from None
        self.workload: Workload = workload(preset)
        self.preset, self.cluster, self.gpus = preset, cluster, gpus
        self.rates = Rates(load_calibration(calibration) if calibration else _cluster_calibration(cluster), cluster.gpu)
        self._plans: dict[tuple[int, int, int], ShardingPlan | None] = {}
        self._fsdp: dict[tuple, dict] = {}
        self._busiest: dict[tuple, tuple[int, float]] = {}

    # --- pieces --------------------------------------------------------------------------------------------

    def layouts(self, local_batches: tuple[int, ...] = LOCAL_BATCHES) -> list[Layout]:
        w, n, topology = self.workload, self.gpus, self.cluster.topology
        experts = sorted({1, w.model.num_experts} if w.experts else {1})
        found = []
        for shard, expert, sparse_replicate in itertools.product(divisors(n), experts, divisors(self.cluster.gpus_per_host)):
            if n % sparse_replicate:
                continue  # no whole sparse group (ParallelConfig refuses sparse_group 0 when made)
            for checkpointing, collectives, reshard in itertools.product((False, True), ("default", "copy_engine"), (True, False)):
                if shard == 1 and (collectives != "default" or not reshard):
                    continue  # nothing is sharded: these options change nothing
                config = ParallelConfig(n // shard, shard, expert, n // sparse_replicate,
                                        sparse_replicate, reshard, 1, checkpointing, collectives)
                try:
                    config = validate_layout(config, topology, n)
                except ValueError:
                    continue
                for batch, fully in itertools.product(local_batches, (False, True) if sparse_replicate > 1 else (False,)):
                    found.append(Layout(config, batch, fully))
        return found

    def sparse_plan(self, group: int, replicas: int, budget: float) -> ShardingPlan | None:
        w = self.workload
        key = _plan_key(group, replicas, budget)
        if key not in self._plans:
            budget = key[2] * BUDGET_STEP
            total = sum(t.num_embeddings * (t.embedding_dim * t.dtype.itemsize + state_bytes_per_row(t.embedding_dim, w.embedding_optimizer)) for t in w.tables)
            plan = None
            if budget > 0 and total <= 0.9 * budget * group:  # else plan_sharding would search a long time and fail
                ids = {t.name: n for t, n in ((t, w.ids_per_sample[t.name]) for t in w.tables)}
                try:
                    plan = plan_sharding(list(w.tables), group, budget, ids, Topology(max(1, self.cluster.gpus_per_host // replicas)), w.embedding_optimizer)
                except ValueError:
                    plan = None
            self._plans[key] = plan
        return self._plans[key]

    def sparse_cost(self, layout: Layout, budget: float) -> SparseCost | None:
        c, b, w = layout.parallel, layout.local_batch, self.workload
        plan = self.sparse_plan(c.sparse_group, c.sparse_replicate, budget)
        if plan is None:
            return None
        # the busiest rank's bytes and ids x dim a step: the same for every layout of one plan and batch
        key = (*_plan_key(c.sparse_group, c.sparse_replicate, budget), b)
        if key not in self._busiest:
            scale = c.sparse_group * b  # the plan was made with ids per sample; a step looks up G x b samples
            tables = list(w.tables)
            self._busiest[key] = (plan.max_rank_bytes(tables, w.embedding_optimizer),
                                  plan.max_rank_cost(tables, {k: v * scale for k, v in w.ids_per_sample.items()}))
        held, busiest = self._busiest[key]
        element = max(t.dtype.itemsize for t in w.tables)
        shards = {name: len(s.shards) for name, s in plan.tables.items()}
        row_split = {name: s.sharding in ROW_SPLIT_TYPES for name, s in plan.tables.items()}
        index = sparse_index_bytes(c, b, {k: v * b for k, v in w.ids_per_sample.items()}, shards, row_split)
        a2a = {coll: n for (dim, coll), n in index.items()}
        a2a["all_to_all_embeddings"] = busiest * element
        a2a["all_to_all_embedding_grads"] = busiest * element
        replica: dict[str, float] = {}
        if c.sparse_replicate > 1 and layout.sparse_fully_sharded:
            replica = {"all_gather": held, "reduce_scatter": held}
            held = held + held / c.sparse_replicate
        elif c.sparse_replicate > 1:
            replica = {"all_reduce": held / layout.sparse_sync_every}
        return SparseCost(held, busiest * element, a2a, replica)

    def fsdp_bytes(self, config: ParallelConfig) -> dict:
        key = (config.dense_replicate, config.dense_shard, config.expert, config.reshard_after_forward)
        if key not in self._fsdp:
            self._fsdp[key] = fsdp_step_bytes(fsdp_units(self.workload, config), BF16, 4)
        return self._fsdp[key]

    def predict(self, layout: Layout) -> Prediction:
        w, c = self.workload, layout.parallel
        dense = sum(dense_memory(w, layout, self.rates.table.activation_bytes).values()) + FRAMEWORK_RESERVE
        budget = self.cluster.gpu.hbm_bytes - dense
        sparse = self.sparse_cost(layout, budget) if budget > 0 else None
        expert = expert_bytes(w, c, layout.local_batch, BF16)
        return estimate(w, self.cluster, self.rates, layout, sparse, self.fsdp_bytes(c), expert)

    def plan(self, local_batches: tuple[int, ...] = LOCAL_BATCHES, batch_shuffling: bool = True,
             sparse_sync_every: int = 1) -> Plan:
        if not isinstance(local_batches, (tuple, list)) or not local_batches or any(
                not is_int(b) or b < 1 for b in local_batches):
            raise ValueError(f"local_batches must be non-empty integers >= 1, got {local_batches!r}")
        if not is_int(sparse_sync_every) or sparse_sync_every < 1:
            raise ValueError(f"sparse_sync_every must be an integer >= 1, got {sparse_sync_every!r}")
        layouts = [dataclasses.replace(l, batch_shuffling=batch_shuffling, sparse_sync_every=sparse_sync_every)
                   for l in self.layouts(local_batches)]
        predictions = []
        infeasible = 0
        for layout in layouts:
            if any(p.layout.parallel == layout.parallel and p.layout.sparse_fully_sharded == layout.sparse_fully_sharded
                   and p.layout.local_batch < layout.local_batch and not p.fits for p in predictions[-len(local_batches):]):
                infeasible += 1  # a smaller batch of the same layout already did not fit
                continue
            prediction = self.predict(layout)
            if prediction.fits:
                predictions.append(prediction)
            else:
                infeasible += 1
                predictions.append(prediction)
        ranked = sorted((p for p in predictions if p.fits), key=lambda p: -p.e2e_mfu)
        if not ranked:  # the checks above leave at least one valid layout: here memory is what failed
            raise ValueError(f"no layout of {self.preset} fits {self.gpus} GPUs of {self.cluster.name} "
                             f"({self.cluster.gpu.hbm_gib:.0f} GiB each): none of the {len(layouts)} layouts "
                             f"evaluated fits in memory")
        return Plan(self.preset, self.cluster, self.gpus, ranked, len(layouts), infeasible)
