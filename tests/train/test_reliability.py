"""Crash safety: kill -9 and resume, corrupt and failed checkpoints, non-finite steps, loss spikes."""

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from opengem.train import checkpoint as checkpoint_module
from opengem.train import trainer as trainer_module
from opengem.train.checkpoint import latest_checkpoint, verify_checkpoint
from opengem.train.config import load_config
from opengem.train.guards import StepGuard, TrainingDiverged

SMALL = [
    "batch_size=32",
    "eval_samples=600",
    "log_every=1",
    "warmup_steps=1",
    "baseline=false",
    "model.d_model=16",
    "model.embedding_dim=8",
    "model.num_layers=1",
    "model.mlp_dims=16,8",
]


def _losses(run_dir: Path) -> dict[int, float]:
    losses = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss/model" in record and "event" not in record:
            losses[record["step"]] = record["loss/model"]  # a resumed run rewrites steps: keep the last
    return losses


def _cli(out: Path, name: str, steps: int, *extra: str) -> list[str]:
    sets = [*SMALL, f"out_dir={out}", f"name={name}", "checkpoint_every=5", "eval_every=1000", *extra]
    return [sys.executable, "-m", "opengem.cli.main", "train", "--no-progress", "--steps", str(steps),
            *[x for s in sets for x in ("--set", s)]]


