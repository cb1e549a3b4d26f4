"""Ads metrics: normalized entropy (NE), ROC AUC and calibration; sequential HR@K / NDCG@K."""

from __future__ import annotations

import math

import torch

from opengem.validation import is_int

_EPS = 1e-7


class UndefinedMetric(ValueError):
    """Valid input on which a metric is undefined (one label class only): a larger sample may define it."""


def log_loss(probabilities: torch.Tensor, labels: torch.Tensor) -> float:
    _check(probabilities, labels, probabilities=True)
    return _log_loss(probabilities, labels)


def normalized_entropy(probabilities: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean log loss divided by the entropy of the base rate; < 1 beats predicting the average rate."""
    _check(probabilities, labels, probabilities=True)
    return _normalized_entropy(probabilities, labels)


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Probability that a random positive outranks a random negative (ties count half)."""
    _check(scores, labels)
    return _roc_auc(scores, labels)


def calibration(probabilities: torch.Tensor, labels: torch.Tensor) -> float:
    """Sum of predictions over sum of labels (1.0 is perfectly calibrated on average)."""
    _check(probabilities, labels, probabilities=True)
    return _calibration(probabilities, labels)


def binary_metrics(probabilities: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """NE, AUC, calibration and log loss, the inputs checked once (each check scans both tensors)."""
    _check(probabilities, labels, probabilities=True)
    return {
        "ne": _normalized_entropy(probabilities, labels),
        "auc": _roc_auc(probabilities, labels),
        "calibration": _calibration(probabilities, labels),
        "log_loss": _log_loss(probabilities, labels),
    }


# The metrics on checked inputs (`_check`)


def _log_loss(probabilities: torch.Tensor, labels: torch.Tensor) -> float:
    p = probabilities.double().clamp(_EPS, 1 - _EPS)  # only 0 and 1 move (log 0); the range is checked
    y = labels.double()
    return float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())


def _normalized_entropy(probabilities: torch.Tensor, labels: torch.Tensor) -> float:
    base = float(labels.double().mean())
    if base <= 0.0 or base >= 1.0:
        raise UndefinedMetric(f"NE is undefined when every label is {int(base)}: the base-rate entropy is 0")
    entropy = -(base * math.log(base) + (1 - base) * math.log(1 - base))
    return _log_loss(probabilities, labels) / entropy


def _roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    y = labels.double()
    positives = float(y.sum())
    negatives = y.numel() - positives
    if positives == 0 or negatives == 0:
        raise UndefinedMetric("AUC needs at least one positive and one negative label")
    order = torch.argsort(scores.double())
    sorted_scores = scores.double()[order]
    # average ranks over ties (1-based)
    _, inverse, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    average_rank = (ends - (counts.double() - 1) / 2)[inverse]
    rank_sum = float(average_rank[y[order] == 1].sum())
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def _calibration(probabilities: torch.Tensor, labels: torch.Tensor) -> float:
    total = float(labels.double().sum())
    if total == 0:
        raise UndefinedMetric("calibration is undefined with no positive label")
    return float(probabilities.double().sum()) / total


def hit_rate_and_ndcg(scores: torch.Tensor, target: torch.Tensor, k: int) -> tuple[float, float]:
    """HR@K and NDCG@K for ``scores [N, num_items]`` and the held-out item ``target [N]``.

    The rank of the target counts items scoring strictly higher (ties resolved in the target's favour
    after the strict count, the usual leave-one-out convention); callers mask items to exclude (e.g.
    history items) with ``-inf`` first.
    """
    if scores.dim() != 2 or target.shape != (scores.shape[0],):
        raise ValueError(f"scores must be [N, items] and target [N], got {tuple(scores.shape)}, {tuple(target.shape)}")
    # k < 1 (or True) had scored 0 hits; an empty set NaN means; a target outside the items a raw gather error
    if not is_int(k) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    if scores.shape[0] == 0:
        raise ValueError("HR@K / NDCG@K need at least one row (scores [0, items])")
    if target.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"target must hold integer item ids, got {target.dtype}")
    # a NaN score compares False with everything: a diverged model's all-NaN rows ranked every target first (HR 1.0)
    if bool(torch.isnan(scores).any()):
        row = int(torch.isnan(scores).any(dim=1).nonzero()[0, 0])
        raise ValueError(f"scores must not be NaN (-inf masks an item), got NaN in row {row}")
    outside = (target < 0) | (target >= scores.shape[1])
    if bool(outside.any()):
        row = int(outside.nonzero()[0, 0])
        raise ValueError(f"target[{row}] = {int(target[row])} is not an item column of scores [N, {scores.shape[1]}]")
    target_scores = scores.gather(1, target[:, None])
    rank = (scores > target_scores).sum(dim=1)  # 0-based
    hit = rank < k
    ndcg = torch.where(hit, 1.0 / torch.log2(rank.double() + 2.0), torch.zeros((), dtype=torch.float64))
    return float(hit.double().mean()), float(ndcg.mean())


def _check(predictions: torch.Tensor, labels: torch.Tensor, probabilities: bool = False) -> None:
    """Shapes, binary labels and finite predictions (in [0, 1] when they are ``probabilities``): a label of 2 had
    counted as positive in NE and as negative in AUC, a NaN score gave AUC 1.0, and probabilities outside [0, 1]
    were clamped into the log loss."""
    if predictions.shape != labels.shape or predictions.dim() != 1:
        raise ValueError(
            f"predictions and labels must be equal-length 1-D tensors, got {tuple(predictions.shape)} "
            f"and {tuple(labels.shape)}"
        )
    if predictions.numel() == 0:
        raise ValueError("metrics need at least one sample")
    _first_bad("labels", labels, (labels != 0) & (labels != 1), "must be 0 or 1")
    _first_bad("predictions", predictions, ~torch.isfinite(predictions), "must be finite")
    if probabilities:
        _first_bad("probabilities", predictions, (predictions < 0) | (predictions > 1), "must be in [0, 1]")


def _first_bad(what: str, values: torch.Tensor, bad: torch.Tensor, rule: str) -> None:
    if bool(bad.any()):
        index = int(bad.nonzero()[0, 0])
        raise ValueError(f"{what} {rule}, got {float(values[index])} at index {index}")
