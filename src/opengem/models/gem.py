"""GEM: the reference hybrid model of GEM_SPEC section 6 (Wukong interaction + InterFormer-style sequence branch).

Data flow per batch (B samples, n = one token per non-sequence feature + one dense token, d = d_model)::

    X [B, n, d]     <- per-feature projections of the sparse embeddings, plus a token from the dense features
    S  Jagged [T', d] <- [CLS tokens | history, newest first]; a history token is a projection of its
                       features' embeddings, scaled and shifted per event type, plus an event-age embedding;
                       the CLS tokens start as learned vectors plus a projection of X's summary
    each layer:  X_sum = gate(linear-compress(X))                        [B, m, d]
                 S <- S + PFFN(S, X_sum)     GDPA cross-attention, K/V = the sample's m summary tokens
                 S <- S + SelfAttention(S)   windowed JFA (CLS rows see everything) or BlockAttention
                                             with time-aware rotary; then a feed-forward
                 S_sum = gate([CLS | seed-pooled (broadcast-Q GDPA) | K most recent])   [B, s, d]
                 X <- Wukong(concat(X, S_sum))   (dense experts: several Wukong layers summed)
    heads: per task an MLP on flatten([X_sum | S_sum]) with one output per domain; the ``domain_feature``
           (surface) of each sample picks its domain's logit.

Ablations: ``use_sequence`` (no history at all), ``use_pffn``, ``use_pooling``, ``use_wukong`` (X passes
through unchanged). The model has no parallelism inside; attention runs through ``opengem.ops``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from opengem.data.schema import TASKS, Batch, FeatureSpec
from opengem.jagged import Jagged, KeyedJagged, uniform_offsets
from opengem.models.sequence_ctr import AGE_BUCKETS, age_buckets
from opengem.nn.embedding import EmbeddingCollection, EmbeddingOptimizer, EmbeddingTableConfig
from opengem.nn.gem_layers import PersonalizedFFN, SequenceSelfAttention, SequenceSummary, TokenSummary
from opengem.nn.layers import MLP
from opengem.nn.wukong import DenseExperts, WukongLayer
from opengem.ops.autocast import autocast_dtype
from opengem.ops.embedding import few_row_grad
from opengem.validation import require_at_least, require_heads_divide


TABLE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # GEMConfig.embedding_dtype


@dataclass(frozen=True)
class GEMConfig:
    """Defaults: the gem-tiny CPU demo (``opengem.models.presets.GEM_PRESETS`` has the larger sizes)."""

    embedding_dim: int = 32  # every table's dim (<= 256 in the presets)
    d_model: int = 64
    num_heads: int = 2
    num_layers: int = 1
    num_summary_tokens: int = 4  # m: X_sum tokens, the PFFN's K/V per sample
    num_cls: int = 2
    num_seeds: int = 2  # PMA seed queries
    num_recent: int = 4  # most recent history tokens copied into S_sum
    self_attention: Literal["jfa", "block"] = "jfa"
    window: int = 32  # jfa: |i - j| <= window
    block_size: int = 64  # block: tokens per attention block
    time_scale: float = 3600.0  # block: rotary phase log(1 + age / time_scale)
    ffn_mult: int = 2  # sequence feed-forward width / d_model (0: none)
    attention_activation: str = "silu"  # GDPA activation of PFFN and seed pooling
    fm_rank: int = 8  # Wukong's k
    wukong_hidden: int = 256
    num_experts: int = 1  # dense experts: Wukong layers run in parallel and summed
    head_dims: tuple[int, ...] = (256, 64)
    domain_feature: str = "surface"
    event_type_feature: str = "hist_event_type"
    attention_backend: Literal["auto", "triton", "reference"] = "auto"  # auto: Triton on CUDA, reference on CPU
    # jfa self-attention's arithmetic (issue 12): fp8 (E4M3, block scales) or mxfp8 (MX-E4M3 numerics)
    attention_precision: Literal["bf16", "fp8", "mxfp8"] = "bf16"
    # ... except in the last N layers, whose self-attention stays in bf16: GEM's lever of keeping the sensitive
    # late layers in BF16 (GEM_SPEC section 5)
    bf16_attention_last_layers: int = 0
    # The sequence stream S (residual adds, norms' inputs, saved activations) in fp32, or in the forward's
    # compute dtype (bf16 under autocast; FSDP's bf16 parameters already give that). "compute" halves the
    # element-wise traffic of the sequence branch: on CPU, gem-small at batch 256 moved 25.7 GB in its
    # non-GEMM ops per step instead of 48.5 GB (eager; benchmarks/diag/elementwise_bytes.py).
    sequence_dtype: Literal["fp32", "compute"] = "fp32"
    # the embedding tables' dtype: bf16 halves their memory (gem-large: 5.4B sparse parameters, 21.6 GB in fp32);
    # their updated rows are rounded stochastically (opengem.nn.embedding.EmbeddingOptimizer.stochastic_rounding)
    embedding_dtype: Literal["fp32", "bf16"] = "fp32"
    use_sequence: bool = True
    use_pffn: bool = True
    use_pooling: bool = True
    use_wukong: bool = True

    def __post_init__(self) -> None:
        # the head count, refused here rather than when the model is built (which checks it again, with the other
        # sizes); messages start with the field's name so a config file's error can name its section (gem.num_heads)
        require_heads_divide(self, "d_model")  # every attention block (PFFN, self-attention, pooling) splits d_model


class GEMLayer(nn.Module):
    """One interleaved layer: summaries of both sides, the sequence branch, the interaction branch."""

    def __init__(
        self, num_tokens: int, config: GEMConfig, last: bool, attention_precision: str | None = None
    ) -> None:
        """``attention_precision``: this layer's self-attention arithmetic (default ``config.attention_precision``)."""
        super().__init__()
        d = config.d_model
        self.x_summary = self.pffn = self.self_attention = self.s_summary = None
        summary_tokens = 0
        if config.use_sequence:
            if config.use_pffn:  # X_sum feeds the PFFN's keys and values
                self.x_summary = TokenSummary(num_tokens, config.num_summary_tokens, d)
                self.pffn = PersonalizedFFN(d, config.num_heads, config.attention_activation, config.attention_backend)
            self.self_attention = SequenceSelfAttention(
                d, config.num_heads, config.self_attention, window=config.window, block_size=config.block_size,
                contextual_len=config.num_cls, ffn_mult=config.ffn_mult, time_scale=config.time_scale,
                backend=config.attention_backend, precision=attention_precision or config.attention_precision,
            )  # fmt: skip
            if config.use_wukong or last:  # S_sum feeds the interaction branch, or the heads after the last layer
                seeds = config.num_seeds if config.use_pooling else 0
                self.s_summary = SequenceSummary(
                    d, config.num_heads, config.num_cls, seeds, config.num_recent, config.attention_activation,
                    config.attention_backend,
                )
                summary_tokens = self.s_summary.num_tokens
        self.interaction = None
        if config.use_wukong:
            fm_tokens = (num_tokens + 1) // 2
            experts = [
                WukongLayer(num_tokens + summary_tokens, d, fm_tokens, num_tokens - fm_tokens, config.fm_rank,
                            config.wukong_hidden)
                for _ in range(config.num_experts)
            ]  # fmt: skip
            self.interaction = experts[0] if len(experts) == 1 else DenseExperts(experts)

    def forward(
        self, x: torch.Tensor, sequence: Jagged | None, age: torch.Tensor | None,
        summary_offsets: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Jagged | None, torch.Tensor | None]:
        """Returns the new ``X``, the new sequence and this layer's ``S_sum`` (None without a sequence).

        ``summary_offsets``: the jagged layout of ``X_sum`` (``m`` rows per sample) for the PFFN."""
        s_sum = None
        interaction_input = x
        if sequence is not None:
            if self.pffn is not None:
                sequence = self.pffn(sequence, self.x_summary(x), summary_offsets)
            sequence = self.self_attention(sequence, age)
            if self.s_summary is not None:
                s_sum, sequence = self.s_summary(sequence)  # the rows it takes pass through to the next layer
                interaction_input = torch.cat([x, s_sum], dim=1)
        if self.interaction is not None:
            x = self.interaction(interaction_input)
        return x, sequence, s_sum


