"""MXFP8 JFA (``precision="mxfp8"``) on JFA's kernels: numerics of GEM's MXFP8 attention on any GPU.

Q and K are rotated and quantized to MX-E4M3 along the head dim, and V along the sequence, by one Triton pass per
operand (:func:`mx_values`); the forward kernel multiplies those values, exact in 16 bits, with P quantized to
MX-E4M3 inside its key loop (``P_MX``). Hopper has no MX tensor cores, so this costs the quantization on top of
the bf16 kernel: it is for training with MXFP8's numerics (what a Blackwell run would compute). The backward runs
JFA's bf16 kernels straight through the quantization, then rotates dQ and dK back. Specification:
:mod:`opengem.ops.reference.attention_mxfp8`.

The pass's bits are the emulation's but for the rotation's sums: 16-bit inputs are rotated on the tensor cores
with fp32 sums (the emulation: fp64, then one rounding), so an element within an fp32 ulp of an E4M3 rounding
midpoint may take the neighbouring value, as in FP8 JFA's quantize pass; fp32 inputs are rotated in fp64.
Session 20 measured the torch-op quantization this pass replaces at 15-16 ms for ~150k tokens x 4 heads (op
0.10x bf16 on JFA (a)).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from opengem.jagged.blocks import block_offsets
from opengem.ops.reference.attention_fp8 import rotation_size
from opengem.ops.reference.mx import MX_BLOCK
from opengem.ops.triton import jagged_attention as kernels
from opengem.ops.triton.jagged_attention import _INTERPRET
from opengem.ops.triton.jagged_attention_fp8 import (
    _rotation_on,
    rotate_slices,
    rotated_back,
    rotated_gradient_buffers,
)
from opengem.ops.triton.mx import mx_e4m3_rows
from opengem.ops.triton.ragged_tiles import last_dim_contiguous

# tokens a program quantizes along the head dim: the FP8 pass's tile on the GPU (registers from its sm_90 counts)
ROWS_ALONG_HEAD_DIM = 32 if _INTERPRET else 128
# its warps per head dim: the FP8 pass's before session 29 (that pass now runs D 128 at 4 warps under a register
# cap, timed on its own kernel only)
MX_QUANTIZE_WARPS = {32: 4, 64: 4, 128: 8, 256: 16}


@triton.jit(do_not_specialize=["rows"])
def _mx_operand_kernel(
    X, OUT, R, block_starts, rows, stride_t, stride_h, heads,
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, ROT: tl.constexpr, ROTATE: tl.constexpr,
    ALONG_SEQUENCE: tl.constexpr, EXACT: tl.constexpr, HEAD_DIM_BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (token tile, head): ``BLOCK_T`` tokens of one head of ``X``, rotated when ``ROTATE``, to MX-E4M3
    values in ``OUT`` (contiguous ``[T, heads, D]``, X's dtype): blocks of 32 along the head dim, or with
    ``ALONG_SEQUENCE`` (``BLOCK_T`` 32) one block of tokens ``block_starts[i] .. block_starts[i + 1]`` per channel.
    ``HEAD_DIM_BLOCK``: 32, or the head dim when it is shorter (D 16: one zero-padded block, as the emulation's)."""
    h = tl.program_id(1)
    if ALONG_SEQUENCE:
        start = tl.load(block_starts + tl.program_id(0)).to(tl.int64)
        end = tl.load(block_starts + tl.program_id(0) + 1).to(tl.int64)
    else:
        start = tl.program_id(0).to(tl.int64) * BLOCK_T
        end = tl.minimum(start + BLOCK_T, rows)
    tokens = start + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, HEAD_DIM)
    inside = tokens[:, None] < end  # rows past the block load as zeros: they leave its maximum alone
    x = tl.load(X + tokens[:, None] * stride_t + h * stride_h + offs_d[None, :], mask=inside, other=0.0)
    if ROTATE:
        if X.dtype.element_ty == tl.float32:  # fp64 sums, rounded once: the emulation's bits
            x = rotate_slices(x.to(tl.float64), R, BLOCK_T, HEAD_DIM, ROT, "ieee")
        else:  # +-1 times 16-bit values: exact products, fp32 sums
            x = rotate_slices(x, R, BLOCK_T, HEAD_DIM, ROT, "tf32")
    x = x.to(tl.float32)
    if ALONG_SEQUENCE:
        values = tl.trans(mx_e4m3_rows(tl.trans(x), HEAD_DIM, BLOCK_T, EXACT, BLOCK_T, NAN_BLOCKS=True))
    else:
        values = mx_e4m3_rows(x, BLOCK_T, HEAD_DIM, EXACT, HEAD_DIM_BLOCK, NAN_BLOCKS=True)
    out = OUT + tokens[:, None] * (heads * HEAD_DIM) + h * HEAD_DIM + offs_d[None, :]
    tl.store(out, values.to(OUT.dtype.element_ty), mask=inside)


def _mx_operand(x: torch.Tensor, rotate: bool, kv_offsets: torch.Tensor | None = None) -> torch.Tensor:
    """One operand ``[T, H, D]`` through :func:`_mx_operand_kernel`: along the head dim (rotated when ``rotate``),
    or with ``kv_offsets`` along each sample's blocks of 32 tokens. A new contiguous tensor of x's dtype."""
    x = last_dim_contiguous(x)
    tokens, heads, head_dim = x.shape
    out = torch.empty((tokens, heads, head_dim), dtype=x.dtype, device=x.device)
    n = rotation_size(head_dim)
    rotation = _rotation_on(n, torch.float64 if x.dtype == torch.float32 else x.dtype, x.device)
    if kv_offsets is None:
        starts = x  # unread: a tensor stands in for the block starts
        grid, block_t = (triton.cdiv(tokens, ROWS_ALONG_HEAD_DIM), heads), ROWS_ALONG_HEAD_DIM
    else:
        starts = block_offsets(kv_offsets, MX_BLOCK)
        grid, block_t = (starts.numel() - 1, heads), MX_BLOCK
    if tokens and heads and grid[0]:
        _mx_operand_kernel[grid](
            x, out, rotation, starts, tokens, x.stride(0), x.stride(1), heads, HEAD_DIM=head_dim, BLOCK_T=block_t,
            ROT=n, ROTATE=rotate, ALONG_SEQUENCE=kv_offsets is not None, EXACT=_INTERPRET,
            HEAD_DIM_BLOCK=min(MX_BLOCK, head_dim),
            num_warps=MX_QUANTIZE_WARPS.get(head_dim, 4) if block_t > MX_BLOCK else 4,
        )  # fmt: skip
    return out


def mx_values(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotated Q and K, and V (blocked by ``kv_offsets``), as MX-E4M3 values in their own dtypes: exact in 16 bits,
    but for values under 2^-24 in fp16. Their logits are ``n`` times Q K^T (``n = rotation_size(D)``); the
    emulation's ``straight_through_operands`` to the rotation's sums (module docstring)."""
    return _mx_operand(q, True), _mx_operand(k, True), _mx_operand(v, False, kv_offsets=kv_offsets)


def operands(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pb: kernels.Problem
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, kernels.Problem]:
    """:func:`mx_values`, and ``pb`` with the logit scale ``/ n`` of the rotation."""
    rotated_pb = dataclasses.replace(pb, scale=pb.scale / rotation_size(q.shape[2]))  # (q R)(k R)^T = n q k^T
    return (*mx_values(q, k, v, pb.offsets), rotated_pb)


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pb: kernels.Problem
) -> tuple[torch.Tensor, torch.Tensor]:
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
