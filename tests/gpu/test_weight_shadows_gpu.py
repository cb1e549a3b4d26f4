"""bf16 weight shadows (``weight_shadows=true``; with ``shadow_adamw``, the default for bf16 on a GPU) on the GPU: a
compiled GEM learner trains to the plain learner's losses and launches fewer kernels a step (autocast's per-use weight
casts gone); with ``fp32_weight_grads=true`` the weight gradients come from fp32-output GEMMs, fewer kernels again;
with ``shadow_adamw=true`` the optimizer reads the shadows' bf16 gradients and writes the shadows (no gradient casts,
no refresh).

Not bit for bit, as the layers are eagerly (``tests/nn/test_weight_shadows.py``): each setting compiles its own graph,
and Inductor fuses and picks GEMM kernels per graph, so sums run in other orders. Session 39 (H100): first losses
1.3882231 plain, 1.3882203 shadows, 1.3882195 fp32 gradients (2e-6 apart relative, at most)."""

import dataclasses

import pytest
import torch
from torch.autograd import DeviceType

from opengem.data.parquet import batches_from_table
from opengem.data.synthetic import generate
from opengem.models.presets import GEM_PRESETS
from opengem.nn.low_precision import LowPrecisionLinear
from opengem.ops.fp32_gemm import fp32_product
from opengem.train.config import load_config
from opengem.train.shadow_adamw import ShadowAdamW
from opengem.train.trainer import Learner, build_learner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


SETTINGS = {"plain": {"weight_shadows": False}, "shadows": {"weight_shadows": True, "shadow_adamw": False},
            "fp32_grads": {"weight_shadows": True, "fp32_weight_grads": True},
            "shadow_adamw": {"weight_shadows": True, "shadow_adamw": True},
            "bf16_moments": {"shadow_adamw_moments": "bf16"},
            "default": {}, "fp8_plain": {"weight_shadows": False, "low_precision_mlp": "fp8_rowwise"},
            "fp8_default": {"low_precision_mlp": "fp8_rowwise"}}  # fmt: skip


def _learner(name: str) -> Learner:
    """A compiled 2-layer gem-small learner with ``SETTINGS[name]``."""
    config = load_config("gem-small", None, ["architecture=gem", "precision=bf16", "gem.num_layers=2",
                                             "batch_size=256", "device=cuda", "compile=true"])
    return build_learner(dataclasses.replace(config, **SETTINGS[name]), config.model.history, torch.device("cuda"))


def _losses_and_kernels(name: str) -> tuple[list[float], int]:
    """``_learner(name)``'s first 3 losses, and the kernels its 4th step launches."""
    table = generate(GEM_PRESETS["gem-small"].data, 4 * 256, seed=5)
    batches = [b.to("cuda") for b in batches_from_table(table, 256)]
    torch.manual_seed(0)
    learner = _learner(name)
    losses = [float(learner.step(batch)) for batch in batches[:3]]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        learner.step(batches[3])
        torch.cuda.synchronize()
    return losses, sum(1 for event in profile.events() if event.device_type == DeviceType.CUDA)


def test_compiled_learner_with_weight_shadows_matches_and_launches_fewer_kernels():
    (want_losses, plain_kernels), (got_losses, shadow_kernels) = map(_losses_and_kernels, ("plain", "shadows"))
    assert got_losses[0] == pytest.approx(want_losses[0], rel=1e-5)  # the same bf16 weights, other kernels
    assert got_losses[1:] == pytest.approx(want_losses[1:], rel=1e-3)  # after Adam steps on those sums
    assert shadow_kernels < plain_kernels, (shadow_kernels, plain_kernels)


def test_fp32_weight_grads_keep_the_first_loss_and_launch_fewer_kernels_than_shadows():
    (want_losses, shadow_kernels), (got_losses, fp32_kernels) = map(_losses_and_kernels, ("shadows", "fp32_grads"))
    # the same forward (up to the kernels each graph picks), then gradients without the bf16 rounding
    assert got_losses[0] == pytest.approx(want_losses[0], rel=1e-5)
    assert got_losses[1:] == pytest.approx(want_losses[1:], rel=1e-2)
    assert fp32_kernels < shadow_kernels, (fp32_kernels, shadow_kernels)


