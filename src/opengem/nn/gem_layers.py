"""GEM layer blocks (GEM_SPEC section 6): summaries, PFFN cross-attention, seed pooling, sequence self-attention.

Non-sequence tokens are dense ``[B, n, d]`` tensors; the sequence is a :class:`Jagged` ``[T, d]`` whose
first ``num_cls`` rows per sample are CLS tokens followed by the history, newest event first (so the
most recent events sit next to the CLS tokens, share their attention block, and are found at fixed
offsets). Every attention runs through ``opengem.ops`` (Triton on CUDA, the reference on CPU).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import nn

from opengem.jagged import Jagged, uniform_offsets
from opengem.nn.layers import MLP
from opengem.nn.weight_shadows import ShadowedLinear, linear_forward
from opengem.ops.block_attention import Rotary, block_attention_from_hidden
from opengem.ops.gdpa import gdpa, gdpa_packed_kv
from opengem.ops.jagged_attention import jagged_attention_packed


def projected(linear: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``linear(x)`` and the bias an attention op should return the gradient of (its ``projection_bias``): a plain
    ``nn.Linear`` (or one with bf16 weight shadows, ``opengem.nn.weight_shadows``) adds its bias without a gradient,
    and the op's backward kernels give it from their tiles, a pass over the projection's output gradient less
    (gem-large: 0.27-0.8 GB a layer per bias). Any other module (a low-precision projection,
    ``opengem.nn.low_precision``) runs as itself, its bias gradient its own."""
    if type(linear) in (nn.Linear, ShadowedLinear) and linear.bias is not None:
        return linear_forward(linear, x, bias_gradient=False), linear.bias
    return linear(x), None


