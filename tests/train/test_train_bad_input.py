"""opengem.train and the CLI refuse bad input with a message naming what was wrong and where (no training runs here:
the checkpoints are written for a one-layer stand-in learner)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from opengem.cli.main import main
from opengem.train import metrics
from opengem.train.bench import layers
from opengem.train.bench.step import TrainBenchOptions
from opengem.train.checkpoint import (
    MANIFEST_FILE,
    STATE_FILE,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
    sha256_of,
)
from opengem.train.config import load_config
from opengem.train.flops import device_peak_flops, mfu, train_flops
from opengem.train.guards import StepGuard
from opengem.train.sequential import SequentialConfig
from opengem.train.trainer import build_learner, train


def _learners() -> dict[str, SimpleNamespace]:
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters())
    return {"model": SimpleNamespace(model=model, optimizer=optimizer,
                                     scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))}


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A step-2 checkpoint of the stand-in learner, saved with gem-tiny's settings."""
    return save_checkpoint(tmp_path / "run", _learners(), 2, load_config("gem-tiny"), keep=1)


def _rewrite_state(folder: Path, edit) -> None:
    """Edit ``state.pt`` and keep its checksum right, so that only the content is wrong."""
    state = torch.load(folder / STATE_FILE, weights_only=True)
    edit(state)
    torch.save(state, folder / STATE_FILE)
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    manifest["sha256"] = sha256_of(folder / STATE_FILE)
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest))


def test_a_manifest_that_is_not_an_object_is_named(checkpoint: Path) -> None:
    """A JSON list had failed as an AttributeError."""
    (checkpoint / MANIFEST_FILE).write_text("[]")
    with pytest.raises(ValueError, match="not usable: the manifest must be a JSON object, got list"):
        resolve_checkpoint(checkpoint)


def test_a_distributed_manifest_with_a_list_of_files_is_named(checkpoint: Path) -> None:
    manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())
    (checkpoint / MANIFEST_FILE).write_text(json.dumps({**manifest, "format": "dcp", "files": [STATE_FILE]}))
    with pytest.raises(ValueError, match="the manifest's 'files' must be an object of file names"):
        resolve_checkpoint(checkpoint)


def test_a_learner_state_without_its_optimizer_is_named(checkpoint: Path) -> None:
    """A raw KeyError: 'optimizer' before."""
    _rewrite_state(checkpoint, lambda state: state["learners"]["model"].pop("optimizer"))
    with pytest.raises(ValueError, match=r"the 'model' learner's state must hold \['model', 'optimizer', "
                                         r"'scheduler'\], got \['model', 'scheduler'\]"):
        load_checkpoint(checkpoint, _learners())


def test_a_bad_rng_state_is_named_before_any_weight_loads(checkpoint: Path) -> None:
    """A raw TypeError from torch.set_rng_state, after the weights had loaded."""
    _rewrite_state(checkpoint, lambda state: state.update(rng=5))
    learners = _learners()
    before = learners["model"].model.weight.detach().clone()
    with pytest.raises(ValueError, match="'rng' must be a uint8 tensor"):
        load_checkpoint(checkpoint, learners)
    assert torch.equal(learners["model"].model.weight, before)


def test_a_file_outside_any_checkpoint_is_named(tmp_path: Path, capsys) -> None:
    """It was "no usable checkpoint under <the file's folder>/checkpoints", a folder the user never named."""
    foreign = tmp_path / "notes.txt"
    foreign.write_text("hello")
    assert main(["train", "--no-progress", "--resume", str(foreign)]) == 2
    assert f"--resume: {foreign} is a file outside any checkpoint folder" in capsys.readouterr().err


@pytest.mark.parametrize("steps", [1, 2])
def test_resuming_at_or_past_the_end_is_refused_before_anything_is_written(checkpoint: Path, steps: int) -> None:
    """The run trained nothing, said it was done and overwrote its summary with "final": null."""
    config = dataclasses.replace(load_config("gem-tiny"), steps=steps, out_dir=str(checkpoint.parents[2]), name="run")
    summary = checkpoint.parents[1] / "summary.json"
    summary.write_text("{}")
    with pytest.raises(ValueError, match=f"is at step 2 and steps={steps}: nothing left to train; give --steps "
                                         "above 2"):
        train(config, resume=checkpoint, progress=False)
    assert summary.read_text() == "{}"


