"""Jagged Flash Attention (JFA): softmax attention over jagged ``[T, H, D]`` sequences with recommendation masks.

Public entry point :func:`jagged_attention`; :func:`attention_pairs` counts the unmasked (query, key)
pairs (useful work, GEM_SPEC section 8) for the FLOP formula and the benchmarks.

Dispatch: CUDA tensors run the Triton kernels of :mod:`opengem.ops.triton.jagged_attention`; CPU tensors
run the fp32 reference (:mod:`opengem.ops.reference.attention`), unless ``backend="triton"`` (or the
environment variable ``OPENGEM_JFA_BACKEND=triton``) forces the kernels, e.g. under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import register_flop_formula

from opengem.jagged.host import host_copy
from opengem.ops.attention_flops import counted_or_bound
from opengem.ops.autocast import cast_inputs
from opengem.ops.backend import triton_chosen
from opengem.ops.checks import (
    SELF_ATTENTION,
    check_attention_inputs,
    check_bools,
    check_finite_numbers,
    check_mask_options,
    check_projection_bias,
    unit_stride,
)
from opengem.ops.reference.attention import jagged_attention as reference_jagged_attention
from opengem.ops.reference.attention import jagged_attention_backward as reference_jagged_attention_backward
from opengem.ops.reference.attention_fp8 import jagged_attention_fp8 as reference_jagged_attention_fp8
from opengem.ops.reference.attention_fp8 import jagged_attention_fp8_backward as reference_jagged_attention_fp8_backward
from opengem.ops.reference.attention_fp8_backward import jagged_attention_fp8_mma_backward
from opengem.ops.reference.attention_mxfp8 import jagged_attention_mxfp8 as reference_jagged_attention_mxfp8
from opengem.ops.reference.attention_mxfp8 import (
    jagged_attention_mxfp8_backward as reference_jagged_attention_mxfp8_backward,
)

KERNEL_HEAD_DIMS = (16, 32, 64, 128, 256)
PRECISIONS = ("bf16", "fp8", "mxfp8")
BACKWARD_PRECISIONS = ("bf16", "fp8")
# The registered ops' precision for precision="fp8" with backward_precision="fp8": the FP8 forward, then the
# backward with E4M3 S and dP products and dO quantized (opt-in: on an H200 it measured 0.82x the bf16 backward on
# JFA workload (a), against the straight-through one's 0.91x, session 19)
FP8_WITH_FP8_BACKWARD = "fp8+fp8_backward"
_NO_WINDOW = -1  # custom ops take plain ints: -1 stands for "no window"


def attention_pairs(
    offsets: torch.Tensor,
    *,
    causal: bool = True,
    num_targets: torch.Tensor | None = None,
    contextual_len: int = 0,
    window: int | None = None,
) -> int:
    """Number of (query, key) pairs the mask of :mod:`opengem.ops.reference.masks` leaves visible.

    Closed form per query row (no ``L x L`` mask): with ``H`` the history length and ``p = min(i, H)``,
    a contextual row sees the ``H`` history keys, any other row the history keys within its causal /
    window range around ``p``; a target row also sees itself.
    """
    bounds = host_copy(offsets).to(torch.int64)
    lengths = bounds[1:] - bounds[:-1]
    if lengths.numel() == 0 or int(lengths.sum()) == 0:
        return 0
    targets = torch.zeros_like(lengths) if num_targets is None else host_copy(num_targets).to(torch.int64)
    sample = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    i = torch.arange(int(lengths.sum())) - bounds[:-1][sample]
    hist = (lengths - targets)[sample]
    p = torch.minimum(i, hist)
    lo = torch.zeros_like(i) if window is None else (p - window).clamp_min(0)
    hi = hist - 1
    if causal:
        hi = torch.minimum(hi, p)
    elif window is not None:
        hi = torch.minimum(hi, p + window)
    in_range = torch.where(i < contextual_len, hist, (hi - lo + 1).clamp_min(0))
    return int((in_range + (i >= hist).to(torch.int64)).sum())


def _use_triton(q: torch.Tensor, backend: str | None) -> bool:
    """JFA's choice (``opengem.ops.backend``), also read by the fused QKV attention."""
    return triton_chosen(q.device, backend, "OPENGEM_JFA_BACKEND")


def _problem(q, offsets, num_targets, max_len, causal, contextual_len, window, scale):
    from opengem.ops.triton import jagged_attention as kernels

    opts = kernels.MaskOptions(causal, contextual_len, None if window == _NO_WINDOW else window)
    return kernels, kernels.problem(offsets, num_targets, opts, max_len, scale, q.device)


