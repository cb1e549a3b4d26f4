"""Reference rotary position embedding (RoPE), positional and time-aware, rotate-half convention.

Each token gets one real *phase* ``p``; channel pair ``(i, i + D/2)`` is rotated by the angle
``p * base ** (-2 i / D)`` (``i < D/2``), i.e. ``x_lo' = x_lo cos - x_hi sin``, ``x_hi' = x_hi cos + x_lo sin``
(the GPT-NeoX / LLaMA "rotate half" layout). The phase is the token's position (positional RoPE) or
``log(1 + max(gap, 0) / time_scale)`` for a per-token time gap (time-aware RoPE).
"""

from __future__ import annotations

import torch


def inv_freq(head_dim: int, base: float, device: torch.device | str) -> torch.Tensor:
    """``base ** (-2 i / head_dim)`` for ``i < head_dim / 2``, fp32 ``[head_dim / 2]``."""
    exponents = torch.arange(0, head_dim // 2, dtype=torch.float64, device=device) * 2.0 / head_dim
    return (float(base) ** -exponents).to(torch.float32)  # on the device: no host copy (graph capture)


def positions_in_sequence(offsets: torch.Tensor, total: int) -> torch.Tensor:
    """Position of every token within its own sequence, int64 ``[T]``."""
    lengths = (offsets[1:] - offsets[:-1]).long()
    starts = offsets[:-1].long().repeat_interleave(lengths, output_size=total)
    return torch.arange(total, device=offsets.device) - starts


def time_phase(time_gaps: torch.Tensor, time_scale: float) -> torch.Tensor:
    """Time-aware phase ``log(1 + max(gap, 0) / time_scale)``, fp32 ``[T]``."""
    return torch.log1p(time_gaps.float().clamp_min(0.0) / time_scale)


def apply_rotary(x: torch.Tensor, phase: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` (D even) by per-token ``phase [T]``; fp32 result."""
    half = x.shape[-1] // 2
    angles = phase.float()[:, None] * inv_freq(x.shape[-1], base, x.device)[None, :]  # [T, D/2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    lo, hi = x.float()[..., :half], x.float()[..., half:]
    return torch.cat((lo * cos - hi * sin, hi * cos + lo * sin), dim=-1)
