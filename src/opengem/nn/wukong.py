"""Wukong interaction layers (Zhang et al. 2024): stacked factorization-machine blocks over feature tokens.

``X [B, n, d]`` holds one token per non-sequence feature (or group). A layer computes
``X' = LN(concat(FMB(X), LCB(X)) + residual(X))`` where

* FMB, the factorization-machine block, uses the "optimized FM": with a learnable ``Y [n, k]`` it forms
  ``X (X^T Y)`` (``[B, n, k]``, O(n d k) instead of the O(n^2 d) of all pairwise dot products),
  flattens, normalizes and maps it through an MLP to ``fm_tokens`` new tokens;
* LCB, the linear compression block, mixes the n tokens linearly into ``lc_tokens`` tokens.

Token counts are small and often odd (39 and 67 in the GEM presets). A GEM whose operand rows are not a
multiple of 16 bytes gets cuBLAS's unaligned kernels (``cutlass_75_..._align1``: ~10 ms of a 140 ms
gem-small step on an H200, session 16), so the token-mixing products run on ``n`` padded with zero tokens to a
multiple of ``TOKEN_ALIGN``, with the LCB and residual projections as one product: the same sums.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from opengem.nn.layers import MLP

TOKEN_ALIGN = 8  # 16 bytes of bf16: the row alignment of cuBLAS's vectorized (sm90) GEMM kernels


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
        self.token_align = TOKEN_ALIGN  # 1: no padding (see ``unpadded_token_mixing``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens = x.shape[0], x.shape[1]
        identity = isinstance(self.residual, nn.Identity)
        mixing = torch.cat([self.lc.weight] + ([] if identity else [self.residual.weight]))  # [lc (+ out), n]
        aligned, fm_projection = x, self.fm_projection
        padding = -tokens % self.token_align
        if padding:  # zero tokens, and zero weights for them: they add nothing to any sum below
            aligned = F.pad(x, (0, 0, 0, padding))
            fm_projection = F.pad(fm_projection, (0, 0, 0, padding))
            mixing = F.pad(mixing, (0, padding))
        compressed = torch.einsum("bnd,nk->bdk", aligned, fm_projection)  # X^T Y
        interactions = torch.bmm(x, compressed).flatten(1)  # X (X^T Y), flattened
        fm = self.fm_mlp(self.fm_norm(interactions)).view(batch, self.fm_tokens, self.dim)
        mixed = torch.matmul(mixing, aligned)  # [B, lc (+ out), d]
        lc_tokens = self.lc.out_features
        residual = x if identity else mixed[:, lc_tokens:]
        return self.norm(torch.cat([fm, mixed[:, :lc_tokens]], dim=1) + residual)


@contextlib.contextmanager
def unpadded_token_mixing(model: nn.Module) -> Iterator[None]:
    """Every Wukong layer of ``model`` mixes its tokens unpadded while inside: the same results, and a FLOP
    counter then counts the useful products only (GEM_SPEC section 8), not the padding's."""
    layers = [module for module in model.modules() if isinstance(module, WukongLayer)]
    saved = [layer.token_align for layer in layers]
    for layer in layers:
        layer.token_align = 1
    try:
        yield
    finally:
        for layer, align in zip(layers, saved):
            layer.token_align = align


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
