"""``shadow_adamw_moments="bf16"``: the shadow AdamW keeps the shadowed weights' moments in bf16, rounded
stochastically (`opengem.train.shadow_adamw`), on the CPU (the reference update; the kernel:
tests/ops/test_adamw_moments.py)."""

import dataclasses

import pytest
import torch
from torch import nn

from opengem.nn.weight_shadows import shadow_linear_weights, shadows_in_use
from opengem.train.config import load_config
from opengem.train.shadow_adamw import ShadowAdamW
from opengem.train.trainer import build_learner, train
from tests.train.test_shadow_adamw import GEM_BF16, GEM_SHADOW_ADAMW, SHADOW_ADAMW, _runs
from tests.train.test_trainer import _losses, resume_matches_the_straight_run

BF16_MOMENTS = {**SHADOW_ADAMW, "shadow_adamw_moments": "bf16"}


def test_bf16_moments_train_close_to_fp32_moments_and_keep_bf16_state():
    runs = _runs({"fp32": SHADOW_ADAMW, "bf16": BF16_MOMENTS}, steps=4)
    assert runs["bf16"][0] == pytest.approx(runs["fp32"][0], rel=2e-3)
    learner = runs["bf16"][2]
    optimizer = learner.optimizer
    dtypes = {(m.grad is None, optimizer.state[m]["exp_avg"].dtype, optimizer.state[m]["exp_avg_sq"].dtype)
              for m, _ in learner.weight_shadows}
    # the shadow-stepped weights in bf16; the biases whose gradients reach the fp32 tensors stay AdamW's, in fp32
    assert dtypes == {(True, torch.bfloat16, torch.bfloat16), (False, torch.float32, torch.float32)}
    for master, shadow in learner.weight_shadows:
        assert torch.equal(shadow, master.detach().bfloat16())


def test_resume_rounds_as_the_uninterrupted_run_and_loads_into_fp32_moments(tmp_path):
    """The rounding bits are keyed by the config's seed, the step and the tensor: a resumed run continues bit for
    bit. The checkpoint's bf16 moments load widened into fp32-moment runs too."""
    straight, middle, expected = resume_matches_the_straight_run(tmp_path, *GEM_SHADOW_ADAMW,
                                                                 "shadow_adamw_moments=bf16")
    state = torch.load(middle / "state.pt", weights_only=True)["learners"]["model"]["optimizer"]["state"]
    assert torch.bfloat16 in {s["exp_avg"].dtype for s in state.values()}
    for name, extra in (("fp32_moments", {"shadow_adamw_moments": "fp32"}),
                        ("plain", {"weight_shadows": False, "shadow_adamw": False, "shadow_adamw_moments": "fp32"})):
        train(dataclasses.replace(straight, name=name, **extra), resume=middle, progress=False)
        assert _losses(tmp_path / name).keys() == expected.keys()


def test_a_gradient_that_changes_tensor_after_the_first_step_is_refused():
    """With bf16 moments a weight's moments live where its first gradient went (shadow: bf16 kernel state; fp32
    tensor: AdamW's fp32 state), so a later gradient on the other tensor is refused, not dropped or mis-stepped."""
    model = nn.Linear(4, 2)
    pairs = shadow_linear_weights(model, shadow_grads=True)
    optimizer = ShadowAdamW(model.parameters(), pairs, moments_dtype=torch.bfloat16, lr=0.01)
    with shadows_in_use(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(3, 4)).float().sum().backward()
    optimizer.step()
    assert {optimizer.state[m]["exp_avg"].dtype for m, _ in pairs} == {torch.bfloat16}
    optimizer.zero_grad()
    model.weight.grad = torch.ones_like(model.weight)
    with pytest.raises(RuntimeError, match="1 shadowed parameters .* took their gradient on the other tensor"):
        optimizer.step()


def test_bf16_moments_without_the_shadow_adamw_are_refused_by_name():
    with pytest.raises(ValueError, match="shadow_adamw_moments must be one of .'fp32', 'bf16'., got 'fp16'"):
        load_config("gem-tiny", None, ["shadow_adamw_moments=fp16"])
    needs = "shadow_adamw_moments=bf16 is the shadow AdamW's state: it needs shadow_adamw true or auto"
    with pytest.raises(ValueError, match=f"{needs} and fp32_weight_grads false, got shadow_adamw=false"):
        load_config("gem-tiny", None, ["precision=bf16", "shadow_adamw=false", "shadow_adamw_moments=bf16"])
    with pytest.raises(ValueError, match="fp32_weight_grads=True"):
        load_config("gem-tiny", None, ["precision=bf16", "fp32_weight_grads=true", "shadow_adamw_moments=bf16"])
    with pytest.raises(ValueError, match="shadow_adamw_moments computes .* got precision='fp32'"):
        load_config("gem-tiny", None, ["shadow_adamw_moments=bf16"])
    config = dataclasses.replace(load_config("gem-tiny", None, GEM_BF16), shadow_adamw_moments="bf16")
    with pytest.raises(ValueError, match="shadow_adamw_moments=bf16 is the shadow AdamW's state, and auto leaves"):
        build_learner(config, config.model.history, torch.device("cpu"))  # auto: no shadows on the CPU
    with pytest.raises(ValueError, match="moments_dtype must be torch.float32 or torch.bfloat16"):
        ShadowAdamW(nn.Linear(2, 2).parameters(), [], moments_dtype=torch.float16, lr=0.01)
    with pytest.raises(ValueError, match=r"rounding_seed must be in \[0, 2 \*\* 32\)"):
        ShadowAdamW(nn.Linear(2, 2).parameters(), [], rounding_seed=-1, lr=0.01)
