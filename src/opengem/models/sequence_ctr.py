"""A first end-to-end recommendation model: embeddings -> sequence encoder -> interaction -> task heads.

The candidate ad is appended to each user's history as a target token (GEM_SPEC section 4: targets
see the whole history and themselves), so the encoder computes a candidate-aware summary of the
history. With ``history="none"`` the same model ignores the history: the history-free baseline that
the trainer reports beside it; with ``history="mean"`` it is a DLRM-style model that mean-pools the
history embeddings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from opengem.data.schema import TASKS, Batch, FeatureSpec
from opengem.jagged import Jagged, KeyedJagged
from opengem.nn.embedding import EmbeddingCollection, EmbeddingOptimizer, EmbeddingTableConfig
from opengem.nn.layers import MLP, JaggedTransformerLayer
from opengem.validation import require_at_least, require_heads_divide

AGE_BUCKETS = 32  # log2-spaced buckets of event age, from seconds to years


@dataclass(frozen=True)
class SequenceCTRConfig:
    embedding_dim: int = 32
    d_model: int = 64
    num_heads: int = 2
    num_layers: int = 2
    mlp_dims: tuple[int, ...] = (256, 128)
    dropout: float = 0.0
    # how the history is read: a target-aware transformer, a mean pool (DLRM-style), or not at all
    history: Literal["attention", "mean", "none"] = "attention"
    # the sparse feature whose embedding stands for the candidate inside the sequence
    candidate_feature: str = "ad_category"

    def __post_init__(self) -> None:
        # the settings the model would only refuse when built, refused here; each message starts with the field's
        # name so a config file's error can name its section (opengem.train.config: model.num_heads)
        if not 0 <= self.dropout < 1:  # 1 zeroes every activation it reaches; NaN fails too
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.history == "attention":  # only the attention encoder splits heads
            require_heads_divide(self, "d_model", when=" with history='attention'")
        else:
            require_at_least(self, ("num_heads",), 1)


class SequenceCTRModel(nn.Module):
    def __init__(
        self,
        features: Sequence[FeatureSpec],
        num_dense: int,
        config: SequenceCTRConfig,
        embedding_optimizer: EmbeddingOptimizer | None = EmbeddingOptimizer(),
    ) -> None:
        super().__init__()
        if config.history not in ("attention", "mean", "none"):
            raise ValueError(f"history must be attention, mean or none, got {config.history!r}")
        if not config.mlp_dims or min(config.mlp_dims) < 1:  # the last size feeds the task heads
            raise ValueError(f"mlp_dims must be one or more sizes >= 1, got {config.mlp_dims}")
        self.config = config
        self.sparse_names = [f.name for f in features if f.kind != "sequence"]
        uses_history = config.history != "none"
        self.sequence_names = [f.name for f in features if f.kind == "sequence"] if uses_history else []
        if uses_history and not self.sequence_names:
            raise ValueError(f"history={config.history!r} needs at least one sequence feature")
        if config.candidate_feature not in self.sparse_names:
            raise ValueError(f"candidate_feature {config.candidate_feature!r} is not a sparse feature")
        tables = [
            EmbeddingTableConfig(
                name=f.name,
                num_embeddings=f.num_embeddings,
                embedding_dim=config.embedding_dim,
                feature_names=(f.name,),
                pooling="none" if f.kind == "sequence" else ("mean" if f.kind == "multi_hot" else "sum"),
            )
            for f in features
            if f.kind != "sequence" or uses_history
        ]
        self.embeddings = EmbeddingCollection(tables, optimizer=embedding_optimizer)
        e, d = config.embedding_dim, config.d_model
        self.dense_proj = nn.Linear(num_dense, e)
        interaction_in = e * (len(self.sparse_names) + 1)
        if uses_history:
            self.token_proj = nn.Linear(e * len(self.sequence_names), d)
            self.age_embedding = nn.Embedding(AGE_BUCKETS, d)
            interaction_in += d
        if config.history == "attention":
            self.candidate_proj = nn.Linear(e, d)
            self.encoder = nn.ModuleList(
                JaggedTransformerLayer(d, config.num_heads, dropout=config.dropout) for _ in range(config.num_layers)
            )
            self.encoder_norm = nn.LayerNorm(d)
        self.interaction = MLP(interaction_in, config.mlp_dims[:-1], config.mlp_dims[-1], config.dropout)
        self.heads = nn.ModuleDict({task: nn.Linear(config.mlp_dims[-1], 1) for task in TASKS})

    def forward(self, batch: Batch) -> torch.Tensor:
        """Logits ``[B, len(TASKS)]``."""
        batch.check_model_input(self.dense_proj.in_features)
        features = KeyedJagged.concat([batch.sparse, batch.sequence]) if self.sequence_names else batch.sparse
        embedded = self.embeddings(features)
        parts = [embedded[name] for name in self.sparse_names]
        parts.append(self.dense_proj(batch.dense))
        if self.sequence_names:
            parts.append(self._encode_history(batch, embedded))
        hidden = self.interaction(torch.cat(parts, dim=1))
        return torch.cat([self.heads[task](hidden) for task in TASKS], dim=1)

    def _encode_history(self, batch: Batch, embedded: dict[str, torch.Tensor | Jagged]) -> torch.Tensor:
        history: Jagged = embedded[self.sequence_names[0]]
        tokens = self.token_proj(torch.cat([embedded[n].values for n in self.sequence_names], dim=1))
        tokens = tokens + self.age_embedding(age_buckets(batch.history_age.values))
        if self.config.history == "mean":
            return mean_pool(history.with_values(tokens))
        candidate = self.candidate_proj(embedded[self.config.candidate_feature])
        sequence = append_target(history.with_values(tokens), candidate)
        num_targets = torch.ones(sequence.batch_size, dtype=torch.int64, device=tokens.device)
        for layer in self.encoder:
            sequence = layer(sequence, num_targets)
        last = sequence.offsets[1:] - 1
        return self.encoder_norm(sequence.values[last])


def mean_pool(sequence: Jagged) -> torch.Tensor:
    """``[B, d]`` mean over each sample's rows (zero for an empty history)."""
    sums = sequence.values.new_zeros((sequence.batch_size, sequence.values.shape[1]))
    sums.index_add_(0, sequence.sample_ids(), sequence.values)
    return sums / sequence.lengths().clamp_min(1).unsqueeze(1).to(sums.dtype)


def age_buckets(age_seconds: torch.Tensor) -> torch.Tensor:
    """log2-spaced buckets: 0 for under 2 s, then one bucket per doubling, capped."""
    return torch.clamp(torch.log2(age_seconds.float() + 1.0).floor().long(), 0, AGE_BUCKETS - 1)


def append_target(history: Jagged, targets: torch.Tensor) -> Jagged:
    """Append one row per sample (``targets [B, d]``) at the end of each sequence."""
    batch = history.batch_size
    offsets = history.offsets + torch.arange(batch + 1, device=history.offsets.device, dtype=history.offsets.dtype)
    values = history.values.new_empty((history.num_values + batch, history.values.shape[1]))
    rows = torch.arange(history.num_values, device=values.device) + history.sample_ids()
    values = values.index_copy(0, rows, history.values).index_copy(0, offsets[1:] - 1, targets.to(values.dtype))
    host_offsets = history.offsets_host + torch.arange(batch + 1, dtype=history.offsets_host.dtype)
    return Jagged(values, offsets, host_offsets, history.max_len + 1)
