"""What one sample of a GEM preset costs: FLOPs by kernel family, tokens, ids, parameters and FSDP units.

Per-sample FLOPs are expectations over the preset's history-length law (``p(L) ~ L^-a`` on
``[min_history, max_history]``, `opengem.data.synthetic`), computed with ``gem_flops`` at a grid of
lengths and interpolated over every integer length (FLOPs per sample are piecewise smooth in L).
The attention FLOPs are split by kernel family by switching the PFFN and the seed pooling off in turn:
self-attention (JFA or BlockAttention), PFFN cross-attention (GDPA, K/V = the ``m`` summary tokens) and
seed pooling (GDPA with broadcast queries).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from opengem.data.synthetic import SyntheticConfig, generate
from opengem.models.gem import GEM, GEMConfig
from opengem.models.presets import GEM_PRESETS, gem_flops
from opengem.nn.embedding import EmbeddingOptimizer, EmbeddingTableConfig
from opengem.nn.wukong import DenseExperts
from opengem.parallel.fsdp import own_params, select_blocks

GRID_POINTS = 96
ID_SAMPLES = 64  # generated samples that give the mean ids per sample of multi-hot features


@dataclass(frozen=True)
class LengthLaw:
    """The probability of every integer history length."""

    lengths: np.ndarray
    probs: np.ndarray

    @classmethod
    def of(cls, data: SyntheticConfig) -> LengthLaw:
        lengths = np.arange(max(data.min_history, 1), data.max_history + 1, dtype=np.float64)
        weights = lengths ** -data.history_exponent
        return cls(lengths, weights / weights.sum())

    def expect(self, values: np.ndarray) -> float:
        return float((self.probs * values).sum())

    def mean_and_std(self, values: np.ndarray) -> tuple[float, float]:
        mean = self.expect(values)
        return mean, float(np.sqrt(max(self.expect(values**2) - mean**2, 0.0)))


@dataclass(frozen=True)
class ExpertShape:
    """A dense-experts layer: its experts' parameters and the rows exchanged under expert parallelism."""

    module: str
    expert_params: tuple[nn.Parameter, ...]  # one expert's
    all_params: tuple[nn.Parameter, ...]  # every expert's (what an EP rank drops from its block)
    num_experts: int
    input_elems: int  # per sample: tokens in x d_model
    output_elems: int  # per sample: tokens out x d_model


@dataclass(frozen=True)
class Workload:
    name: str
    model: GEMConfig
    data: SyntheticConfig
    flops: dict[str, float]  # forward FLOPs per sample: gemm, self_attention, pffn, pooling
    train_flops: float  # per sample, forward + backward (GEM_SPEC section 8)
    cost_cv: float  # coefficient of variation of a sample's train FLOPs (load imbalance)
    tokens: float  # sequence tokens per sample (history + CLS)
    mean_history: float
    self_keys_per_query: float
    ids_per_sample: dict[str, float]  # per table
    tables: tuple[EmbeddingTableConfig, ...]
    embedding_optimizer: EmbeddingOptimizer
    dense_params: int
    blocks: tuple[tuple[str, tuple[nn.Parameter, ...]], ...]  # FSDP blocks (meta parameters)
    root_params: tuple[nn.Parameter, ...]
    experts: tuple[ExpertShape, ...]
    # block_params by expert_parallel: the planner asks once a layout, thousands of times a plan
    _block_params: dict[bool, int] = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_layers(self) -> int:
        return self.model.num_layers

    def block_params(self, expert_parallel: bool) -> int:
        """Parameters of the largest FSDP block (gathered at once), experts left out under EP."""
        if expert_parallel not in self._block_params:
            taken = {id(p) for e in self.experts for p in e.all_params} if expert_parallel else set()
            self._block_params[expert_parallel] = max(
                (sum(p.numel() for p in params if id(p) not in taken) for _, params in self.blocks), default=0)
        return self._block_params[expert_parallel]


def _attention_split(config: GEMConfig, data: SyntheticConfig, lengths: list[int]) -> dict[str, np.ndarray]:
    """Per-length forward FLOPs (one sample each) by family."""
    def per_length(cfg: GEMConfig, key: str) -> np.ndarray:
        return np.array([gem_flops(cfg, data, [n])[key] for n in lengths], dtype=np.float64)

    no_pool = dataclasses.replace(config, use_pooling=False)
    self_only = dataclasses.replace(no_pool, use_pffn=False)
    total, without_pool, only_self = per_length(config, "attention"), per_length(no_pool, "attention"), per_length(self_only, "attention")
    return {"gemm": per_length(config, "gemm"), "self_attention": only_self, "pffn": without_pool - only_self,
            "pooling": total - without_pool}


