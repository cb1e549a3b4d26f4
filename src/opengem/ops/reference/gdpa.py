"""Reference GDPA (pointwise-activation attention): per sample and head, fp32, differentiable.

The specification the Triton kernels are tested against and the CPU path of :func:`opengem.ops.gdpa.gdpa`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from opengem.ops.activations import activation_value
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
    masked = causal or num_targets is not None or contextual_len > 0 or window is not None
    group = q.shape[1] // k.shape[1]
    k_bounds = k_offsets.detach().cpu().tolist()
    q_bounds = k_bounds if broadcast_q else q_offsets.detach().cpu().tolist()
    targets = [0] * (len(k_bounds) - 1) if num_targets is None else num_targets.detach().cpu().tolist()
    outputs = []
    for b in range(len(k_bounds) - 1):
        qb = q if broadcast_q else q[q_bounds[b] : q_bounds[b + 1]]
        kb = k[k_bounds[b] : k_bounds[b + 1]].float().repeat_interleave(group, dim=1).transpose(0, 1)
        vb = v[k_bounds[b] : k_bounds[b + 1]].float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = pre_scale * (qb.float().transpose(0, 1) @ kb.transpose(1, 2))  # [H, Lq, Lk]
        weights = torch.stack([activation_value(name, scores[h]) for h, name in enumerate(head_activations)])
        if masked:
            mask = attention_mask(
                qb.shape[0],
                causal=causal,
                num_targets=int(targets[b]),
                contextual_len=contextual_len,
                window=window,
                device=q.device,
            )
            weights = torch.where(mask, weights, 0.0)
        outputs.append(out_scale * (weights @ vb).transpose(0, 1))
    if not outputs:
        return q.new_zeros((0, *q.shape[1:]))
    return torch.cat(outputs).to(q.dtype)
