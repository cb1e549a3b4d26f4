"""Sequential training: ranking metrics with history exclusion, the popularity baseline, presets, and a tiny
training run on a synthetic .inter file whose next item is predictable."""

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from opengem.data.movielens import LeaveOneOut
from opengem.train.sequential import (
    SEQUENTIAL_PRESETS,
    load_sequential_config,
    popularity_scorer,
    rank_metrics,
    train_sequential,
)


def test_rank_metrics_exclude_history_and_padding() -> None:
    # columns: padding, items 1..5; row 0 ranks items 1, 2 above its target 3 but they are history
    scores = torch.tensor([[9.0, 5, 4, 3, 2, 1], [9.0, 5, 4, 3, 2, 1]])
    histories = [np.array([1, 2]), np.array([5])]
    metrics = rank_metrics(scores, histories, np.array([3, 4]))
    # row 0: rank 0 -> hit, ndcg 1; row 1: items 1, 2, 3 score higher -> rank 3, ndcg 1/log2(5)
    assert metrics["hr@10"] == 2.0
    assert metrics["ndcg@10"] == pytest.approx(1.0 + 1.0 / math.log2(5))
    without_exclusion = rank_metrics(scores, [np.array([], dtype=np.int64)] * 2, np.array([3, 4]))
    assert without_exclusion["ndcg@10"] == pytest.approx(1 / math.log2(4) + 1 / math.log2(5))
    assert scores[0, 1] == 5.0  # the caller's scores are not modified


def test_popularity_counts_training_items_with_distinct_scores() -> None:
    split = LeaveOneOut(train=[np.array([2, 3, 3]), np.array([3, 1])], valid_target=np.array([1, 2]),
                        test_target=np.array([4, 4]), num_items=4)  # fmt: skip
    scores = popularity_scorer(split)([np.array([1])])
    assert scores.shape == (1, 5)
    # item 3 (3 times) first; items 1 and 2 (once each) by smaller id; then 0 and 4 (never)
    assert torch.argsort(scores[0], descending=True).tolist() == [3, 1, 2, 0, 4]


def test_presets_and_overrides() -> None:
    assert {"hstu-ml100k", "sasrec-ml100k"} <= set(SEQUENTIAL_PRESETS)
    config = load_sequential_config("sasrec-ml100k", ["dim=32", "seed=4"])
    assert (config.model, config.dim, config.seed) == ("sasrec", 32, 4)
    with pytest.raises(ValueError, match="unknown sequential preset"):
        load_sequential_config("gru4rec")
    with pytest.raises(ValueError, match="unknown setting 'depth'"):
        load_sequential_config("hstu-ml100k", ["depth=3"])


@pytest.mark.parametrize(("override", "message"), [
    ("temperature=0", "temperature must be > 0, got 0.0"),  # was a NaN loss reported with HR@10 = 1.0
    ("lr=-1", "lr must be > 0, got -1.0"),
    ("batch_size=0", "batch_size must be >= 1, got 0"),  # was a ZeroDivisionError
    ("eval_every=0", "eval_every must be >= 1, got 0"),
    ("max_len=0", "max_len must be >= 1, got 0"),
    ("epochs=0", "epochs must be >= 1, got 0"),  # ran nothing and exited 0
    ("uniform_negatives=-1", "uniform_negatives must be >= 0, got -1"),
    ("weight_decay=-0.1", "weight_decay must be >= 0, got -0.1"),
    ("name=../elsewhere", "name must be one folder name under out_dir"),  # had written beside out_dir
])
def test_bad_settings_are_refused_by_name(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        load_sequential_config("hstu-ml100k", [override])


def test_a_run_needs_some_negatives() -> None:
    with pytest.raises(ValueError, match="in_batch_negatives \\+ uniform_negatives must be >= 1"):
        load_sequential_config("hstu-ml100k", ["in_batch_negatives=0", "uniform_negatives=0"])
    assert load_sequential_config("hstu-ml100k", ["in_batch_negatives=0"]).uniform_negatives == 128


def cyclic_inter(path: Path, users: int = 32, items: int = 40, length: int = 10, seed: int = 0) -> Path:
    """Each user walks item i -> i + 1 (mod items) from a random start: the next item is predictable."""
    rng = np.random.default_rng(seed)
    rows = ["user_id:token\titem_id:token\trating:float\ttimestamp:float"]
    for user in range(users):
        start = int(rng.integers(items))
        rows += [f"{user}\t{(start + t) % items}\t1\t{100 + t}" for t in range(length)]
    path.write_text("\n".join(rows) + "\n")
    return path


@pytest.mark.parametrize("model", ["hstu", "sasrec"])
def test_tiny_training_run_beats_popularity(tmp_path: Path, model: str) -> None:
    settings = {"data": cyclic_inter(tmp_path / "cycle.inter"), "out_dir": tmp_path / "runs", "name": model,
                "dim": 16, "num_layers": 1, "max_len": 16, "dropout": 0.0, "lr": 0.01, "batch_size": 16,
                "epochs": 8, "eval_every": 4, "in_batch_negatives": 8, "uniform_negatives": 16, "device": "cpu"}
    config = load_sequential_config(f"{model}-ml100k", [f"{k}={v}" for k, v in settings.items()])
    summary = train_sequential(config, progress=False)
    popularity = summary["popularity"]["test"]["ndcg@10"]
    assert summary["test"]["ndcg@10"] > popularity + 0.3, (summary["test"], popularity)
    records = [json.loads(line) for line in (tmp_path / "runs" / model / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 8 and losses[-1] < losses[0]
    assert sum("valid" in r for r in records) == 2 and "test" in records[-1]
