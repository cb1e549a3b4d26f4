"""`opengem bench` refuses bad input with a clear message before anything is measured (no benchmark runs here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from opengem.cli.main import main
from opengem.train.bench import calibrate, layers, step
from opengem.train.bench.step import TrainBenchOptions

TINY = ["--preset", "gem-tiny", "--batch-size", "8", "--device", "cpu", "--precision", "fp32"]
SHORT = ["--steps", "1", "--warmup", "0", "--lead-steps", "0", "--max-tuning-steps", "0", "--profile-steps", "1",
         "--loader-batches", "1"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def must_not_run(*args: object, **kwargs: object) -> None:
    raise AssertionError("the benchmark ran before its input was checked")


@pytest.fixture
def nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step, "bench_train", must_not_run)
    monkeypatch.setattr(step, "build_learner", must_not_run)
    monkeypatch.setattr(layers, "bench_layers", must_not_run)
    monkeypatch.setattr(calibrate, "measure_launch_us", must_not_run)


@pytest.mark.parametrize("size", ["-1", "0"])
def test_matmul_size_below_one_is_refused_before_the_run(size: str, nothing_runs: None, capsys) -> None:
    """-1 failed in torch after the whole benchmark; 0 quietly measured at 512 and recorded 0."""
    assert main(["bench", "train", *TINY, *SHORT, "--matmul-size", size]) == 2
    assert f"matmul_size must be >= 1, got {size}" in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"matmul_size must be >= 1, got {size}"):
        TrainBenchOptions(preset="gem-tiny", matmul_size=int(size))


def test_the_cpp_wrapper_without_compile_is_refused(capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C++ wrapper is a setting of the compiled blocks: without --compile it would be dropped without a word.
    (Checked by the config itself, before the learner is built.)"""
    monkeypatch.setattr(step, "build_learner", must_not_run)
    assert main(["bench", "train", *TINY, *SHORT, "--set", "compile_cpp_wrapper=true"]) == 2
    message = ("compile_cpp_wrapper=true is a setting of the compiled blocks: set compile=true as well "
               "(bench train: --compile)")
    assert message in capsys.readouterr().err


def test_an_infinite_peak_is_refused(nothing_runs: None, capsys) -> None:
    """An infinite peak made every MFU 0."""
    assert main(["bench", "train", *TINY, *SHORT, "--peak-tflops", "inf"]) == 2
    assert "peak_tflops must be finite, got inf" in capsys.readouterr().err


