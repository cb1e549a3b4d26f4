import contextlib
import dataclasses
import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from opengem.cli.main import main
from opengem.data.synthetic import HOLDOUT_START
from opengem.train.checkpoint import latest_checkpoint
from opengem.train.config import TrainConfig, apply_overrides, load_config
from opengem.train.trainer import train

SMALL = [
    "batch_size=64",
    "eval_samples=1500",
    "log_every=1",
    "warmup_steps=1",
    "model.d_model=16",
    "model.embedding_dim=8",
    "model.num_layers=1",
    "model.mlp_dims=32,16",
]


def _config(tmp_path, *extra):
    return load_config("gem-tiny", None, [*SMALL, f"out_dir={tmp_path}", *extra])


def _losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss/model"] for r in records if "loss/model" in r}


def _final_weights(run_dir):
    state = torch.load(latest_checkpoint(run_dir) / "state.pt", weights_only=True)
    return state["learners"]["model"]["model"]


def test_training_improves_held_out_ne(tmp_path):
    config = _config(tmp_path, "steps=60", "eval_every=10", "lr=0.01", "embedding_lr=0.1")
    summary = train(config, progress=False)
    records = [json.loads(line) for line in (tmp_path / "gem-tiny" / "metrics.jsonl").read_text().splitlines()]
    evaluations = [r for r in records if "click/model/ne" in r]
    assert [e["step"] for e in evaluations] == [10, 20, 30, 40, 50, 60]
    first, last = evaluations[0], evaluations[-1]
    assert last["click/model/ne"] < first["click/model/ne"]
    assert last["click/oracle/ne"] < 1.0  # the oracle is printed beside the model
    assert summary["final"]["step"] == 60


def resume_matches_the_straight_run(tmp_path, *settings: str, steps: int = 4) -> tuple[TrainConfig, Path, dict]:
    """A run of ``steps`` with ``settings``, checkpointed halfway, then resumed from there: the resumed run's later
    losses and its final weights equal the straight run's, bit for bit. Returns the straight run's config, the
    checkpoint and those losses."""
    half = steps // 2
    straight = _config(tmp_path, f"steps={steps}", f"eval_every={half}", f"checkpoint_every={half}", "name=straight",
                       *settings)
    train(straight, progress=False)
    middle = tmp_path / "straight" / "checkpoints" / f"step_{half:08d}"
    train(apply_overrides(straight, ["name=resumed"]), resume=middle, progress=False)
    expected = {step: loss for step, loss in _losses(tmp_path / "straight").items() if step > half}
    assert _losses(tmp_path / "resumed") == expected
    a = _final_weights(tmp_path / "straight")
    b = _final_weights(tmp_path / "resumed")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    return straight, middle, expected


def test_resume_continues_exactly(tmp_path):
    resume_matches_the_straight_run(tmp_path, steps=6)


def test_cli_trains_and_resumes(tmp_path, capsys):
    args = ["train", "--no-progress", "--steps", "2", *[x for s in SMALL for x in ("--set", s)],
            "--set", f"out_dir={tmp_path}", "--set", "eval_every=2", "--set", "baseline=false"]
    assert main(args) == 0
    assert latest_checkpoint(tmp_path / "gem-tiny").name == "step_00000002"
    assert main(["train", "--no-progress", "--resume", str(tmp_path / "gem-tiny"), "--steps", "4"]) == 0
    assert max(_losses(tmp_path / "gem-tiny")) == 4