def _forward_precision(precision: str) -> str:
    """The forward's arithmetic of a registered op's ``precision``."""
    return "fp8" if precision == FP8_WITH_FP8_BACKWARD else precision


def _reference(q, k, v, offsets, num_targets, max_len, causal, contextual_len, window, scale, precision) -> torch.Tensor:
    window = None if window == _NO_WINDOW else window
    precision = _forward_precision(precision)
    if precision == "fp8":
        from opengem.ops.triton.jagged_attention_fp8 import BLOCK

        return reference_jagged_attention_fp8(
            q, k, v, offsets, block=BLOCK, causal=causal, num_targets=num_targets, contextual_len=contextual_len,
            window=window, scale=scale,
        )  # fmt: skip
    if precision == "mxfp8":
        return reference_jagged_attention_mxfp8(
            q, k, v, offsets, causal=causal, num_targets=num_targets, contextual_len=contextual_len, window=window,
            scale=scale,
        )  # fmt: skip
    return reference_jagged_attention(
        q, k, v, offsets, max_len, causal=causal, num_targets=num_targets, contextual_len=contextual_len,
        window=window, scale=scale,
    )  # fmt: skip


def _reference_backward(dout, q, k, v, offsets, num_targets, causal, contextual_len, window, scale, precision):
    mask = dict(causal=causal, num_targets=num_targets, contextual_len=contextual_len,
                window=None if window == _NO_WINDOW else window, scale=scale)  # fmt: skip
    if precision in ("fp8", FP8_WITH_FP8_BACKWARD):
        from opengem.ops.triton.jagged_attention_fp8 import BLOCK

        if precision == FP8_WITH_FP8_BACKWARD:
            return jagged_attention_fp8_mma_backward(dout, q, k, v, offsets, block=BLOCK, **mask)
        return reference_jagged_attention_fp8_backward(dout, q, k, v, offsets, block=BLOCK, **mask)
    if precision == "mxfp8":
        return reference_jagged_attention_mxfp8_backward(dout, q, k, v, offsets, **mask)
    return reference_jagged_attention_backward(dout, q, k, v, offsets, **mask)


def _kernels(precision: str, backward: bool = False):
    """The Triton module whose ``forward`` / ``backward`` run a registered op's precision: JFA's (bf16), the FP8
    one (its backward straight through on JFA's bf16 kernels), for ``FP8_WITH_FP8_BACKWARD`` the FP8 forward and
    the backward with E4M3 S and dP products, the MXFP8 one."""
    from opengem.ops.triton import jagged_attention, jagged_attention_fp8, jagged_attention_fp8_backward
    from opengem.ops.triton import jagged_attention_mxfp8

    if precision == FP8_WITH_FP8_BACKWARD and backward:
        return jagged_attention_fp8_backward
    modules = {"bf16": jagged_attention, "fp8": jagged_attention_fp8, "mxfp8": jagged_attention_mxfp8}
    return modules[_forward_precision(precision)]


def _triton_backward(dout, q, k, v, out, lse, pb, precision, grads=None):
    """The kernels' backward of a forward in ``precision`` (:func:`_kernels`)."""
    return _kernels(precision, backward=True).backward(dout, q, k, v, out, lse, pb, grads=grads)


