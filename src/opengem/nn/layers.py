"""Small building blocks shared by the models: MLP and a pre-norm jagged transformer layer."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from opengem.jagged import Jagged
from opengem.ops import jagged_attention_packed


class MLP(nn.Sequential):
    """Linear layers with an activation between them (none after the last)."""

    def __init__(self, in_dim: int, hidden_dims: Sequence[int], out_dim: int, dropout: float = 0.0) -> None:
        dims = [in_dim, *hidden_dims, out_dim]
        layers: list[nn.Module] = []
        for i in range(len(dims) - 1):
            layers.append(nn.Linear(dims[i], dims[i + 1]))
            if i < len(dims) - 2:
                layers.append(nn.GELU())
                if dropout > 0:
                    layers.append(nn.Dropout(dropout))
        super().__init__(*layers)


class JaggedTransformerLayer(nn.Module):
    """Pre-norm self-attention + feed-forward over a jagged ``[T, d_model]`` batch.

    Attention uses :func:`opengem.ops.jagged_attention_packed` with the recommendation mask (causal over the
    history; the last ``num_targets[b]`` tokens of each sample are candidates that see the history and
    themselves only).
    """

    def __init__(self, d_model: int, num_heads: int, ffn_mult: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % num_heads != 0:
            raise ValueError(f"d_model {d_model} must be divisible by num_heads {num_heads}")
        self.d_model, self.num_heads = d_model, num_heads
        self.head_dim = d_model // num_heads
        self.attn_norm = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.ffn_norm = nn.LayerNorm(d_model)
        self.ffn = MLP(d_model, [ffn_mult * d_model], d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Jagged, num_targets: torch.Tensor | None = None) -> Jagged:
        # Python-visible types and static widths only: no sync, no graph break in a compiled region
        if not isinstance(x, Jagged):  # a plain tensor had failed in layer_norm on its ``values`` method
            raise TypeError(f"JaggedTransformerLayer: x must be a Jagged [T, d_model] batch, got {type(x).__name__}")
        h = x.values
        if h.dim() != 2 or h.shape[1] != self.d_model:
            raise ValueError(f"JaggedTransformerLayer: x.values must be [T, d_model = {self.d_model}], "
                             f"got {tuple(h.shape)}")  # fmt: skip
        qkv = self.qkv(self.attn_norm(h)).view(h.shape[0], 3, self.num_heads, self.head_dim)
        attended = jagged_attention_packed(qkv, x.offsets, x.max_len, causal=True, num_targets=num_targets)
        h = h + self.dropout(self.out(attended.reshape(h.shape[0], -1)))
        h = h + self.dropout(self.ffn(self.ffn_norm(h)))
        return x.with_values(h)
