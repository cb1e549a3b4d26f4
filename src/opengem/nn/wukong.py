"""Wukong interaction layers (Zhang et al. 2024): stacked factorization-machine blocks over feature tokens.

``X [B, n, d]`` holds one token per non-sequence feature (or group). A layer computes
``X' = LN(concat(FMB(X), LCB(X)) + residual(X))`` where

* FMB, the factorization-machine block, uses the "optimized FM": with a learnable ``Y [n, k]`` it forms
  ``X (X^T Y)`` (``[B, n, k]``, O(n d k) instead of the O(n^2 d) of all pairwise dot products),
  flattens, normalizes and maps it through an MLP to ``fm_tokens`` new tokens;
* LCB, the linear compression block, mixes the n tokens linearly into ``lc_tokens`` tokens.

Token counts are small and often odd (39 and 67 in the GEM presets). A GEMM whose operand rows are not a
multiple of 16 bytes gets cuBLAS's unaligned kernels (``cutlass_75_..._align1``: ~10 ms of a 140 ms
gem-small step on an H200, session 16). So every token-mixing product (``Y^T X``, the LCB's and the residual's) runs
as one batched GEMM ``L X`` whose left operand ``L = [Y | W_lc^T | W_res^T]^T`` is shared by the batch and stored
column-major (``[n, M]`` in memory, its ``M`` rows padded with zero rows to a multiple of ``TOKEN_ALIGN``): its
contiguous dimension is then aligned, and ``X [B, n, d]`` enters as it is, where a token-major product would need a
transposed, zero-padded copy of it (forward and backward: ~2 ms a gem-large step in session 30's kernels).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from opengem.nn.layers import MLP
from opengem.ops.autocast import autocast_dtype

TOKEN_ALIGN = 8  # 16 bytes of bf16: the row alignment of cuBLAS's vectorized (sm90) GEMM kernels


class WukongLayer(nn.Module):
    def __init__(
        self, num_tokens: int, dim: int, fm_tokens: int, lc_tokens: int, fm_rank: int, mlp_hidden: int
    ) -> None:
        super().__init__()
        self.num_tokens, self.fm_tokens, self.dim = num_tokens, fm_tokens, dim
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
        # shapes only (no sync, no graph break): a wrong token count had failed deep in a bmm, a 2-D x in another
        if x.dim() != 3 or x.shape[1] != self.num_tokens or x.shape[2] != self.dim:
            raise ValueError(f"WukongLayer: x must be [B, num_tokens = {self.num_tokens}, dim = {self.dim}], "
                             f"got {tuple(x.shape)}")  # fmt: skip
        batch = x.shape[0]
        identity = isinstance(self.residual, nn.Identity)
        rank, lc_tokens = self.fm_projection.shape[1], self.lc.out_features
        # [n, M]: column j of it is row j of the left operand L (the module docstring)
        columns = [self.fm_projection, self.lc.weight.t()] + ([] if identity else [self.residual.weight.t()])
        left = torch.cat(columns, dim=1)
        padding = -left.shape[1] % self.token_align
        if padding:  # zero rows of L: products nobody reads
            left = F.pad(left, (0, padding))
        mixed = _SharedLeftProduct.apply(left, x)  # [B, M, d]
        compressed = mixed[:, :rank].transpose(1, 2)  # X^T Y, [B, d, k]
        interactions = torch.bmm(x, compressed).flatten(1)  # X (X^T Y), flattened
        fm = self.fm_mlp(self.fm_norm(interactions)).view(batch, self.fm_tokens, self.dim)
        lc = mixed[:, rank : rank + lc_tokens]
        residual = x if identity else mixed[:, rank + lc_tokens : rank + lc_tokens + self.residual.out_features]
        return self.norm(torch.cat([fm, lc], dim=1) + residual)


class _SharedLeftProduct(torch.autograd.Function):
    """``L @ x[b]`` for each sample of ``x [B, n, d]``, with ``L`` stored transposed as ``left [n, M]`` and shared by
    the batch (an expanded view, never copied): ``[B, M, d]``.

    Written out for the backward: autograd's own would give ``L``'s gradient as ``[B, M, n]`` products, n-contiguous
    (n is odd: cuBLAS's unaligned kernels). Here it is ``x[b] @ grad[b]^T``, ``[B, n, M]``, M-contiguous, summed
    over the batch into ``left``'s own layout. Under autocast both operands are cast as autocast would cast them for
    ``bmm``, and the gradients cast back."""

    @staticmethod
    def forward(ctx: Any, left: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        compute = autocast_dtype(x) or x.dtype
        left_compute, x_compute = left.to(compute), x.to(compute)
        ctx.save_for_backward(left_compute, x_compute)
        ctx.dtypes = left.dtype, x.dtype
        with torch.autocast(x.device.type, enabled=False):
            return torch.bmm(left_compute.t().expand(x.shape[0], -1, -1), x_compute)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        left, x = ctx.saved_tensors
        grad_left = grad_x = None
        # autocast off: a compiled region traces this inside the forward's autocast
        with torch.autocast(grad.device.type, enabled=False):
            grad = grad.to(x.dtype)
            if ctx.needs_input_grad[0]:
                products = torch.bmm(x, grad.transpose(1, 2))  # [B, n, M]
                grad_left = products.sum(0, dtype=torch.promote_types(x.dtype, torch.float32)).to(ctx.dtypes[0])
            if ctx.needs_input_grad[1]:
                grad_x = torch.bmm(left.expand(x.shape[0], -1, -1), grad).to(ctx.dtypes[1])
        return grad_left, grad_x


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
