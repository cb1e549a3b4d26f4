"""The training loop: data stream -> model -> BCE per task -> AdamW (dense) + fused sparse optimizer.

Also trains, on the same batches, the history-free baseline, and evaluates NE / AUC / calibration per
task on a held-out set next to the generator's oracle. Metrics go to ``runs/<name>/metrics.jsonl``; a
checkpoint at the end (and every ``eval_every`` steps) lets ``--resume`` continue exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import IO, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from tqdm import tqdm

from opengem.data.schema import TASKS, Batch
from opengem.data.synthetic import SYNTHETIC_PRESETS
from opengem.models.gem import GEM
from opengem.models.sequence_ctr import SequenceCTRModel
from opengem.nn.embedding import EmbeddingCollection, EmbeddingOptimizer
from opengem.nn.low_precision import convert_to_low_precision, default_filter
from opengem.nn.numerics import NumericsMonitor, convert_with_precision
from opengem.nn.weight_shadows import refresh_shadows, shadow_linear_weights, shadows_in_use
from opengem.parallel.fsdp import checkpoint_blocks
from opengem.parallel.mesh import ParallelConfig
from opengem.parallel.sparse import ShardedEmbeddingCollection
from opengem.train.checkpoint import (
    checkpoint_step,
    is_distributed_checkpoint,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
)
from opengem.train.compile import compile_regions
from opengem.train.config import ARCHITECTURES, TrainConfig, shadow_settings
from opengem.train.data_stream import eval_batches, train_batches
from opengem.train.guards import StepGuard
from opengem.train.metrics import UndefinedMetric, binary_metrics
from opengem.train.shadow_adamw import ShadowAdamW

COMPUTE_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}  # precision -> autocast dtype


@dataclasses.dataclass
class Learner:
    """A model and its dense optimizer (the sparse optimizer lives inside the embedding collection)."""

    model: SequenceCTRModel | GEM
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    compute_dtype: torch.dtype | None = None  # autocast dtype of the forward (None: the parameters' fp32)
    skip_on_device: bool = False  # see step(): set by make_learner when the optimizer is a fused AdamW
    # (parameter, bf16 shadow) pairs of opengem.nn.weight_shadows, refreshed at each step's start; None: autocast casts
    weight_shadows: list[tuple[torch.Tensor, ...]] | None = None
    _skip_gates: list[torch.Tensor] | None = dataclasses.field(default=None, init=False, repr=False)
    _frozen: bool = dataclasses.field(default=False, init=False, repr=False)

    def forward(self, batch: Batch) -> torch.Tensor:
        """fp32 logits; the dense compute runs under autocast when ``compute_dtype`` is set."""
        device_type = batch.labels.device.type
        with torch.autocast(device_type, dtype=self.compute_dtype, enabled=self.compute_dtype is not None):
            return self.model(batch).float()

    def loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss to backpropagate, its detached value): BCE averaged over the batch, summed over the tasks."""
        logits = self.forward(batch)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="none").mean(0).sum()
        return loss, loss.detach()

    def step(self, batch: Batch) -> torch.Tensor:
        """One optimizer step; returns the loss as a device scalar (reading it is the caller's choice).

        A non-finite loss skips the step: nothing is updated. With ``skip_on_device`` (a fused AdamW and
        every embedding collection gated) the decision stays on the device: the flag ``!isfinite(loss)``
        is written into the embedding collections' ``update_skip`` (read by the fused update kernels in
        the backward) and handed to the fused AdamW as ``found_inf``, so the step has no host sync. Otherwise
        the loss is read on the host first and the backward is not run.

        A model left in eval mode (by ``predict``) is put back in training mode, every submodule with it; a submodule
        the caller sets to eval while the model trains (a frozen block) stays in eval until then.
        """
        if not self.model.training:  # after predict(); a walk of every module each step took 1.9 ms (0.96 under the
            self.model.train()  # lock; gem-large, session 55's samples) and undid a submodule the user froze in eval
        with self._shadows():
            return self._step(batch)

    def _shadows(self) -> contextlib.AbstractContextManager:
        """With weight shadows: refreshed from the parameters (the last optimizer step or a loaded checkpoint), then
        in use for the block (the backward's recomputed activations included)."""
        if self.weight_shadows is None:
            return contextlib.nullcontext()
        if not (isinstance(self.optimizer, ShadowAdamW) and self.optimizer.shadows_fresh()):
            refresh_shadows(self.weight_shadows)
        return shadows_in_use()

    def _step(self, batch: Batch) -> torch.Tensor:
        loss, value = self.loss(batch)
        self.optimizer.zero_grad(set_to_none=True)
        if self.skip_on_device:
            skip = (~torch.isfinite(value)).to(torch.float32)  # 0-d, as fused AdamW expects
            for gate in self._gates():
                gate.copy_(skip)
            self.optimizer.found_inf = skip  # fused AdamW leaves parameters, moments and steps unchanged
            loss.backward()
            self.optimizer.step()
        elif math.isfinite(float(value)):
            loss.backward()
            self.optimizer.step()
        self.scheduler.step()
        if not self._frozen and value.is_cuda:
            # The first step's compile leaves millions of long-lived objects (graphs, kernels); frozen, they
            # drop out of the collector's full passes, each of which otherwise stalls a GPU step (389 ms at
            # step 98 of gem-small, session 13). Frozen objects are never collected, so this runs once per learner.
            gc.collect()
            gc.freeze()
            self._frozen = True
        return value

    def _gates(self) -> list[torch.Tensor]:
        """The embedding collections' skip flags, found once (not a module walk every step)."""
        if self._skip_gates is None:
            modules = self.model.modules()
            self._skip_gates = [m.update_skip for m in modules if isinstance(m, EmbeddingCollection) and m.optimizer]
        return self._skip_gates

    @torch.no_grad()
    def predict(self, batches: list[Batch]) -> torch.Tensor:
        self.model.eval()
        with self._shadows():
            return torch.cat([torch.sigmoid(self.forward(b)).cpu() for b in batches])


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA device")
    if name != "cpu" and not name.startswith("cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda[:N], got {name!r}")
    return torch.device(name)


