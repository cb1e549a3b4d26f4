"""Memory per GPU and step time of one layout: the cost model behind the planner.

Step time per GPU = max(host, device + exposed communication), where

- device = kernel time (FLOPs / calibrated rates; memory-bound work / calibrated bandwidths) times the
  load imbalance of the slowest rank (``imbalance``) times the SM-contention penalty of NCCL kernels
  overlapping compute, plus the recomputed forward under activation checkpointing;
- host = the measured host time of a step (``bench calibrate``'s host probe: per step + per layer) or,
  in tables without it, launches x per-launch host cost + attention-op calls x their host work (a
  host-bound step runs at the host's pace: the GPU idles between launches);
- exposed communication: FSDP all-gathers hidden behind forward compute and reduce-scatters /
  all-reduces behind backward compute when prefetching (the first unit's gather is always exposed);
  expert-parallel and sparse all-to-all traffic sits on the critical path; sparse replica syncs too.

Memory per GPU: FSDP-sharded fp32 parameters, gradients and Adam states; the gathered bf16 blocks
(prefetch depth + 1, or all of them without resharding); activations (all layers, or only the block
inputs plus one layer under checkpointing); expert-parallel gather buffers; embedding shards with their
optimizer state (from ``plan_sharding``) and lookup buffers; a fixed framework reserve.

MFU (GEM_SPEC section 8): useful FLOPs / (step time x dense BF16 peak). Local MFU: the same FLOPs over
the kernel time alone (no host, communication, imbalance or recompute). Scaling ratio = E2E / local.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from opengem.parallel.mesh import ParallelConfig
from opengem.plan.calibration import Rates
from opengem.plan.cluster import Cluster
from opengem.plan.comm import collective_seconds, group_tier
from opengem.plan.workload import Workload
from opengem.validation import is_int, require_at_least

BF16, FP32 = 2, 4
ADAM_STATE_BYTES = FP32 + FP32 + 2 * FP32  # fp32 master, fp32 gradient, two moments
OPTIMIZER_TRAFFIC_BYTES = 28  # Adam reads param, grad, m, v and writes param, m, v (fp32)
FRAMEWORK_RESERVE = 3 * 2**30  # CUDA context, NCCL buffers, allocator slack
SUB_BATCH = 128  # Base Batch Shuffling's sub-batch (GEM_SPEC section 7)


@dataclass(frozen=True)
class Layout:
    parallel: ParallelConfig  # resolved
    local_batch: int
    sparse_fully_sharded: bool = False
    batch_shuffling: bool = True
    sparse_sync_every: int = 1

    def __post_init__(self) -> None:
        for name in ("local_batch", "sparse_sync_every"):  # 2.5 and True had been predicted
            if not is_int(getattr(self, name)):
                raise ValueError(f"Layout: {name} must be an int, got {getattr(self, name)!r}")
        require_at_least(self, ("local_batch", "sparse_sync_every"), 1)  # 0 divided by zero, < 0 reached math.log
        for name in ("sparse_fully_sharded", "batch_shuffling"):  # "no" had meant yes
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Layout: {name} must be a bool, got {getattr(self, name)!r}")
        if self.parallel.dense_shard < 1 or self.parallel.sparse_group < 1:  # -1 had been costed as -1 ranks
            raise ValueError("Layout: parallel must be resolved (validate_layout), got dense_shard="
                             f"{self.parallel.dense_shard}, sparse_group={self.parallel.sparse_group}")

    def describe(self) -> str:
        c = self.parallel
        sparse = "fs2d" if self.sparse_fully_sharded else "2d"
        return (f"R{c.dense_replicate} S{c.dense_shard} E{c.expert} G{c.sparse_group} "
                f"SR{c.sparse_replicate}{sparse if c.sparse_replicate > 1 else ''} b{self.local_batch}"
                f"{' ac' if c.activation_checkpointing else ''}{' ce' if c.collectives == 'copy_engine' else ''}"
                f"{'' if c.reshard_after_forward else ' noreshard'}")


@dataclass(frozen=True)
class CollectiveCost:
    dim: str
    collective: str
    tier: str
    group: int
    bytes: float
    seconds: float
    exposed: float


@dataclass
class Prediction:
    layout: Layout
    fits: bool
    memory: dict[str, float]
    step_s: float = math.inf
    device_s: float = 0.0
    host_s: float = 0.0
    kernels_s: float = 0.0
    exposed_comm_s: float = 0.0
    imbalance: float = 1.0
    imbalance_without_shuffling: float = 1.0
    e2e_mfu: float = 0.0
    local_mfu: float = 0.0
    kernel_times: dict[str, float] = field(default_factory=dict)
    collectives: list[CollectiveCost] = field(default_factory=list)

    @property
    def memory_total(self) -> float:
        return sum(self.memory.values())

    @property
    def scaling_ratio(self) -> float:
        return self.e2e_mfu / self.local_mfu if self.local_mfu else 0.0


def imbalance_factor(cv: float, local_batch: int, world: int, shuffling: bool) -> float:
    """Slowest rank / mean rank: a rank's cost sums ``local_batch`` samples with coefficient of variation
    ``cv``; the largest of ``world`` such sums is ~ sqrt(2 ln world) standard deviations above the mean.
    Base Batch Shuffling deals sub-batches of 128 sorted by cost (heavy with light): a stratified sum,
    whose spread falls like 1/k in the k sub-batches instead of 1/sqrt(k); below one sub-batch it cannot help."""
    if world <= 1:
        return 1.0
    spread = cv / math.sqrt(local_batch)
    sub_batches = local_batch / SUB_BATCH
    if shuffling and sub_batches >= 2:
        spread = cv / math.sqrt(SUB_BATCH) / sub_batches
    return 1.0 + math.sqrt(2 * math.log(world)) * spread


@dataclass(frozen=True)
class KernelTimes:
    """Per-step kernel seconds on one GPU (no imbalance), and the forward share for recompute."""

    times: dict[str, float]
    forward: float

    @property
    def total(self) -> float:
        return sum(self.times.values())


def kernel_times(workload: Workload, rates: Rates, local_batch: int, embedding_bytes: float, dense_local_params: float) -> KernelTimes:
    """Kernel time of one step: GEMMs, attention by family, element-wise, embeddings, dense optimizer."""
    config, b = workload.model, local_batch
    d, layers = config.d_model, config.num_layers
    tokens = b * workload.tokens
    f = {k: v * b for k, v in workload.flops.items()}
    gemm_rate = rates.gemm_flops_per_s(tokens, 3 * d, d)
    times = {"gemm": 3 * f["gemm"] / gemm_rate}
    forward = f["gemm"] / gemm_rate
    if config.self_attention == "jfa":
        fwd, bwd = rates.attention_flops_per_s("jfa", workload.self_keys_per_query)
        times["jfa"] = f["self_attention"] / fwd + 2.5 * f["self_attention"] / bwd
        forward += f["self_attention"] / fwd
    else:  # BlockAttention is bandwidth-bound: q, k, v read and o written once (bf16); backward twice that
        fwd_gbps, bwd_gbps = rates.table.block_attention_gbps
        moved = 4 * tokens * d * BF16 * layers
        times["block_attention"] = moved / rates.bytes_per_s(fwd_gbps) + 2 * moved / rates.bytes_per_s(bwd_gbps)
        forward += moved / rates.bytes_per_s(fwd_gbps)
    for family, keys in (("pffn", config.num_summary_tokens), ("pooling", config.num_seeds)):
        fwd, bwd = rates.attention_flops_per_s("gdpa", keys)
        times[f"gdpa_{family}"] = f[family] / fwd + 2.5 * f[family] / bwd
        forward += f[family] / fwd
    elementwise = tokens * layers * d * rates.table.elementwise_bytes / rates.bytes_per_s(rates.table.copy_gbps)
    times["elementwise"] = elementwise
    forward += elementwise / 3
    times["embeddings"] = 3 * embedding_bytes / rates.bytes_per_s(rates.table.embedding_gbps)
    times["optimizer"] = dense_local_params * OPTIMIZER_TRAFFIC_BYTES / rates.bytes_per_s(rates.table.copy_gbps)
    return KernelTimes(times, forward)


def host_seconds(workload: Workload, rates: Rates, checkpointing: bool) -> float:
    host = rates.table.host
    layers = workload.num_layers
    if host.step_ms is not None:  # measured by the host probe; checkpointing reruns each layer's forward
        return (host.step_ms + host.layer_ms * layers * (4 / 3 if checkpointing else 1)) * 1e-3
    launches = host.launches_per_layer * layers * (4 / 3 if checkpointing else 1) + host.launches_per_step
    per_layer_calls = 2 * (1 + workload.model.use_pffn + workload.model.use_pooling)  # fwd + bwd per op
    calls = layers * per_layer_calls * (1.5 if checkpointing else 1)
    return (launches * host.launch_us + calls * host.attention_call_us) * 1e-6


def dense_memory(workload: Workload, layout: Layout, activation_bytes: float) -> dict[str, float]:
    """Bytes per GPU of everything but the embeddings; ``activation_bytes`` per token, layer and d_model element."""
    c, b = layout.parallel, layout.local_batch
    expert_parallel = c.expert > 1
    expert_total = sum(p.numel() for e in workload.experts for p in e.all_params)
    expert_local = sum(p.numel() for e in workload.experts for p in e.expert_params) if expert_parallel else 0
    shared = workload.dense_params - (expert_total if expert_parallel else 0)
    states = ADAM_STATE_BYTES * (shared / c.dense_shard + expert_local / max(c.dense_shard // c.expert, 1))
    block = workload.block_params(expert_parallel) + (expert_local / len(workload.experts) if expert_parallel and workload.experts else 0)
    root = sum(p.numel() for p in workload.root_params)
    if c.reshard_after_forward:
        gathered = BF16 * ((1 + c.prefetch) * block + root) + 2 * FP32 * block  # + unsharded grads during reduce-scatter
    else:
        gathered = BF16 * (shared + expert_local) + 2 * FP32 * block
    d, layers, tokens = workload.model.d_model, workload.num_layers, b * workload.tokens
    per_layer = tokens * d * activation_bytes
    activations = (tokens * d * BF16 * layers + per_layer) if c.activation_checkpointing else per_layer * layers
    memory = {"dense_states": states, "gathered_params": gathered, "activations": activations}
    if expert_parallel and workload.experts:
        layer = workload.experts[0]
        memory["expert_buffers"] = c.expert * b * (layer.input_elems + layer.output_elems) * BF16 * 2
    return memory


@dataclass(frozen=True)
class SparseCost:
    """What the embedding side costs one rank: memory, lookup bytes and exchanged bytes per step."""

    memory: float  # shards + optimizer state (+ the gathered group shard when fully sharded)
    lookup_bytes: float  # embedding rows read per step on the busiest rank
    all_to_all_bytes: dict[str, float]  # ids / lengths / embeddings / embedding_grads sent by the busiest rank
    replica_bytes: dict[str, float]  # sparse_replicate collective -> bytes per step


def estimate(workload: Workload, cluster: Cluster, rates: Rates, layout: Layout, sparse: SparseCost | None,
             fsdp_bytes: dict[tuple[str, str], float], expert: dict[tuple[str, str], float]) -> Prediction:
    """Predict one layout (``sparse`` None: the tables do not fit; the prediction says so)."""
    c, b = layout.parallel, layout.local_batch
    world = c.dense_replicate * c.dense_shard
    memory = dense_memory(workload, layout, rates.table.activation_bytes)
    memory["framework"] = FRAMEWORK_RESERVE
    if sparse is None:
        return Prediction(layout, False, {**memory, "embeddings": math.inf})
    memory["embeddings"] = sparse.memory
    memory["embedding_buffers"] = 4 * sum(v for k, v in sparse.all_to_all_bytes.items() if k.startswith("embedding"))
    fits = sum(memory.values()) <= cluster.gpu.hbm_bytes
    expert_parallel = c.expert > 1
    shared = workload.dense_params - (sum(p.numel() for e in workload.experts for p in e.all_params) if expert_parallel else 0)
    local_params = shared / c.dense_shard
    kernels = kernel_times(workload, rates, b, sparse.lookup_bytes, local_params)
    imbalance = imbalance_factor(workload.cost_cv, b, world, layout.batch_shuffling)
    no_shuffle = imbalance_factor(workload.cost_cv, b, world, False)
    recompute = kernels.forward if c.activation_checkpointing else 0.0
    compute_fwd = kernels.forward * imbalance
    compute_bwd = (kernels.total - kernels.forward + recompute) * imbalance

    collectives: list[CollectiveCost] = []

    def add(dim: str, collective: str, nbytes: float, calls: int, exposed_share: float | None = None) -> float:
        size, tier = group_tier(cluster, c, dim)
        seconds = collective_seconds(collective, nbytes, size, tier, calls)
        collectives.append(CollectiveCost(dim, collective, tier.name, size, nbytes, seconds, seconds if exposed_share is None else exposed_share))
        return seconds

    units = len(workload.blocks) + 1 + (len(workload.experts) if expert_parallel else 0)
    gather = sum(add(dim, coll, n, units) for (dim, coll), n in fsdp_bytes.items() if coll == "all_gather")
    reduce = sum(add(dim, coll, n, units) for (dim, coll), n in fsdp_bytes.items() if coll != "all_gather")
    # Overlap: prefetch hides gathers behind forward (half of them when resharding: the backward's
    # re-gathers hide behind backward) and reductions behind backward; the first unit's gather never hides.
    fwd_gather = gather / 2 if c.reshard_after_forward else gather
    if c.prefetch > 0:
        exposed_fsdp = gather / units + max(0.0, fwd_gather - compute_fwd) + max(0.0, gather - fwd_gather + reduce - compute_bwd)
    else:
        exposed_fsdp = gather + reduce
    overlapped = gather + reduce - exposed_fsdp
    share = exposed_fsdp / (gather + reduce) if gather + reduce else 0.0  # spread the exposure pro rata
    collectives[:] = [CollectiveCost(x.dim, x.collective, x.tier, x.group, x.bytes, x.seconds, x.seconds * share)
                      for x in collectives]
    critical = 0.0
    for (dim, coll), nbytes in expert.items():
        critical += add(dim, coll, nbytes, 2 * len(workload.experts))
    for coll, nbytes in sparse.all_to_all_bytes.items():
        critical += add("sparse_group", coll, nbytes, 1)
    for coll, nbytes in sparse.replica_bytes.items():
        critical += add("sparse_replicate", coll, nbytes, 1)
    critical += add("world", "all_reduce", 24, 2)
    # SM contention: NCCL kernels running beside compute slow it; copy-engine all-gathers inside a host do not.
    sm_free = c.collectives == "copy_engine" and group_tier(cluster, c, "shard")[1].name == "nvlink"
    contended = overlapped * (0.5 if sm_free else 1.0)  # reduce-scatter still runs NCCL kernels
    device_compute = compute_fwd + compute_bwd
    penalty = rates.table.sm_contention * min(1.0, contended / device_compute) if device_compute else 0.0
    device = device_compute * (1 + penalty)
    host = host_seconds(workload, rates, c.activation_checkpointing)
    exposed = exposed_fsdp + critical
    step = max(host, device + exposed)
    flops = b * workload.train_flops
    peak = cluster.gpu.bf16_tflops * 1e12
    return Prediction(
        layout=layout, fits=fits, memory=memory, step_s=step, device_s=device, host_s=host, kernels_s=kernels.total,
        exposed_comm_s=exposed, imbalance=imbalance, imbalance_without_shuffling=no_shuffle,
        e2e_mfu=flops / (step * peak), local_mfu=flops / (kernels.total * peak), kernel_times=kernels.times,
        collectives=collectives,
    )
