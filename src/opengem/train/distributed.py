"""Distributed training: the trainer's loop (``opengem.train.trainer``) over torch.distributed.

Launched by ``torchrun --nproc-per-node N -m opengem train [--parallel ...]`` (or ``train(...,
parallel=...)`` on ranks already in a process group). Every rank

1. joins the process group (NCCL with ``cuda:LOCAL_RANK`` on CUDA, gloo on CPU) and builds the 5D
   meshes of its ``ParallelConfig`` (``opengem.parallel.mesh``);
2. builds the same model from the same seed, replaces its embedding collection by a
   ``ShardedEmbeddingCollection`` over the sparse mesh (tables placed by the planner) and applies
   FSDP2 per block plus expert parallelism over the dense mesh (``opengem.parallel.parallelize``);
3. trains on its own slice of every global batch (``rank_slice``): the ranks together see exactly the
   single-process run's batches, and the loss each rank backpropagates makes every gradient that of
   the global-batch mean (``data_parallel_loss``); the logged loss is that mean;
4. evaluates its slice of every held-out batch; the predictions are gathered, so every rank computes
   the same metrics (rank 0 writes the metrics log, progress and summary);
5. writes layout-independent DCP checkpoints (``opengem.train.distributed_checkpoint``).

Differences from the single-process run: no history-free baseline (it would double the sharded
state for a side metric); on CUDA the forward runs under bf16 autocast (FSDP keeps bf16 parameter
copies for compute, fp32 masters and fp32 gradient reduction). With ``sparse_replicate > 1`` the
embedding tables train as TorchRec's 2D parallelism does (each replica group updates on its own
ranks' samples, then the replicas are averaged): exactly the single-process run with SGD, close to it
with the row-wise optimizers (see ``opengem.parallel.sparse``).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from opengem.data.parquet import batches_from_table
from opengem.data.schema import Batch
from opengem.data.synthetic import SYNTHETIC_PRESETS, generate
from opengem.jagged import KeyedJagged
from opengem.nn.embedding import EmbeddingCollection
from opengem.nn.wukong import DenseExperts
from opengem.parallel.collectives import CommStats, probe_capabilities, select_collectives
from opengem.parallel.fsdp import data_parallel_loss, fsdp_step_bytes, parallelize
from opengem.parallel.mesh import ParallelConfig, init_distributed
from opengem.parallel.sparse import shard_embeddings
from opengem.parallel.sparse_plan import ShardingPlan, plan_sharding, state_bytes_per_row
from opengem.train.config import TrainConfig, refuse_two_recompute_policies
from opengem.train.data_stream import eval_batches, in_sample_order, train_batches
from opengem.train.distributed_checkpoint import load_distributed_checkpoint, save_distributed_checkpoint
from opengem.train.trainer import Learner, build_model, make_learner, resolve_device

PLANNER_SAMPLES = 256  # samples whose id counts weigh the tables for the sharding planner


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a launched job (torchrun's, or ``run_distributed``'s, variables)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


@dataclasses.dataclass
class DistributedLearner(Learner):
    """A learner whose batch is this rank's slice of the global batch.

    ``stats`` is reset at the start of every step, so after it holds the bytes that step moved;
    On CUDA ``compute_dtype`` is bf16 (FSDP computes in bf16 there).
    """

    stats: CommStats | None = None

    def loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's share of the global loss, the global-batch loss): one scalar all-reduce for the value."""
        logits = self.forward(batch)
        loss_sum = F.binary_cross_entropy_with_logits(logits.float(), batch.labels, reduction="none").sum()
        rows = batch.batch_size()
        totals = torch.stack([loss_sum.detach().double(), loss_sum.new_tensor(rows, dtype=torch.float64)])
        dist.all_reduce(totals)
        if self.stats is not None:  # the totals here, the sample count in data_parallel_loss
            self.stats.record("world", "all_reduce", totals.numel() * totals.element_size() + 8)
        return data_parallel_loss(loss_sum, rows), totals[0] / totals[1]

    def step(self, batch: Batch) -> torch.Tensor:
        if self.stats is not None:
            self.stats.reset()
        return super().step(batch)


def _rank_device(name: str) -> torch.device:
    device = resolve_device(name)
    if device.type == "cuda":  # one GPU per rank
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def sparse_plan(model: nn.Module, config: TrainConfig, group_size: int) -> ShardingPlan:
    """Place the model's tables on the ``group_size`` ranks of a sharding group, balancing ids per step.

    The ids per step are counted on the first ``PLANNER_SAMPLES`` samples (the same on every rank).
    The memory budget is the size of all tables with their optimizer state: every table may go
    anywhere, so the plan only balances the lookup work.
    """
    tables = [t for m in model.modules() if type(m) is EmbeddingCollection for t in m.tables]
    optimizer = next(m.optimizer for m in model.modules() if type(m) is EmbeddingCollection)
    sample = next(batches_from_table(generate(SYNTHETIC_PRESETS[config.data_preset], PLANNER_SAMPLES, config.seed),
                                     PLANNER_SAMPLES))
    counts = {k: j.num_values for k, j in KeyedJagged.concat([sample.sparse, sample.sequence]).to_dict().items()}
    ids = {t.name: float(sum(counts.get(f, 0) for f in t.feature_names)) for t in tables}
    budget = sum(t.num_embeddings * (t.embedding_dim * t.dtype.itemsize + state_bytes_per_row(t.embedding_dim, optimizer))
                 for t in tables)
    return plan_sharding(tables, group_size, budget, ids, optimizer=optimizer)