def build_learner(config: TrainConfig, history: str, device: torch.device) -> Learner:
    """The configured architecture; ``history="none"`` always builds the history-free SequenceCTR baseline."""
    return make_learner(build_model(config, history, device), config)


def build_model(config: TrainConfig, history: str, device: torch.device) -> nn.Module:
    """The model of ``build_learner``, without its optimizer (the distributed trainer shards it first)."""
    data = SYNTHETIC_PRESETS[config.data_preset]
    embedding_optimizer = EmbeddingOptimizer(lr=config.embedding_lr)
    if config.architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {config.architecture!r}")
    if config.architecture == "gem" and history != "none":
        model: nn.Module = GEM(data.feature_specs(), data.num_dense, config.gem, embedding_optimizer)
    else:
        sequence_config = dataclasses.replace(config.model, history=history)
        model = SequenceCTRModel(data.feature_specs(), data.num_dense, sequence_config, embedding_optimizer)
    model = model.to(device)
    if config.low_precision_mlp != "none":  # before make_learner compiles: the compiled blocks hold the FP8 layers
        keep = default_filter(model, min_features=config.low_precision_min_features)
        if config.low_precision_mlp == "auto":
            converted = _select_low_precision(model, config, keep, device)
        else:
            converted = convert_to_low_precision(model, config.low_precision_mlp, filter=keep)
        if not converted:
            warnings.warn(f"low_precision_mlp={config.low_precision_mlp!r}: no Linear layer has both dims >= "
                          f"low_precision_min_features={config.low_precision_min_features} (and multiples of 16) "
                          "outside the heads: the model stays BF16", stacklevel=2)
    return model


def _select_low_precision(
    model: nn.Module, config: TrainConfig, keep: Callable[[str, nn.Linear], bool], device: torch.device
) -> dict[str, str]:
    """``low_precision_mlp="auto"``: each eligible layer's recipe picked on the run's first training batch
    (`opengem.nn.numerics.convert_with_precision`, bound ``numerics_bound``), in the dtype training computes
    in; the picks are logged."""
    batch = next(train_batches(dataclasses.replace(config, num_workers=0), 0)).to(device)
    compute_dtype = COMPUTE_DTYPES[config.precision]

    def calibration() -> None:
        with torch.autocast(device.type, dtype=compute_dtype, enabled=compute_dtype is not None):
            model(batch)

    choices = convert_with_precision(model, "auto", calibration, bound=config.numerics_bound, filter=keep)
    logging.getLogger(__name__).info("low_precision_mlp=auto: %s", choices)
    return choices


