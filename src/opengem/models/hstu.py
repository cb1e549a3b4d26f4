"""Sequential next-item recommenders over jagged item histories: HSTU and a SASRec-style baseline.

Both share the input (item embedding * sqrt(d) + learned absolute position embedding, dropout), the
output (L2-normalized user and item embeddings, cosine / temperature logits, as in the HSTU
repository's MovieLens setup) and the loss; only the layer differs:

* ``hstu`` (GEM_SPEC section 6): ``U, V, Q, K = split(SiLU(W1 LN(X)))``,
  ``A = SiLU(alpha Q K^T) V / N`` (causal, :func:`opengem.ops.gdpa.hstu_attention`),
  ``Y = X + W2(dropout(LN(A) * U))``, with ``alpha = 1 / sqrt(head_dim)`` and N = the batch's max_len.
* ``sasrec``: a pre-norm transformer block, causal softmax attention
  (:func:`opengem.ops.jagged_attention.jagged_attention`) and a ReLU feed-forward of width d.

HSTU's relative position/time attention bias is not implemented: ``hstu_attention`` takes no bias
input, so positions enter as absolute embeddings in both models (HSTU's "no rab" ablation).

Training is autoregressive: every position predicts the next item with a sampled softmax over the
positive and shared negatives (random items of the batch's targets, i.e. in-batch negatives, plus
uniform random items); a negative equal to the row's positive is masked out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from opengem.jagged import validate_offsets
from opengem.ops.gdpa import hstu_attention
from opengem.ops.jagged_attention import jagged_attention
from opengem.validation import require_heads_divide

ARCHITECTURES = ("hstu", "sasrec")


@dataclass(frozen=True)
class SequentialModelConfig:
    architecture: str = "hstu"  # hstu | sasrec
    num_items: int = 0  # item ids are 1..num_items; 0 is padding
    dim: int = 64
    num_layers: int = 2
    num_heads: int = 1
    max_len: int = 200  # longest history the position embedding covers
    dropout: float = 0.2
    temperature: float = 0.05

    def __post_init__(self) -> None:
        # refused with the settings' names before a model is built (num_items is filled in from the data later)
        if not 0 <= self.dropout < 1:  # 1 zeroes every activation it reaches; NaN fails too
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        require_heads_divide(self, "dim")  # both layer kinds split dim into heads


class HSTULayer(nn.Module):
    def __init__(self, dim: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.input_norm = nn.LayerNorm(dim)
        self.uvqk = nn.Linear(dim, 4 * dim)
        self.attention_norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, max_len: int) -> torch.Tensor:
        u, v, q, k = F.silu(self.uvqk(self.input_norm(x))).chunk(4, dim=-1)
        heads = [t.unflatten(-1, (self.num_heads, -1)) for t in (q, k, v)]
        alpha = 1.0 / math.sqrt(heads[0].shape[-1])
        a = hstu_attention(*heads, offsets, max_len, alpha=alpha, causal=True).flatten(1)
        return x + self.output(self.dropout(self.attention_norm(a) * u))


class SASRecLayer(nn.Module):
    def __init__(self, dim: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.attention_norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.attention_output = nn.Linear(dim, dim)
        self.ffn_norm = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Dropout(dropout), nn.Linear(dim, dim))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, max_len: int) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (self.num_heads, -1)) for t in self.qkv(self.attention_norm(x)).chunk(3, dim=-1))
        a = jagged_attention(q, k, v, offsets, max_len, causal=True).flatten(1)
        x = x + self.dropout(self.attention_output(a))
        return x + self.dropout(self.ffn(self.ffn_norm(x)))


class SequentialRecommender(nn.Module):
    """Encodes jagged item histories (``items [T]`` int64 ids in 1..num_items, ``offsets [B + 1]``)
    into one L2-normalized ``[T, dim]`` user state per position (causal: position t sees items <= t)."""

    def __init__(self, config: SequentialModelConfig) -> None:
        super().__init__()
        if config.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {config.architecture!r}")
        if config.num_items < 1:
            raise ValueError(f"num_items must be >= 1, got {config.num_items}")
        self.config = config
        self.item_embedding = nn.Embedding(config.num_items + 1, config.dim, padding_idx=0)
        self.position_embedding = nn.Embedding(config.max_len, config.dim)
        nn.init.trunc_normal_(self.item_embedding.weight, std=0.02)
        nn.init.trunc_normal_(self.position_embedding.weight, std=0.02)
        with torch.no_grad():
            self.item_embedding.weight[0].zero_()
        self.input_dropout = nn.Dropout(config.dropout)
        layer = HSTULayer if config.architecture == "hstu" else SASRecLayer
        self.layers = nn.ModuleList(
            layer(config.dim, config.num_heads, config.dropout) for _ in range(config.num_layers)
        )
        self.output_norm = nn.LayerNorm(config.dim)

    def forward(self, items: torch.Tensor, offsets: torch.Tensor, max_len: int) -> torch.Tensor:
        if max_len > self.config.max_len:
            raise ValueError(f"max_len {max_len} exceeds the model's max_len {self.config.max_len}")
        if items.dim() != 1 or items.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"items must be 1-D int32/int64 ids, got {items.dtype} {tuple(items.shape)}")
        validate_offsets(offsets, items.numel(), "offsets")  # the host mirror the attention op reads too
        if items.device.type == "cpu":  # free here; on a device nn.Embedding's own assert stops a bad id
            bad = torch.nonzero((items < 1) | (items > self.config.num_items)).flatten()
            if bad.numel():
                first = int(bad[0])
                raise ValueError(f"items must be ids in [1, {self.config.num_items}], got {int(items[first])} at "
                                 f"position {first}")
        lengths = offsets[1:] - offsets[:-1]
        positions = torch.arange(items.numel(), device=items.device) - torch.repeat_interleave(offsets[:-1], lengths)
        x = self.item_embedding(items) * math.sqrt(self.config.dim) + self.position_embedding(positions)
        x = self.input_dropout(x)
        for layer in self.layers:
            x = layer(x, offsets, max_len)
        return F.normalize(self.output_norm(x), dim=-1)

    def item_vectors(self, items: torch.Tensor | None = None) -> torch.Tensor:
        """L2-normalized embeddings of ``items`` (all ids 0..num_items when None; id 0 is padding)."""
        weight = self.item_embedding.weight if items is None else self.item_embedding(items)
        return F.normalize(weight, dim=-1)

    def scores(self, states: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, num_items + 1]`` of every item for user states ``[N, dim]`` (column 0 is padding)."""
        return states @ self.item_vectors().T / self.config.temperature

    def sample_negatives(self, targets: torch.Tensor, in_batch: int, uniform: int) -> torch.Tensor:
        """Shared negatives ``[in_batch + uniform]``: ``in_batch`` draws from the batch's ``targets`` (so
        popular items are drawn more, as in in-batch softmax) and ``uniform`` items of 1..num_items."""
        return torch.cat([
            targets[torch.randint(targets.numel(), (in_batch,), device=targets.device)],
            torch.randint(1, self.config.num_items + 1, (uniform,), device=targets.device),
        ])  # fmt: skip

    def sampled_softmax_loss(
        self, states: torch.Tensor, targets: torch.Tensor, negatives: torch.Tensor
    ) -> torch.Tensor:
        """Mean cross-entropy of each row's positive ``targets [T]`` among itself and the shared
        ``negatives [M]`` for user states ``states [T, dim]``; a negative equal to the row's positive is masked."""
        positive = (states * self.item_vectors(targets)).sum(-1, keepdim=True)
        negative = states @ self.item_vectors(negatives).T
        negative = negative.masked_fill(negatives[None, :] == targets[:, None], float("-inf"))
        logits = torch.cat([positive, negative], dim=1) / self.config.temperature
        return F.cross_entropy(logits, torch.zeros_like(targets))
