"""MXFP8 JFA (``precision="mxfp8"``) on JFA's kernels: numerics of GEM's MXFP8 attention on any GPU.

Q and K are rotated and quantized to MX-E4M3 along the head dim, and V along the sequence, by the reference's
torch ops (the same bits on every device); the forward kernel multiplies those values, exact in 16 bits, with P
quantized to MX-E4M3 inside its key loop (``P_MX``). Hopper has no MX tensor cores, so this costs the
quantization on top of the bf16 kernel: it is for training with MXFP8's numerics (what a Blackwell run would
compute); it is not yet timed. The backward runs JFA's bf16 kernels straight through the quantization, then rotates
dQ and dK back. Specification: :mod:`opengem.ops.reference.attention_mxfp8`.
"""

from __future__ import annotations

import dataclasses

import torch

from opengem.ops.reference.attention_fp8 import rotation_size
from opengem.ops.reference.attention_mxfp8 import straight_through_operands
from opengem.ops.triton import jagged_attention as kernels
from opengem.ops.triton.jagged_attention_fp8 import rotated_back, rotated_gradient_buffers


def mx_values(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotated Q and K, and V (blocked by ``kv_offsets``), as MX-E4M3 values in their own dtypes: exact in 16 bits,
    but for values under 2^-24 in fp16. Their logits are ``n`` times Q K^T (``n = rotation_size(D)``)."""
    qd, kd, vd = straight_through_operands(q, k, v, kv_offsets)
    return qd.to(q.dtype), kd.to(k.dtype), vd.to(v.dtype)


def operands(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pb: kernels.Problem
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, kernels.Problem]:
    """:func:`mx_values`, and ``pb`` with the logit scale ``/ n`` of the rotation."""
    rotated_pb = dataclasses.replace(pb, scale=pb.scale / rotation_size(q.shape[2]))  # (q R)(k R)^T = n q k^T
    return (*mx_values(q, k, v, pb.offsets), rotated_pb)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pb: kernels.Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """``out [T, H, D]`` in q's dtype and ``lse [H, T]`` (fp32, base 2, of the rotated logits' unquantized P)."""
    qd, kd, vd, rotated_pb = operands(q, k, v, pb)
    return kernels.forward(qd, kd, vd, rotated_pb, p_mx=True)


def backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    pb: kernels.Problem, grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dq, dk, dv`` straight through the quantization: JFA's backward on the operands the forward multiplied,
    against its ``out`` and ``lse``, then dQ and dK rotated back; ``grads`` as in JFA's ``backward``."""
    qd, kd, vd, rotated_pb = operands(q, k, v, pb)
    buffers = rotated_gradient_buffers(qd, kd, v, grads)
    kernels.backward(dout, qd, kd, vd, out, lse, rotated_pb, grads=buffers)
    return rotated_back(*buffers, grads)