@torch.library.custom_op("opengem::jagged_attention_fwd", mutates_args=())
def _jagged_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    num_targets: torch.Tensor | None,
    max_len: int,
    causal: bool,
    contextual_len: int,
    window: int,
    scale: float,
    use_triton: bool,
    precision: str = "bf16",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The registered forward: ``window = -1`` means none, ``scale`` is final (max_len division included),
    ``use_triton`` picks the kernels, ``precision`` the forward's arithmetic. Returns ``out [T, H, D]`` and
    ``lse [H, T]`` fp32 in base 2 (``[H, 0]`` on the reference path, whose backward recomputes)."""
    return _forward(q, k, v, offsets, num_targets, max_len, causal, contextual_len, window, scale, use_triton, precision)


def _forward(q, k, v, offsets, num_targets, max_len, causal, contextual_len, window, scale, use_triton, precision):
    if not use_triton:
        out = _reference(q, k, v, offsets, num_targets, max_len, causal, contextual_len, window, scale, precision)
        return out, q.new_empty((q.shape[1], 0), dtype=torch.float32)
    _, pb = _problem(q, offsets, num_targets, max_len, causal, contextual_len, window, scale)
    return _kernels(precision).forward(q, k, v, pb)


@_jagged_attention_fwd.register_fake
def _(q, k, v, offsets, num_targets, max_len, causal, contextual_len, window, scale, use_triton, precision="bf16"):
    lse_len = q.shape[0] if use_triton else 0
    return torch.empty_like(q), q.new_empty((q.shape[1], lse_len), dtype=torch.float32)


@torch.library.custom_op("opengem::jagged_attention_bwd", mutates_args=())
def _jagged_attention_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    offsets: torch.Tensor,
    num_targets: torch.Tensor | None,
    max_len: int,
    causal: bool,
    contextual_len: int,
    window: int,
    scale: float,
    use_triton: bool,
    precision: str = "bf16",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``dq, dk, dv``; the reference path differentiates the recomputed reference. ``precision``: the
    forward's (an FP8 forward's backward goes straight through its quantization)."""
    if use_triton:
        _, pb = _problem(q, offsets, num_targets, max_len, causal, contextual_len, window, scale)
        return _triton_backward(dout, q, k, v, out, lse, pb, precision)
    return _reference_backward(dout, q, k, v, offsets, num_targets, causal, contextual_len, window, scale, precision)


@_jagged_attention_bwd.register_fake
def _(dout, q, k, v, out, lse, offsets, num_targets, max_len, causal, contextual_len, window, scale, use_triton,
      precision="bf16"):  # fmt: skip
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, offsets, num_targets, max_len, causal, contextual_len, window, scale, use_triton, precision = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, offsets, num_targets)
    ctx.options = (max_len, causal, contextual_len, window, scale, use_triton, precision)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, offsets, num_targets = ctx.saved_tensors
    dq, dk, dv = _jagged_attention_bwd(dout, q, k, v, out, lse, offsets, num_targets, *ctx.options)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


_jagged_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def forward_flops(heads: int, head_dim: int, offsets, num_targets, causal, contextual_len, window, tokens: int,
                  max_len: int) -> int:
    """4 * H * D per unmasked pair (two GEMMs, GEM_SPEC section 8); the backward is 2.5x that. ``window`` as the
    registered ops take it (-1: none); on fake offsets the bound of ``tokens`` queries seeing ``max_len`` keys."""
    window = None if window == _NO_WINDOW else window
    pairs = counted_or_bound(offsets, tokens * max_len, lambda: attention_pairs(
        offsets, causal=causal, num_targets=num_targets, contextual_len=contextual_len, window=window))
    return 4 * heads * head_dim * pairs


@register_flop_formula(torch.ops.opengem.jagged_attention_fwd, get_raw=True)
def _fwd_flops(q, k, v, offsets, num_targets, max_len, causal, contextual_len, window, scale, use_triton, precision="bf16", out_val=None):  # fmt: skip
    return forward_flops(q.shape[1], q.shape[2], offsets, num_targets, causal, contextual_len, window, q.shape[0],
                         max_len)


@register_flop_formula(torch.ops.opengem.jagged_attention_bwd, get_raw=True)
def _bwd_flops(dout, q, k, v, out, lse, offsets, num_targets, max_len, causal, contextual_len, window, scale, use_triton, precision="bf16", out_val=None):  # fmt: skip
    """2.5x the forward (five GEMMs with recompute not counted, GEM_SPEC section 8)."""
    return 5 * forward_flops(q.shape[1], q.shape[2], offsets, num_targets, causal, contextual_len, window, q.shape[0],
                             max_len) // 2


# The packed ops: q, k, v = qkv.unbind(1) of one [T, 3, H, D] tensor (a fused QKV projection's output). The
# kernels read the three strided views and write the three gradients into one [T, 3, H, D] tensor, which the
# projection's backward takes as is: through unbind, autograd would stack three gradients (a copy of
# 3 x [T, H, D], 2.7 ms of a gem-small step on an H200, session 16).


