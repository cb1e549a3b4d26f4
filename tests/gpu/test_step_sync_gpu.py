"""A GEM training step on the GPU makes no device synchronization (found with set_sync_debug_mode).

The batch layout reaches the ops as host mirrors (opengem.jagged.host), tile schedules go to the GPU
through pinned memory, and the embedding id check (one sync when on) is switched off here.
"""

import dataclasses
import gc

import pytest
import torch
import torch.nn.functional as F

from opengem.data.parquet import batches_from_table
from opengem.data.synthetic import generate
from opengem.models.gem import GEM
from opengem.models.presets import GEM_PRESETS
from opengem.nn.embedding import EmbeddingCollection

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _step(model: GEM, batch) -> None:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(batch)
    F.binary_cross_entropy_with_logits(logits.float(), batch.labels).backward()


@pytest.mark.parametrize("self_attention", ["jfa", "block"])
def test_gem_forward_backward_without_sync(self_attention):
    preset = GEM_PRESETS["gem-small"]
    config = dataclasses.replace(preset.model, num_layers=2, self_attention=self_attention)
    model = GEM(preset.data.feature_specs(), preset.data.num_dense, config).cuda()
    for module in model.modules():
        if isinstance(module, EmbeddingCollection):
            module.validate_ids = False
    host_batch = next(iter(batches_from_table(generate(preset.data, 256, seed=3), 256))).pin_memory()
    _step(model, host_batch.to("cuda", non_blocking=True))  # compiles, autotunes, fills schedule caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(model, host_batch.to("cuda", non_blocking=True))  # a fresh copy: new device tensors, new mirrors
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_learner_step_without_sync():
    """The whole optimizer step (forward, loss, backward, fused embedding update, the default shadow AdamW and fused
    AdamW, schedule): a non-finite loss is skipped on the device, so the step never reads the GPU back."""
    from opengem.train.config import load_config
    from opengem.train.shadow_adamw import ShadowAdamW
    from opengem.train.trainer import build_learner

    config = load_config("gem-small", None, ["architecture=gem", "precision=bf16", "gem.num_layers=2",
                                             "batch_size=256", "device=cuda", "compile=false"])
    learner = build_learner(config, config.model.history, torch.device("cuda"))
    assert learner.skip_on_device and isinstance(learner.optimizer, ShadowAdamW)  # bf16 on a GPU: the default
    for module in learner.model.modules():
        if isinstance(module, EmbeddingCollection):
            module.validate_ids = False
    preset = GEM_PRESETS["gem-small"]
    host_batch = next(iter(batches_from_table(generate(preset.data, 256, seed=4), 256))).pin_memory()
    learner.step(host_batch.to("cuda", non_blocking=True))  # compiles, autotunes, fills caches
    assert gc.get_freeze_count() > 0  # the first step froze what it built: no full collection rescans it
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = learner.step(host_batch.to("cuda", non_blocking=True))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.isfinite(loss)