def test_kill_9_then_resume_matches_uninterrupted_bit_for_bit(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src")}
    subprocess.run(_cli(tmp_path, "straight", 30), check=True, env=env, capture_output=True)
    victim = subprocess.Popen(_cli(tmp_path, "killed", 30), env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and victim.poll() is None:
        if metrics.exists() and max(_losses(tmp_path / "killed"), default=0) >= 12:
            break
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    killed_at = max(_losses(tmp_path / "killed"))
    assert 12 <= killed_at < 30, "the run must be killed mid-way"
    resume = [sys.executable, "-m", "opengem.cli.main", "train", "--no-progress", "--resume",
              str(tmp_path / "killed"), "--steps", "30"]
    subprocess.run(resume, check=True, env=env, capture_output=True)
    straight, resumed = _losses(tmp_path / "straight"), _losses(tmp_path / "killed")
    assert len(straight) == 30 and sorted(resumed) == sorted(straight)
    last_checkpoint_before_kill = killed_at - killed_at % 5
    following = range(last_checkpoint_before_kill + 1, 31)
    assert len(following) >= 10
    assert [resumed[s] for s in following] == [straight[s] for s in following]  # bit for bit


def _train(tmp_path, *extra):
    config = load_config("gem-tiny", None, [*SMALL, f"out_dir={tmp_path}", "eval_every=1000", *extra])
    return trainer_module.train(config, progress=False)


def test_corrupt_newest_checkpoint_falls_back_with_a_warning(tmp_path):
    _train(tmp_path, "steps=6", "checkpoint_every=3")
    run = tmp_path / "gem-tiny"
    newest = latest_checkpoint(run)
    assert newest.name == "step_00000006"
    state = newest / "state.pt"
    state.write_bytes(state.read_bytes()[:-100])  # truncated
    assert "checksum" in verify_checkpoint(newest)
    with pytest.warns(UserWarning, match="skipping checkpoint .*step_00000006"):
        assert latest_checkpoint(run).name == "step_00000003"


def test_a_good_checkpoint_is_hashed_once_until_a_file_changes(tmp_path, monkeypatch):
    """A resume resolved its checkpoint up to four times, hashing every state file each time."""
    _train(tmp_path, "steps=3", "checkpoint_every=3")
    checkpoint = latest_checkpoint(tmp_path / "gem-tiny")
    hashed = []
    real_sha256 = checkpoint_module.sha256_of
    monkeypatch.setattr(checkpoint_module, "sha256_of", lambda path: hashed.append(path.name) or real_sha256(path))
    assert verify_checkpoint(checkpoint) is None and verify_checkpoint(checkpoint) is None
    assert hashed == []  # latest_checkpoint above verified it already
    state = checkpoint / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the same size, a new modification time
    state.write_bytes(bytes(data))
    assert "checksum" in verify_checkpoint(checkpoint) and hashed == ["state.pt"]


def test_failed_save_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    _train(tmp_path, "steps=3", "checkpoint_every=3")
    run = tmp_path / "gem-tiny"
    good = latest_checkpoint(run)
    real_save = torch.save

    def disk_full(obj, path, *args, **kwargs):
        real_save(obj, path, *args, **kwargs)
        with open(path, "r+b") as file:
            file.truncate(10)  # a partial file, then the error
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_module.torch, "save", disk_full)
    with pytest.warns(UserWarning, match="checkpoint not saved .*No space left"):
        trainer_module.train(load_config("gem-tiny", None, [*SMALL, f"out_dir={tmp_path}", "eval_every=1000",
                                                            "steps=6", "checkpoint_every=3"]),
                             resume=run, progress=False)
    assert latest_checkpoint(run) == good and verify_checkpoint(good) is None
    assert not list((run / "checkpoints").glob(".tmp-*"))


def test_resume_from_a_checkpoint_file_and_clear_errors_for_bad_manifests(tmp_path, capsys):
    from opengem.cli.main import main

    _train(tmp_path, "steps=3", "checkpoint_every=3")
    checkpoint = latest_checkpoint(tmp_path / "gem-tiny")
    # the --resume help says a checkpoint file will do: its folder is the checkpoint
    assert main(["train", "--no-progress", "--resume", str(checkpoint / "state.pt"), "--steps", "4"]) == 0
    assert max(_losses(tmp_path / "gem-tiny")) == 4
    capsys.readouterr()
    # the resumed run saved step 4 in the same folder; the step-3 checkpoint is edited below
    manifest = checkpoint / "manifest.json"
    saved = json.loads(manifest.read_text())
    for edit, message in [
        (lambda m: m.pop("config"), "has no 'config' section"),
        (lambda m: m["config"].update(future_key=1),
         "saved config has settings this version does not know: future_key"),
        (lambda m: m["config"]["model"].update(depth=2), "does not know: model.depth"),
        (lambda m: m["config"].update(batch_size="abc"), "saved config's 'batch_size' must be an int, got 'abc'"),
        # a string seed would have loaded (no __post_init__ compares it) and failed steps later
        (lambda m: m["config"].update(seed="x"), "saved config's 'seed' must be an int, got 'x'"),
        (lambda m: m["config"]["gem"].update(attention_precision="fp4"), "'gem.attention_precision' must be one of"),
    ]:
        broken = json.loads(json.dumps(saved))
        edit(broken)
        manifest.write_text(json.dumps(broken))  # the checksum covers state.pt only
        assert main(["train", "--no-progress", "--resume", str(checkpoint)]) == 2
        error = capsys.readouterr().err
        assert f"--resume {checkpoint}: " in error and message in error, error
    manifest.write_text(json.dumps(saved))
    # (--steps 4: at its own end, step 3, the resume is refused before the sizes are compared)
    argv = ["train", "--no-progress", "--resume", str(checkpoint), "--steps", "4", "--set", "model.d_model=32"]
    assert main(argv) == 2
    assert "does not fit the 'model' learner built from the settings (did an override change its sizes?)" in (
        capsys.readouterr().err)


def _poison(steps_to_poison):
    original = trainer_module.train_batches

    def poisoned(config, start_step):
        for step, batch in enumerate(original(config, start_step), start=start_step + 1):
            if step in steps_to_poison:
                batch.dense[:] = float("nan")
            yield batch

    return poisoned


def test_non_finite_steps_are_skipped_and_logged(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_module, "train_batches", _poison({3, 4}))
    summary = _train(tmp_path, "steps=6")
    assert summary["skipped_steps"] == 2
    events = [json.loads(line) for line in (tmp_path / "gem-tiny" / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("event") == "skipped"] == [3, 4]
    weights = torch.load(latest_checkpoint(tmp_path / "gem-tiny") / "state.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in weights["learners"]["model"]["model"].values() if t.is_floating_point())


def test_too_many_bad_steps_stop_training(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_module, "train_batches", _poison(set(range(2, 100))))
    with pytest.raises(TrainingDiverged, match="3 steps in a row had a non-finite loss"):
        _train(tmp_path, "steps=10", "max_bad_steps=3")


def test_step_guard_reports_spikes():
    guard = StepGuard(max_bad_steps=2, spike_factor=3.0)
    assert [guard.check(s, loss) for s, loss in enumerate([1.0, 1.1, 0.9, 5.0, 1.0])] == [
        None, None, None, "spike", None]
    assert guard.check(5, float("inf")) == "skipped" and guard.bad_in_a_row == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TrainingDiverged):
            guard.check(6, float("nan"))


@pytest.mark.parametrize("architecture", ["gem", "sequence_ctr"])
def test_a_non_finite_step_is_skipped_on_the_device(architecture):
    """The device-side skip (fused AdamW's found_inf, the embedding kernels' update_skip): a NaN loss leaves
    every parameter, embedding table, optimizer state and step counter bit-identical, without the trainer
    reading the loss first."""
    import copy
    import math

    from opengem.train.data_stream import train_batches

    config = load_config("gem-tiny", None, [*SMALL, f"architecture={architecture}"])
    learner = trainer_module.build_learner(config, config.model.history, torch.device("cpu"))
    assert learner.skip_on_device
    stream = train_batches(config, 0)
    learner.step(next(stream))  # a real step first: moments and step counters exist
    model_before = copy.deepcopy(learner.model.state_dict())
    optimizer_before = copy.deepcopy(learner.optimizer.state_dict()["state"])
    bad = next(stream)
    bad.dense[:] = float("nan")
    assert not math.isfinite(float(learner.step(bad)))
    for name, tensor in learner.model.state_dict().items():
        assert torch.equal(tensor, model_before[name]), name
    for index, state in learner.optimizer.state_dict()["state"].items():
        for key, tensor in state.items():
            assert torch.equal(tensor, optimizer_before[index][key]), (index, key)
    learner.step(next(stream))  # and the next finite step trains again
    assert any(not torch.equal(t, model_before[n]) for n, t in learner.model.state_dict().items())