class GEM(nn.Module):
    def __init__(
        self,
        features: Sequence[FeatureSpec],
        num_dense: int,
        config: GEMConfig,
        embedding_optimizer: EmbeddingOptimizer | None = EmbeddingOptimizer(),
    ) -> None:
        super().__init__()
        self.config = config
        by_name = {f.name: f for f in features}
        self.sparse_names = [f.name for f in features if f.kind != "sequence"]
        self.sequence_names = [f.name for f in features if f.kind == "sequence"] if config.use_sequence else []
        domain = by_name.get(config.domain_feature)
        if domain is None or domain.kind != "categorical":
            raise ValueError(f"domain_feature {config.domain_feature!r} must name a categorical feature")
        if config.use_sequence and by_name.get(config.event_type_feature, domain).kind != "sequence":
            raise ValueError(f"event_type_feature {config.event_type_feature!r} must name a sequence feature")
        # num_heads and its split of d_model: GEMConfig checked them when it was made
        require_at_least(config, ("embedding_dim", "d_model", "num_layers", "num_summary_tokens",
                                  "fm_rank", "wukong_hidden") + (("num_seeds",) if config.use_pooling else ()), 1)
        # a negative num_recent once cut S_sum's tokens silently
        require_at_least(config, ("num_recent", "ffn_mult", "num_cls"), 0)
        if any(dim < 1 for dim in config.head_dims):  # empty: a linear head
            raise ValueError(f"head_dims must be sizes >= 1, got {config.head_dims}")
        if not 0 <= config.bf16_attention_last_layers <= config.num_layers:
            raise ValueError(f"bf16_attention_last_layers must be in [0, num_layers = {config.num_layers}], "
                             f"got {config.bf16_attention_last_layers}")  # fmt: skip
        if config.sequence_dtype not in ("fp32", "compute"):
            raise ValueError(f"sequence_dtype must be 'fp32' or 'compute', got {config.sequence_dtype!r}")
        if config.embedding_dtype not in TABLE_DTYPES:
            raise ValueError(f"embedding_dtype must be one of {sorted(TABLE_DTYPES)}, got {config.embedding_dtype!r}")
        if config.use_sequence and config.num_cls < 1:
            raise ValueError("num_cls must be >= 1 with use_sequence (the CLS tokens carry the sequence summary)")
        self.num_domains = domain.num_embeddings
        e, d = config.embedding_dim, config.d_model
        tables = [
            EmbeddingTableConfig(
                name=f.name, num_embeddings=f.num_embeddings, embedding_dim=e, feature_names=(f.name,),
                pooling="none" if f.kind == "sequence" else ("mean" if f.kind == "multi_hot" else "sum"),
                dtype=TABLE_DTYPES[config.embedding_dtype],
            )
            for f in features
            if f.kind != "sequence" or config.use_sequence
        ]  # fmt: skip
        self.embeddings = EmbeddingCollection(tables, optimizer=embedding_optimizer)
        num_features = len(self.sparse_names)
        self.feature_proj = nn.Parameter(torch.randn(num_features, e, d) / e**0.5)
        self.feature_bias = nn.Parameter(torch.zeros(num_features, d))
        self.dense_proj = nn.Linear(num_dense, d)
        self.token_norm = nn.LayerNorm(d)
        num_tokens = num_features + 1
        if config.use_sequence:
            event_types = by_name[config.event_type_feature].num_embeddings
            self.sequence_tokens = SequenceTokens(e * len(self.sequence_names), d, event_types,
                                                  to_compute_dtype=config.sequence_dtype == "compute")
            self.cls_summary = TokenSummary(num_tokens, config.num_summary_tokens, d)
            self.cls_proj = nn.Linear(config.num_summary_tokens * d, config.num_cls * d)
            self.cls = nn.Parameter(torch.randn(config.num_cls, d) * 0.02)
        low_precision_layers = config.num_layers - config.bf16_attention_last_layers
        self.layers = nn.ModuleList(
            GEMLayer(num_tokens, config, last=i == config.num_layers - 1,
                     attention_precision=config.attention_precision if i < low_precision_layers else "bf16")
            for i in range(config.num_layers)
        )  # fmt: skip
        self.final_summary = TokenSummary(num_tokens, config.num_summary_tokens, d)
        summary_tokens = self.layers[-1].s_summary.num_tokens if config.use_sequence else 0
        head_in = (config.num_summary_tokens + summary_tokens) * d
        self.heads = nn.ModuleDict(
            {task: MLP(head_in, config.head_dims, self.num_domains) for task in TASKS}
        )

    def forward(self, batch: Batch) -> torch.Tensor:
        """Logits ``[B, len(TASKS)]``."""
        batch.check_model_input(self.dense_proj.in_features)
        features = KeyedJagged.concat([batch.sparse, batch.sequence]) if self.sequence_names else batch.sparse
        embedded = self.embeddings(features)
        x = self._feature_tokens(batch, embedded)
        sequence = age = s_sum = summary_offsets = None
        if self.sequence_names:
            sequence, age = self._sequence_tokens(batch, embedded, x)
            summary_offsets = uniform_offsets(x.shape[0], self.config.num_summary_tokens, x.device, sequence.offsets.dtype)
        for layer in self.layers:
            x, sequence, s_sum = layer(x, sequence, age, summary_offsets)
        summaries = [self.final_summary(x)] + ([s_sum] if s_sum is not None else [])
        hidden = torch.cat(summaries, dim=1).flatten(1)
        domain = batch.sparse[self.config.domain_feature].values.long().unsqueeze(1)
        return torch.cat([self.heads[task](hidden).gather(1, domain) for task in TASKS], dim=1)

    def _feature_tokens(self, batch: Batch, embedded: dict[str, torch.Tensor | Jagged]) -> torch.Tensor:
        stacked = self._widened(torch.stack([embedded[name] for name in self.sparse_names], dim=1))  # [B, F, e]
        tokens = torch.einsum("bfe,fed->bfd", stacked, self.feature_proj) + self.feature_bias
        dense = self.dense_proj(batch.dense).unsqueeze(1)
        return self.token_norm(torch.cat([tokens, dense], dim=1))

    def _widened(self, rows: torch.Tensor) -> torch.Tensor:
        """Looked-up rows of bf16 tables in the parameters' dtype where no autocast casts them (an fp32 run); a
        no-op for fp32 tables."""
        return rows if autocast_dtype(rows) is not None else rows.to(self.feature_proj.dtype)

    def _sequence_tokens(
        self, batch: Batch, embedded: dict[str, torch.Tensor | Jagged], x: torch.Tensor
    ) -> tuple[Jagged, torch.Tensor]:
        """The ``[CLS | newest-first history]`` sequence and each row's event age (0 on CLS rows)."""
        history: Jagged = embedded[self.sequence_names[0]]
        ages = batch.history_age.values
        tokens = self.sequence_tokens([self._widened(embedded[n].values) for n in self.sequence_names],
                                      batch.sequence[self.config.event_type_feature].values, ages)
        cls = self.cls + self.cls_proj(self.cls_summary(x).flatten(1)).view(x.shape[0], self.config.num_cls, -1)
        return prepend_reversed(history, tokens, cls, ages.float())  # the CLS rows take the tokens' dtype