def test_an_empty_precision_setting_is_refused(capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--set precision=` fell through to the device's default precision. (Checked in `bench_train`'s config, before
    the learner is built.)"""
    monkeypatch.setattr(step, "build_learner", must_not_run)
    argv = ["bench", "train", "--preset", "gem-tiny", "--device", "cpu", *SHORT, "--set", "precision="]
    assert main(argv) == 2
    assert "precision must be one of" in capsys.readouterr().err


def test_a_trace_into_an_existing_directory_is_refused_before_the_run(tmp_path: Path, capsys,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The trace landed in `<dir>.tmp` while the run said it wrote `<dir>`. (`bench_train` itself runs here: its
    check comes before the learner is built.)"""
    monkeypatch.setattr(step, "build_learner", must_not_run)
    argv = ["bench", "train", *TINY, *SHORT, "--trace", str(tmp_path), "--out", str(tmp_path / "r.json")]
    assert main(argv) == 2
    assert f"trace {tmp_path} is a directory; give a file name" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["train", *TINY, *SHORT], ["layers", *TINY], ["calibrate", "--quick"]])
def test_out_into_an_existing_directory_is_refused_before_the_run(command: list[str], tmp_path: Path,
                                                                  nothing_runs: None, capsys) -> None:
    """A raw IsADirectoryError came after the run."""
    assert main(["bench", *command, "--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path} is a directory; give a file name" in capsys.readouterr().err


def test_out_under_a_file_is_refused_before_the_run(tmp_path: Path, nothing_runs: None, capsys) -> None:
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "r.json"
    assert main(["bench", "train", *TINY, *SHORT, "--out", str(out)]) == 2
    assert f"--out {out}: {tmp_path / 'file'} is a file, not a directory" in capsys.readouterr().err


def test_train_out_named_like_its_plot_is_refused(tmp_path: Path, nothing_runs: None, capsys) -> None:
    """The PNG written next to the JSON would overwrite it."""
    out = tmp_path / "r.png"
    assert main(["bench", "train", *TINY, *SHORT, "--out", str(out)]) == 2
    assert f"--out {out} would be overwritten by its plot (the same name with .png); give a .json name" in (
        capsys.readouterr().err)


def fake_result() -> dict:
    """The parts of a `bench train` result that the plot reads."""
    return {"benchmark": "train", "preset": "gem-tiny", "environment": {"device": "cpu"},
            "settings": {"precision": "fp32", "batch_size": 8}, "results": {"samples_per_s": 100.0, "mfu": None},
            "phases_ms": {"forward": 2.0, "backward": 3.0, "idle": 0.5}}  # fmt: skip


def test_plot_writes_exactly_the_path_asked_for(tmp_path: Path, capsys) -> None:
    """A name without .png: matplotlib wrote `<name>.png` while the command said it wrote `<name>`."""
    result = tmp_path / "r.json"
    result.write_text(json.dumps(fake_result()))
    out = tmp_path / "phases"
    assert main(["bench", "plot", str(result), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_SIGNATURE and not out.with_suffix(".png").exists()
    assert f"wrote {out}" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["phases.pdf", "phases.svg"])
def test_plot_refuses_a_name_of_another_format(name: str, tmp_path: Path, capsys) -> None:
    result = tmp_path / "r.json"
    result.write_text(json.dumps(fake_result()))
    assert main(["bench", "plot", str(result), "--out", str(tmp_path / name)]) == 2
    assert f"--out {tmp_path / name}: bench plot writes a PNG; give a name ending in .png" in capsys.readouterr().err
    assert not (tmp_path / name).exists()


def test_plot_into_an_existing_directory_is_refused(tmp_path: Path, capsys) -> None:
    result = tmp_path / "r.json"
    result.write_text(json.dumps(fake_result()))
    (tmp_path / "dir.png").mkdir()
    assert main(["bench", "plot", str(result), "--out", str(tmp_path / "dir.png")]) == 2
    assert f"--out {tmp_path / 'dir.png'} is a directory; give a file name" in capsys.readouterr().err


def _without(key: str) -> dict:
    return {k: v for k, v in fake_result().items() if k != key}


@pytest.mark.parametrize("payload, why", [
    ([1, 2], "the JSON is an array, not an object"),
    ({"benchmark": "train", "phases_ms": {"a": 1.0}}, "missing 'results'"),
    (_without("preset"), "missing 'preset'"),
    (_without("environment"), "missing 'environment'"),
    ({**fake_result(), "results": [1]}, "'results' is not an object"),
    ({**fake_result(), "results": {"mfu": None}}, "missing 'results.samples_per_s'"),
    ({**fake_result(), "settings": {"precision": "fp32"}}, "missing 'settings.batch_size'"),
    ({**fake_result(), "environment": {}}, "missing 'environment.device'"),
    ({**fake_result(), "phases_ms": {"forward": "2"}}, "phases_ms.forward is not a number: '2'"),
])  # fmt: skip
def test_plot_names_the_file_and_what_its_result_lacks(payload: object, why: str, tmp_path: Path, capsys) -> None:
    """A raw AttributeError (a list) or KeyError (a missing key) before."""
    result = tmp_path / "r.json"
    result.write_text(json.dumps(payload))
    assert main(["bench", "plot", str(result)]) == 2
    assert f"{result} is not an `opengem bench train` result ({why})" in capsys.readouterr().err
    assert not result.with_suffix(".png").exists()


@pytest.mark.parametrize("flag, name", [("--hbm-gbps", "hbm_gbps"), ("--peak-tflops", "peak_tflops")])
@pytest.mark.parametrize("value, why", [("-5", "positive, got -5.0"), ("0", "positive, got 0.0"),
                                        ("nan", "positive, got nan"), ("inf", "finite, got inf")])
def test_calibrate_refuses_a_bad_nominal_figure_before_measuring(flag: str, name: str, value: str, why: str,
                                                                 tmp_path: Path, nothing_runs: None, capsys,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked before the CUDA check and the measuring: a negative --hbm-gbps was refused only after the
    measurements, NaN not at all."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "calib.json"
    assert main(["bench", "calibrate", "--quick", flag, value, "--out", str(out)]) == 2
    assert f"{name} must be {why}" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(ValueError, match=f"{name} must be {why}"):
        calibrate.measure(calibrate.QUICK, **{name: float(value)})