def _build_meta(preset_model: GEMConfig, data: SyntheticConfig) -> GEM:
    with torch.device("meta"):
        return GEM(data.feature_specs(), data.num_dense, preset_model)


def _fsdp_structure(model: GEM) -> tuple[tuple, tuple, tuple]:
    """Blocks and root parameters as ``opengem.parallel.parallelize`` groups them, and the expert layers."""
    experts = []
    for name, module in model.named_modules():
        if isinstance(module, DenseExperts):
            first = module.experts[0]
            tokens_out = first.fm_tokens + first.lc.out_features
            d = first.fm_projection.shape[0], first.norm.normalized_shape[-1]
            experts.append(ExpertShape(name, tuple(first.parameters()), tuple(module.parameters()), len(module.experts), d[0] * d[1], tokens_out * d[1]))
    sparse = {p for m in model.modules() if getattr(m, "opengem_sparse", False) for p in m.parameters()}
    taken = {n for n, p in own_params("", model, set()).items() if p in sparse}
    blocks = []
    for name, block in select_blocks(model, None, ()):
        owned = own_params(name, block, taken)
        blocks.append((name, tuple(owned.values())))
        taken.update(owned)
    root = tuple(own_params("", model, taken).values())
    return tuple(blocks), root, tuple(experts)


def _ids_per_sample(data: SyntheticConfig, model: GEM) -> dict[str, float]:
    kinds = {f.name: f.kind for f in data.feature_specs()}
    multi_hot = [n for n, k in kinds.items() if k == "multi_hot"]
    counts = {}
    if multi_hot:
        table = generate(data, ID_SAMPLES, seed=0)
        counts = {n: len(table.column(n).combine_chunks().flatten()) / ID_SAMPLES for n in multi_hot}
    per_feature = {n: data.mean_history_length() if k == "sequence" else counts.get(n, 1.0) for n, k in kinds.items()}
    return {t.name: sum(per_feature.get(f, 0.0) for f in t.feature_names) for t in model.embeddings.tables}


def workload(name: str) -> Workload:
    """The :class:`Workload` of a ``GEM_PRESETS`` entry (cached: a few seconds for gem-xl)."""
    if name not in GEM_PRESETS:
        raise ValueError(f"unknown GEM preset {name!r}; choose one of {sorted(GEM_PRESETS)}")
    return workload_of(name, GEM_PRESETS[name].model, GEM_PRESETS[name].data)


@functools.cache
def workload_of(name: str, config: GEMConfig, data: SyntheticConfig) -> Workload:
    """The :class:`Workload` of a GEM model ``config`` reading the synthetic world ``data``."""
    law = LengthLaw.of(data)
    grid = np.unique(np.geomspace(law.lengths[0], law.lengths[-1], GRID_POINTS).round().astype(int))
    if config.self_attention == "jfa":  # the window bends the attention curve: sample around it
        grid = np.unique(np.concatenate([grid, np.clip([config.window, config.window + 1], grid[0], grid[-1])]))
    split = {k: np.interp(law.lengths, grid, v) for k, v in _attention_split(config, data, grid.tolist()).items()}
    flops = {k: law.expect(v) for k, v in split.items()}
    attention = split["self_attention"] + split["pffn"] + split["pooling"]
    per_sample_train = 3 * split["gemm"] + 3.5 * attention
    train_mean, train_std = law.mean_and_std(per_sample_train)
    tokens = law.expect(law.lengths) + config.num_cls
    d = config.d_model
    pairs = flops["self_attention"] / (4 * d * config.num_layers)  # forward = 4 H D per pair = 4 d per pair
    model = _build_meta(config, data)
    blocks, root, experts = _fsdp_structure(model)
    return Workload(
        name=name, model=config, data=data, flops=flops, train_flops=train_mean, cost_cv=train_std / train_mean,
        tokens=tokens, mean_history=law.expect(law.lengths), self_keys_per_query=pairs / tokens,
        ids_per_sample=_ids_per_sample(data, model), tables=tuple(model.embeddings.tables),
        embedding_optimizer=model.embeddings.optimizer,
        dense_params=sum(p.numel() for p in model.parameters()),
        blocks=blocks, root_params=root, experts=experts,
    )
