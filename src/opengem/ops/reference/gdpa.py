"""Reference GDPA (pointwise-activation attention): per sample and head, fp32, differentiable.

The specification the Triton kernels are tested against and the CPU path of :func:`opengem.ops.gdpa.gdpa`.
"""

from __future__ import annotations

from collections.abc import Callable
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
    p_quantizer: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``O_i = out_scale * sum_j [mask_ij] phi_h(pre_scale * q_i . k_j) v_j``; returns q's dtype.

    q ``[Tq, H, D]`` (or ``[Lq, H, D]`` shared by all samples with ``broadcast_q``; the output is then
    ``[B * Lq, H, D]``, sample-major); k, v ``[Tk, H_kv, D]``; offsets ``[B + 1]``. ``out_scale`` is
    ``post_scale / norm``. With any mask option (causal, targets, contextual prefix, window) the sample is
    self-attention (equal q/k lengths) under :func:`attention_mask`; otherwise every key of the sample is
    visible. Masked pairs contribute exactly 0 (the mask applies after the activation). ``p_quantizer`` (the
    low-precision emulations): applied to each sample's ``P [..., Lq, Lk]`` (keys from the sample's first, masked
    and padded keys 0) before ``P V``.
    """
    quantized = p_quantizer or (lambda p: p)
    if not _is_masked(causal, num_targets, contextual_len, window):
        return _unmasked_forward(q, k, v, q_offsets, k_offsets, head_activations, pre_scale, out_scale, broadcast_q,
                                 quantized)  # fmt: skip
    outputs = [
        out_scale * (quantized(_weights(scores, mask, head_activations)[0]) @ vb).transpose(0, 1)
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
    if not _is_masked(causal, num_targets, contextual_len, window):
        return _unmasked_backward(
            grad_out, q, k, v, q_offsets, k_offsets, head_activations, pre_scale, out_scale, broadcast_q
        )
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


# ---------------------------------------------------------------- unmasked (cross / broadcast-Q) samples, batched
# Cross-attention and seed pooling have no mask, so samples of similar length can be zero-padded into one
# [n, H, Lq, Lk] score tensor (padded keys get weight 0, padded query rows are dropped): the same math as
# the per-sample loop above, without a Python iteration per sample (which made CPU training crawl).

_SCORES_PER_CHUNK = 1 << 22  # elements of one chunk's padded score tensor


def _is_masked(causal: bool, num_targets, contextual_len: int, window) -> bool:
    return causal or num_targets is not None or contextual_len > 0 or window is not None


def _chunks(q_lengths: list[int], k_lengths: list[int], heads: int):
    """Groups of samples (longest first, so padding stays small) whose padded scores fit the chunk budget."""
    order = sorted(range(len(k_lengths)), key=lambda b: (-q_lengths[b], -k_lengths[b]))
    while order:
        count, lq, lk = 0, 0, 0
        while count < len(order):
            b = order[count]
            wider_q, wider_k = max(lq, q_lengths[b]), max(lk, k_lengths[b])
            if count and (count + 1) * heads * wider_q * wider_k > _SCORES_PER_CHUNK:
                break
            lq, lk, count = wider_q, wider_k, count + 1
        yield order[:count], lq, lk
        order = order[count:]


def _pad(x: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, size: int):
    """Rows ``starts[i] : starts[i] + lengths[i]`` of ``x [T, H, D]`` as fp32 ``[n, H, size, D]`` (zero padded),
    with ``valid [n, size]`` and the source row of every valid slot, in ``valid``'s order."""
    positions = torch.arange(size, device=x.device)
    valid = positions[None, :] < lengths[:, None]
    index = (starts[:, None] + positions[None, :])[valid]
    padded = torch.zeros((len(starts), size, *x.shape[1:]), dtype=torch.float32, device=x.device)
    padded[valid] = x[index].float()
    return padded.transpose(1, 2), valid, index