class DistributedRun:
    """The distributed side of the trainer's loop (the interface of ``opengem.train.trainer.LocalRun``)."""

    def __init__(self, config: TrainConfig, parallel: ParallelConfig) -> None:
        if config.low_precision_mlp != "none":  # before any process group exists
            raise NotImplementedError(
                f"low_precision_mlp={config.low_precision_mlp!r} trains in one process only for now: the FP8 "
                "layers' weight quantization over FSDP's gathered weights is untested; train without --parallel / "
                "torchrun, or with low_precision_mlp=none")
        self.config = config
        self.device = _rank_device(config.device)
        if config.activation_checkpointing and not parallel.activation_checkpointing:  # was dropped silently
            parallel = dataclasses.replace(parallel, activation_checkpointing=True)
        refuse_two_recompute_policies(parallel.activation_checkpointing, config.activation_memory_budget)
        self.owns_process_group = not dist.is_initialized()
        environment = set(os.environ)  # init_distributed fills in torchrun's variables for a 1-rank job
        try:
            self._start(config, parallel)
        except BaseException:  # a bad layout or setting: leave no process group or variables to a later train()
            self.added_variables = set(os.environ) - environment
            self.close()
            raise
        self.added_variables = set(os.environ) - environment

    def _start(self, config: TrainConfig, parallel: ParallelConfig) -> None:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        meshes = init_distributed(parallel, backend=backend)
        self.layout = meshes.config
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.is_main = self.rank == 0
        self._check(config)
        torch.manual_seed(config.seed)
        model = build_model(config, config.model.history, self.device)
        stats = CommStats()
        self.sparse = shard_embeddings(
            model, sparse_plan(model, config, self.layout.sparse_group), meshes.sparse,
            grad_scale=1.0 / self.layout.sparse_group, stats=stats,
        )  # fmt: skip
        route = select_collectives(self.layout.collectives, probe_capabilities(backend))
        if self.layout.collectives != "default" and route.is_default and self.is_main:
            warnings.warn(f"--parallel collectives={self.layout.collectives}: falling back to the default "
                          f"collectives: {route.reason}", stacklevel=3)
        units = parallelize(model, meshes, expert_types=(DenseExperts,), plan=route, stats=stats)
        learner = make_learner(model, config, DistributedLearner)
        learner.stats = stats
        if self.device.type == "cuda":
            learner.compute_dtype = torch.bfloat16
        self.learners: dict[str, DistributedLearner] = {"model": learner}  # type: ignore[dict-item]
        on_cuda = self.device.type == "cuda"
        self.fsdp_units = units  # the fully_shard calls (benchmarks count their collectives per step)
        self.fsdp_bytes = fsdp_step_bytes(units, param_bytes=2 if on_cuda else 4, reduce_bytes=4)

    def _check(self, config: TrainConfig) -> None:
        if config.batch_size < self.world:
            raise ValueError(f"batch_size={config.batch_size} is smaller than the {self.world} ranks")
        last = config.eval_samples % config.batch_size
        if 0 < last < self.world:
            raise ValueError(f"eval_samples={config.eval_samples}: the last held-out batch has {last} samples, "
                             f"fewer than the {self.world} ranks")
        if self.layout.expert > 1:
            experts = config.gem.num_experts if config.architecture == "gem" else 1
            if experts != self.layout.expert:
                raise ValueError(f"--parallel expert={self.layout.expert} needs architecture=gem with "
                                 f"gem.num_experts={self.layout.expert} (one expert per rank), got {experts} experts")
        if config.baseline and self.is_main:
            warnings.warn("distributed run: the history-free baseline is not trained", stacklevel=4)

    def restore(self, checkpoint: Path) -> int:
        return load_distributed_checkpoint(checkpoint, self.learners["model"], self.sparse)

    def save(self, run_dir: Path, step: int) -> None:
        save_distributed_checkpoint(run_dir, self.learners["model"], self.sparse, step, self.config, self.layout,
                                    keep=self.config.keep_checkpoints)

    def batches(self, start_step: int) -> Iterator[Batch]:
        return train_batches(self.config, start_step, self.rank, self.world)

    def holdout(self) -> list[Batch]:
        return [b.to(self.device) for b in eval_batches(self.config, self.rank, self.world)]

    def predictions(self, holdout: list[Batch]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The model's and the oracle's probabilities and the labels of the whole held-out set (every rank)."""
        mine = {
            "model": self.learners["model"].predict(holdout),
            "oracle": torch.cat([b.oracle.float().cpu() for b in holdout]),
            "labels": torch.cat([b.labels.float().cpu() for b in holdout]),
        }
        everyone: list[dict[str, torch.Tensor]] = [None] * self.world  # type: ignore[list-item]
        dist.all_gather_object(everyone, mine)
        merged = {key: in_sample_order([part[key] for part in everyone], self.config.batch_size) for key in mine}
        labels = merged.pop("labels")
        return merged, labels

    def sum_over_ranks(self, values: list[float]) -> list[float]:
        totals = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        return totals.tolist()

    def step_bytes(self) -> dict[str, int]:
        """Bytes this rank moved in the last step per mesh dimension and collective: FSDP's analytic
        count (``fsdp_step_bytes``) plus what the sparse exchange and the experts recorded."""
        stats = self.learners["model"].stats
        counts = dict(stats.bytes) if stats is not None else {}
        for key, nbytes in self.fsdp_bytes.items():
            counts[key] = counts.get(key, 0) + nbytes
        return {f"comm/{dim}/{collective}_bytes": n for (dim, collective), n in sorted(counts.items())}

    def close(self) -> None:
        """Leave the process as it was: no process group (when this run created it), no added variables
        (a later ``train`` in this process would otherwise see a torchrun job)."""
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        for key in self.added_variables:
            os.environ.pop(key, None)