def test_cli_reports_bad_input(tmp_path, capsys):
    assert main(["train", "--set", "model.nope=3"]) == 2
    assert "unknown setting 'model.nope'" in capsys.readouterr().err  # the full dotted key
    assert main(["train", "--resume", str(tmp_path / "missing")]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    (tmp_path / "broken" / "checkpoints").mkdir(parents=True)
    assert main(["train", "--resume", str(tmp_path / "broken")]) == 2
    assert "no usable checkpoint" in capsys.readouterr().err


def test_device_validation():
    from opengem.train.trainer import resolve_device

    with pytest.raises(ValueError, match="auto, cpu or cuda"):
        resolve_device("tpu")


def test_cli_synth_then_train_from_parquet(tmp_path, capsys):
    data_dir = tmp_path / "parquet"
    assert main(["data", "synth", "--out", str(data_dir), "--samples", "300", "--preset", "gem-tiny"]) == 0
    assert "wrote 300 samples" in capsys.readouterr().out
    assert list(data_dir.glob("*.parquet"))
    args = ["train", "--no-progress", "--steps", "3", *[x for s in SMALL for x in ("--set", s)],
            "--set", f"out_dir={tmp_path}", "--set", "eval_every=3", "--set", f"data_dir={data_dir}"]
    assert main(args) == 0
    assert max(_losses(tmp_path / "gem-tiny")) == 3
    # a held-out folder: the samples the training range never reaches, evaluated instead of generated ones
    eval_dir = tmp_path / "held_out"
    assert main(["data", "synth", "--out", str(eval_dir), "--samples", "200", "--preset", "gem-tiny", "--holdout"]) == 0
    assert "wrote 200 held-out samples" in capsys.readouterr().out
    ids = pq.read_table(eval_dir, columns=["sample_id"]).column("sample_id").to_pylist()
    assert ids == list(range(HOLDOUT_START, HOLDOUT_START + 200))
    with pytest.warns(UserWarning, match="holds 200 samples, fewer than eval_samples=1500"):
        assert main([*args, "--set", f"eval_dir={eval_dir}", "--set", "name=with_eval_dir"]) == 0
    records = [json.loads(line) for line in (tmp_path / "with_eval_dir" / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval_samples"] for r in records if "click/model/ne" in r] == [200]
    assert main([*args, "--set", f"eval_dir={data_dir}"]) == 2
    assert "is data_dir: the held-out set would be training samples" in capsys.readouterr().err


def test_cli_synth_rejects_unknown_preset(tmp_path, capsys):
    assert main(["data", "synth", "--out", str(tmp_path), "--samples", "10", "--preset", "nope"]) == 2
    assert "nope" in capsys.readouterr().err


def test_cli_sequential_presets_reject_step_counts(capsys):
    assert main(["train", "--preset", "hstu-ml100k", "--steps", "3"]) == 2
    assert "--steps is not supported for hstu-ml100k" in capsys.readouterr().err


def test_cli_movielens_reports_a_malformed_file(tmp_path, capsys):
    bad = tmp_path / "bad.inter"
    bad.write_text("user_id:token\titem_id:token\ttimestamp:float\n1\t2\tnot-a-time\n")
    assert main(["data", "movielens", "--out", str(tmp_path / "out"), "--inter", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.inter" in err and "line 2" in err


@pytest.mark.parametrize("architecture", ["gem", "sequence_ctr"])
def test_bf16_autocast_tracks_fp32(tmp_path, architecture):
    """bf16 autocast runs every op (attention included) in one dtype and stays near the fp32 loss curve."""
    runs = {}
    for precision in ("fp32", "bf16"):
        config = _config(tmp_path, "steps=4", "eval_every=4", "eval_samples=500", "baseline=false",
                         f"architecture={architecture}", f"precision={precision}", f"name={precision}")
        train(config, progress=False)
        runs[precision] = _losses(tmp_path / precision)
    assert runs["bf16"].keys() == runs["fp32"].keys() == {1, 2, 3, 4}
    for step, loss in runs["fp32"].items():
        assert runs["bf16"][step] == pytest.approx(loss, rel=0.03), step
    assert runs["bf16"] != runs["fp32"]  # bf16 really ran in bf16


def test_low_precision_mlps_train_near_the_bf16_curve(tmp_path):
    """``low_precision_mlp`` converts the large Linear layers before training (at gem-tiny's widths once
    ``low_precision_min_features`` allows them); the loss curve stays near BF16's."""
    from opengem.nn.low_precision import LowPrecisionLinear
    from opengem.parallel.mesh import ParallelConfig
    from opengem.train.trainer import build_model

    extra = ["steps=4", "eval_every=4", "eval_samples=500", "baseline=false", "architecture=gem", "precision=bf16"]
    fp8 = ["low_precision_mlp=fp8_rowwise", "low_precision_min_features=128"]
    model = build_model(_config(tmp_path, *extra, *fp8), "attention", torch.device("cpu"))
    converted = [name for name, m in model.named_modules() if isinstance(m, LowPrecisionLinear)]
    assert converted == ["cls_proj", "layers.0.interaction.fm_mlp.2"]  # both dims >= 128 and multiples of 16
    runs = {}
    for name, settings in (("bf16", []), ("fp8", fp8)):
        train(_config(tmp_path, *extra, *settings, f"name={name}"), progress=False)
        runs[name] = _losses(tmp_path / name)
    assert runs["fp8"].keys() == runs["bf16"].keys() == {1, 2, 3, 4}
    # step 1 is the same weights through FP8 GEMMs; later steps compound the FP8 updates at gem-tiny's
    # high early learning rate (the loss halves in 4 steps), so the curves drift apart by a few percent
    assert runs["fp8"][1] == pytest.approx(runs["bf16"][1], rel=1e-3)
    for step, loss in runs["bf16"].items():
        assert runs["fp8"][step] == pytest.approx(loss, rel=0.1), (step, runs)
    assert runs["fp8"][4] < 0.6 * runs["fp8"][1] and runs["fp8"] != runs["bf16"]  # FP8 ran, and trains
    with pytest.warns(UserWarning, match="no Linear layer has both dims >= low_precision_min_features=512"):
        build_model(_config(tmp_path, *extra, "low_precision_mlp=fp8_rowwise"), "attention", torch.device("cpu"))
    with pytest.raises(ValueError, match="low_precision_mlp must be one of"):
        _config(tmp_path, "low_precision_mlp=fp4")
    with pytest.raises(NotImplementedError, match="trains in one process only"):
        train(_config(tmp_path, *extra, *fp8), progress=False, parallel=ParallelConfig())


def test_numerics_monitoring_logs_each_fp8_layer_and_leaves_training_unchanged(tmp_path):
    """``numerics_every``: every N steps each FP8 layer's output against BF16 goes to metrics.jsonl, measured in
    an extra eager forward of its own, so the losses equal an unmonitored run's bit for bit; past a tiny bound
    with ``numerics_fallback`` the layers warn and switch to BF16. (Compiled blocks:
    tests/nn/test_low_precision.py, the monitor's measurement of a compiled model.)"""
    extra = ["steps=4", "eval_every=4", "eval_samples=500", "baseline=false", "architecture=gem", "precision=bf16",
             "low_precision_mlp=fp8_rowwise", "low_precision_min_features=128"]
    train(_config(tmp_path, *extra, "name=plain"), progress=False)
    train(_config(tmp_path, *extra, "numerics_every=2", "name=watched"), progress=False)
    assert _losses(tmp_path / "watched") == _losses(tmp_path / "plain")
    records = [json.loads(line) for line in (tmp_path / "watched" / "metrics.jsonl").read_text().splitlines()]
    numerics = [r for r in records if any(key.startswith("numerics/") for key in r)]
    assert [r["step"] for r in numerics] == [2, 4]
    for record in numerics:
        errors = {key: value for key, value in record.items() if key != "step"}
        assert set(errors) == {"numerics/cls_proj/rel_error", "numerics/layers.0.interaction.fm_mlp.2/rel_error"}
        assert all(0.005 < error < 0.1 for error in errors.values()), errors
    with pytest.warns(RuntimeWarning, match="exceeds the bound 1e-09 at step 2; falling back to BF16"):
        train(_config(tmp_path, *extra, "numerics_every=2", "numerics_bound=1e-9", "numerics_fallback=true",
                      "name=fallback"), progress=False)
    with pytest.raises(ValueError, match="numerics_every monitors the low-precision layers: set low_precision_mlp or"):
        _config(tmp_path, "numerics_every=10")
    with pytest.raises(ValueError, match="numerics_bound must be > 0"):
        _config(tmp_path, *extra, "numerics_every=10", "numerics_bound=0")


@pytest.mark.parametrize("precision", ["fp8", "mxfp8"])
def test_numerics_monitoring_covers_low_precision_attention(tmp_path, precision):
    """``gem.attention_precision=fp8`` (or ``mxfp8``) alone is enough for ``numerics_every``: each low-precision
    self-attention layer's residual update against its bf16 shadow goes to metrics.jsonl (a few percent)."""
    extra = ["steps=2", "eval_every=2", "eval_samples=500", "baseline=false", "architecture=gem", "precision=bf16",
             f"gem.attention_precision={precision}", "numerics_every=2", "name=attention"]
    train(_config(tmp_path, *extra), progress=False)
    records = [json.loads(line) for line in (tmp_path / "attention" / "metrics.jsonl").read_text().splitlines()]
    (numerics,) = [r for r in records if any(key.startswith("numerics/") for key in r)]
    errors = {key: value for key, value in numerics.items() if key != "step"}
    assert errors and all(key.endswith("/rel_error") and "attention" in key for key in errors), errors
    assert all(0.003 < error < 0.2 for error in errors.values()), errors


def test_late_bf16_attention_layers_from_the_command_line(tmp_path):
    """``--set gem.bf16_attention_last_layers=N`` reaches the built model: the last N self-attention layers in bf16,
    the others in the low precision, and only those are watched by the numerics monitor."""
    from opengem.nn.numerics import low_precision_attention
    from opengem.train.trainer import build_model

    extra = ["architecture=gem", "precision=bf16", "gem.num_layers=3", "gem.d_model=64", "gem.num_heads=2",
             "gem.attention_precision=mxfp8", "gem.bf16_attention_last_layers=2"]
    model = build_model(_config(tmp_path, *extra), "attention", torch.device("cpu"))
    assert [layer.self_attention.precision for layer in model.layers] == ["mxfp8", "bf16", "bf16"]
    watched = [name for name, m in model.named_modules() if low_precision_attention(m)]
    assert watched == ["layers.0.self_attention"]


def test_converted_mlp_blocks_train_fused_and_stay_monitored(tmp_path):
    """At widths down to 64, gem-tiny's attention FFN (Linear, GELU, Linear) converts in full and trains as
    one fused `LowPrecisionMLP` (same state-dict keys as the BF16 model); the numerics monitor still
    measures both of its layers (the block runs them one by one while watched)."""
    from opengem.nn.low_precision_mlp import LowPrecisionMLP
    from opengem.train.trainer import build_model

    extra = ["steps=2", "eval_every=2", "eval_samples=500", "baseline=false", "architecture=gem", "precision=bf16",
             "low_precision_mlp=fp8_rowwise", "low_precision_min_features=64", "numerics_every=1"]
    model = build_model(_config(tmp_path, *extra), "attention", torch.device("cpu"))
    bf16 = build_model(_config(tmp_path, *extra[:6]), "attention", torch.device("cpu"))
    fused = [name for name, m in model.named_modules() if isinstance(m, LowPrecisionMLP)]
    assert fused == ["layers.0.self_attention.ffn.1"] and list(model.state_dict()) == list(bf16.state_dict())
    train(_config(tmp_path, *extra, "name=fused"), progress=False)
    records = [json.loads(line) for line in (tmp_path / "fused" / "metrics.jsonl").read_text().splitlines()]
    measured = {key for r in records for key in r if key.startswith("numerics/")}
    assert {f"numerics/{fused[0]}.0/rel_error", f"numerics/{fused[0]}.2/rel_error"} <= measured
    assert all(math.isfinite(loss) for loss in _losses(tmp_path / "fused").values())


def test_low_precision_auto_picks_each_layer_on_a_training_batch(tmp_path):
    """``low_precision_mlp=auto``: the eligible layers get the fastest recipe whose error on the first training
    batch is within ``numerics_bound`` (on CPU the fixed speed order: fp8_rowwise first, at ~3.5% here), and
    BF16 where none is; the run then trains."""
    from opengem.nn.low_precision import LowPrecisionLinear
    from opengem.train.trainer import build_model

    extra = ["steps=2", "eval_every=2", "eval_samples=500", "baseline=false", "architecture=gem", "precision=bf16",
             "low_precision_mlp=auto", "low_precision_min_features=128"]

    def recipes(*settings: str) -> dict[str, str]:
        model = build_model(_config(tmp_path, *extra, *settings), "attention", torch.device("cpu"))
        return {name: m.recipe for name, m in model.named_modules() if isinstance(m, LowPrecisionLinear)}

    picked = recipes()
    assert set(picked) == {"cls_proj", "layers.0.interaction.fm_mlp.2"}
    assert all(recipe.forward == "fp8_rowwise" and not recipe.is_bf16 for recipe in picked.values())
    assert all(recipe.is_bf16 for recipe in recipes("numerics_bound=1e-6").values())
    summary = train(_config(tmp_path, *extra, "name=auto"), progress=False)
    assert summary["final"] is not None and all(math.isfinite(loss) for loss in _losses(tmp_path / "auto").values())


def test_bad_precision_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="precision must be one of"):
        _config(tmp_path, "precision=fp8")


@pytest.mark.parametrize("architecture", ["gem", "sequence_ctr"])
def test_compiled_regions_trace_whole_and_match_eager(architecture):
    """Every dense block compiles without a graph break (fullgraph) and computes what eager computes."""
    from opengem.train.compile import compile_regions
    from opengem.train.data_stream import train_batches
    from opengem.train.trainer import build_model

    config = load_config("gem-tiny", None, [*SMALL, f"architecture={architecture}", "gem.num_layers=2"])
    torch.manual_seed(0)
    eager = build_model(config, config.model.history, torch.device("cpu"))
    compiled = build_model(config, config.model.history, torch.device("cpu"))
    compiled.load_state_dict(eager.state_dict())
    # GEM: 2 layers, the history's token rows, the CLS and final token summaries
    regions = {"gem": 5, "sequence_ctr": 1}[architecture]
    assert compile_regions(compiled, backend="aot_eager") == regions
    stream = train_batches(config, 0)
    for _ in range(2):  # two batches of different jagged lengths: no recompile error with dynamic shapes
        batch = next(stream)
        torch.testing.assert_close(compiled(batch), eager(batch))


@pytest.mark.parametrize("path", ["inductor", "custom_op"])
def test_compiled_regions_with_fp8_linears_train_like_eager(monkeypatch, path: str):
    """FP8 linears inside the compiled blocks keep them whole (fullgraph: GPU session 12's bench train died on
    an eager region's graph break) and give eager's loss and gradients: to float rounding through the custom ops.
    Through the torch ops (``OPENGEM_FP8_COMPILE=inductor``, the default) ``_scaled_mm`` rounds its output to bf16,
    which the CPU's eager emulation (fp32 out) skips, and the later layers' E4M3 roundings follow apart (1-3% per
    gradient here): each is held to the unconverted fp32 model instead, the compiled one within 1.5x of eager's
    error (a lost gradient is off by 100%; the ratio depends on the CPU's vector code: up to 1.29x on an AMD EPYC,
    layer 1's q bias 8.2% against eager's 6.4%, under 1.25x on the CI machine)."""
    from opengem.nn.low_precision import convert_to_low_precision
    from opengem.train.compile import compile_regions
    from opengem.train.data_stream import train_batches
    from opengem.train.trainer import build_model

    monkeypatch.setenv("OPENGEM_FP8_COMPILE", path)
    config = load_config("gem-tiny", None, [*SMALL, "architecture=gem", "gem.num_layers=2"])
    torch.manual_seed(0)
    exact, *models = [build_model(config, config.model.history, torch.device("cpu")) for _ in range(3)]
    every_aligned = lambda name, m: m.in_features % 16 == 0 and m.out_features % 16 == 0  # noqa: E731
    converted = []
    for model in models:
        model.load_state_dict(exact.state_dict())
        converted.append(convert_to_low_precision(model, "fp8_rowwise", filter=every_aligned))
    assert converted[0] == converted[1] and len(converted[0]) >= 4
    assert compile_regions(models[1], backend="aot_eager") == 5  # 2 layers, the token rows, 2 token summaries
    batch = next(train_batches(config, 0))
    losses, grads = [], []
    for model in (exact, *models):
        loss = model(batch).float().square().mean()
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() == grads[2].keys()
    for name in converted[0]:
        assert grads[2][f"{name}.weight"].abs().sum() > 0, name
    if path == "custom_op":
        torch.testing.assert_close(losses[2], losses[1])
        for name, grad in grads[1].items():
            torch.testing.assert_close(grads[2][name], grad, rtol=1e-4, atol=1e-5, msg=name)
        return
    error = lambda got, want: ((got - want).norm() / want.norm()).item()  # noqa: E731
    assert error(losses[2], losses[0]) < 1.5 * error(losses[1], losses[0]) + 2e-3
    for name, grad in grads[0].items():
        compiled, eager = error(grads[2][name], grad), error(grads[1][name], grad)
        assert compiled < 1.5 * eager + 2e-3, (name, compiled, eager)


def test_compile_mode_reaches_every_region(monkeypatch):
    """``compile_mode`` is handed to torch.compile for each block ("default": torch's own default, None);
    an unknown mode is refused when the config is built."""
    from torch import nn

    from opengem.train.compile import compile_regions
    from opengem.train.trainer import build_model

    config = load_config("gem-tiny", None, [*SMALL, "architecture=gem", "gem.num_layers=2",
                                            "compile_mode=max-autotune-no-cudagraphs"])
    model = build_model(config, config.model.history, torch.device("cpu"))
    seen = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kwargs: seen.append(kwargs["mode"]))
    assert compile_regions(model, mode=config.compile_mode) == 5
    assert compile_regions(model) == 5
    assert seen == ["max-autotune-no-cudagraphs"] * 5 + [None] * 5
    with pytest.raises(ValueError, match="compile_mode must be one of"):
        load_config("gem-tiny", None, ["compile_mode=reduce-overhead"])


def test_compile_cpp_wrapper_reaches_every_region_with_the_modes_options(monkeypatch):
    """``compile_cpp_wrapper`` hands each block Inductor's ``cpp_wrapper`` option, with the compile mode's own
    options in place of the mode (torch.compile refuses both); other backends and compile=false refuse it."""
    from torch import nn

    from opengem.train.compile import compile_regions
    from opengem.train.trainer import build_model

    config = load_config("gem-tiny", None, [*SMALL, "architecture=gem", "gem.num_layers=2",
                                            "compile=true", "compile_cpp_wrapper=true"])
    model = build_model(config, config.model.history, torch.device("cpu"))
    seen = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kwargs: seen.append(kwargs))
    assert compile_regions(model, cpp_wrapper=config.compile_cpp_wrapper) == 5
    assert compile_regions(model, mode="max-autotune-no-cudagraphs", cpp_wrapper=True) == 5
    assert all("mode" not in kwargs for kwargs in seen)
    assert [kwargs["options"] for kwargs in seen] == [{"cpp_wrapper": True}] * 5 + [
        {"max_autotune": True, "coordinate_descent_tuning": True, "cpp_wrapper": True}] * 5
    with pytest.raises(ValueError, match="backend 'aot_eager' has neither"):
        compile_regions(model, backend="aot_eager", cpp_wrapper=True)
    with pytest.raises(ValueError, match="compile_cpp_wrapper=true is a setting of the compiled blocks: set compile"):
        load_config("gem-tiny", None, [*SMALL, "compile_cpp_wrapper=true"])  # the config refuses it: train, bench


def test_a_block_compiled_with_the_cpp_wrapper_runs_it_and_computes_what_eager_does():
    """A real compile (g++ on the wrapper, ~12 s on the CI machine): the generated code is the C++ wrapper, not
    Python's ``call``, and the block's output is eager's. A training run of gem-tiny gave the same losses bit for bit
    with and without it (session 55, by hand: a minute of compiling)."""
    from torch import nn
    from torch._inductor.utils import run_and_get_code

    from opengem.jagged.jagged import Jagged
    from opengem.nn.layers import JaggedTransformerLayer
    from opengem.train.compile import compile_regions

    torch.manual_seed(0)
    eager, compiled = [nn.ModuleList([JaggedTransformerLayer(16, 2, ffn_mult=1)]) for _ in range(2)]
    compiled.load_state_dict(eager.state_dict())
    assert compile_regions(compiled, cpp_wrapper=True) == 1
    x = Jagged.from_lengths(torch.randn(7, 16), torch.tensor([3, 0, 4]))  # an empty sample between two others
    with torch.no_grad():
        out, codes = run_and_get_code(lambda: compiled[0](x).values)
        want = eager[0](x).values
    assert len(codes) == 1 and "cpp_wrapper_src" in codes[0] and "def call(" not in codes[0]
    torch.testing.assert_close(out, want)


def test_activation_memory_budget_reaches_every_region_through_inductor(monkeypatch):
    """``activation_memory_budget`` hands each block one Inductor backend that carries the budget, the compile mode
    and the C++ wrapper; a budget out of [0, 1], without compile, beside whole-block checkpointing or for another
    backend is refused."""
    from torch import nn

    from opengem.train.compile import BudgetedInductor, compile_regions
    from opengem.train.trainer import build_learner

    seen = []
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kwargs: seen.append(kwargs))
    config = load_config("gem-tiny", None, [*SMALL, "architecture=gem", "gem.num_layers=2", "compile=true",
                                            "compile_mode=max-autotune-no-cudagraphs", "compile_cpp_wrapper=true",
                                            "activation_memory_budget=0.4"])
    build_learner(config, config.model.history, torch.device("cpu"))
    assert len(seen) == 5 and all(kwargs["backend"] is seen[0]["backend"] for kwargs in seen)
    backend = seen[0]["backend"]
    assert isinstance(backend, BudgetedInductor) and backend.budget == 0.4 and "mode" not in seen[0]
    assert backend.config == {"max_autotune": True, "coordinate_descent_tuning": True, "cpp_wrapper": True}
    assert backend != BudgetedInductor(0.5, "max-autotune-no-cudagraphs", {"cpp_wrapper": True})
    for bad in ("2", "-0.1"):
        with pytest.raises(ValueError, match="activation_memory_budget must be in \\[0, 1\\]"):
            load_config("gem-tiny", None, [*SMALL, "compile=true", f"activation_memory_budget={bad}"])
    with pytest.raises(ValueError, match="activation_memory_budget is a setting of the compiled blocks: set compile"):
        load_config("gem-tiny", None, [*SMALL, "activation_memory_budget=0.5"])
    with pytest.raises(ValueError, match="activation_checkpointing recomputes whole blocks; activation_memory_budget"):
        load_config("gem-tiny", None, [*SMALL, "compile=true", "activation_memory_budget=0.5",
                                       "activation_checkpointing=true"])
    with pytest.raises(ValueError, match="backend 'aot_eager' has neither"):
        compile_regions(nn.Module(), backend="aot_eager", memory_budget=0.5)
    with pytest.raises(ValueError, match="memory_budget must be in \\[0, 1\\]"):
        compile_regions(nn.Module(), memory_budget=1.5)


def test_a_memory_budget_saves_fewer_activations_for_the_same_gradients():
    """A real compile (~15 s on the CI machine): a transformer layer compiled with budget 0 and 0.3 keeps fewer
    activation bytes for its backward than with the default partition (1), and every run gives eager's output and
    input gradient."""
    from torch import nn

    from opengem.jagged.jagged import Jagged
    from opengem.nn.layers import JaggedTransformerLayer
    from opengem.train.compile import compile_regions

    torch.manual_seed(0)
    eager = JaggedTransformerLayer(32, 2, ffn_mult=4)
    lengths = torch.tensor([50, 0, 70, 30])
    values = torch.randn(int(lengths.sum()), 32)

    def run(layer: nn.Module) -> tuple[int, torch.Tensor, torch.Tensor]:
        saved = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            saved.append(tensor.numel() * tensor.element_size())
            return tensor

        x = Jagged.from_lengths(values.clone().requires_grad_(True), lengths)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = layer(x).values
        out.square().sum().backward()
        return sum(saved), out.detach(), x.values.grad

    _, want, want_grad = run(eager)
    saved_bytes = {}
    for budget in (1.0, 0.3, 0.0):
        compiled = nn.ModuleList([JaggedTransformerLayer(32, 2, ffn_mult=4)])
        compiled.load_state_dict({f"0.{name}": value for name, value in eager.state_dict().items()})
        assert compile_regions(compiled, memory_budget=budget) == 1
        saved_bytes[budget], out, grad = run(compiled[0])
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(grad, want_grad, rtol=1e-4, atol=1e-4)
    assert saved_bytes[0.0] < saved_bytes[0.3] < saved_bytes[1.0], saved_bytes


def test_a_gem_model_compiled_with_a_memory_budget_trains_as_eager_and_keeps_the_attention():
    """One real compile of a one-layer gem-tiny (~20 s on the CI machine) at budget 0.5: the loss and every dense
    gradient are eager's, and JFA's forward runs once a step. The budget's partitioner ranks recompute candidates by
    FLOP formulas run on fake tensors, where GDPA's read fake offsets and failed the compile; and it took the custom
    ops for free to recompute (gem-large b512 ran JFA's forward twice, session 58)."""
    from opengem.train.data_stream import train_batches
    from opengem.train.trainer import build_learner

    results = []
    for extra in (["compile=false"], ["compile=true", "activation_memory_budget=0.5"]):
        config = load_config("gem-tiny", None, ["architecture=gem", "batch_size=32", "gem.num_layers=1", *extra])
        torch.manual_seed(0)
        learner = build_learner(config, config.model.history, torch.device("cpu"))
        batch = next(train_batches(config, 0))
        learner.loss(batch)[0].backward()  # the compile
        learner.model.zero_grad()
        with torch.profiler.profile() as profile:
            loss, value = learner.loss(batch)
            loss.backward()
        calls = [event.name for event in profile.events()]
        assert calls.count("opengem::jagged_attention_packed_fwd") == 1, extra
        grads = {name: p.grad for name, p in learner.model.named_parameters() if p.grad is not None}
        results.append((value, grads))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == want_grads.keys() and want_grads
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_activation_checkpointing_recomputes_to_the_same_losses(tmp_path):
    """Each block's activations recomputed in the backward: the same losses, the same checkpoint names."""
    runs = {}
    for checkpointing in ("false", "true"):
        config = _config(tmp_path, "steps=3", "eval_every=3", "eval_samples=500", "baseline=false",
                         "architecture=gem", "gem.num_layers=2", f"activation_checkpointing={checkpointing}",
                         f"name=ac_{checkpointing}")
        train(config, progress=False)
        runs[checkpointing] = _losses(tmp_path / f"ac_{checkpointing}")
    assert runs["true"] == runs["false"]
    assert _final_weights(tmp_path / "ac_true").keys() == _final_weights(tmp_path / "ac_false").keys()


def test_checkpoint_blocks_wraps_every_gem_layer():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from opengem.parallel.fsdp import checkpoint_blocks
    from opengem.train.trainer import build_learner, build_model

    config = load_config("gem-tiny", None, ["architecture=gem", "gem.num_layers=2"])
    model = build_model(config, config.model.history, torch.device("cpu"))
    names = checkpoint_blocks(model)
    assert names == ["layers.0", "layers.1"]
    assert all(isinstance(layer, CheckpointWrapper) for layer in model.layers)
    learner = build_learner(apply_overrides(config, ["activation_checkpointing=true"]), "attention", torch.device("cpu"))
    assert all(isinstance(layer, CheckpointWrapper) for layer in learner.model.layers)  # the trainer's path


def test_weight_shadows_train_bit_for_bit_like_autocast(tmp_path):
    """``weight_shadows=true`` (bf16 copies of the Linear weights cast once a step) with AdamW (``shadow_adamw=false``)
    trains the GEM model and its baseline to the same losses and final weights as autocast's per-use casts."""
    runs = {}
    for shadows in ("false", "true"):
        config = _config(tmp_path, "steps=3", "eval_every=3", "eval_samples=500", "architecture=gem",
                         "precision=bf16", f"weight_shadows={shadows}", "shadow_adamw=false", f"name=shadows_{shadows}")
        train(config, progress=False)
        runs[shadows] = (_losses(tmp_path / f"shadows_{shadows}"), _final_weights(tmp_path / f"shadows_{shadows}"))
    (want_losses, want_weights), (got_losses, got_weights) = runs["false"], runs["true"]
    assert got_losses == want_losses and len(got_losses) == 3
    assert got_weights.keys() == want_weights.keys()
    for name, weight in want_weights.items():
        assert torch.equal(got_weights[name], weight), name


def test_fp32_weight_grads_train_close_to_autocast_from_the_same_first_loss():
    """``fp32_weight_grads=true``: the same forward (the first step's loss is autocast's bit for bit), weight gradients
    without autocast's bf16 rounding, so the weights after the first update differ, by little."""
    from opengem.train.data_stream import train_batches
    from opengem.train.trainer import build_learner

    config = load_config("gem-tiny", None, [*SMALL, "architecture=gem", "gem.num_layers=2", "precision=bf16"])
    stream = train_batches(config, 0)
    batches = [next(stream) for _ in range(3)]
    runs = {}
    for name, settings in (("plain", {"weight_shadows": False}),
                           ("fp32", {"weight_shadows": True, "fp32_weight_grads": True})):
        torch.manual_seed(0)
        learner = build_learner(dataclasses.replace(config, **settings), config.model.history, torch.device("cpu"))
        losses = [float(learner.step(batch)) for batch in batches]
        runs[name] = (losses, {n: p.detach().clone() for n, p in learner.model.named_parameters()})
    (want_losses, want_weights), (got_losses, got_weights) = runs["plain"], runs["fp32"]
    assert got_losses[0] == want_losses[0]
    assert got_losses[1:] == pytest.approx(want_losses[1:], rel=1e-3)
    changed = [n for n, w in want_weights.items() if not torch.equal(got_weights[n], w)]
    assert any(".kv." in n or ".q." in n or "fm_mlp" in n for n in changed), changed
    # AdamW moves a weight by at most ~lr a step whatever its gradient (a near-zero one, such as the key bias's under
    # softmax, can flip sign), so no weight may differ by more than the three steps allow
    for name, weight in want_weights.items():
        assert (got_weights[name] - weight).abs().max() <= 2 * 3 * config.lr, name


@pytest.mark.parametrize("architecture", ["gem", "sequence_ctr"])
def test_compiled_regions_read_weight_shadows_whole(architecture):
    """With weight shadows in use the dense blocks still compile without a graph break (fullgraph) and compute what
    the eager model with autocast's casts computes, gradients included."""
    from opengem.nn.weight_shadows import shadow_linear_weights, shadows_in_use
    from opengem.train.compile import compile_regions
    from opengem.train.data_stream import train_batches
    from opengem.train.trainer import build_model

    config = load_config("gem-tiny", None, [*SMALL, f"architecture={architecture}", "gem.num_layers=2"])
    torch.manual_seed(0)
    eager = build_model(config, config.model.history, torch.device("cpu"))
    compiled = build_model(config, config.model.history, torch.device("cpu"))
    compiled.load_state_dict(eager.state_dict())
    assert shadow_linear_weights(compiled)
    compile_regions(compiled, backend="aot_eager")
    batch = next(train_batches(config, 0))
    outputs = []
    for model, use in ((eager, False), (compiled, True)):
        with torch.autocast("cpu", dtype=torch.bfloat16), (shadows_in_use() if use else contextlib.nullcontext()):
            out = model(batch)
        out.float().sum().backward()
        outputs.append((out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (want, want_grads), (got, got_grads) = outputs
    torch.testing.assert_close(got, want)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, msg=name)


def test_learner_computes_from_its_weight_shadows():
    """The learner's steps read the shadows, refreshed at each step's start: its losses are the plain learner's; with
    the shadows zeroed its forward changes, and entering a step refreshes them from the parameters."""
    from opengem.nn.weight_shadows import ShadowedLinear, shadows_in_use
    from opengem.train.data_stream import train_batches
    from opengem.train.trainer import build_learner

    config = load_config("gem-tiny", None, [*SMALL, "architecture=gem", "gem.num_layers=1", "precision=bf16"])
    stream = train_batches(config, 0)
    batches = [next(stream) for _ in range(2)]
    losses = {}
    shadows_with_adamw = {"weight_shadows": True, "shadow_adamw": False}
    for name, settings in (("plain", {"weight_shadows": False}), ("shadows", shadows_with_adamw)):
        torch.manual_seed(0)
        learner = build_learner(dataclasses.replace(config, **settings), config.model.history, torch.device("cpu"))
        losses[name] = [float(learner.step(batch)) for batch in batches]
    assert losses["shadows"] == losses["plain"]
    assert learner.weight_shadows and any(isinstance(m, ShadowedLinear) for m in learner.model.modules())
    learner.model.eval()
    with torch.no_grad():
        plain_out = learner.forward(batches[0])
        for _, shadow in learner.weight_shadows:
            shadow.zero_()
        with shadows_in_use():
            zeroed_out = learner.forward(batches[0])
        assert not torch.equal(zeroed_out, plain_out)  # in use, the forward reads the (zeroed) shadows
        with learner._shadows():  # a step's context: refreshed from the parameters first
            pairs = learner.weight_shadows
            assert all(torch.equal(shadow, parameter.to(torch.bfloat16)) for parameter, shadow in pairs)
            assert torch.equal(learner.forward(batches[0]), plain_out)


def test_step_trains_after_predict_and_keeps_a_submodule_the_user_froze_in_eval():
    """``Learner.step`` puts the model back in training mode after ``predict`` (which leaves it in eval), without a
    walk of every module each step: a submodule the user put in eval mode on purpose stays there."""
    from opengem.train.data_stream import train_batches
    from opengem.train.trainer import build_learner

    config = load_config("gem-tiny", None, [*SMALL, "architecture=gem", "gem.num_layers=2"])
    stream = train_batches(config, 0)
    learner = build_learner(config, config.model.history, torch.device("cpu"))
    learner.step(next(stream))
    frozen = learner.model.layers[0]
    frozen.eval()
    learner.step(next(stream))
    assert learner.model.training and not frozen.training and not any(m.training for m in frozen.modules())
    learner.predict([next(stream)])
    assert not any(m.training for m in learner.model.modules())
    learner.step(next(stream))
    assert all(m.training for m in learner.model.modules())  # back in training mode, the frozen layer included