class SequenceTokens(nn.Module):
    """The history's rows ``[T, d]``: its embeddings' projection, scaled and shifted by the event type's embeddings,
    plus the embedding of the event's age (log2 buckets); in the autocast dtype with ``to_compute_dtype``.

    A block of its own so that it compiles as one region (``opengem.train.compile``): run eagerly, each op is a pass
    over a ``[T, d]`` tensor, most of them fp32 (the embeddings' gathers, the products, the sums, the cast), forward
    and backward, where compiled the gathers, products and cast are one pass."""

    def __init__(self, in_features: int, dim: int, event_types: int, to_compute_dtype: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, dim)
        self.event_scale = nn.Embedding(event_types, dim)
        self.event_shift = nn.Embedding(event_types, dim)
        nn.init.ones_(self.event_scale.weight)
        nn.init.zeros_(self.event_shift.weight)
        self.age_embedding = nn.Embedding(AGE_BUCKETS, dim)
        self.to_compute_dtype = to_compute_dtype

    def forward(self, embeddings: list[torch.Tensor], event_type: torch.Tensor, ages: torch.Tensor) -> torch.Tensor:
        """``embeddings``: each sequence feature's ``[T, e]`` rows; ``event_type``, ``ages``: ``[T]``."""
        tokens = self.proj(torch.cat(embeddings, dim=1))
        event_type = event_type.long()
        scale = _FewRowLookup.apply(self.event_scale.weight, event_type)
        tokens = tokens * scale + _FewRowLookup.apply(self.event_shift.weight, event_type)
        tokens = tokens + _FewRowLookup.apply(self.age_embedding.weight, age_buckets(ages.float()))
        compute = autocast_dtype(tokens)
        return tokens.to(compute) if self.to_compute_dtype and compute is not None else tokens