def make_learner(model: nn.Module, config: TrainConfig, kind: type[Learner] = Learner) -> Learner:
    """AdamW on the dense parameters (the embedding tables have their own fused optimizer) and the schedule.

    With weight shadows (``opengem.train.config.shadow_settings``; by default on for bf16 in this single-process
    trainer on a GPU) the plain Linear layers compute from bf16 shadows, and with the shadow AdamW (by default wherever
    the shadows are) the optimizer is ``opengem.train.shadow_adamw.ShadowAdamW``. With ``config.compile`` the dense
    blocks are compiled here, after any parallel wrapping; with ``config.activation_checkpointing`` a single-process
    model's blocks are checkpointed first (the distributed trainer checkpoints them in ``parallelize``).
    """
    sharded = _is_sharded(model)
    if config.activation_checkpointing and not sharded:
        checkpoint_blocks(model)
    single_process = not sharded and kind is Learner
    on_gpu = any(p.is_cuda for p in model.parameters())
    weight_shadows, shadow_adamw = shadow_settings(config, single_process and on_gpu)
    shadows = None
    if weight_shadows:  # before compiling: the compiled blocks read the shadows
        if not single_process:
            raise ValueError("weight_shadows is for the single-process trainer: sharded parameters are cast by FSDP's "
                             "mixed precision instead")
        shadows = shadow_linear_weights(model, fp32_grads=config.fp32_weight_grads, shadow_grads=shadow_adamw)
    if config.compile:  # the one place the blocks are compiled with the config's settings (train, bench, diagnostics)
        compile_regions(model, mode=config.compile_mode, cpp_wrapper=config.compile_cpp_wrapper,
                        memory_budget=config.activation_memory_budget)
    parameters = list(model.parameters())
    # fused AdamW skips a step on a device flag (found_inf); kept to plain tensors (sharded DTensor
    # parameters and sharded embedding collections take the host-checked path)
    fused = bool(parameters) and not sharded and len({p.device for p in parameters}) == 1
    fused = fused and parameters[0].device.type in ("cuda", "cpu")
    adamw = {"lr": config.lr, "weight_decay": config.weight_decay, "fused": fused or None}
    if shadow_adamw:
        moments = torch.bfloat16 if config.shadow_adamw_moments == "bf16" else torch.float32
        optimizer: torch.optim.Optimizer = ShadowAdamW(parameters, shadows, moments_dtype=moments,
                                                       rounding_seed=config.seed % 2**32, **adamw)
    else:
        optimizer = torch.optim.AdamW(parameters, **adamw)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, config=config))
    return kind(model, optimizer, scheduler, COMPUTE_DTYPES[config.precision], skip_on_device=fused,
                weight_shadows=shadows)


def _is_sharded(model: nn.Module) -> bool:
    """Wrapped by the distributed trainer: FSDP2 blocks (DTensor parameters) or sharded embedding collections
    (whose local tables may sit outside ``modules()``, out of reach of the skip flags)."""
    return any(isinstance(m, (FSDPModule, ShardedEmbeddingCollection)) for m in model.modules())


