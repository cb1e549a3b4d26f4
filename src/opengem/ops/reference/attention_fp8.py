"""Exact emulation of the FP8 JFA forward (``precision="fp8"``): quantize as the kernel does, then fp32 attention.

The recipe (the specification :mod:`opengem.ops.triton.jagged_attention_fp8` is tested against; why this
one: ``docs/fp8_attention.md``):

- Q and K are first rotated along the head dim by the same randomized Hadamard matrix (FlashAttention-3's
  incoherent processing): ``x R`` with ``R = diag(signs) H_n`` (``H_n`` Sylvester's, entries +-1,
  unnormalized; ``n = min(D, 128)``, or the largest power of two dividing D; block diagonal when D > n;
  ``signs`` fixed by :data:`ROTATION_SEED`). ``R R^T = n I``, so ``(q R)(k R)^T = n q k^T`` exactly and
  the logit scale absorbs ``1 / n``, a power of two. The rotation spreads an outlier channel over all n,
  so one large product no longer carries a large rounding error into every logit.
- Rotated Q and K, and V, are cut, per sample and head, into blocks of ``block`` rows starting at the
  sample's first token (the last block of a sample is partial). Each block gets one fp32 scale
  ``amax / 448`` (amax over the block's rows and the head dim, at least 1e-12) and its elements become
  E4M3 ``rne(clamp(x * (448 / amax), -448, 448))``; both quotients correctly rounded, rounding to
  nearest-even with subnormals (torch's ``float8_e4m3fn`` cast), so the kernel's fp8 bits are the same.
- Logits in base 2, ``(q8 * sq) (k8 * sk)^T * scale * log2(e) / n``, masked as the reference mask says.
- An online softmax over the key blocks (the kernel's key tiles are the same blocks, in the same order):
  running row maximum ``m``, ``p = exp2(s - m)`` in fp32, the row sum of the fp32 ``p``, and
  ``P V`` with ``P`` quantized to E4M3 as ``rne(p * 256)``: p <= 1, so the fixed power-of-two scale 256
  cannot overflow (<= 448) and scales exactly; every p >= 2^-14 keeps E4M3's full 3-bit mantissa and
  smaller ones (under 6e-5 of the running maximum) go subnormal, then to zero below 2^-17.
  A per-tile scale from the tile maximum would buy nothing: the tile maximum is 1 in any tile holding
  a row's running maximum, and elsewhere only a tile far below the maximum, which adds little, would gain.

Only fp32 rounding differs from the kernel: the rotation's sums (the kernel's is a matmul), the attention's
sums in another order, ``exp2`` to a few ulps; so a rotated element or a ``p`` within an ulp of an E4M3
rounding boundary may round the other way.

The backward (:func:`jagged_attention_fp8_backward`) goes straight through the quantization: it is the
gradient of softmax attention over the operands the forward multiplied (rotated Q and K, and V, each
quantized and scaled back; logit scale ``/ n``), with dQ and dK rotated back by ``R^T``. Its logits, and so
its P, are the forward's: a backward recomputing them from the bf16 Q and K against the FP8 forward's
log-sum-exp gets rows of P that do not sum to one (by 17-23% on outlier-channel inputs), which put dQ and dK
32-51% off the fp32 gradient there, against 14-16% straight through; on N(0, 1) inputs the order reverses, 2%
against 5% (``benchmarks/diag/fp8_attention_backward.py``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import torch

from opengem.ops.reference.attention import _length_groups, _pad, _unpad, jagged_attention_backward
from opengem.ops.reference.masks import batched_attention_mask

E4M3_MAX = 448.0
P_SCALE = 256.0  # P's fixed quantization scale (a power of two <= 448 / max(p) = 448)
LOG2E = 1.4426950408889634
MIN_AMAX = 1e-12  # blocks of zeros get a finite scale
MAX_ROTATION = 128  # the Hadamard block: wider buys little (docs/fp8_attention.md), and it stays one MMA
ROTATION_SEED = 12  # the signs of the randomized Hadamard matrix, shared with the kernel


def rotation_size(head_dim: int) -> int:
    """The Hadamard block ``n`` for a head dim: the largest power of two dividing it, at most 128."""
    return min(MAX_ROTATION, head_dim & -head_dim)


@functools.lru_cache(maxsize=None)
def _rotation(n: int) -> torch.Tensor:
    hadamard = torch.ones(1, 1)
    while hadamard.shape[0] < n:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)])
    signs = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(ROTATION_SEED)) * 2 - 1
    return signs[:, None].float() * hadamard


def rotation(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[n, n]`` randomized Hadamard matrix ``diag(signs) H_n``, entries +-1 (exact in every float dtype)."""
    return _rotation(n).to(dtype=dtype, device=device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x [..., D]`` -> fp32 ``x R`` with ``R`` block diagonal of :func:`rotation` (``n = rotation_size(D)``),
    correctly rounded: fp64 sums of n fp32 terms times +-1 are exact for 16-bit inputs and carry 29 more
    bits than fp32 otherwise; so no TF32 or summation order setting changes it."""
    n = rotation_size(x.shape[-1])
    blocks = x.double().reshape(*x.shape[:-1], x.shape[-1] // n, n)
    return (blocks @ rotation(n, torch.float64, x.device)).float().reshape(x.shape)


def quantize_padded_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded ``x [G, H, L, D]`` (L a multiple of ``block``, zeros past each sample) -> E4M3 ``[G, H, L, D]``
    and the fp32 dequantization scale of each row's block ``[G, H, L, 1]``."""
    g, h, length, d = x.shape
    blocks = x.float().reshape(g, h, length // block, block * d)
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(MIN_AMAX)
    # tensor / tensor: torch divides by a python scalar as a product with its reciprocal on CUDA, and a
    # scalar by a tensor as reciprocal times scalar everywhere; neither is the kernel's correctly rounded quotient
    limit = torch.full_like(amax, E4M3_MAX)
    data = (blocks * (limit / amax)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    scale = (amax / limit).expand(-1, -1, -1, block)
    return data.reshape(x.shape), scale.reshape(g, h, length, 1)


def quantize_jagged_blocks(x: torch.Tensor, offsets: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Jagged ``x [T, H, D]`` -> E4M3 ``[T, H, D]`` and each row's block scale ``[T, H]`` fp32."""
    data = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(x.shape[:2], dtype=torch.float32, device=x.device)
    for rows, lengths, size, _ in _length_groups(offsets, None, x.shape[1], x.device):
        padded = _pad(x[rows].float(), lengths, _round_up(size, block))
        q8, s = quantize_padded_blocks(padded, block)
        data[rows] = _unpad(q8.view(torch.uint8), lengths, padded.shape[2]).view(torch.float8_e4m3fn)
        scale[rows] = _unpad(s, lengths, padded.shape[2])[..., 0]
    return data, scale


def unrotate_gradient(grad: torch.Tensor) -> torch.Tensor:
    """The gradient of ``x`` from that of ``rotate(x)``: ``grad R^T`` (fp64 sums, as :func:`rotate`), fp32."""
    n = rotation_size(grad.shape[-1])
    blocks = grad.double().reshape(*grad.shape[:-1], grad.shape[-1] // n, n)
    return (blocks @ rotation(n, torch.float64, grad.device).T).float().reshape(grad.shape)


def straight_through_operands(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, block: int,
    k_offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the FP8 forward multiplies, fp32 ``[T, H, D]``: rotated Q and K, and V, quantized and scaled back;
    blocked by ``offsets``, K and V by ``k_offsets`` when given (cross-attention)."""
    key_offsets = offsets if k_offsets is None else k_offsets
    dequantized = []
    for x, x_offsets in ((rotate(q), offsets), (rotate(k), key_offsets), (v.float(), key_offsets)):
        data, scale = quantize_jagged_blocks(x, x_offsets, block)
        dequantized.append(data.float() * scale[..., None])
    return dequantized[0], dequantized[1], dequantized[2]


def jagged_attention_fp8_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    *,
    block: int,
    causal: bool,
    num_targets: torch.Tensor | None,
    contextual_len: int,
    window: int | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dq, dk, dv`` of :func:`jagged_attention_fp8`, straight through its quantization (module docstring), in the
    inputs' dtypes as :func:`~opengem.ops.reference.attention.jagged_attention_backward`'s; ``scale`` final."""
    q_st, k_st, v_st = straight_through_operands(q, k, v, offsets, block)
    dq, dk, dv = jagged_attention_backward(
        grad_out.float(), q_st, k_st, v_st, offsets, causal=causal, num_targets=num_targets,
        contextual_len=contextual_len, window=window, scale=scale / rotation_size(q.shape[-1]),
    )  # fmt: skip
    return unrotate_gradient(dq).to(q.dtype), unrotate_gradient(dk).to(k.dtype), dv.to(v.dtype)


def quantize_p(p: torch.Tensor) -> torch.Tensor:
    """fp32 ``p`` in [0, 1] -> the E4M3 values of ``p * 256``, as fp32."""
    return (p * P_SCALE).to(torch.float8_e4m3fn).float()


def jagged_attention_fp8(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    *,
    block: int,
    causal: bool = True,
    num_targets: torch.Tensor | None = None,
    contextual_len: int = 0,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The FP8 forward of :func:`opengem.ops.jagged_attention` (``scale`` final, default ``1 / sqrt(D)``);
    returns ``[T, H, D]`` in q's dtype. Shapes as in :func:`opengem.ops.reference.attention.jagged_attention`."""
    head_dim = q.shape[2]
    # (q R)(k R)^T = n q k^T: the power of two 1 / n goes with the logit scale
    scale_log2 = (1.0 / math.sqrt(head_dim) if scale is None else scale) * LOG2E / rotation_size(head_dim)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    mask_options = dict(causal=causal, contextual_len=contextual_len, window=window)
    for rows, lengths, padded, (qd, kd, vd), mask in quantized_groups(q, k, v, offsets, num_targets, block,
                                                                       **mask_options):  # fmt: skip
        logits = (qd @ kd.transpose(-1, -2)) * scale_log2
        logits = logits.masked_fill(~mask[:, None], float("-inf"))
        out[rows] = _unpad(_online_softmax_pv(logits, vd, block), lengths, padded)
    return out.to(q.dtype)


def quantized_groups(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, num_targets: torch.Tensor | None,
    block: int, *, causal: bool, contextual_len: int, window: int | None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, int, tuple[torch.Tensor, ...], torch.Tensor]]:
    """Self-attention's samples in padded groups, as the FP8 emulations consume them: each group's rows, lengths,
    padded length (a multiple of ``block``), its straight-through operands ``[G, H, L, D]`` (rotated Q and K, and
    V, quantized per block and scaled back; K and V repeated to Q's heads) and its mask ``[G, L, L]``."""
    group = q.shape[1] // k.shape[1]
    for rows, lengths, size, targets in _length_groups(offsets, num_targets, q.shape[1], q.device):
        padded = _round_up(size, block)
        operands = (rotate(q[rows]), rotate(k[rows]), v[rows].float())
        qd, kd, vd = (_dequantized(_pad(x, lengths, padded), block) for x in operands)
        kd, vd = kd.repeat_interleave(group, dim=1), vd.repeat_interleave(group, dim=1)
        mask = batched_attention_mask(
            lengths, padded, causal=causal, num_targets=targets, contextual_len=contextual_len, window=window
        )
        yield rows, lengths, padded, (qd, kd, vd), mask


def _online_softmax_pv(logits: torch.Tensor, v: torch.Tensor, block: int) -> torch.Tensor:
    """``softmax(logits) v`` key block by key block, as the kernel runs it, with P quantized per block."""
    row_max = torch.full(logits.shape[:-1], -1.0e30, device=logits.device)  # the kernel's finite start
    row_sum = torch.zeros_like(row_max)
    acc = torch.zeros((*logits.shape[:-1], v.shape[-1]), device=logits.device)
    for start in range(0, logits.shape[-1], block):
        s = logits[..., start : start + block]
        new_max = torch.maximum(row_max, s.amax(-1))
        p = torch.exp2(s - new_max[..., None])
        alpha = torch.exp2(row_max - new_max)
        row_sum = row_sum * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + quantize_p(p) @ v[..., start : start + block, :] / P_SCALE
        row_max = new_max
    return acc / torch.where(row_sum > 0, row_sum, 1.0)[..., None]


def _dequantized(x: torch.Tensor, block: int) -> torch.Tensor:
    data, scale = quantize_padded_blocks(x, block)
    return data.float() * scale


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
