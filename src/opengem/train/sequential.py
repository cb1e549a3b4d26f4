"""Sequential next-item training on MovieLens-style data: HSTU or SASRec, plus a popularity baseline.

``train_sequential(config)`` trains on each user's leave-one-out training sequence (every position
predicts the next item, sampled softmax), evaluates HR@K / NDCG@K (K = 10, 50, 200; full catalogue,
the user's history items excluded) on the validation targets every ``eval_every`` epochs and on the
test targets at the end, and scores the popularity baseline (training-sequence item counts) the same
way. Records go to ``<out_dir>/<name>/metrics.jsonl``; the returned summary also lands in ``summary.json``.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from opengem.data.movielens import LeaveOneOut, leave_one_out, load_sequences
from opengem.models.hstu import ARCHITECTURES, SequentialModelConfig, SequentialRecommender
from opengem.train.config import apply_overrides
from opengem.train.guards import StepGuard, check_spike_factor
from opengem.train.metrics import hit_rate_and_ndcg
from opengem.train.trainer import resolve_device
from opengem.validation import check_run_name, require_at_least, require_finite, require_positive, require_seed

TOP_K = (10, 50, 200)


@dataclass(frozen=True)
class SequentialConfig:
    preset: str = "hstu-ml100k"
    name: str = ""  # run folder under out_dir; defaults to the preset name
    out_dir: str = "runs"
    data: str = ""  # .inter file or `opengem data movielens` folder; empty = ML-100K from recbole
    model: str = "hstu"  # hstu | sasrec
    dim: int = 64
    num_layers: int = 2
    num_heads: int = 1
    max_len: int = 200
    dropout: float = 0.2
    temperature: float = 0.05
    lr: float = 2e-3
    weight_decay: float = 0.0
    batch_size: int = 32
    epochs: int = 30
    eval_every: int = 5  # epochs
    in_batch_negatives: int = 128
    uniform_negatives: int = 128
    eval_batch_size: int = 256
    max_bad_steps: int = 5  # consecutive non-finite losses before training stops (as opengem train)
    spike_factor: float = 3.0  # a loss above this multiple of its running mean is reported; inf: never
    seed: int = 0
    device: str = "auto"

    def __post_init__(self) -> None:
        check_run_name(self.name)
        require_at_least(self, ("dim", "num_layers", "num_heads", "max_len", "batch_size", "epochs", "eval_every",
                                "eval_batch_size", "max_bad_steps"), 1)
        require_at_least(self, ("in_batch_negatives", "uniform_negatives", "weight_decay"), 0)
        if self.in_batch_negatives + self.uniform_negatives < 1:
            raise ValueError("in_batch_negatives + uniform_negatives must be >= 1 (the sampled softmax needs "
                             "negatives), got 0")
        require_positive(self, ("temperature", "lr"))  # temperature 0 divided every logit by zero: a NaN loss
        # lr=inf turned the weights to NaN and temperature=inf every logit to 0, both trained on without a word
        require_finite(self, ("lr", "temperature", "weight_decay"))
        if self.model not in ARCHITECTURES:  # was refused later as "architecture", a name no setting has
            raise ValueError(f"model must be one of {ARCHITECTURES}, got {self.model!r}")
        require_seed(self)  # numpy refused it at the run's start as "Seed", naming no setting
        check_spike_factor(self.spike_factor)

    @property
    def run_name(self) -> str:
        return self.name or self.preset


SEQUENTIAL_PRESETS: dict[str, SequentialConfig] = {
    "hstu-ml100k": SequentialConfig(),
    "sasrec-ml100k": SequentialConfig(preset="sasrec-ml100k", model="sasrec"),
}


def load_sequential_config(preset: str, overrides: Sequence[str] = ()) -> SequentialConfig:
    """A preset of :data:`SEQUENTIAL_PRESETS` with ``key=value`` overrides (as ``opengem train --set``)."""
    if preset not in SEQUENTIAL_PRESETS:
        raise ValueError(f"unknown sequential preset {preset!r}; choose one of {sorted(SEQUENTIAL_PRESETS)}")
    return apply_overrides(SEQUENTIAL_PRESETS[preset], overrides)


def jagged_batch(sequences: Sequence[np.ndarray], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Flat ``items [T]``, ``offsets [B + 1]`` and the host max_len of a list of id arrays."""
    lengths = [len(s) for s in sequences]
    items = torch.from_numpy(np.concatenate(sequences).astype(np.int64)).to(device)
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64, device=device)
    return items, offsets, max(lengths, default=0)