class SelfGate(nn.Module):
    """``x * sigmoid(W x)`` per token: lets each summary token scale its own channels (InterFormer's gating)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.gate(x))


class TokenSummary(nn.Module):
    """``X_sum = gate(LCB(X))``: a linear compression of ``[B, n, d]`` tokens to ``[B, m, d]``, self-gated."""

    def __init__(self, num_tokens: int, out_tokens: int, dim: int) -> None:
        super().__init__()
        self.compress = nn.Linear(num_tokens, out_tokens, bias=False)
        self.norm = nn.LayerNorm(dim)
        self.gate = SelfGate(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(self.norm(self.compress(x.transpose(1, 2)).transpose(1, 2)))


class PersonalizedFFN(nn.Module):
    """PFFN: GDPA cross-attention from every sequence token to the sample's ``m`` summary tokens.

    The keys/values of sample b are its ``m`` rows of ``context [B, m, d]``, so ``k_offsets = arange(B + 1) * m``
    (short dense K/V, the layout GDPA keeps resident). Residual: ``S + W_o gdpa(W_q LN(S), W_k C, W_v C)``.
    """

    def __init__(self, dim: int, num_heads: int, activation: str = "silu", backend: str = "auto") -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.activation, self.backend = num_heads, dim // num_heads, activation, backend
        self.norm = nn.LayerNorm(dim)
        self.context_norm = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, sequence: Jagged, context: torch.Tensor, context_offsets: torch.Tensor | None = None) -> Jagged:
        """``context_offsets``: ``arange(B + 1) * m``; pass it from outside a compiled region (made inside one,
        it has no host mirror, and the kernel would read it back with a device sync)."""
        h = sequence.values
        batch, m, _ = context.shape
        q, q_bias = projected(self.q, self.norm(h))
        k, v = self.kv(self.context_norm(context)).view(batch * m, 2, self.num_heads, self.head_dim).unbind(1)
        k_offsets = uniform_offsets(batch, m, h.device, sequence.offsets.dtype) if context_offsets is None else context_offsets
        attended = gdpa(
            q.view(h.shape[0], self.num_heads, self.head_dim), k.contiguous(), v.contiguous(), sequence.offsets,
            k_offsets, sequence.max_len, m, activation=self.activation, pre_scale=self.head_dim**-0.5,
            post_scale=1.0 / m, backend=self.backend, projection_bias=q_bias,
        )  # fmt: skip
        return sequence.with_values(h + self.out(attended.reshape(h.shape[0], -1)))


class SeedPooling(nn.Module):
    """PMA: ``num_seeds`` learned queries shared by the batch attend over each sample's sequence.

    One broadcast-Q GDPA call (``[B * num_seeds, H, D]`` out, dq summed over the batch inside the op);
    the sum over a variable number of keys is normalized by a LayerNorm before the output projection
    (finite for an empty sequence too).
    """

    def __init__(
        self, dim: int, num_heads: int, num_seeds: int, activation: str = "silu", backend: str = "auto"
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_seeds = num_heads, dim // num_heads, num_seeds
        self.activation, self.backend = activation, backend
        self.seeds = nn.Parameter(torch.randn(num_seeds, num_heads, self.head_dim) / math.sqrt(self.head_dim))
        self.norm = nn.LayerNorm(dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)
        self.out_norm = nn.LayerNorm(dim)

    def forward(self, sequence: Jagged) -> torch.Tensor:
        """``[B, num_seeds, d]``."""
        h = sequence.values
        # k and v stay strided views of the projection (GDPA takes token / head strides), and their gradient comes
        # back packed: contiguous copies, or unbind's stack in the backward, would move 2 x [T, d] more per layer
        kv, kv_bias = projected(self.kv, self.norm(h))
        kv = kv.view(h.shape[0], 2, self.num_heads, self.head_dim)
        pooled = gdpa_packed_kv(
            self.seeds.to(kv.dtype), kv, None, sequence.offsets, self.num_seeds,
            sequence.max_len, activation=self.activation, pre_scale=self.head_dim**-0.5, broadcast_q=True,
            backend=self.backend, projection_bias=kv_bias,
        )  # fmt: skip
        pooled = pooled.reshape(sequence.batch_size, self.num_seeds, -1)
        return self.out(self.out_norm(pooled))


class SequenceSelfAttention(nn.Module):
    """Pre-norm self-attention over the sequence, then a feed-forward (skipped when ``ffn_mult == 0``).

    ``kind="block"``: BlockAttention (``block_size`` tokens per block) with time-aware rotary on the
    event age; ``kind="jfa"``: windowed softmax JFA (``|i - j| <= window``) where the first
    ``contextual_len`` rows (the CLS tokens) see the whole sequence; ``precision="fp8"`` runs its forward
    in E4M3 (``opengem.ops.jagged_attention``; Q, K and V quantized by its fused quantize pass, which measured
    faster than quantizing in the projection's epilogue at model dim 512: ``opengem.ops.qkv_attention``; this
    layer's widths are not measured).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        kind: Literal["block", "jfa"],
        *,
        window: int,
        block_size: int,
        contextual_len: int,
        ffn_mult: int,
        time_scale: float,
        backend: str = "auto",
        precision: str = "bf16",
    ) -> None:
        super().__init__()
        if kind not in ("block", "jfa"):
            raise ValueError(f"self_attention must be 'block' or 'jfa', got {kind!r}")
        if precision != "bf16" and kind != "jfa":
            raise ValueError(f"attention precision {precision!r} is available for jfa self-attention only")
        self.precision = precision
        self.kind, self.num_heads, self.head_dim = kind, num_heads, dim // num_heads
        self.window, self.block_size, self.contextual_len = window, block_size, contextual_len
        self.time_scale, self.backend = time_scale, backend
        self.attn_norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.ffn = nn.Sequential(nn.LayerNorm(dim), MLP(dim, [ffn_mult * dim], dim)) if ffn_mult > 0 else None

    def bf16_shadow(self, inputs: tuple[Jagged, torch.Tensor], output: Jagged) -> tuple[torch.Tensor, torch.Tensor]:
        """For the numerics monitor (``opengem.nn.numerics``): this layer's residual update (output minus input)
        from its forward hook's ``inputs`` and ``output``, and the update of the same layer with its attention in
        bf16 on the same inputs (compared without the residual, which would hide the attention's error)."""
        sequence, age = inputs
        precision, self.precision = self.precision, "bf16"
        try:
            shadow = self(sequence, age)
        finally:
            self.precision = precision
        return output.values - sequence.values, shadow.values - sequence.values

    def forward(self, sequence: Jagged, age: torch.Tensor) -> Jagged:
        """``age [T]``: seconds between each token's event and the impression (0 for CLS tokens)."""
        h = sequence.values
        x = self.attn_norm(h)
        if self.kind == "block":
            attended = block_attention_from_hidden(
                x, self.qkv.weight, sequence.offsets, sequence.max_len, self.num_heads, bias=self.qkv.bias,
                block_size=self.block_size, rotary=Rotary(time_gaps=age, time_scale=self.time_scale),
                backend=self.backend,
            )  # fmt: skip
        else:
            options = {"causal": False, "contextual_len": self.contextual_len, "window": self.window,
                       "backend": None if self.backend == "auto" else self.backend, "precision": self.precision}
            qkv, qkv_bias = projected(self.qkv, x)
            # the gradient comes back packed: no stack copy in the backward
            attended = jagged_attention_packed(qkv.view(h.shape[0], 3, self.num_heads, self.head_dim),
                                               sequence.offsets, sequence.max_len, projection_bias=qkv_bias,
                                               **options)  # fmt: skip
            attended = attended.reshape(h.shape[0], -1)
        h = h + self.out(attended)
        if self.ffn is not None:
            h = h + self.ffn(h)
        return sequence.with_values(h)