class _FewRowLookup(torch.autograd.Function):
    """``table[ids]`` for a table of a few rows looked up by many ids (event types and age buckets: 4-32 rows, one
    lookup a history token). The table's gradient is one GEMM, ``one_hot(ids)^T @ grad`` (``opengem.ops.embedding.
    few_row_grad``), where Inductor's decomposition of an embedding's backward scatters ``T x d`` atomic adds into
    those few rows."""

    @staticmethod
    def forward(ctx: Any, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.rows, ctx.table_dtype = table.shape[0], table.dtype
        return table[ids]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (ids,) = ctx.saved_tensors
        return few_row_grad(ids, grad, ctx.rows).to(ctx.table_dtype), None


def prepend_reversed(
    history: Jagged, tokens: torch.Tensor, prefix: torch.Tensor, ages: torch.Tensor
) -> tuple[Jagged, torch.Tensor]:
    """Per sample ``[prefix rows | history rows in reverse order]``.

    ``tokens [T, d]`` and ``ages [T]`` follow ``history``'s layout (oldest first); ``prefix [B, c, d]``.
    Returns the new Jagged ``[T + B c, d]`` and the ages in the new layout (0 on prefix rows). No host sync:
    the new host offsets and max_len come from the old ones.
    """
    batch, c = prefix.shape[0], prefix.shape[1]
    offsets = history.offsets
    shift = torch.arange(batch + 1, device=offsets.device, dtype=offsets.dtype) * c
    new_offsets = offsets + shift
    sample = history.sample_ids()
    position = torch.arange(history.num_values, device=offsets.device) - offsets[sample]
    lengths = history.lengths()
    history_rows = new_offsets[sample] + c + (lengths[sample] - 1 - position)
    prefix_rows = (new_offsets[:-1].unsqueeze(1) + torch.arange(c, device=offsets.device)).flatten()
    total = history.num_values + batch * c
    values = _PlaceRows.apply(tokens, history_rows, prefix.flatten(0, 1).to(tokens.dtype), prefix_rows)
    new_ages = ages.new_zeros(total).index_copy(0, history_rows, ages)
    host_offsets = history.offsets_host + torch.arange(batch + 1, dtype=history.offsets_host.dtype) * c
    return Jagged(values, new_offsets, host_offsets, history.max_len + c), new_ages


class _PlaceRows(torch.autograd.Function):
    """``out[rows] = values`` and ``out[prefix_rows] = prefix``, where the two sets of rows are all of ``out``'s, each
    once: one write of ``out`` (a zero fill and out-of-place ``index_copy``s would add three passes over it), and
    the backward two gathers."""

    @staticmethod
    def forward(
        ctx: Any, values: torch.Tensor, rows: torch.Tensor, prefix: torch.Tensor, prefix_rows: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(rows, prefix_rows)
        out = values.new_empty((values.shape[0] + prefix.shape[0], values.shape[1]))
        out[rows] = values
        out[prefix_rows] = prefix
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None, None]:
        rows, prefix_rows = ctx.saved_tensors
        grad_values = grad[rows] if ctx.needs_input_grad[0] else None
        grad_prefix = grad[prefix_rows] if ctx.needs_input_grad[2] else None
        return grad_values, None, grad_prefix, None