class _Chunk:
    """Samples ``members`` in the padded layout: q ``[n|1, H, Lq, D]``, k/v ``[n, H, Lk, D]`` (GQA-expanded)."""

    def __init__(self, q, k, v, q_bounds, k_bounds, members, lq, lk, broadcast_q):
        def starts_lengths(bounds):
            starts = torch.tensor([bounds[b] for b in members], device=k.device)
            return starts, torch.tensor([bounds[b + 1] for b in members], device=k.device) - starts

        group = q.shape[1] // k.shape[1]
        k_starts, k_lengths = starts_lengths(k_bounds)
        k_padded, self.k_valid, self.k_index = _pad(k, k_starts, k_lengths, lk)
        self.k = k_padded.repeat_interleave(group, dim=1)
        self.v = _pad(v, k_starts, k_lengths, lk)[0].repeat_interleave(group, dim=1)
        if broadcast_q:
            self.q = q.float().transpose(0, 1).unsqueeze(0)
            self.q_valid = None
            rows = torch.arange(q.shape[0], device=q.device)
            self.o_index = (torch.tensor(members, device=q.device)[:, None] * q.shape[0] + rows).flatten()
        else:
            self.q, self.q_valid, self.o_index = _pad(q, *starts_lengths(q_bounds), lq)

    def scores(self, pre_scale: float) -> torch.Tensor:
        return pre_scale * (self.q @ self.k.transpose(-1, -2))  # [n, H, Lq, Lk]

    def unpad_q(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, H, Lq, D]`` -> the rows of ``o_index``, ``[rows, H, D]``."""
        x = x.transpose(1, 2)
        return x.flatten(0, 1) if self.q_valid is None else x[self.q_valid]

    def unpad_k(self, x: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """``[n, H, Lk, D]`` -> the rows of ``k_index``, ``[rows, H_kv, D]``, summed over each GQA group."""
        n, heads, lk, d = x.shape
        return x.view(n, kv_heads, heads // kv_heads, lk, d).sum(2).transpose(1, 2)[self.k_valid]


def _unmasked_chunks(q, k, v, q_offsets, k_offsets, broadcast_q):
    k_bounds = k_offsets.detach().cpu().tolist()
    batch = len(k_bounds) - 1
    q_bounds = None if broadcast_q else q_offsets.detach().cpu().tolist()
    q_lengths = [q.shape[0]] * batch if broadcast_q else [q_bounds[b + 1] - q_bounds[b] for b in range(batch)]
    k_lengths = [k_bounds[b + 1] - k_bounds[b] for b in range(batch)]
    for members, lq, lk in _chunks(q_lengths, k_lengths, q.shape[1]):
        yield _Chunk(q, k, v, q_bounds, k_bounds, members, lq, lk, broadcast_q)


def _activate(scores: torch.Tensor, k_valid: torch.Tensor, head_activations, with_grad: bool):
    keep = k_valid[:, None, None, :]
    weights = torch.stack([activation_value(n, scores[:, h]) for h, n in enumerate(head_activations)], 1)
    weights = weights.masked_fill(~keep, 0.0)
    if not with_grad:
        return weights, None
    slopes = torch.stack([activation_grad(n, scores[:, h]) for h, n in enumerate(head_activations)], 1)
    return weights, slopes.masked_fill(~keep, 0.0)


def _unmasked_forward(q, k, v, q_offsets, k_offsets, head_activations, pre_scale, out_scale, broadcast_q, quantized):
    rows = q.shape[0] * (k_offsets.numel() - 1) if broadcast_q else q.shape[0]
    out = torch.zeros((rows, *q.shape[1:]), dtype=torch.float32, device=q.device)
    for chunk in _unmasked_chunks(q, k, v, q_offsets, k_offsets, broadcast_q):
        weights, _ = _activate(chunk.scores(pre_scale), chunk.k_valid, head_activations, with_grad=False)
        out.index_copy_(0, chunk.o_index, chunk.unpad_q(out_scale * (quantized(weights) @ chunk.v)))
    return out.to(q.dtype)


def _unmasked_backward(grad_out, q, k, v, q_offsets, k_offsets, head_activations, pre_scale, out_scale, broadcast_q):
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for chunk in _unmasked_chunks(q, k, v, q_offsets, k_offsets, broadcast_q):
        rows = grad_out[chunk.o_index].float()
        if chunk.q_valid is None:
            dout = rows.view(-1, *q.shape).transpose(1, 2)  # [n, H, Lq, D]
        else:
            dout = torch.zeros_like(chunk.q)
            dout.transpose(1, 2)[chunk.q_valid] = rows
        weights, slopes = _activate(chunk.scores(pre_scale), chunk.k_valid, head_activations, with_grad=True)
        dx = out_scale * (dout @ chunk.v.transpose(-1, -2)) * slopes
        dq_chunk = pre_scale * (dx @ chunk.k)
        if chunk.q_valid is None:  # broadcast q: every sample's dq lands on the shared rows
            dq += dq_chunk.sum(0).transpose(0, 1)
        else:
            dq.index_copy_(0, chunk.o_index, chunk.unpad_q(dq_chunk))
        dk.index_copy_(0, chunk.k_index, chunk.unpad_k(pre_scale * (dx.transpose(-1, -2) @ chunk.q), k.shape[1]))
        dv.index_copy_(0, chunk.k_index, chunk.unpad_k(out_scale * (weights.transpose(-1, -2) @ dout), k.shape[1]))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