@torch.library.custom_op("opengem::jagged_attention_packed_fwd", mutates_args=())
def _jagged_attention_packed_fwd(
    qkv: torch.Tensor,
    offsets: torch.Tensor,
    num_targets: torch.Tensor | None,
    max_len: int,
    causal: bool,
    contextual_len: int,
    window: int,
    scale: float,
    use_triton: bool,
    precision: str = "bf16",
    projection_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``opengem::jagged_attention_fwd`` on ``qkv.unbind(1)``; ``out`` is a new contiguous ``[T, H, D]``.

    ``projection_bias [3 H D]``: the bias the QKV projection already added into ``qkv`` (without a gradient there);
    unused here, its gradient (dqkv's column sums) comes from the backward kernels (``opengem.ops.qkv_attention``)."""
    q, k, v = qkv.unbind(1)
    out, lse = _forward(q, k, v, offsets, num_targets, max_len, causal, contextual_len, window, scale, use_triton,
                        precision)  # fmt: skip
    return out.contiguous(), lse


@_jagged_attention_packed_fwd.register_fake
def _(qkv, offsets, num_targets, max_len, causal, contextual_len, window, scale, use_triton, precision="bf16",
      projection_bias=None):  # fmt: skip
    q = qkv[:, 0]
    lse_len = q.shape[0] if use_triton else 0
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), q.new_empty((q.shape[1], lse_len), dtype=torch.float32)


@torch.library.custom_op("opengem::jagged_attention_packed_bwd", mutates_args=())
def _jagged_attention_packed_bwd(
    dout: torch.Tensor,
    qkv: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    offsets: torch.Tensor,
    num_targets: torch.Tensor | None,
    max_len: int,
    causal: bool,
    contextual_len: int,
    window: int,
    scale: float,
    use_triton: bool,
    precision: str = "bf16",
    column_sums: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dqkv [T, 3, H, D]`` (the kernels write dq, dk and dv into its three views) and, with ``column_sums``, its
    sum over tokens ``[3, H, D]`` fp32 (else ``[0]``): from the bf16 kernels' fp32 tiles, elsewhere from ``dqkv``."""
    q, k, v = qkv.unbind(1)
    if use_triton:
        dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
        _, pb = _problem(q, offsets, num_targets, max_len, causal, contextual_len, window, scale)
        if column_sums and precision == "bf16":
            from opengem.ops.triton.jagged_attention import backward_with_column_sums

            *_, sums = backward_with_column_sums(dout, q, k, v, out, lse, pb, grads=dqkv.unbind(1))
            return dqkv, sums
        _triton_backward(dout, q, k, v, out, lse, pb, precision, grads=dqkv.unbind(1))
    else:
        grads = _reference_backward(dout, q, k, v, offsets, num_targets, causal, contextual_len, window, scale,
                                    precision)  # fmt: skip
        dqkv = torch.stack(grads, 1)
    sums = dqkv.sum(0, dtype=torch.float32) if column_sums else dqkv.new_empty((0,), dtype=torch.float32)
    return dqkv, sums


@_jagged_attention_packed_bwd.register_fake
def _(dout, qkv, out, lse, offsets, num_targets, max_len, causal, contextual_len, window, scale, use_triton,
      precision="bf16", column_sums=False):  # fmt: skip
    sums_shape = qkv.shape[1:] if column_sums else (0,)
    return torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device), qkv.new_empty(sums_shape, dtype=torch.float32)


def _setup_packed_context(ctx, inputs, output):
    qkv, offsets, num_targets, max_len, causal, contextual_len, window, scale, use_triton, precision, bias = inputs
    out, lse = output
    ctx.save_for_backward(qkv, out, lse, offsets, num_targets)
    ctx.options = (max_len, causal, contextual_len, window, scale, use_triton, precision)
    ctx.bias = None if bias is None else (bias.shape, bias.dtype)


def _packed_backward(ctx, dout, dlse):
    qkv, out, lse, offsets, num_targets = ctx.saved_tensors
    column_sums = ctx.bias is not None and ctx.needs_input_grad[-1]  # projection_bias: the last input
    dqkv, sums = _jagged_attention_packed_bwd(dout, qkv, out, lse, offsets, num_targets, *ctx.options, column_sums)
    dbias = sums.reshape(ctx.bias[0]).to(ctx.bias[1]) if column_sums else None
    return dqkv, None, None, None, None, None, None, None, None, None, dbias


_jagged_attention_packed_fwd.register_autograd(_packed_backward, setup_context=_setup_packed_context)


@register_flop_formula(torch.ops.opengem.jagged_attention_packed_fwd, get_raw=True)
def _packed_fwd_flops(qkv, offsets, num_targets, max_len, causal, contextual_len, window, scale, use_triton, precision="bf16", projection_bias=None, out_val=None):  # fmt: skip
    return forward_flops(qkv.shape[2], qkv.shape[3], offsets, num_targets, causal, contextual_len, window,
                         qkv.shape[0], max_len)


@register_flop_formula(torch.ops.opengem.jagged_attention_packed_bwd, get_raw=True)
def _packed_bwd_flops(dout, qkv, out, lse, offsets, num_targets, max_len, causal, contextual_len, window, scale, use_triton, precision="bf16", column_sums=False, out_val=None):  # fmt: skip
    return 5 * forward_flops(qkv.shape[2], qkv.shape[3], offsets, num_targets, causal, contextual_len, window,
                             qkv.shape[0], max_len) // 2


def jagged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_len: int,
    *,
    causal: bool = True,
    num_targets: torch.Tensor | None = None,
    contextual_len: int = 0,
    window: int | None = None,
    scale: float | None = None,
    normalize_by_max_len: bool = False,
    backend: str | None = None,
    precision: str = "bf16",
    backward_precision: str = "bf16",
) -> torch.Tensor:
    """Softmax attention per sample and head over jagged sequences: ``softmax(scale q k^T + mask) v``.

    Args:
        q: ``[T, H, D]`` queries; fp16 / bf16 (fp32 accepted), ``T`` the total tokens of the batch.
        k, v: ``[T, H_kv, D]`` keys and values, same dtype; ``H_kv`` divides ``H`` (GQA / MQA).
        offsets: ``[B + 1]`` int32 or int64; sample ``b`` owns rows ``offsets[b]:offsets[b + 1]``
            (zero-length samples are legal and cost nothing).
        max_len: host int, at least the longest sample.
        causal: keys after the query's position are masked.
        num_targets: optional ``[B]`` int32 / int64: the last ``num_targets[b]`` tokens of sample ``b``
            are targets, which see the contextual + history tokens (within ``window``) and themselves,
            and are seen by no other token.
        contextual_len: the first ``contextual_len`` tokens of every sample see all non-target tokens.
        window: optional int ``w``: a query at position ``p`` sees keys ``p - w <= j <= p`` (causal) or
            ``|p - j| <= w``.
        scale: logit scale, default ``1 / sqrt(D)``.
        normalize_by_max_len: further divide the logits by ``max_len`` (FBGEMM ``sll``'s option).
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (``opengem.ops.backend``); default
            ``OPENGEM_JFA_BACKEND`` when set, else auto: Triton for CUDA tensors, the reference on CPU.
        precision: the forward's arithmetic. ``"bf16"``: the inputs' dtype with fp32 accumulation.
            ``"fp8"``: Q and K rotated along D by a randomized Hadamard matrix (``Q K^T`` unchanged, outlier
            channels spread out), then Q, K and V quantized to E4M3 with one fp32 scale per (block of 128 rows
            of a sample, head), E4M3 ``Q K^T`` and ``P V`` (P quantized as ``p * 256``) with fp32 accumulation,
            ~20x the bf16 error on N(0, 1) inputs (``docs/fp8_attention.md``), output
            in q's dtype; head_dim >= 32 on the Triton path; the reference path emulates it exactly
            (:mod:`opengem.ops.reference.attention_fp8`). The backward runs JFA's bf16 kernels straight
            through the quantization: on the operands the forward multiplied (quantized and scaled back), so
            its P is the forward's, with dQ and dK rotated back.
            ``"mxfp8"``: OCP MX-E4M3 with power-of-two scales per 32 elements: Q and K (Hadamard-rotated, as
            for ``"fp8"``) along D, V along each sample's tokens, P along the keys
            (:mod:`opengem.ops.reference.attention_mxfp8`, which the reference path runs and the kernels match).
            Hopper has no MX tensor cores, so the kernels multiply the MX values on the 16-bit ones: MXFP8's
            numerics with more work than the bf16 path (its kernel alone 0.82x bf16 on an H200; the op with
            its operand pass: ``docs/fp8_attention.md``). Backward straight through on JFA's bf16 kernels.
        backward_precision: ``"bf16"`` (default): the backward on JFA's bf16 kernels, straight through a low
            precision forward's quantization. ``"fp8"`` (with ``precision="fp8"`` only): S and dP products in
            E4M3 with dO quantized per block, emulated exactly by
            :mod:`opengem.ops.reference.attention_fp8_backward`; on an H200 it measured 0.82x the bf16 backward
            on workload (a), slower than the straight-through one's 0.91x (session 19), so it is opt-in.

    Returns:
        ``[T, H, D]`` in q's dtype. The exact mask is the one of :mod:`opengem.ops.reference.masks`.
        Differentiable in q, k and v (the Triton backward is deterministic, without atomics).
    """
    (q, k, v), autocast_off = cast_inputs(q, k, v)
    options = _op_options(q, k, v, offsets, max_len, causal, num_targets, contextual_len, window, scale,
                          normalize_by_max_len, backend, precision, backward_precision)  # fmt: skip
    with autocast_off:
        out, _ = _jagged_attention_fwd(q, k, v, *options)
    return out


