"""Wukong interaction layers (Zhang et al. 2024): stacked factorization-machine blocks over feature tokens.

``X [B, n, d]`` holds one token per non-sequence feature (or group). A layer computes
``X' = LN(concat(FMB(X), LCB(X)) + residual(X))`` where

* FMB, the factorization-machine block, uses the "optimized FM": with a learnable ``Y [n, k]`` it forms
  ``X (X^T Y)`` (``[B, n, k]``, O(n d k) instead of the O(n^2 d) of all pairwise dot products),
  flattens, normalizes and maps it through an MLP to ``fm_tokens`` new tokens;
* LCB, the linear compression block, mixes the n tokens linearly into ``lc_tokens`` tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from opengem.nn.layers import MLP


class WukongLayer(nn.Module):
    def __init__(
        self, num_tokens: int, dim: int, fm_tokens: int, lc_tokens: int, fm_rank: int, mlp_hidden: int
    ) -> None:
        super().__init__()
        self.fm_tokens, self.dim = fm_tokens, dim
        out_tokens = fm_tokens + lc_tokens
        self.fm_projection = nn.Parameter(torch.randn(num_tokens, fm_rank) / num_tokens**0.5)
        self.fm_norm = nn.LayerNorm(num_tokens * fm_rank)
        self.fm_mlp = MLP(num_tokens * fm_rank, [mlp_hidden], fm_tokens * dim)
        self.lc = nn.Linear(num_tokens, lc_tokens, bias=False)
        # the residual needs the output's token count; a token mixing projection when it changes
        self.residual = nn.Identity() if out_tokens == num_tokens else nn.Linear(num_tokens, out_tokens, bias=False)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        compressed = torch.einsum("bnd,nk->bdk", x, self.fm_projection)  # X^T Y
        interactions = torch.bmm(x, compressed).flatten(1)  # X (X^T Y), flattened
        fm = self.fm_mlp(self.fm_norm(interactions)).view(batch, self.fm_tokens, self.dim)
        lc = self.lc(x.transpose(1, 2)).transpose(1, 2)
        residual = self.residual(x.transpose(1, 2)).transpose(1, 2)
        return self.norm(torch.cat([fm, lc], dim=1) + residual)


class DenseExperts(nn.Module):
    """Several experts run on every sample, outputs summed (GEM's dense experts).

    ``experts`` is a ModuleList so that expert parallelism (``opengem.parallel``) can place one expert
    per rank from outside without the model knowing.
    """

    def __init__(self, experts: list[nn.Module]) -> None:
        super().__init__()
        if not experts:
            raise ValueError("DenseExperts needs at least one expert")
        self.experts = nn.ModuleList(experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts[0](x)
        for expert in self.experts[1:]:
            out = out + expert(x)
        return out