@pytest.mark.parametrize(("call", "message"), [
    (lambda: metrics.normalized_entropy(torch.tensor([0.2, 0.7, 0.9]), torch.tensor([0.0, 2.0, 1.0])),
     "labels must be 0 or 1, got 2.0 at index 1"),
    (lambda: metrics.roc_auc(torch.tensor([0.2, 0.7, 0.9]), torch.tensor([0.0, 0.5, 1.0])),
     "labels must be 0 or 1, got 0.5 at index 1"),
    (lambda: metrics.roc_auc(torch.tensor([float("nan"), 0.2, 0.3]), torch.tensor([1.0, 0.0, 1.0])),
     "predictions must be finite, got nan at index 0"),  # AUC was 1.0
    (lambda: metrics.log_loss(torch.tensor([1.5, 0.2]), torch.tensor([1.0, 0.0])),
     r"probabilities must be in \[0, 1\], got 1.5 at index 0"),  # clamped into the loss
    (lambda: metrics.calibration(torch.tensor([-0.2, 0.5]), torch.tensor([1.0, 0.0])),
     r"probabilities must be in \[0, 1\], got -0.2"),
])
def test_binary_metrics_refuse_bad_labels_and_predictions(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_undefined_metrics_keep_their_own_type() -> None:
    """The trainer advises more eval samples only for these."""
    with pytest.raises(metrics.UndefinedMetric, match="AUC needs at least one positive and one negative label"):
        metrics.roc_auc(torch.tensor([0.2, 0.7]), torch.tensor([1.0, 1.0]))


SCORES = torch.arange(15, dtype=torch.float32).reshape(3, 5)


@pytest.mark.parametrize(("scores", "target", "k", "message"), [
    (SCORES, torch.tensor([1, 2, 3]), 0, "k must be an int >= 1, got 0"),  # 0 hits
    (SCORES, torch.tensor([1, 2, 3]), True, "k must be an int >= 1, got True"),
    (SCORES, torch.tensor([1, 2, 5]), 3, r"target\[2\] = 5 is not an item column of scores \[N, 5\]"),
    (SCORES, torch.tensor([-1, 2, 3]), 3, r"target\[0\] = -1 is not an item column"),
    (SCORES, torch.tensor([1.0, 2.0, 3.0]), 3, "target must hold integer item ids, got torch.float32"),
    (torch.zeros(0, 5), torch.zeros(0, dtype=torch.int64), 3, "need at least one row"),  # NaN means
    (torch.full((3, 5), float("nan")), torch.tensor([1, 2, 3]), 3, "scores must not be NaN.*row 0"),  # HR 1.0
])
def test_hit_rate_refuses_bad_input(scores: torch.Tensor, target: torch.Tensor, k: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        metrics.hit_rate_and_ndcg(scores, target, k)


@pytest.fixture(scope="module")
def gem_tiny() -> torch.nn.Module:
    config = load_config("gem-tiny", overrides=["device=cpu"])
    return build_learner(config, config.model.history, torch.device("cpu")).model


@pytest.mark.parametrize(("lengths", "message"), [
    ([], "history_lengths is empty"),  # 0 FLOPs
    ([3, -5], r"history_lengths\[1\] must be an int >= 0, got -5"),  # deep in the attention count
    ([2.7, 3], r"history_lengths\[0\] must be an int >= 0, got 2.7"),  # truncated to 2
    (torch.tensor([[1, 2]]), "history_lengths must be a 1-D integer tensor, got 2-D torch.int64"),
])
def test_train_flops_refuses_bad_lengths(gem_tiny: torch.nn.Module, lengths, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        train_flops(gem_tiny, lengths)


def test_train_flops_counts_zero_length_histories(gem_tiny: torch.nn.Module) -> None:
    assert train_flops(gem_tiny, torch.tensor([0, 0])).train == train_flops(gem_tiny, [0, 0]).train > 0


@pytest.mark.parametrize(("call", "message"), [
    (lambda: device_peak_flops("any", peak_tflops=float("nan")), "peak_tflops must be positive, got nan"),
    (lambda: device_peak_flops("any", peak_tflops=float("inf")), "peak_tflops must be finite, got inf"),
    (lambda: device_peak_flops("any", peak_tflops="5"), "peak_tflops must be a number, got '5'"),
    (lambda: mfu(1e12, float("nan")), "peak_flops must be positive, got nan"),
    (lambda: mfu(float("nan"), 1e12), "flops_per_s must be finite and >= 0, got nan"),
])
def test_peaks_and_mfu_refuse_non_finite_figures(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize(("settings", "message"), [
    ({"max_bad_steps": 0}, "max_bad_steps must be an int >= 1, got 0"),
    ({"spike_factor": float("nan")}, "spike_factor must be > 1"),  # never reported a spike
    ({"ema_decay": 1.0}, r"ema_decay must be in \[0, 1\), got 1.0"),
])
def test_step_guard_refuses_bad_settings(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StepGuard(**{"max_bad_steps": 5, "spike_factor": 3.0, **settings})


@pytest.mark.parametrize(("settings", "message"), [
    ({"steps": True}, "steps must be an int, got True"),  # one step
    ({"steps": 2.5}, "steps must be an int, got 2.5"),
    ({"batch_size": True}, "batch_size must be an int, got True"),
    ({"matmul_size": True}, "matmul_size must be an int, got True"),
    ({"peak_tflops": "5"}, "peak_tflops must be a number, got '5'"),  # a TypeError before
])
def test_bench_options_refuse_bools_and_strings(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainBenchOptions(preset="gem-tiny", **settings)


def test_bench_layers_refuses_a_bool_repeat_count() -> None:
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        layers.bench_layers(TrainBenchOptions(preset="gem-tiny", device="cpu"), repeats=True)


@pytest.mark.parametrize(("settings", "message"), [
    ({"model": "foo"}, r"model must be one of \('hstu', 'sasrec'\), got 'foo'"),  # was named "architecture"
    ({"seed": -1}, r"seed must be in \[0, 2\*\*32\), got -1"),  # numpy's "Seed", at the run's start
    ({"lr": float("inf")}, "lr must be finite, got inf"),  # NaN weights, then HR@10 = 1.0
    ({"temperature": float("inf")}, "temperature must be finite, got inf"),
])
def test_sequential_config_refuses_bad_settings(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SequentialConfig(**settings)


def test_sequential_cli_names_the_setting(capsys) -> None:
    assert main(["train", "--preset", "hstu-ml100k", "--set", "model=foo"]) == 2
    assert "--set: model must be one of ('hstu', 'sasrec'), got 'foo'" in capsys.readouterr().err


def test_data_commands_name_their_flags(tmp_path: Path, capsys) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert main(["data", "movielens", "--out", str(a_file), "--inter", str(tmp_path / "unread.inter")]) == 2
    assert f"--out {a_file} is a file, not a folder" in capsys.readouterr().err  # a FileExistsError traceback
    assert main(["data", "synth", "--out", str(tmp_path / "synth"), "--samples", "0"]) == 2
    assert "--samples must be >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "synth").exists()