def rank_metrics(scores: torch.Tensor, histories: Sequence[np.ndarray], targets: np.ndarray) -> dict[str, float]:
    """HR@K / NDCG@K of ``targets [N]`` under ``scores [N, num_items + 1]`` (column 0 = padding), every
    item of the row's history excluded; sums over rows (divide by N for means)."""
    scores = scores.float().clone()
    scores[:, 0] = float("-inf")
    rows = torch.from_numpy(np.repeat(np.arange(len(histories)), [len(h) for h in histories]))
    scores[rows, torch.from_numpy(np.concatenate(histories).astype(np.int64))] = float("-inf")
    target = torch.from_numpy(targets.astype(np.int64)).to(scores.device)
    out: dict[str, float] = {}
    for k in TOP_K:
        hr, ndcg = hit_rate_and_ndcg(scores, target, k)
        out[f"hr@{k}"], out[f"ndcg@{k}"] = hr * len(targets), ndcg * len(targets)
    return out


def evaluate_scorer(
    scorer: Callable[[list[np.ndarray]], torch.Tensor], split: LeaveOneOut, part: str, batch_size: int
) -> dict[str, float]:
    """Mean HR@K / NDCG@K over users; ``part`` is ``valid`` or ``test``; ``scorer`` maps histories to
    ``[N, num_items + 1]`` scores."""
    history = split.valid_history if part == "valid" else split.test_history
    targets = split.valid_target if part == "valid" else split.test_target
    users = len(targets)
    totals: dict[str, float] = {}
    for start in range(0, users, batch_size):
        histories = [history(u) for u in range(start, min(users, start + batch_size))]
        for key, value in rank_metrics(scorer(histories).cpu(), histories, targets[start : start + batch_size]).items():
            totals[key] = totals.get(key, 0.0) + value
    return {key: value / users for key, value in totals.items()}


def popularity_scorer(split: LeaveOneOut) -> Callable[[list[np.ndarray]], torch.Tensor]:
    """Scores items by their count in the training sequences; ties broken by the smaller item id
    (scores are distinct, so the baseline gets no tie credit from the strict-rank metric)."""
    counts = np.bincount(np.concatenate(split.train), minlength=split.num_items + 1).astype(np.float64)
    ids = np.arange(split.num_items + 1)
    order = np.lexsort((-ids, counts))  # ascending popularity, larger id first among equals
    scores = torch.empty(split.num_items + 1, dtype=torch.float64)
    scores[torch.from_numpy(order)] = torch.arange(split.num_items + 1, dtype=torch.float64)
    return lambda histories: scores.expand(len(histories), -1)


def model_scorer(model: SequentialRecommender, max_len: int, device: torch.device) -> Callable:
    @torch.no_grad()
    def scorer(histories: list[np.ndarray]) -> torch.Tensor:
        model.eval()
        items, offsets, longest = jagged_batch([h[-max_len:] for h in histories], device)
        states = model(items, offsets, longest)[offsets[1:] - 1]  # the state after each user's last item
        return model.scores(states)

    return scorer


def batch_loss(model: SequentialRecommender, examples: list[np.ndarray], config: SequentialConfig,
               device: torch.device) -> torch.Tensor:
    """The sampled-softmax loss of next-item prediction at every position of ``examples`` (id arrays)."""
    items, offsets, longest = jagged_batch([s[:-1] for s in examples], device)
    targets, _, _ = jagged_batch([s[1:] for s in examples], device)
    states = model(items, offsets, longest)
    negatives = model.sample_negatives(targets, config.in_batch_negatives, config.uniform_negatives)
    return model.sampled_softmax_loss(states, targets, negatives)


