"""Reference BlockAttention: block-diagonal attention over jagged sequences, fp32, differentiable.

Each sequence is cut into consecutive ``block_size``-token blocks from its first token (the last one
partial); query block c attends to every key of block c (non-causal). ``softmax`` normalizes over the
block; a pointwise activation ``phi`` (GDPA style) gives ``O_i = sum_j phi(scale q_i . k_j) v_j`` with no
normalization. Rotary, if any, is applied to q and k before the dot products.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from opengem.ops.reference.rotary import apply_rotary

POINTWISE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "identity": lambda x: x,
    "relu": F.relu,
    "relu2": lambda x: F.relu(x) ** 2,
    "leaky_relu": lambda x: F.leaky_relu(x, 0.01),
    "silu": F.silu,
    "fast_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "hardswish": F.hardswish,
}
ACTIVATIONS = ("softmax", *POINTWISE)


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    *,
    block_size: int = 64,
    scale: float | None = None,
    activation: str = "softmax",
    rotary_phase: torch.Tensor | None = None,
    rotary_base: float = 10000.0,
) -> torch.Tensor:
    """q ``[T, H, D]``, k/v ``[T, H_kv, D]`` (``H_kv`` divides ``H``), offsets ``[B + 1]``; returns ``[T, H, D]``.

    ``rotary_phase [T]`` (fp32, see :mod:`opengem.ops.reference.rotary`) rotates q and k when given.
    Inputs are assumed valid (the public op validates).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    qf, kf, vf = q.float(), k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)
    if rotary_phase is not None:
        qf, kf = apply_rotary(qf, rotary_phase, rotary_base), apply_rotary(kf, rotary_phase, rotary_base)
    out = torch.zeros_like(qf)
    bounds = offsets.detach().cpu().tolist()
    for seq_start, seq_end in zip(bounds[:-1], bounds[1:]):
        for start in range(seq_start, seq_end, block_size):
            end = min(start + block_size, seq_end)
            qb, kb, vb = (t[start:end].transpose(0, 1) for t in (qf, kf, vf))  # [H, n, D]
            logits = (qb @ kb.transpose(1, 2)) * scale
            weights = torch.softmax(logits, dim=-1) if activation == "softmax" else POINTWISE[activation](logits)
            out[start:end] = (weights @ vb).transpose(0, 1)
    return out.to(q.dtype)