def jagged_attention_packed(
    qkv: torch.Tensor,
    offsets: torch.Tensor,
    max_len: int,
    *,
    causal: bool = True,
    num_targets: torch.Tensor | None = None,
    contextual_len: int = 0,
    window: int | None = None,
    scale: float | None = None,
    normalize_by_max_len: bool = False,
    backend: str | None = None,
    precision: str = "bf16",
    backward_precision: str = "bf16",
    projection_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`jagged_attention` of ``q, k, v = qkv.unbind(1)``, for a fused QKV projection's output viewed
    ``[T, 3, H, D]`` (same arguments otherwise). The same output; the gradient comes back as one ``[T, 3, H, D]``
    tensor the kernels write directly, instead of three that ``unbind``'s backward stacks with a copy.

    ``projection_bias``: ``[3 H D]``, the bias the projection already added into ``qkv``, there without a gradient
    (``qkv = F.linear(x, W, b.detach())``, then ``projection_bias=b``; :func:`opengem.ops.qkv_attention` does both).
    Unused in the forward; the op returns b's gradient, dqkv's column sums, from the bf16 backward kernels' tiles
    (elsewhere from dqkv), which saves a pass over dqkv. Given while the projection keeps its own bias gradient, b's
    gradient counts twice."""
    if qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError(f"qkv must have shape [T, 3, H, D], got {list(qkv.shape)}")
    if projection_bias is not None:
        check_projection_bias(projection_bias, qkv, 3 * qkv.shape[2] * qkv.shape[3], "3 * heads * head_dim")
    (qkv,), autocast_off = cast_inputs(qkv)
    q, k, v = qkv.unbind(1)
    options = _op_options(q, k, v, offsets, max_len, causal, num_targets, contextual_len, window, scale,
                          normalize_by_max_len, backend, precision, backward_precision,
                          fn="jagged_attention_packed")  # fmt: skip
    with autocast_off:
        out, _ = _jagged_attention_packed_fwd(qkv, *options, projection_bias)
    return out


def _op_options(q, k, v, offsets, max_len, causal, num_targets, contextual_len, window, scale, normalize_by_max_len,
                backend, precision, backward_precision, fn: str = "jagged_attention") -> tuple:  # fmt: skip
    """The registered ops' arguments after the inputs, once the inputs are checked (see :func:`jagged_attention`);
    ``fn``: the public function called, which the errors name."""
    use_triton = _use_triton(q, backend)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if backward_precision not in BACKWARD_PRECISIONS:
        raise ValueError(f"backward_precision must be one of {BACKWARD_PRECISIONS}, got {backward_precision!r}")
    if backward_precision == "fp8" and precision != "fp8":
        raise ValueError(f"backward_precision='fp8' (E4M3 products) exists for precision='fp8' only, got "
                         f"precision={precision!r}")  # fmt: skip
    if not torch.compiler.is_compiling():  # validation reads host values (and Dynamo may trace scalars as symbols)
        check_bools(fn, causal=causal, normalize_by_max_len=normalize_by_max_len)
        if scale is not None:
            check_finite_numbers(fn, scale=scale)
        check_attention_inputs(q, k, v, offsets, offsets, max_len, max_len, SELF_ATTENTION)
        check_mask_options(offsets, num_targets, contextual_len, window)
        if num_targets is not None and num_targets.device != q.device:
            raise ValueError(f"num_targets must be on {q.device}, got {num_targets.device}")
        if use_triton and q.shape[2] not in KERNEL_HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {KERNEL_HEAD_DIMS} for the Triton kernel, got {q.shape[2]}")
        if use_triton and precision == "fp8" and q.shape[2] < 32:
            raise ValueError(f"head_dim must be at least 32 for precision='fp8' (E4M3 MMA), got {q.shape[2]}")
        if use_triton and q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"q, k, v must be float16, bfloat16 or float32 for the Triton kernel, got {q.dtype}")
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    if normalize_by_max_len:
        scale = scale / max(max_len, 1)
    window_arg = _NO_WINDOW if window is None else window
    op_precision = FP8_WITH_FP8_BACKWARD if backward_precision == "fp8" else precision
    return (unit_stride(offsets), unit_stride(num_targets), max_len, causal, contextual_len, window_arg, scale,
            use_triton, op_precision)
