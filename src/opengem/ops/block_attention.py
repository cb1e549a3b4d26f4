"""BlockAttention: block-diagonal attention over jagged sequences, with rotary embedding fused in.

Public entry points: :func:`block_attention`, :func:`block_attention_from_hidden` and the :class:`Rotary`
config. Registered as ``opengem::block_attention_fwd`` / ``opengem::block_attention_bwd`` custom ops
(fake + autograd + FLOP formula), so ``torch.compile`` traces through without graph breaks. CUDA tensors
run the Triton kernels; CPU tensors run the fp32 reference (``backend="triton"`` forces Triton, e.g.
under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

from opengem.jagged.host import host_copy
from opengem.ops.attention_flops import counted_or_bound
from opengem.ops.autocast import cast_inputs
from opengem.ops.backend import triton_chosen
from opengem.ops.block_attention_fp8 import block_attention_fp8
from opengem.ops.checks import (
    SELF_ATTENTION,
    check_attention_inputs,
    check_finite_numbers,
    check_positive_finite,
    check_projection_bias,
    is_plain_int,
)
from opengem.ops.reference import block_attention as reference
from opengem.ops.reference.rotary import inv_freq, positions_in_sequence, time_phase

BLOCK_SIZES = (16, 32, 64, 128)
TRITON_HEAD_DIMS = (32, 64, 128, 256)
PRECISIONS = ("bf16", "fp8", "mxfp8")
# Rotary modes passed to the custom op (and to the kernels as a constexpr).
ROTARY_NONE, ROTARY_SEQUENCE_POSITION, ROTARY_POSITIONS, ROTARY_TIME_GAPS = 0, 1, 2, 3


@dataclass(frozen=True)
class Rotary:
    """Rotary position embedding applied to q and k inside the attention kernel (rotate-half layout).

    Channel pair ``(i, i + D/2)`` of every q and k row is rotated by ``phase * base ** (-2 i / D)``:

    - neither tensor given: positional RoPE, phase = the token's position within its own sequence;
    - ``positions [T]`` (int or float): positional RoPE at these per-token positions;
    - ``time_gaps [T]`` (float, e.g. seconds since the previous event, or the event's age): time-aware
      RoPE, phase = ``log(1 + max(gap, 0) / time_scale)``.

    Positions and time gaps get no gradient.
    """

    positions: torch.Tensor | None = None
    time_gaps: torch.Tensor | None = None
    base: float = 10000.0
    time_scale: float = 1.0

    def mode(self) -> int:
        if self.time_gaps is not None:
            return ROTARY_TIME_GAPS
        return ROTARY_POSITIONS if self.positions is not None else ROTARY_SEQUENCE_POSITION

    def values(self) -> torch.Tensor | None:
        """The per-token tensor the kernel reads: fp32, contiguous (or None for in-sequence positions)."""
        given = self.time_gaps if self.time_gaps is not None else self.positions
        return None if given is None else given.float().contiguous()


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_len: int,
    *,
    block_size: int = 64,
    scale: float | None = None,
    activation: str = "softmax",
    rotary: Rotary | None = None,
    backend: str = "auto",
    precision: str = "bf16",
) -> torch.Tensor:
    """Block-diagonal attention: block c of each sequence's queries attends to block c of its keys.

    Args:
        q: ``[T, H, D]`` floating point (bf16/fp16/fp32; the GPU kernel multiplies fp32 in TF32), jagged
            over ``offsets``.
        k, v: ``[T, H_kv, D]``, same dtype; ``H_kv`` divides ``H`` (GQA/MQA). The last dim must be
            contiguous; other strides are free (views of a fused QKV projection are read in place).
        offsets: ``[B + 1]`` int32/int64 on q's device, ``offsets[0] = 0``, non-decreasing, ``offsets[B] = T``.
        max_len: host int >= the longest sequence.
        block_size: 16, 32, 64 or 128. Each sequence is cut into consecutive blocks of this many tokens
            from its first token; the last block of a sequence may be partial; attention inside a block is
            full (non-causal).
        scale: logit scale, default ``1 / sqrt(D)``.
        activation: ``"softmax"`` (normalized over the block's keys) or a pointwise GDPA activation
            (identity, relu, relu2, leaky_relu (slope 0.01), silu, fast_gelu, gelu, gelu_tanh,
            hardswish), giving ``O_i = sum_j phi(scale q_i . k_j) v_j`` over the block, unnormalized.
        rotary: optional :class:`Rotary`; q and k are rotated before the dot products; gradients are
            rotated back with the transposed rotation. On the GPU, for bf16/fp16 inputs, cos/sin are
            rounded to q's dtype and q/k are rotated in packed 16-bit math: ~1.2x the output error of an
            fp32 rotation (6.0e-4 against 5.1e-4 in fp16, interpreter); the gradients are rotated back in
            fp32 with cos/sin recomputed in fp32; fp32 inputs rotate in fp32. cos/sin come from the
            special-function unit (absolute error below ~3e-5), and in-sequence positions are rotated
            relative to each block, which leaves scores and gradients unchanged.
        backend: ``"auto"`` (CUDA -> Triton, CPU -> reference), ``"triton"`` or ``"reference"``.
        precision: ``"bf16"`` (the inputs' dtype) or ``"fp8"``: the blocks as sequences of their own through the
            FP8 JFA (softmax) or FP8 GDPA (pointwise), rotary applied before in fp32 torch ops
            (:mod:`opengem.ops.block_attention_fp8`; head dims 32-256 on the Triton path). It measured 0.19x
            the bf16 kernel forward and 0.26x backward (H200, session 19): the bf16 kernel runs at copy
            bandwidth, so reading the bf16 inputs to quantize them already costs as much. ``"mxfp8"``: the
            same composition through the MXFP8 JFA / GDPA (MXFP8's numerics, slower than bf16:
            ``docs/fp8_attention.md``).

    Returns:
        ``[T, H, D]`` in q's dtype. Head dims 32/64/128/256 on the Triton path (block 128 with D = 256 is
        refused there: its backward tile does not fit shared memory), any D (even with rotary) otherwise.

    Inputs are validated (``ValueError``) in eager mode; under ``torch.compile`` the checks, which read the
    offsets on the host, are skipped. The Triton path builds a per-block schedule from the offsets on the
    host once per offsets tensor (cached) and reuses it for every layer and the backward.
    """
    (q, k, v), autocast_off = cast_inputs(q, k, v)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if not torch.compiler.is_compiling():
        _check_scalars("block_attention", scale, rotary)
        _check_inputs(q, k, v, offsets, max_len, block_size, activation, rotary, backend)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    mode, values = (ROTARY_NONE, None) if rotary is None else (rotary.mode(), rotary.values())
    config = rotary or Rotary()
    if precision != "bf16":
        phase = _reference_phase(offsets, q.shape[0], mode, values, config.time_scale)
        with autocast_off:
            return block_attention_fp8(q, k, v, offsets, block_size=block_size, scale=scale, activation=activation,
                                       rotary_phase=phase, rotary_base=float(config.base), backend=backend,
                                       precision=precision)  # fmt: skip
    with autocast_off:
        return torch.ops.opengem.block_attention_fwd(
            q, k, v, offsets, block_size, scale, activation, mode, values, float(config.base),
            float(config.time_scale), backend,
        )


def block_attention_from_hidden(
    x: torch.Tensor,
    w_qkv: torch.Tensor,
    offsets: torch.Tensor,
    max_len: int,
    heads: int,
    *,
    bias: torch.Tensor | None = None,
    block_size: int = 64,
    scale: float | None = None,
    activation: str = "softmax",
    rotary: Rotary | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """QKV projection (one cuBLAS GEMM) then BlockAttention with rotary fused, reading q/k/v in place.

    ``x [T, d_model]``; ``w_qkv [3 * heads * D, d_model]`` in ``nn.Linear`` layout, output features ordered
    (q heads, k heads, v heads), each head's D channels contiguous; ``bias [3 * heads * D]`` optional.
    Returns ``[T, heads * D]`` in x's dtype, ready for the output projection. Other options as in
    :func:`block_attention`.
    """
    if not is_plain_int(heads) or heads < 1:  # 0 was a ZeroDivisionError, True ran with 1 head
        raise ValueError(f"block_attention_from_hidden: heads must be an int >= 1, got {heads!r}")
    if not torch.compiler.is_compiling():  # here too, so the errors name the function called
        _check_scalars("block_attention_from_hidden", scale, rotary)
    if x.dim() != 2:
        raise ValueError(f"x must have shape [T, d_model], got {tuple(x.shape)}")
    if w_qkv.dim() != 2 or w_qkv.shape[0] % (3 * heads) != 0 or w_qkv.shape[1] != x.shape[-1]:
        raise ValueError(
            f"w_qkv must have shape [3 * heads * head_dim, d_model] = [3 * {heads} * D, {x.shape[-1]}], "
            f"got {tuple(w_qkv.shape)}"
        )
    head_dim = w_qkv.shape[0] // (3 * heads)
    if bias is not None:
        check_projection_bias(bias, x, w_qkv.shape[0], "w_qkv's rows, 3 * heads * head_dim", name="bias")
    qkv = F.linear(x, w_qkv, bias).view(x.shape[0], 3, heads, head_dim)
    q, k, v = qkv.unbind(1)
    out = block_attention(
        q, k, v, offsets, max_len, block_size=block_size, scale=scale, activation=activation, rotary=rotary, backend=backend
    )
    return out.view(x.shape[0], heads * head_dim)


def _check_scalars(fn: str, scale: float | None, rotary: Rotary | None) -> None:
    """The Python-scalar options (no device sync): ``"2"`` had been converted by float(), NaN made the output NaN, and
    a str ``rotary.base`` failed in a comparison."""
    if scale is not None:
        check_finite_numbers(fn, scale=scale)
    if rotary is None:
        return
    if not isinstance(rotary, Rotary):
        raise ValueError(f"{fn}: rotary must be None or a Rotary, got {type(rotary).__name__}")
    check_positive_finite(fn, **{"rotary.base": rotary.base, "rotary.time_scale": rotary.time_scale})


def _check_inputs(q, k, v, offsets, max_len, block_size, activation, rotary, backend) -> None:
    check_attention_inputs(q, k, v, offsets, offsets, max_len, max_len, SELF_ATTENTION)
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {BLOCK_SIZES}, got {block_size!r}")
    if activation not in reference.ACTIVATIONS:
        raise ValueError(f"activation must be one of {reference.ACTIVATIONS}, got {activation!r}")
    if _use_triton(q, backend) and q.shape[-1] not in TRITON_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {TRITON_HEAD_DIMS} for the Triton kernel, got {q.shape[-1]}")
    if _use_triton(q, backend) and block_size * q.shape[-1] > 128 * 128:
        # The backward's tiles for 128 x 256 need ~320 KB of shared memory (an H100/H200 SM has 227 KB).
        raise ValueError(f"block_size * head_dim must be <= 16384 for the Triton kernel, got {block_size} * {q.shape[-1]}")
    if rotary is None:
        return
    if q.shape[-1] % 2:
        raise ValueError(f"rotary needs an even head_dim, got {q.shape[-1]}")
    if rotary.positions is not None and rotary.time_gaps is not None:
        raise ValueError("rotary takes positions or time_gaps, not both")
    for name, t in (("rotary.positions", rotary.positions), ("rotary.time_gaps", rotary.time_gaps)):
        if t is None:
            continue
        if t.shape != (q.shape[0],):
            raise ValueError(f"{name} must have shape [T] = [{q.shape[0]}], got {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on {q.device}, got {t.device}")
        if name.endswith("time_gaps") and not t.is_floating_point():
            raise ValueError(f"rotary.time_gaps must be floating point, got {t.dtype}")
        if t.dtype == torch.bool or t.is_complex():  # True had been taken as position 1
            raise ValueError(f"{name} must be an int or float tensor, got {t.dtype}")


def _use_triton(q: torch.Tensor, backend: str) -> bool:
    return triton_chosen(q.device, backend)


@functools.lru_cache(maxsize=32)
def _inv_freq(head_dim: int, base: float, device: torch.device) -> torch.Tensor:
    return inv_freq(head_dim, base, device)


def _reference_phase(offsets, total, rotary_mode, rotary_values, time_scale) -> torch.Tensor | None:
    if rotary_mode == ROTARY_SEQUENCE_POSITION:
        return positions_in_sequence(offsets, total).float()
    if rotary_mode == ROTARY_TIME_GAPS:
        return time_phase(rotary_values, time_scale)
    return rotary_values if rotary_mode == ROTARY_POSITIONS else None


def _triton_options(q, block_size, scale, activation, rotary_mode, rotary_values, rotary_base, time_scale) -> dict:
    # Positions (rotated relative to the block's first row) and time phases (<= 89) give angles below
    # 128 rad when every inv_freq <= 1, i.e. base >= 1; the kernel reduces a block's given positions that
    # span more on its own.
    reduce_angles = rotary_base < 1.0
    return dict(
        block_size=block_size, scale=scale, activation_name=activation, rotary_mode=rotary_mode,
        rotary_values=rotary_values, time_scale=time_scale, reduce_angles=reduce_angles,
        inv_freq=_inv_freq(q.shape[-1], rotary_base, q.device) if rotary_mode != ROTARY_NONE else None,
    )  # fmt: skip


@torch.library.custom_op("opengem::block_attention_fwd", mutates_args=())
def _block_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    block_size: int,
    scale: float,
    activation: str,
    rotary_mode: int,
    rotary_values: torch.Tensor | None,
    rotary_base: float,
    time_scale: float,
    backend: str,
) -> torch.Tensor:
    if _use_triton(q, backend):
        from opengem.ops.triton.block_attention import block_attention_fwd

        options = _triton_options(q, block_size, scale, activation, rotary_mode, rotary_values, rotary_base, time_scale)
        return block_attention_fwd(q, k, v, offsets, **options)
    phase = _reference_phase(offsets, q.shape[0], rotary_mode, rotary_values, time_scale)
    out = reference.block_attention(
        q, k, v, offsets, block_size=block_size, scale=scale, activation=activation,
        rotary_phase=phase, rotary_base=rotary_base,
    )  # fmt: skip
    return out.clone() if out is q else out


@_block_attention_fwd.register_fake
def _(q, k, v, offsets, block_size, scale, activation, rotary_mode, rotary_values, rotary_base, time_scale, backend):
    return q.new_empty(q.shape)


@torch.library.custom_op("opengem::block_attention_bwd", mutates_args=())
def _block_attention_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    block_size: int,
    scale: float,
    activation: str,
    rotary_mode: int,
    rotary_values: torch.Tensor | None,
    rotary_base: float,
    time_scale: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _use_triton(q, backend):
        from opengem.ops.triton.block_attention import block_attention_bwd

        options = _triton_options(q, block_size, scale, activation, rotary_mode, rotary_values, rotary_base, time_scale)
        return block_attention_bwd(grad_out, q, k, v, offsets, **options)
    phase = _reference_phase(offsets, q.shape[0], rotary_mode, rotary_values, time_scale)
    dq, dk, dv = reference.block_attention_backward(
        grad_out, q, k, v, offsets, block_size=block_size, scale=scale, activation=activation,
        rotary_phase=phase, rotary_base=rotary_base,
    )  # fmt: skip
    return dq, dk, dv


@_block_attention_bwd.register_fake
def _(grad_out, q, k, v, offsets, block_size, scale, activation, rotary_mode, rotary_values, rotary_base, time_scale, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, offsets, *options = inputs
    ctx.save_for_backward(q, k, v, offsets, options[4])
    ctx.options = options


def _backward(ctx, grad_out):
    q, k, v, offsets, rotary_values = ctx.saved_tensors
    block_size, scale, activation, rotary_mode, _, rotary_base, time_scale, backend = ctx.options
    dq, dk, dv = torch.ops.opengem.block_attention_bwd(
        grad_out.contiguous(), q, k, v, offsets, block_size, scale, activation,
        rotary_mode, rotary_values, rotary_base, time_scale, backend,
    )  # fmt: skip
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


_block_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def block_pairs(offsets: torch.Tensor, block_size: int) -> int:
    """Number of (query, key) pairs inside blocks: sum over blocks of ``length^2``."""
    host = host_copy(offsets).long()
    lengths = host[1:] - host[:-1]
    full, rest = lengths // block_size, lengths % block_size
    return int((full * block_size**2 + rest**2).sum())


@register_flop_formula(torch.ops.opengem.block_attention_fwd, get_raw=True)
def _forward_flops(q, k, v, offsets, block_size, *args, out_val=None, **kwargs) -> int:
    """GEM_SPEC section 8: ``4 H D`` per unmasked pair (QK^T and PV)."""
    return 4 * q.shape[1] * q.shape[2] * _pairs(q, offsets, block_size)


@register_flop_formula(torch.ops.opengem.block_attention_bwd, get_raw=True)
def _backward_flops(grad_out, q, k, v, offsets, block_size, *args, out_val=None, **kwargs) -> int:
    """2.5x the forward (GEM_SPEC section 8; the recompute of S is not counted)."""
    return 10 * q.shape[1] * q.shape[2] * _pairs(q, offsets, block_size)


def _pairs(q: torch.Tensor, offsets: torch.Tensor, block_size: int) -> int:
    """On fake offsets, the bound of every query seeing a whole block."""
    return counted_or_bound(offsets, q.shape[0] * block_size, lambda: block_pairs(offsets, block_size))