class SequenceSummary(nn.Module):
    """``S_sum = gate([CLS tokens | seed-pooled tokens | K most recent tokens])``, ``[B, s, d]``, and the sequence to
    go on with (every later use of the sequence should read that one).

    Expects the CLS-first, newest-first layout of this module's docstring; recent slots beyond a
    sample's history are zero.
    """

    def __init__(self, dim: int, num_heads: int, num_cls: int, num_seeds: int, num_recent: int,
                 activation: str = "silu", backend: str = "auto") -> None:
        super().__init__()
        self.num_cls, self.num_recent = num_cls, num_recent
        self.pooling = SeedPooling(dim, num_heads, num_seeds, activation, backend) if num_seeds > 0 else None
        self.gate = SelfGate(dim)

    @property
    def num_tokens(self) -> int:
        return self.num_cls + self.num_recent + (self.pooling.num_seeds if self.pooling is not None else 0)

    def forward(self, sequence: Jagged) -> tuple[torch.Tensor, Jagged]:
        """``S_sum``, and the sequence to go on with: the same values, through which the taken rows' gradient joins
        the sequence's (see :class:`_RowsAndPassThrough`)."""
        c = self.num_cls
        slots = torch.arange(c + self.num_recent, device=sequence.values.device)
        rows = (sequence.offsets[:-1].unsqueeze(1) + slots).clamp(max=sequence.num_values - 1)
        values, gathered = _RowsAndPassThrough.apply(sequence.values, rows)
        sequence = sequence.with_values(values)
        if self.num_recent > 0:  # recent slots past the history are zero (a CLS slot is always in the sequence)
            gathered = gathered * (slots < sequence.lengths().unsqueeze(1)).unsqueeze(2).to(gathered.dtype)
        parts = [gathered[:, :c]]
        if self.pooling is not None:
            parts.append(self.pooling(sequence))
        if self.num_recent > 0:
            parts.append(gathered[:, c:])
        return self.gate(torch.cat(parts, dim=1)), sequence


class _RowsAndPassThrough(torch.autograd.Function):
    """``(values, values[rows])``. A plain gather's backward scatters the rows' gradient into a zero ``[T, d]``
    tensor that autograd then adds to the values' other gradients (gem-large b512: 0.27 GB written and read again a
    layer). When every other use of the values reads the pass-through output instead, its gradient is already their
    sum, and the rows' gradient is added into it (``index_put`` with accumulation, which Inductor can do in place)."""

    @staticmethod
    def forward(ctx: Any, values: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(rows)
        return values.view_as(values), values[rows]

    @staticmethod
    def backward(ctx: Any, grad_values: torch.Tensor, grad_rows: torch.Tensor) -> tuple[torch.Tensor, None]:
        (rows,) = ctx.saved_tensors
        return grad_values.index_put((rows.flatten(),), grad_rows.flatten(0, 1), accumulate=True), None
