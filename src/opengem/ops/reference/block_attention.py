"""Reference BlockAttention: block-diagonal attention over jagged sequences, fp32, differentiable.

Each sequence is cut into consecutive ``block_size``-token blocks from its first token (the last one
partial); query block c attends to every key of block c (non-causal). ``softmax`` normalizes over the
block; a pointwise activation ``phi`` (GDPA style) gives ``O_i = sum_j phi(scale q_i . k_j) v_j`` with no
normalization. Rotary, if any, is applied to q and k before the dot products.
"""

from __future__ import annotations

import math

import torch

from opengem.ops.activations import ACTIVATIONS as POINTWISE_ACTIVATIONS
from opengem.ops.activations import activation_grad, activation_value
from opengem.ops.reference.rotary import apply_rotary

ACTIVATIONS = ("softmax", *POINTWISE_ACTIVATIONS)


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
    qf, kf, vf = _prepare(q, k, v, rotary_phase, rotary_base)
    outputs = []
    for start, end in _blocks(offsets, block_size):
        qb, kb, vb = (t[start:end].transpose(0, 1) for t in (qf, kf, vf))  # [H, n, D]
        logits = (qb @ kb.transpose(1, 2)) * scale
        weights = torch.softmax(logits, dim=-1) if activation == "softmax" else activation_value(activation, logits)
        outputs.append((weights @ vb).transpose(0, 1))
    out = torch.cat(outputs) if outputs else qf * 0.0
    return out.to(q.dtype)


def block_attention_backward(
    grad_out: torch.Tensor,
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`block_attention` written out by hand (no autograd), fp32 math, inputs' dtypes."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    qf, kf, vf = _prepare(q, k, v, rotary_phase, rotary_base)
    dof = grad_out.float()
    dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(qf), torch.zeros_like(qf)
    for start, end in _blocks(offsets, block_size):
        qb, kb, vb, dob = (t[start:end].transpose(0, 1) for t in (qf, kf, vf, dof))  # [H, n, D]
        logits = (qb @ kb.transpose(1, 2)) * scale
        dp = dob @ vb.transpose(1, 2)
        if activation == "softmax":
            p = torch.softmax(logits, dim=-1)
            ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        else:
            p = activation_value(activation, logits)
            ds = dp * activation_grad(activation, logits)
        dv[start:end] = (p.transpose(1, 2) @ dob).transpose(0, 1)
        dq[start:end] = (ds @ kb * scale).transpose(0, 1)
        dk[start:end] = (ds.transpose(1, 2) @ qb * scale).transpose(0, 1)
    if rotary_phase is not None:  # the transpose of a rotation is the rotation by the opposite angle
        dq, dk = apply_rotary(dq, -rotary_phase, rotary_base), apply_rotary(dk, -rotary_phase, rotary_base)
    group_sum = lambda t: t.view(t.shape[0], k.shape[1], q.shape[1] // k.shape[1], t.shape[2]).sum(2)  # noqa: E731
    return dq.to(q.dtype), group_sum(dk).to(k.dtype), group_sum(dv).to(v.dtype)


def _prepare(q, k, v, rotary_phase, rotary_base):
    """fp32 q, k, v with k/v repeated over each GQA group and q/k rotated."""
    group = q.shape[1] // k.shape[1]
    qf, kf, vf = q.float(), k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)
    if rotary_phase is not None:
        qf, kf = apply_rotary(qf, rotary_phase, rotary_base), apply_rotary(kf, rotary_phase, rotary_base)
    return qf, kf, vf


def _blocks(offsets: torch.Tensor, block_size: int) -> list[tuple[int, int]]:
    """(start, end) token ranges of every block of every sequence."""
    bounds = offsets.detach().cpu().tolist()
    return [
        (start, min(start + block_size, seq_end))
        for seq_start, seq_end in zip(bounds[:-1], bounds[1:])
        for start in range(seq_start, seq_end, block_size)
    ]