def train_sequential(config: SequentialConfig, progress: bool = True) -> dict[str, Any]:
    device = resolve_device(config.device)
    random.seed(config.seed)
    np.random.seed(config.seed)
    torch.manual_seed(config.seed)
    split = leave_one_out(load_sequences(config.data))
    model_config = SequentialModelConfig(
        architecture=config.model, num_items=split.num_items, dim=config.dim, num_layers=config.num_layers,
        num_heads=config.num_heads, max_len=config.max_len, dropout=config.dropout, temperature=config.temperature,
    )  # fmt: skip
    model = SequentialRecommender(model_config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    # training examples: the last max_len + 1 items of each training sequence with at least one transition
    examples = [s[-(config.max_len + 1) :] for s in split.train if len(s) >= 2]
    steps_per_epoch = -(-len(examples) // config.batch_size)
    run_dir = Path(config.out_dir) / config.run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2))
    scorer = model_scorer(model, config.max_len, device)
    by_count = popularity_scorer(split)
    popularity = {part: evaluate_scorer(by_count, split, part, config.eval_batch_size) for part in ("valid", "test")}
    generator = np.random.default_rng(config.seed)
    guard = StepGuard(config.max_bad_steps, config.spike_factor)
    valid: dict[str, float] = {}
    step = 0
    start = time.perf_counter()
    # both closed when TrainingDiverged leaves the loop: what was logged stays on disk
    with (run_dir / "metrics.jsonl").open("w") as log, \
            tqdm(total=config.epochs * steps_per_epoch, desc=config.run_name, disable=not progress) as bar:

        def record(entry: dict[str, Any]) -> None:
            log.write(json.dumps(entry) + "\n")
            log.flush()

        record({"popularity/valid": popularity["valid"], "popularity/test": popularity["test"]})
        for epoch in range(1, config.epochs + 1):
            model.train()
            order = generator.permutation(len(examples))
            losses = []
            for first in range(0, len(examples), config.batch_size):
                loss = batch_loss(model, [examples[i] for i in order[first : first + config.batch_size]], config,
                                  device)  # fmt: skip
                step += 1
                value = float(loss.detach())  # read every step anyway, so the guard adds no sync
                health = guard.check(step, value)  # raises TrainingDiverged after max_bad_steps bad steps in a row
                if health is not None:
                    record({"step": step, "epoch": epoch, "event": health, "loss": value})
                bar.update()
                if health == "skipped":  # nothing updated: a NaN gradient would poison the weights and AdamW's moments
                    continue
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(value)
                bar.set_postfix(epoch=epoch, loss=f"{value:.3f}")
            # the mean over the epoch's healthy steps (NaN if every step was skipped)
            entry: dict[str, Any] = {"epoch": epoch, "loss": float(np.mean(losses)) if losses else float("nan"),
                                     "elapsed_s": time.perf_counter() - start}  # fmt: skip
            if epoch % config.eval_every == 0 or epoch == config.epochs:
                valid = evaluate_scorer(scorer, split, "valid", config.eval_batch_size)
                entry["valid"] = valid
                if progress:
                    tqdm.write(f"epoch {epoch}: loss {entry['loss']:.4f} valid " + format_metrics(valid))
            record(entry)
        test = evaluate_scorer(scorer, split, "test", config.eval_batch_size)
        record({"test": test})
    summary = {
        "run_dir": str(run_dir), "model": config.model, "epochs": config.epochs, "seed": config.seed,
        "valid": valid, "test": test, "popularity": popularity, "train_s": time.perf_counter() - start,
        "skipped_steps": guard.skipped, "loss_spikes": guard.spikes,
    }  # fmt: skip
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def format_metrics(metrics: dict[str, float]) -> str:
    return " ".join(f"{key} {value:.4f}" for key, value in metrics.items())
