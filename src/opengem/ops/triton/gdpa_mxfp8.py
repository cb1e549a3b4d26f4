"""MXFP8 GDPA (``gdpa(..., precision="mxfp8")``) on GDPA's kernels: GEM's MXFP8 numerics on any GPU.

As MXFP8 JFA (:mod:`opengem.ops.triton.jagged_attention_mxfp8`): Q and K rotated and quantized to MX-E4M3 along
the head dim, V along K/V's samples, by its Triton operand pass (``mx_values``); the forward kernel multiplies
those values (exact in 16 bits) with P quantized to MX-E4M3 in blocks of 32 keys (``P_MX``); the backward runs
GDPA's bf16 kernels straight through and rotates dQ and dK back. Self-, cross-attention and ``broadcast_q`` alike.
Specification: :mod:`opengem.ops.reference.gdpa_mxfp8`. Not a speed mode on Hopper (no MX tensor cores).
"""

from __future__ import annotations

import dataclasses

import torch

from opengem.ops.reference.attention_fp8 import rotation_size
from opengem.ops.triton import gdpa as gdpa_kernels
from opengem.ops.triton.jagged_attention_fp8 import rotated_back, rotated_gradient_buffers
from opengem.ops.triton.jagged_attention_mxfp8 import mx_values


def operands(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_offsets: torch.Tensor, args: gdpa_kernels.GdpaArgs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, gdpa_kernels.GdpaArgs]:
    """MXFP8 JFA's :func:`~opengem.ops.triton.jagged_attention_mxfp8.mx_values` (V blocked by K/V's offsets), and
    ``args`` with ``pre_scale / n``."""
    rotated = dataclasses.replace(args, pre_scale=args.pre_scale / rotation_size(q.shape[2]))  # (q R)(k R)^T = n q k^T
    return (*mx_values(q, k, v, k_offsets), rotated)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor, k_offsets: torch.Tensor,
            num_targets: torch.Tensor | None, args: gdpa_kernels.GdpaArgs) -> torch.Tensor:  # fmt: skip
    qd, kd, vd, rotated = operands(q, k, v, k_offsets, args)
    return gdpa_kernels.gdpa_forward(qd, kd, vd, q_offsets, k_offsets, num_targets, rotated, p_mx=True)


def backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
             k_offsets: torch.Tensor, num_targets: torch.Tensor | None, args: gdpa_kernels.GdpaArgs,
             grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(dq, dk, dv)`` straight through the quantization; ``grads`` as in GDPA's backward."""
    qd, kd, vd, rotated = operands(q, k, v, k_offsets, args)
    buffers = rotated_gradient_buffers(qd, kd, v, grads)
    gdpa_kernels.gdpa_backward(grad_out, qd, kd, vd, q_offsets, k_offsets, num_targets, rotated, grads=buffers)
    return rotated_back(*buffers, grads)
