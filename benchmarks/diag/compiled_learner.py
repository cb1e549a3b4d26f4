"""The learner ``opengem bench train --compile`` times, built the same way for the step diagnostics."""

from __future__ import annotations

import torch

from opengem.nn.embedding import trust_ids
from opengem.train.bench.step import TrainBenchOptions, bench_config
from opengem.train.compile import compile_regions
from opengem.train.config import TrainConfig
from opengem.train.trainer import Learner, build_learner


def compiled_learner(preset: str, batch_size: int) -> tuple[TrainBenchOptions, TrainConfig, torch.device, Learner]:
    """``preset`` at ``batch_size`` with the sequence stream in the compute dtype (as the GPU session's large_b512
    runs), seeded, ids trusted and its regions compiled: the same Inductor settings, so one compile cache serves
    both."""
    options = TrainBenchOptions(preset=preset, compile=True, batch_size=batch_size,
                                overrides=("gem.sequence_dtype=compute",))  # fmt: skip
    config, device, _ = bench_config(options)
    torch.manual_seed(config.seed)
    learner = build_learner(config, config.model.history, device)
    trust_ids(learner.model)
    compile_regions(learner.model, mode=config.compile_mode)
    return options, config, device, learner
