"""``shadow_adamw=true``: AdamW reads the weight shadows' bf16 gradients and writes the shadows as it updates
(`opengem.train.shadow_adamw`), on the CPU (the reference update; the kernel: tests/ops/test_adamw.py)."""

import dataclasses

import pytest
import torch
from torch import nn

from opengem.nn.weight_shadows import shadow_linear_weights, shadows_in_use
from opengem.train.config import config_from_dict, load_config, shadow_settings
from opengem.train.data_stream import train_batches
from opengem.train.shadow_adamw import ShadowAdamW
from opengem.train.trainer import build_learner, train
from tests.train.test_trainer import SMALL, _losses, resume_matches_the_straight_run

GEM_BF16 = [*SMALL, "architecture=gem", "gem.num_layers=2", "precision=bf16"]
SHADOW_ADAMW = {"weight_shadows": True, "shadow_adamw": True}
GEM_SHADOW_ADAMW = ("architecture=gem", "precision=bf16", "weight_shadows=true", "shadow_adamw=true")
PLAIN = {"weight_shadows": False, "shadow_adamw": False}


def _runs(settings: dict[str, dict], steps: int = 3) -> dict[str, tuple[list[float], dict, object]]:
    config = load_config("gem-tiny", None, GEM_BF16)
    stream = train_batches(config, 0)
    batches = [next(stream) for _ in range(steps)]
    runs = {}
    for name, extra in settings.items():
        torch.manual_seed(0)
        learner = build_learner(dataclasses.replace(config, **extra), config.model.history, torch.device("cpu"))
        losses = [float(learner.step(batch)) for batch in batches]
        runs[name] = (losses, {n: p.detach().clone() for n, p in learner.model.named_parameters()}, learner)
    return runs


def test_one_step_updates_every_weight_as_adamw_on_autocasts_gradients():
    """The same gradients (autocast's bf16 weight gradients, widened) and AdamW's formula: after one step every
    weight is within an ulp-scale tolerance of the plain run's, and every shadow is its weight rounded (the biases
    handed to the attention ops, whose gradients reach the fp32 tensors, among them)."""
    runs = _runs({"plain": PLAIN, "shadow_adamw": SHADOW_ADAMW}, steps=1)
    (want_loss, want, _), (got_loss, got, learner) = runs["plain"], runs["shadow_adamw"]
    assert got_loss == want_loss
    for name, weight in want.items():
        torch.testing.assert_close(got[name], weight, rtol=1e-6, atol=1e-7, msg=name)
    optimizer = learner.optimizer
    assert isinstance(optimizer, ShadowAdamW) and learner.weight_shadows
    for master, shadow in learner.weight_shadows:
        assert torch.equal(shadow, master.detach().bfloat16())
    assert optimizer.shadows_fresh()
    stepped = [m for m, s in learner.weight_shadows if float(optimizer.state[m]["step"]) == 1]
    assert len(stepped) == len(learner.weight_shadows)  # every shadowed weight and bias took its step


def test_fp8_mlp_layers_keep_their_own_weights_beside_the_shadowed_ones():
    """With FP8 MLPs (as a GPU run now gets them beside the default shadows) the low-precision layers are not
    shadowed: AdamW steps their fp32 weights, from the gradients of the FP8 run without shadows, and the shadow AdamW
    the plain layers'."""
    from opengem.nn.low_precision import LowPrecisionLinear

    fp8 = {"low_precision_mlp": "fp8_rowwise", "low_precision_min_features": 128}
    runs = _runs({"plain": {**PLAIN, **fp8}, "shadow_adamw": {**SHADOW_ADAMW, **fp8}}, steps=1)
    (want_loss, want, _), (got_loss, got, learner) = runs["plain"], runs["shadow_adamw"]
    assert got_loss == want_loss
    fp8_layers = {n for n, m in learner.model.named_modules() if isinstance(m, LowPrecisionLinear)}
    assert fp8_layers  # gem-tiny's layers with both dims >= 128
    shadowed = {id(master) for master, _ in learner.weight_shadows}
    assert shadowed and isinstance(learner.optimizer, ShadowAdamW)
    for name in fp8_layers:
        weight = learner.model.get_submodule(name).weight
        assert id(weight) not in shadowed and weight.grad is not None  # AdamW's, through the FP8 GEMM
        assert float(learner.optimizer.state[weight]["step"]) == 1
        torch.testing.assert_close(got[f"{name}.weight"], want[f"{name}.weight"], rtol=1e-6, atol=1e-7)


def test_training_stays_close_to_the_plain_run():
    runs = _runs({"plain": PLAIN, "shadow_adamw": SHADOW_ADAMW}, steps=4)
    assert runs["shadow_adamw"][0] == pytest.approx(runs["plain"][0], rel=2e-3)


