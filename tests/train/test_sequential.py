"""Sequential training: ranking metrics with history exclusion, the popularity baseline, presets, and a tiny
training run on a synthetic .inter file whose next item is predictable."""

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from opengem.cli.main import main
from opengem.data.movielens import LeaveOneOut
from opengem.models.hstu import SequentialRecommender
from opengem.train.guards import TrainingDiverged
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
    ("max_bad_steps=0", "max_bad_steps must be >= 1, got 0"),
    ("spike_factor=1", "spike_factor must be > 1 (a multiple of the running mean loss), got 1.0"),
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


def tiny_run_config(tmp_path: Path, model: str, **extra: object):
    settings = {"data": cyclic_inter(tmp_path / "cycle.inter"), "out_dir": tmp_path / "runs", "name": model,
                "dim": 16, "num_layers": 1, "max_len": 16, "dropout": 0.0, "lr": 0.01, "batch_size": 16,
                "epochs": 8, "eval_every": 4, "in_batch_negatives": 8, "uniform_negatives": 16, "device": "cpu",
                **extra}  # fmt: skip
    return load_sequential_config(f"{model}-ml100k", [f"{k}={v}" for k, v in settings.items()])


def read_records(tmp_path: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def nan_loss_at(monkeypatch: pytest.MonkeyPatch, bad_steps: set[int] | None) -> None:
    """Make the loss NaN at the given steps (1-based; None: every step), keeping its graph so a step that were
    taken would write NaN into the weights."""
    real_loss = SequentialRecommender.sampled_softmax_loss
    calls = {"step": 0}

    def loss(self: SequentialRecommender, *args: object) -> torch.Tensor:
        calls["step"] += 1
        value = real_loss(self, *args)
        return value * float("nan") if bad_steps is None or calls["step"] in bad_steps else value

    monkeypatch.setattr(SequentialRecommender, "sampled_softmax_loss", loss)


def test_a_non_finite_loss_skips_the_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nan_loss_at(monkeypatch, {2, 3})  # the run has 2 steps an epoch: one in the first epoch, one in the second
    summary = train_sequential(tiny_run_config(tmp_path, "hstu"), progress=False)
    assert (summary["skipped_steps"], summary["loss_spikes"]) == (2, 0)
    events = [r for r in read_records(tmp_path, "hstu") if "event" in r]
    assert [(e["step"], e["event"]) for e in events] == [(2, "skipped"), (3, "skipped")]
    assert all(math.isnan(e["loss"]) for e in events)
    # no NaN reached the weights: the model still learns the cycle (NaN scores would fail the evaluation)
    assert summary["test"]["ndcg@10"] > summary["popularity"]["test"]["ndcg@10"] + 0.3


def test_training_stops_after_max_bad_steps_in_a_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nan_loss_at(monkeypatch, None)
    with pytest.raises(TrainingDiverged, match="step 3: 3 steps in a row had a non-finite loss"):
        train_sequential(tiny_run_config(tmp_path, "sasrec", max_bad_steps=3), progress=False)
    events = [r for r in read_records(tmp_path, "sasrec") if "event" in r]
    # the skipped steps before the stop stay in the log (the third is named by the error, as in opengem train)
    assert [e["step"] for e in events] == [1, 2]
    assert not (tmp_path / "runs" / "sasrec" / "summary.json").exists()


def test_the_cli_reports_a_diverged_run_without_a_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    nan_loss_at(monkeypatch, None)
    settings = [f"data={cyclic_inter(tmp_path / 'cycle.inter')}", f"out_dir={tmp_path / 'runs'}", "dim=16",
                "num_layers=1", "max_len=16", "batch_size=16", "epochs=2", "max_bad_steps=2"]  # fmt: skip
    code = main(["train", "--preset", "hstu-ml100k", "--device", "cpu", "--no-progress",
                 *(arg for setting in settings for arg in ("--set", setting))])  # fmt: skip
    assert code == 1
    assert "opengem: training stopped: step 2: 2 steps in a row had a non-finite loss" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["hstu", "sasrec"])
def test_tiny_training_run_beats_popularity(tmp_path: Path, model: str) -> None:
    summary = train_sequential(tiny_run_config(tmp_path, model), progress=False)
    assert (summary["skipped_steps"], summary["loss_spikes"]) == (0, 0)
    popularity = summary["popularity"]["test"]["ndcg@10"]
    assert summary["test"]["ndcg@10"] > popularity + 0.3, (summary["test"], popularity)
    records = read_records(tmp_path, model)
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 8 and losses[-1] < losses[0]
    assert sum("valid" in r for r in records) == 2 and "test" in records[-1]
