"""GEM on the GPU (every attention on its Triton kernel) against the same model on the CPU reference ops."""

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from opengem.data.parquet import batches_from_table
from opengem.data.synthetic import SYNTHETIC_PRESETS, generate
from opengem.models.gem import GEM, GEMConfig
from opengem.models.presets import GEM_PRESETS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("self_attention", ["jfa", "block"])
def test_triton_model_matches_reference_model(self_attention):
    data = SYNTHETIC_PRESETS["gem-tiny"]
    batch = next(iter(batches_from_table(generate(data, 128, seed=1), 128)))
    config = GEMConfig(num_layers=2, num_experts=2, self_attention=self_attention, block_size=32)
    torch.manual_seed(0)
    cpu_model = GEM(data.feature_specs(), data.num_dense, config, embedding_optimizer=None)  # tables get .grad
    gpu_model = copy.deepcopy(cpu_model).cuda()
    cpu_logits, gpu_logits = cpu_model(batch), gpu_model(batch.to("cuda"))
    assert _relative(gpu_logits, cpu_logits) < 2e-2  # TF32 in the kernels and GEMMs
    cpu_logits.square().sum().backward()
    gpu_logits.square().sum().backward()
    cpu_grads = dict(cpu_model.named_parameters())
    for name, parameter in gpu_model.named_parameters():
        assert _relative(parameter.grad, cpu_grads[name].grad) < 5e-2, name


def test_gem_small_trains_in_bf16_with_long_histories():
    preset = GEM_PRESETS["gem-small"]
    batch = next(iter(batches_from_table(generate(preset.data, 64, seed=0), 64))).to("cuda")
    assert batch.history_age.max_len > 256  # windowed attention is exercised
    torch.manual_seed(0)
    model = GEM(preset.data.feature_specs(), preset.data.num_dense, preset.model).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(5):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(batch)
        loss = F.binary_cross_entropy_with_logits(logits.float(), batch.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]


def test_block_attention_variant_runs_gem_small_shapes():
    preset = GEM_PRESETS["gem-small"]
    config = dataclasses.replace(preset.model, self_attention="block", num_layers=2)
    batch = next(iter(batches_from_table(generate(preset.data, 32, seed=2), 32))).to("cuda")
    model = GEM(preset.data.feature_specs(), preset.data.num_dense, config).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(batch)
    logits.float().sum().backward()
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("self_attention", ["jfa", "block"])
def test_forced_reference_backend_matches_triton_on_gpu(self_attention):
    """The switch behind the acceptance run: same model on CUDA, attention on Triton vs on the reference."""
    data = SYNTHETIC_PRESETS["gem-tiny"]
    batch = next(iter(batches_from_table(generate(data, 64, seed=4), 64))).to("cuda")
    config = GEMConfig(num_layers=2, self_attention=self_attention, block_size=32)
    torch.manual_seed(0)
    triton_model = GEM(data.feature_specs(), data.num_dense, config, embedding_optimizer=None).cuda()
    reference_config = dataclasses.replace(config, attention_backend="reference")
    reference_model = GEM(data.feature_specs(), data.num_dense, reference_config, embedding_optimizer=None).cuda()
    reference_model.load_state_dict(triton_model.state_dict())
    assert _relative(triton_model(batch), reference_model(batch)) < 2e-2
