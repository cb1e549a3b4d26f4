"""Reference GDPA (pointwise-activation attention): per sample and head, fp32, differentiable.

The specification the Triton kernels are tested against and the CPU path of :func:`opengem.ops.gdpa.gdpa`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from opengem.ops.activations import activation_grad, activation_value
from opengem.ops.reference.masks import attention_mask


def gdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    k_offsets: torch.Tensor,
    *,
    head_activations: Sequence[str],
    pre_scale: float = 1.0,
    out_scale: float = 1.0,
    causal: bool = False,
    num_targets: torch.Tensor | None = None,
    contextual_len: int = 0,
    window: int | None = None,
    broadcast_q: bool = False,
) -> torch.Tensor:
    """``O_i = out_scale * sum_j [mask_ij] phi_h(pre_scale * q_i . k_j) v_j``; returns q's dtype.

    q ``[Tq, H, D]`` (or ``[Lq, H, D]`` shared by all samples with ``broadcast_q``; the output is then
    ``[B * Lq, H, D]``, sample-major); k, v ``[Tk, H_kv, D]``; offsets ``[B + 1]``. ``out_scale`` is
    ``post_scale / norm``. With any mask option (causal, targets, contextual prefix, window) the sample is
    self-attention (equal q/k lengths) under :func:`attention_mask`; otherwise every key of the sample is
    visible. Masked pairs contribute exactly 0 (the mask applies after the activation).
    """
    outputs = [
        out_scale * (_weights(scores, mask, head_activations)[0] @ vb).transpose(0, 1)
        for _, scores, mask, _, vb in _samples(
            q, k, v, q_offsets, k_offsets, pre_scale, causal, num_targets, contextual_len, window, broadcast_q
        )
    ]
    if not outputs:
        return q.new_zeros((0, *q.shape[1:]))
    return torch.cat(outputs).to(q.dtype)


def gdpa_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    k_offsets: torch.Tensor,
    *,
    head_activations: Sequence[str],
    pre_scale: float = 1.0,
    out_scale: float = 1.0,
    causal: bool = False,
    num_targets: torch.Tensor | None = None,
    contextual_len: int = 0,
    window: int | None = None,
    broadcast_q: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Closed-form ``(dq, dk, dv)`` of :func:`gdpa` (the kernels' math, no LSE), in the inputs' dtypes:
    ``dV = c P^T dO``, ``dX = mask * (c dO V^T) * phi'(X)``, ``dQ = pre dX K``, ``dK = pre dX^T Q``."""
    group = q.shape[1] // k.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    samples = _samples(
        q, k, v, q_offsets, k_offsets, pre_scale, causal, num_targets, contextual_len, window, broadcast_q
    )
    for (q_rows, k_rows, o_rows), scores, mask, kb, vb in samples:
        weights, slopes = _weights(scores, mask, head_activations, with_grad=True)
        dob = grad_out[o_rows].float().transpose(0, 1)  # [H, Lq, D]
        dx = out_scale * (dob @ vb.transpose(1, 2)) * slopes
        qb = q[q_rows].float().transpose(0, 1)
        dq[q_rows] += (pre_scale * dx @ kb).transpose(0, 1)
        dk_heads = (pre_scale * dx.transpose(1, 2) @ qb).transpose(0, 1)  # [Lk, H, D]
        dv_heads = (out_scale * weights.transpose(1, 2) @ dob).transpose(0, 1)
        dk[k_rows] += dk_heads.unflatten(1, (-1, group)).sum(2)
        dv[k_rows] += dv_heads.unflatten(1, (-1, group)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _samples(q, k, v, q_offsets, k_offsets, pre_scale, causal, num_targets, contextual_len, window, broadcast_q):
    """Per sample: ((q rows, k rows, output rows), fp32 scores [H, Lq, Lk], mask or None, K and V [H, Lk, D])."""
    masked = causal or num_targets is not None or contextual_len > 0 or window is not None
    group = q.shape[1] // k.shape[1]
    k_bounds = k_offsets.detach().cpu().tolist()
    q_bounds = None if broadcast_q else q_offsets.detach().cpu().tolist()
    targets = [0] * (len(k_bounds) - 1) if num_targets is None else num_targets.detach().cpu().tolist()
    for b in range(len(k_bounds) - 1):
        k_rows = slice(k_bounds[b], k_bounds[b + 1])
        if broadcast_q:
            q_rows, o_rows = slice(0, q.shape[0]), slice(b * q.shape[0], (b + 1) * q.shape[0])
        else:
            q_rows = o_rows = slice(q_bounds[b], q_bounds[b + 1])
        kb = k[k_rows].float().repeat_interleave(group, dim=1).transpose(0, 1)
        vb = v[k_rows].float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = pre_scale * (q[q_rows].float().transpose(0, 1) @ kb.transpose(1, 2))
        mask = None
        if masked:
            mask = attention_mask(
                kb.shape[1],
                causal=causal,
                num_targets=int(targets[b]),
                contextual_len=contextual_len,
                window=window,
                device=q.device,
            )
        yield (q_rows, k_rows, o_rows), scores, mask, kb, vb


def _weights(scores, mask, head_activations, with_grad: bool = False):
    """``(P, phi'(X))`` per head, both zero where masked (the mask applies after the activation)."""
    weights = torch.stack([activation_value(name, scores[h]) for h, name in enumerate(head_activations)])
    slopes = None
    if with_grad:
        slopes = torch.stack([activation_grad(name, scores[h]) for h, name in enumerate(head_activations)])
    if mask is not None:
        weights = torch.where(mask, weights, 0.0)
        slopes = None if slopes is None else torch.where(mask, slopes, 0.0)
    return weights, slopes
