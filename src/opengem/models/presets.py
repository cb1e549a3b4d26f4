"""GEM size presets, with their parameter counts and model FLOPs per sample.

FLOPs follow GEM_SPEC section 8: ``2 M N K`` per GEMM on real (unpadded) rows, attention ``4 H D`` per
unmasked (query, key) pair, backward = 2x forward for GEMMs and 2.5x for attention; embeddings, norms
and element-wise ops count zero. :func:`gem_flops` counts one batch exactly from its history lengths
(it matches ``torch.utils.flop_counter`` on a real forward); :func:`describe` reports one sample of the
preset's mean history length (interpolated between the two nearest integer lengths). With power-law
lengths the attention share per token is higher than at the mean length (E[L^2] > E[L]^2), so the
attention shares printed here are lower bounds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from opengem.data.schema import TASKS
from opengem.data.synthetic import SYNTHETIC_PRESETS, SyntheticConfig
from opengem.models.gem import GEM, GEMConfig
from opengem.ops.attention_flops import visible_pairs
from opengem.ops.block_attention import block_pairs


@dataclass(frozen=True)
class GEMPreset:
    model: GEMConfig
    data: SyntheticConfig  # the synthetic world whose features (vocabularies, lengths) the model reads
    purpose: str


# A planning-only world for gem-xl: billions of users/items/ads so the tables reach ~1T parameters.
_XL_DATA = SyntheticConfig(
    "gem-xl", num_users=2_000_000_000, num_items=1_600_000_000, num_categories=100_000, num_ads=300_000_000,
    num_advertisers=20_000_000, min_history=200, max_history=32768, history_exponent=2.0, click_bias=-4.8,
)

GEM_PRESETS: dict[str, GEMPreset] = {
    "gem-tiny": GEMPreset(
        GEMConfig(),  # the defaults are the CPU demo
        SYNTHETIC_PRESETS["gem-tiny"],
        "CPU demo (the README's model): trains in minutes on 2 cores",
    ),
    "gem-small": GEMPreset(
        GEMConfig(embedding_dim=128, d_model=256, num_heads=2, num_layers=8, num_summary_tokens=16, num_cls=4,
                  num_seeds=8, num_recent=16, window=256, ffn_mult=1, fm_rank=32, wukong_hidden=1536,
                  num_experts=2, head_dims=(1024, 256)),
        SYNTHETIC_PRESETS["gem-small"],
        "one GPU, ~100M dense parameters",
    ),
    "gem-large": GEMPreset(
        GEMConfig(embedding_dim=256, d_model=512, num_heads=4, num_layers=12, num_summary_tokens=32, num_cls=8,
                  num_seeds=16, num_recent=32, window=1024, ffn_mult=1, fm_rank=64, wukong_hidden=5120,
                  num_experts=2, head_dims=(1024, 256)),
        SYNTHETIC_PRESETS["gem-large"],
        "one H100/H200: ~1B dense parameters, histories up to 16k tokens",
    ),
    "gem-xl": GEMPreset(
        GEMConfig(embedding_dim=256, d_model=1024, num_heads=8, num_layers=24, num_summary_tokens=32, num_cls=16,
                  num_seeds=32, num_recent=64, window=2048, ffn_mult=1, fm_rank=128, wukong_hidden=8192,
                  num_experts=2, head_dims=(2048, 512)),
        _XL_DATA,
        "multi-host planning: ~10B dense, ~1T sparse parameters",
    ),
}


@dataclass(frozen=True)
class PresetSummary:
    name: str
    purpose: str
    dense_parameters: int
    sparse_parameters: int
    mean_history_length: float
    forward_flops: float  # per sample at the mean history length
    train_flops: float  # forward + backward
    attention_share: float  # attention's part of train_flops


def parameter_counts(preset: GEMPreset) -> tuple[int, int]:
    """``(dense, sparse)``: the model built on the meta device (no memory), so counts are exact."""
    with torch.device("meta"):
        model = GEM(preset.data.feature_specs(), preset.data.num_dense, preset.model)
    dense = sum(p.numel() for p in model.parameters())
    sparse = sum(t.num_embeddings * t.embedding_dim for t in model.embeddings.tables)
    return dense, sparse


def gem_flops(config: GEMConfig, data: SyntheticConfig, history_lengths: Sequence[int]) -> dict[str, int]:
    """Forward FLOPs of one batch with these history lengths: ``{"gemm": ..., "attention": ...}``."""
    features = data.feature_specs()
    num_sparse = sum(f.kind != "sequence" for f in features)
    num_sequence = sum(f.kind == "sequence" for f in features)
    return _gem_flops(config, num_sparse, num_sequence, data.num_dense, data.num_surfaces, history_lengths)


def gem_model_flops(model: GEM, history_lengths: Sequence[int]) -> dict[str, int]:
    """:func:`gem_flops` of a built model (feature counts read from the model, not from a data preset)."""
    return _gem_flops(model.config, len(model.sparse_names), len(model.sequence_names),
                      model.dense_proj.in_features, model.num_domains, history_lengths)


def _gem_flops(config: GEMConfig, num_sparse: int, num_sequence: int, num_dense: int, num_domains: int,
               history_lengths: Sequence[int]) -> dict[str, int]:
    batch = len(history_lengths)
    e, d, m = config.embedding_dim, config.d_model, config.num_summary_tokens
    n = num_sparse + 1  # feature tokens + the dense token
    gemm = batch * (num_sparse * e * d + num_dense * d)  # feature and dense projections (2x below)
    gemm += batch * (n * m * d + m * d * d)  # the final X summary: compression + gate
    attention = 0
    summary_tokens = 0
    if config.use_sequence:
        c = config.num_cls
        lengths = torch.tensor(list(history_lengths), dtype=torch.int64) + c
        tokens = int(lengths.sum())
        seeds = config.num_seeds if config.use_pooling else 0
        summary_tokens = c + seeds + config.num_recent
        gemm += (tokens - batch * c) * num_sequence * e * d  # history token projection
        gemm += batch * (n * m * d + m * d * d + m * d * c * d)  # CLS from the X summary
        per_layer = tokens * (4 * d * d + 2 * config.ffn_mult * d * d)  # qkv, out, feed-forward
        if config.use_pffn:
            per_layer += tokens * 2 * d * d + batch * (n * m * d + m * d * d + m * 2 * d * d)  # q/out; X_sum; k/v
            attention += config.num_layers * tokens * m * 2 * d  # 4 H D pairs = 2 * (2 d) pairs, halved below
        # S_sum feeds every layer's Wukong; without Wukong only the last layer's reaches the heads
        summarized = config.num_layers if config.use_wukong else 1
        gemm += summarized * batch * summary_tokens * d * d  # S_sum gate
        if seeds:
            gemm += summarized * (tokens * 2 * d * d + batch * seeds * d * d)  # k/v over the sequence; out
            attention += summarized * tokens * seeds * 2 * d
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
        if config.self_attention == "jfa":
            pairs = visible_pairs(lengths, lengths, masked=True, contextual_len=c, window=config.window)
        else:
            pairs = block_pairs(offsets, config.block_size)
        attention += config.num_layers * pairs * 2 * d
        gemm += config.num_layers * per_layer
    if config.use_wukong:
        tokens_in = n + summary_tokens
        fm_tokens = (n + 1) // 2
        expert = 2 * tokens_in * d * config.fm_rank  # X^T Y and X (X^T Y)
        expert += tokens_in * config.fm_rank * config.wukong_hidden + config.wukong_hidden * fm_tokens * d
        expert += d * tokens_in * (n - fm_tokens)  # linear compression
        expert += d * tokens_in * n if tokens_in != n else 0  # residual token projection
        gemm += config.num_layers * config.num_experts * batch * expert
    head_dims = [(m + summary_tokens) * d, *config.head_dims, num_domains]
    gemm += len(TASKS) * batch * sum(a * b for a, b in zip(head_dims[:-1], head_dims[1:]))
    return {"gemm": 2 * gemm, "attention": 2 * attention}


def describe(name: str) -> PresetSummary:
    if name not in GEM_PRESETS:
        raise ValueError(f"unknown GEM preset {name!r}; choose one of {sorted(GEM_PRESETS)}")
    preset = GEM_PRESETS[name]
    dense, sparse = parameter_counts(preset)
    mean = preset.data.mean_history_length()
    low = math.floor(mean)
    weight = mean - low
    at = [gem_flops(preset.model, preset.data, [length]) for length in (low, low + 1)]
    flops = {k: (1 - weight) * at[0][k] + weight * at[1][k] for k in at[0]}
    train_gemm, train_attention = 3 * flops["gemm"], 3.5 * flops["attention"]
    return PresetSummary(
        name=name,
        purpose=preset.purpose,
        dense_parameters=dense,
        sparse_parameters=sparse,
        mean_history_length=mean,
        forward_flops=flops["gemm"] + flops["attention"],
        train_flops=train_gemm + train_attention,
        attention_share=train_attention / (train_gemm + train_attention),
    )
