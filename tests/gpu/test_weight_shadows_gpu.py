"""bf16 weight shadows (``weight_shadows=true``) on the GPU: a compiled GEM learner trains to the plain learner's
losses bit for bit and launches fewer kernels a step (autocast's per-use weight casts gone)."""

import dataclasses

import pytest
import torch
from torch.autograd import DeviceType

from opengem.data.parquet import batches_from_table
from opengem.data.synthetic import generate
from opengem.models.presets import GEM_PRESETS
from opengem.train.config import load_config
from opengem.train.trainer import build_learner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_compiled_learner_with_weight_shadows_matches_and_launches_fewer_kernels():
    config = load_config("gem-small", None, ["architecture=gem", "precision=bf16", "gem.num_layers=2",
                                             "batch_size=256", "device=cuda", "compile=true"])
    table = generate(GEM_PRESETS["gem-small"].data, 4 * 256, seed=5)
    batches = [b.to("cuda") for b in batches_from_table(table, 256)]
    results = {}
    for shadows in (False, True):
        torch.manual_seed(0)
        learner = build_learner(dataclasses.replace(config, weight_shadows=shadows), config.model.history,
                                torch.device("cuda"))
        losses = [float(learner.step(batch)) for batch in batches[:3]]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            learner.step(batches[3])
            torch.cuda.synchronize()
        kernels = sum(1 for event in profile.events() if event.device_type == DeviceType.CUDA)
        results[shadows] = (losses, kernels)
    (want_losses, plain_kernels), (got_losses, shadow_kernels) = results[False], results[True]
    assert got_losses == want_losses
    assert shadow_kernels < plain_kernels, (shadow_kernels, plain_kernels)