def test_shadow_adamw_keeps_the_first_loss_and_launches_fewer_kernels_than_shadows():
    (want_losses, shadow_kernels), (got_losses, adamw_kernels) = map(_losses_and_kernels, ("shadows", "shadow_adamw"))
    # the same forward and gradients; AdamW's arithmetic in another kernel (within an ulp a step)
    assert got_losses[0] == pytest.approx(want_losses[0], rel=1e-5)
    assert got_losses[1:] == pytest.approx(want_losses[1:], rel=1e-3)
    assert adamw_kernels < shadow_kernels, (adamw_kernels, shadow_kernels)  # no gradient casts, no refresh


def test_bf16_moments_keep_the_first_loss_and_the_kernel_count_of_the_default():
    """shadow_adamw_moments=bf16: the same launches (the shadow AdamW's one kernel, narrower state) and losses within
    the moments' rounding of the default's (fp32 moments)."""
    (want_losses, want_kernels), (got_losses, got_kernels) = map(_losses_and_kernels, ("default", "bf16_moments"))
    assert got_losses[0] == pytest.approx(want_losses[0], rel=1e-5)
    assert got_losses[1:] == pytest.approx(want_losses[1:], rel=2e-3)
    assert got_kernels == want_kernels


def test_the_default_bf16_learner_on_a_gpu_uses_shadows_and_the_shadow_adamw():
    """weight_shadows and shadow_adamw default to auto, which is on here: bf16, one process, a GPU."""
    learner = _learner("default")
    assert learner.weight_shadows and isinstance(learner.optimizer, ShadowAdamW)
    plain = _learner("plain")
    assert plain.weight_shadows is None and type(plain.optimizer) is torch.optim.AdamW


def test_default_shadows_beside_fp8_mlps_train_as_the_fp8_run_without_them():
    """FP8 MLPs with the default shadows: the FP8 layers keep their own weights (AdamW's), the plain ones are shadowed
    (the shadow AdamW's), and the losses follow the FP8 run without shadows."""
    (want_losses, _), (got_losses, _) = map(_losses_and_kernels, ("fp8_plain", "fp8_default"))
    assert got_losses[0] == pytest.approx(want_losses[0], rel=1e-4)  # the same weights; each graph its own kernels
    assert got_losses[1:] == pytest.approx(want_losses[1:], rel=1e-2)
    learner = _learner("fp8_default")
    fp8_weights = {id(m.weight) for m in learner.model.modules() if isinstance(m, LowPrecisionLinear)}
    assert fp8_weights and isinstance(learner.optimizer, ShadowAdamW)
    assert not fp8_weights & {id(master) for master, _ in learner.weight_shadows}


def test_fp32_product_is_one_fp32_output_gemm_eager_and_compiled():
    torch.manual_seed(0)
    a = torch.randn(4096, 384, device="cuda").to(torch.bfloat16).t()  # a transposed operand, as dW's is
    b = torch.randn(4096, 256, device="cuda").to(torch.bfloat16)
    want = a.double() @ b.double()
    eager = fp32_product(a, b)
    compiled = torch.compile(fp32_product, fullgraph=True)(a, b)
    for got in (eager, compiled):
        assert got.dtype == torch.float32 and got.shape == (384, 256)
        # fp32 sums over K 4096 in the GEMM's order: session 39 (H100) found them up to 1.0e-3 from fp64's on values
        # up to ~250, where the bf16 output's rounding reaches 0.5 (the margin asserted below)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=4e-3)
    rounded = (a @ b).double()  # autocast's bf16 output is off by its rounding
    assert (rounded - want).abs().max() > 10 * (eager.double() - want).abs().max()