def test_resume_continues_exactly_and_the_state_loads_into_plain_adamw(tmp_path):
    """A resumed run refreshes the shadows from the loaded weights and continues bit for bit; the optimizer state
    has AdamW's keys, so a plain run resumes from it too."""
    straight, middle, expected = resume_matches_the_straight_run(tmp_path, *GEM_SHADOW_ADAMW)
    plain = dataclasses.replace(straight, name="plain", weight_shadows=False, shadow_adamw=False)
    train(plain, resume=middle, progress=False)
    assert _losses(tmp_path / "plain").keys() == expected.keys()


def test_a_skipped_step_changes_nothing_and_zero_grad_clears_the_shadows():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1), nn.LayerNorm(1))
    pairs = shadow_linear_weights(model, shadow_grads=True)
    optimizer = ShadowAdamW(list(model.parameters()), pairs, lr=0.01, fused=True)
    x = torch.randn(32, 8)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with shadows_in_use(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(x).float().sum().backward()
    assert all(s.grad is not None and s.grad.dtype == torch.bfloat16 for _, s in pairs)
    assert all(m.grad is None for m, _ in pairs)
    optimizer.found_inf = torch.ones(())
    optimizer.step()
    for name, weight in model.named_parameters():
        assert torch.equal(weight, before[name]), name
    assert all(float(optimizer.state[m]["step"]) == 0 for m, _ in pairs)
    optimizer.found_inf = torch.zeros(())
    optimizer.step()
    assert all(float(optimizer.state[m]["step"]) == 1 for m, _ in pairs)
    assert not torch.equal(model[0].weight, before["0.weight"])
    optimizer.zero_grad()
    assert all(s.grad is None for _, s in pairs) and model[3].weight.grad is None


def test_settings_changed_after_construction_are_checked_before_anything_steps():
    """Session 65 left it noticed: an lr set to inf on a group after construction was refused only by the shadowed
    update, after torch's AdamW had stepped the unshadowed parameters (here the LayerNorm's) with it."""
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    pairs = shadow_linear_weights(model, shadow_grads=True)
    optimizer = ShadowAdamW(model.parameters(), pairs, lr=0.01)
    with shadows_in_use(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(8, 4)).float().sum().backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer.param_groups[0]["lr"] = float("inf")
    with pytest.raises(ValueError, match="ShadowAdamW: lr must be finite and >= 0"):
        optimizer.step()
    for name, weight in model.named_parameters():
        assert torch.equal(weight, before[name]), name
    optimizer.param_groups[0]["lr"] = 0.01  # a finite lr again: the step runs
    optimizer.step()
    assert not torch.equal(model[1].weight, before["1.weight"])


def test_a_gradient_on_both_the_weight_and_its_shadow_is_refused():
    model = nn.Linear(4, 2)
    pairs = shadow_linear_weights(model, shadow_grads=True)
    optimizer = ShadowAdamW(model.parameters(), pairs, lr=0.01)
    model.weight.grad = torch.zeros_like(model.weight)
    pairs[0][1].grad = torch.zeros_like(pairs[0][1])
    with pytest.raises(RuntimeError, match="both on the fp32 tensor and on the shadow"):
        optimizer.step()


def test_bad_construction_is_refused_by_name():
    model = nn.Linear(4, 2)
    pairs = shadow_linear_weights(model, shadow_grads=True)
    with pytest.raises(ValueError, match="every shadowed parameter must be among params: 1 are not"):
        ShadowAdamW([model.bias], pairs, lr=0.01)
    with pytest.raises(ValueError, match="amsgrad, maximize, capturable and differentiable are not supported"):
        ShadowAdamW(model.parameters(), pairs, lr=0.01, amsgrad=True)
    with pytest.raises(ValueError, match="fp32_grads gives the fp32 parameters their gradients"):
        shadow_linear_weights(nn.Linear(4, 2), fp32_grads=True, shadow_grads=True)


def test_config_refuses_shadow_adamw_without_shadows_or_beside_fp32_grads():
    with pytest.raises(ValueError, match="shadow_adamw computes the weight-shadowed layers' gradients: it needs "
                                         "precision=bf16 and weight_shadows true or auto, got precision='bf16', "
                                         "weight_shadows=false"):
        load_config("gem-tiny", None, ["precision=bf16", "weight_shadows=false", "shadow_adamw=true"])
    with pytest.raises(ValueError, match="fp32_weight_grads computes .* got precision='fp32', weight_shadows=auto"):
        load_config("gem-tiny", None, ["fp32_weight_grads=true"])
    with pytest.raises(ValueError, match="fp32_weight_grads gives the fp32 weights fp32 gradients and shadow_adamw"):
        load_config("gem-tiny", None, ["precision=bf16", "weight_shadows=true", "shadow_adamw=true",
                                       "fp32_weight_grads=true"])


def test_auto_turns_shadows_and_shadow_adamw_on_for_bf16_in_one_process_on_a_gpu():
    """Both settings default to auto (None): on for precision=bf16 where the parameters sit on a GPU in the
    single-process trainer; an explicit true or false wins; fp32_weight_grads keeps the shadows and plain AdamW."""
    bf16 = load_config("gem-tiny", None, ["precision=bf16"])
    assert (bf16.weight_shadows, bf16.shadow_adamw) == (None, None)
    assert shadow_settings(bf16, single_process_gpu=True) == (True, True)
    assert shadow_settings(bf16, single_process_gpu=False) == (False, False)  # CPU, or sharded / distributed
    assert shadow_settings(load_config("gem-tiny"), single_process_gpu=True) == (False, False)  # fp32
    fp32_grads = dataclasses.replace(bf16, fp32_weight_grads=True)
    assert shadow_settings(fp32_grads, single_process_gpu=True) == (True, False)
    assert shadow_settings(dataclasses.replace(bf16, shadow_adamw=False), single_process_gpu=True) == (True, False)
    assert shadow_settings(dataclasses.replace(bf16, weight_shadows=False), single_process_gpu=True) == (False, False)
    assert shadow_settings(dataclasses.replace(bf16, weight_shadows=True), single_process_gpu=False) == (True, True)
    explicit = load_config("gem-tiny", None, ["precision=bf16", "weight_shadows=true", "shadow_adamw=auto"])
    assert (explicit.weight_shadows, explicit.shadow_adamw) == (True, None)
    with pytest.raises(ValueError, match="--set: weight_shadows: expected true, false or auto, got 'maybe'"):
        load_config("gem-tiny", None, ["weight_shadows=maybe"])


def test_auto_leaves_a_cpu_learner_plain_and_refuses_shadow_settings_it_cannot_serve():
    """On the CPU auto keeps autocast's casts and torch's AdamW (the speed was measured on GPUs); a shadow setting
    that needs the shadows, with weight_shadows left auto there, is refused by name, not dropped."""
    config = load_config("gem-tiny", None, GEM_BF16)
    learner = build_learner(config, config.model.history, torch.device("cpu"))
    assert learner.weight_shadows is None and type(learner.optimizer) is torch.optim.AdamW
    for setting in ("shadow_adamw", "fp32_weight_grads"):
        with pytest.raises(ValueError, match=f"{setting}=true computes .* weight_shadows=auto leaves the shadows off"):
            build_learner(dataclasses.replace(config, **{setting: True}), config.model.history, torch.device("cpu"))


def test_saved_configs_keep_auto_and_refuse_other_values():
    """A checkpoint's config stores auto as null (JSON) and loads it back; an old one with false loads as false."""
    config = load_config("gem-tiny", None, ["precision=bf16"])
    saved = dataclasses.asdict(config)
    assert saved["weight_shadows"] is None and config_from_dict(saved) == config
    assert config_from_dict({**saved, "weight_shadows": False}).weight_shadows is False
    with pytest.raises(ValueError, match="saved config's 'shadow_adamw' must be true, false or null, got 'auto'"):
        config_from_dict({**saved, "shadow_adamw": "auto"})


def test_bad_settings_and_pairs_are_refused_at_construction():
    """Session 70's audit: torch lets inf through, so the first step had stepped the unshadowed parameters with
    it before the shadowed ones' update refused it; seeds of 1.5, repeated and mismatched pairs were accepted."""
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    pairs = shadow_linear_weights(model, shadow_grads=True)
    for name, value in (("lr", float("inf")), ("eps", float("inf")), ("weight_decay", float("inf")), ("lr", True),
                        ("lr", "1e-3")):
        with pytest.raises(ValueError, match=f"ShadowAdamW: {name} must be finite and >= 0"):
            ShadowAdamW(model.parameters(), pairs, **{name: value})
    with pytest.raises(ValueError, match=r"ShadowAdamW: betas must be a pair"):
        ShadowAdamW(model.parameters(), pairs, betas=(0.9, 0.99, 0.5))
    with pytest.raises(ValueError, match=r"ShadowAdamW: rounding_seed must be in \[0, 2 \*\* 32\) \(an int\)"):
        ShadowAdamW(model.parameters(), pairs, rounding_seed=1.5)
    optimizer = ShadowAdamW(model.parameters(), pairs)
    with pytest.raises(ValueError, match="ShadowAdamW: lr must be finite and >= 0"):
        optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "lr": float("inf")})
    weight, shadow = pairs[0]
    with pytest.raises(ValueError, match=r"pairs\[1\]: parameter of shape \(4, 4\) is paired with a shadow twice"):
        ShadowAdamW(model.parameters(), [(weight, shadow), (weight, shadow.clone())])
    with pytest.raises(ValueError, match=r"pairs\[0\] must be a contiguous fp32 parameter .* got torch.float32 "
                                         r"\(4, 4\) on cpu and torch.float32 \(4, 4\) on cpu"):
        ShadowAdamW(model.parameters(), [(weight, weight.detach().clone())])
    with pytest.raises(ValueError, match=r"pairs\[0\] must be a \(parameter, shadow\) pair of tensors"):
        ShadowAdamW(model.parameters(), [(weight, shadow, 1)])