def lr_factor(step: int, config: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` of the peak at the last step."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps))
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class LocalRun:
    """The single-process trainer's side of the loop: whole batches, one-file checkpoints, the baseline.

    ``opengem.train.distributed.DistributedRun`` is the same interface over torch.distributed.
    """

    is_main = True

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        torch.manual_seed(config.seed)
        self.learners = {"model": build_learner(config, config.model.history, self.device)}
        if config.baseline:
            self.learners["history_free"] = build_learner(config, "none", self.device)

    def restore(self, checkpoint: Path) -> int:
        return load_checkpoint(checkpoint, self.learners)

    def save(self, run_dir: Path, step: int) -> None:
        save_checkpoint(run_dir, self.learners, step, self.config, keep=self.config.keep_checkpoints)

    def batches(self, start_step: int) -> Iterator[Batch]:
        return train_batches(self.config, start_step)

    def holdout(self) -> list[Batch]:
        return [b.to(self.device) for b in eval_batches(self.config)]

    def predictions(self, holdout: list[Batch]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Every learner's and the oracle's probabilities on the held-out set, and its labels."""
        predictions = {name: learner.predict(holdout) for name, learner in self.learners.items()}
        predictions["oracle"] = torch.cat([b.oracle.float().cpu() for b in holdout])
        return predictions, torch.cat([b.labels.float().cpu() for b in holdout])

    def sum_over_ranks(self, values: list[float]) -> list[float]:
        return values

    def step_bytes(self) -> dict[str, int]:
        """Bytes moved by collectives in the last step (none in one process)."""
        return {}

    def close(self) -> None:
        pass


def train(
    config: TrainConfig, resume: Path | None = None, progress: bool = True, parallel: ParallelConfig | None = None
) -> dict[str, Any]:
    """Train for ``config.steps`` steps (counted from step 0, so a resumed run continues to the same end).

    With ``parallel`` (or under torchrun, where it defaults to FSDP over all ranks, or when resuming a
    distributed checkpoint: one rank) every rank calls this and trains its share of each global batch
    (``opengem.train.distributed``).
    """
    if config.data_preset not in SYNTHETIC_PRESETS:
        raise ValueError(f"unknown data preset {config.data_preset!r}; choose one of {sorted(SYNTHETIC_PRESETS)}")
    from opengem.train import distributed

    if resume is not None:
        resume = resolve_checkpoint(resume)
        # a run resumed at or past its end trained nothing, said it was done and overwrote its summary with no
        # evaluation; checked before anything is built or written
        saved_step = checkpoint_step(resume)
        if saved_step >= config.steps:
            raise ValueError(f"--resume: checkpoint {resume} is at step {saved_step} and steps={config.steps}: "
                             f"nothing left to train; give --steps above {saved_step}")
    if parallel is not None or distributed.launched_by_torchrun() or (resume and is_distributed_checkpoint(resume)):
        run: LocalRun | distributed.DistributedRun = distributed.DistributedRun(config, parallel or ParallelConfig())
    else:
        run = LocalRun(config)
    try:
        return _loop(config, run, resume, progress)
    finally:
        run.close()


def _loop(config: TrainConfig, run: LocalRun | Any, resume: Path | None, progress: bool) -> dict[str, Any]:
    start_step = run.restore(resume) if resume is not None else 0
    run_dir = Path(config.out_dir) / config.run_name
    if run.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2))
    progress = progress and run.is_main
    holdout = run.holdout()
    log = (run_dir / "metrics.jsonl").open("a") if run.is_main else open(os.devnull, "w")  # noqa: SIM115
    guard = StepGuard(config.max_bad_steps, config.spike_factor)
    monitor = NumericsMonitor(run.learners["model"].model, config.numerics_every, config.numerics_bound,
                              config.numerics_fallback, hooks=False) if config.numerics_every else None
    evaluations: list[dict[str, Any]] = []
    stream: Iterator[Batch] = run.batches(start_step)
    bar = tqdm(range(start_step, config.steps), desc="train", disable=not progress, initial=start_step, total=config.steps)
    try:
        window_start, window_samples, window_tokens = time.perf_counter(), 0, 0
        pending: list[tuple[int, dict[str, torch.Tensor]]] = []  # losses still on the device
        for step in bar:
            batch = next(stream).to(run.device, non_blocking=True)
            pending.append((step + 1, {name: learner.step(batch) for name, learner in run.learners.items()}))
            window_samples += batch.batch_size()
            window_tokens += batch.num_history_tokens()
            if monitor is not None and (step + 1) % config.numerics_every == 0:
                learner = run.learners["model"]
                numerics = monitor.measure(partial(learner.forward, batch), step + 1)
                log.write(json.dumps({"step": step + 1, **numerics}) + "\n")
            boundaries = (config.log_every, config.eval_every, config.checkpoint_every)
            if any((step + 1) % every == 0 for every in boundaries) or step + 1 == config.steps:
                losses = _read_losses(pending, guard, log)
                pending.clear()
            if (step + 1) % config.log_every == 0 or step + 1 == config.steps:
                samples, tokens = run.sum_over_ranks([window_samples, window_tokens])
                elapsed = time.perf_counter() - window_start
                record = {
                    "step": step + 1,
                    **{f"loss/{name}": float(loss) for name, loss in losses.items()},
                    "samples_per_s": samples / elapsed,
                    "tokens_per_s": tokens / elapsed,
                    **run.step_bytes(),
                }
                log.write(json.dumps(record) + "\n")
                log.flush()
                bar.set_postfix(loss=f"{record['loss/model']:.4f}", samples_s=f"{record['samples_per_s']:.0f}",
                                tokens_s=f"{record['tokens_per_s']:.0f}")
                window_start, window_samples, window_tokens = time.perf_counter(), 0, 0
            if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
                predictions, labels = run.predictions(holdout)
                evaluation = {"step": step + 1, "eval_samples": labels.shape[0], **evaluate(predictions, labels)}
                evaluations.append(evaluation)
                log.write(json.dumps(evaluation) + "\n")
                log.flush()
                if progress:
                    tqdm.write(format_evaluation(evaluation))
            if (step + 1) % config.checkpoint_every == 0 or step + 1 == config.steps:
                try:
                    run.save(run_dir, step + 1)
                except OSError as error:  # e.g. disk full: the previous checkpoints are intact, keep training
                    warnings.warn(f"step {step + 1}: checkpoint not saved ({error}); the previous ones are intact",
                                  stacklevel=2)
    finally:
        log.close()
        bar.close()
    summary = {
        "run_dir": str(run_dir),
        "steps": config.steps,
        "skipped_steps": guard.skipped,
        "loss_spikes": guard.spikes,
        "final": evaluations[-1] if evaluations else None,
    }
    if run.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _read_losses(pending: list[tuple[int, dict[str, torch.Tensor]]], guard: StepGuard, log: IO[str]) -> dict[str, float]:
    """Read the losses of the pending steps in one host transfer, in step order through the guard (which
    logs skipped steps and spikes, and raises after too many bad steps in a row); the last step's losses.

    Reading every step would synchronize every step; a skipped step was already skipped on the device.
    """
    names = list(pending[0][1])
    values = torch.stack([torch.stack([losses[n].double() for n in names]) for _, losses in pending]).tolist()
    for (step, _), row in zip(pending, values):
        health = guard.check(step, row[names.index("model")])
        if health is not None:
            log.write(json.dumps({"step": step, "event": health, "loss/model": row[names.index("model")]}) + "\n")
    return dict(zip(names, values[-1]))


def evaluate(predictions: dict[str, torch.Tensor], labels: torch.Tensor) -> dict[str, Any]:
    """NE / AUC / calibration per task for every set of probabilities (learners and the generator's oracle)."""
    out: dict[str, Any] = {}
    for name, probabilities in predictions.items():
        for t, task in enumerate(TASKS):
            try:
                metrics = binary_metrics(probabilities[:, t], labels[:, t])
            except ValueError as error:  # e.g. a held-out set without a single positive label, or NaN predictions
                # more samples help only an undefined metric; a diverged model's NaN predictions need no such advice
                hint = "; raise eval_samples" if isinstance(error, UndefinedMetric) else ""
                warnings.warn(f"held-out {task} metrics of {name} undefined: {error}{hint}", stacklevel=2)
                metrics = dict.fromkeys(("ne", "auc", "calibration", "log_loss"), float("nan"))
            for metric, value in metrics.items():
                out[f"{task}/{name}/{metric}"] = value
    return out


def format_evaluation(evaluation: dict[str, Any]) -> str:
    names = sorted({key.split("/")[1] for key in evaluation if key.count("/") == 2}, key=_row_order)
    lines = [f"step {evaluation['step']}: held-out metrics", f"{'task':<11}{'model':<14}{'NE':>8}{'AUC':>8}{'calib':>8}"]
    for task in TASKS:
        for name in names:
            ne, auc, cal = (evaluation[f"{task}/{name}/{m}"] for m in ("ne", "auc", "calibration"))
            lines.append(f"{task:<11}{name:<14}{ne:>8.4f}{auc:>8.4f}{cal:>8.3f}")
    return "\n".join(lines)


def _row_order(name: str) -> int:
    return {"model": 0, "history_free": 1, "oracle": 2}.get(name, 3)
