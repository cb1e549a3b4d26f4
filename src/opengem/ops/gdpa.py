"""GDPA: generalized (pointwise-activation) attention over jagged batches, and HSTU attention on top of it.

``gdpa`` serves the three GEM attention patterns (GEM_SPEC section 4): self-attention with the
recommendation mask, cross-attention with short dense K/V per sample, and broadcast-query pooling.
Dispatch: CUDA tensors -> Triton (:mod:`opengem.ops.triton.gdpa`), CPU tensors -> the fp32 reference
(:mod:`opengem.ops.reference.gdpa`) with autograd; ``backend="triton"`` forces Triton (on CPU under
``TRITON_INTERPRET=1``), ``backend="reference"`` the reference.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.utils.flop_counter import register_flop_formula

from opengem.jagged.host import host_copy, to_device
from opengem.ops.activations import ACTIVATIONS, activation_id
from opengem.ops.attention_flops import attention_flops, counted_or_bound, visible_pairs
from opengem.ops.autocast import cast_inputs
from opengem.ops.backend import triton_chosen
from opengem.ops.checks import (
    SELF_ATTENTION,
    ArgNames,
    check_attention_inputs,
    check_bools,
    check_finite_numbers,
    check_mask_options,
    check_mask_scalars,
    check_projection_bias,
    unit_stride,
)
from opengem.ops.reference.gdpa import gdpa as gdpa_reference
from opengem.ops.reference.gdpa import gdpa_backward as gdpa_reference_backward
from opengem.ops.reference.gdpa_fp8 import gdpa_fp8 as gdpa_fp8_reference
from opengem.ops.reference.gdpa_fp8 import gdpa_fp8_backward as gdpa_fp8_reference_backward
from opengem.ops.reference.gdpa_mxfp8 import gdpa_mxfp8 as gdpa_mxfp8_reference
from opengem.ops.reference.gdpa_mxfp8 import gdpa_mxfp8_backward as gdpa_mxfp8_reference_backward
from opengem.ops.triton import gdpa_fp8, gdpa_mxfp8
from opengem.ops.triton.gdpa import (
    GdpaArgs,
    check_triton_head_dim,
    gdpa_backward,
    gdpa_backward_with_column_sums,
    gdpa_forward,
)
from opengem.ops.triton.jagged_attention_fp8 import BLOCK as FP8_BLOCK
from opengem.ops.triton.jagged_attention_fp8 import FP8_HEAD_DIMS
from opengem.validation import is_positive_finite

PRECISIONS = ("bf16", "fp8", "mxfp8")


def gdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor | None,
    k_offsets: torch.Tensor,
    max_len_q: int,
    max_len_k: int,
    *,
    activation: str = "silu",
    head_activations: Sequence[str] | None = None,
    pre_scale: float = 1.0,
    post_scale: float = 1.0,
    norm: str | float | None = None,
    causal: bool = False,
    num_targets: torch.Tensor | None = None,
    contextual_len: int = 0,
    window: int | None = None,
    broadcast_q: bool = False,
    backend: str = "auto",
    precision: str = "bf16",
    projection_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``O_i = post_scale / norm * sum_j phi_h(pre_scale * q_i . k_j) * v_j`` over the sample's visible keys.

    Shapes (one floating dtype for q, k, v; fp32 accumulation; the output has q's dtype):

    * ``q``: ``[Tq, H, D]`` jagged by ``q_offsets [B + 1]`` (int32/int64); with ``broadcast_q=True``
      ``q`` is ``[Lq, H, D]``, shared by every sample (seed pooling), ``q_offsets`` must be ``None`` and
      ``max_len_q == Lq``; the output is then ``[B * Lq, H, D]``, sample-major (rows ``b*Lq:(b+1)*Lq``
      belong to sample b), and dq is summed over the batch deterministically (bitwise reproducible).
    * ``k``, ``v``: ``[Tk, H_kv, D]`` jagged by ``k_offsets [B + 1]``; ``H_kv`` divides ``H`` (GQA/MQA:
      q head h reads K/V head ``h // (H / H_kv)``).
    * ``max_len_q``, ``max_len_k``: host ints >= the longest sequence (grid sizes; no device sync).

    Options:

    * ``activation``: one of ``identity, gelu, gelu_tanh, fast_gelu, relu, relu2, leaky_relu, silu,
      hardswish`` (definitions, incl. the fast_gelu polynomial and the leaky slope 0.01, in
      :mod:`opengem.ops.activations`); ``head_activations`` (length H) overrides it per head.
    * ``pre_scale`` multiplies ``q . k`` before the activation; ``post_scale`` the output;
      ``norm``: ``None`` (1), ``"max_len"`` (divide by ``max(max_len_k, 1)``, HSTU's N) or a positive number.
    * Mask (self-attention only: ``q_offsets`` equal to ``k_offsets``): ``causal``, ``num_targets [B]``
      (int), ``contextual_len``, ``window``, with the semantics of :mod:`opengem.ops.reference.masks`
      (every token sees itself). Without them every key of the sample is visible; that is also the only
      mode for cross-attention (different offsets) and ``broadcast_q``. Masked pairs contribute exactly 0:
      the mask applies after the activation (``phi(0)`` need not be 0).
    * ``precision``: ``"bf16"`` (the inputs' dtype), or ``"fp8"`` (self- and cross-attention, not
      ``broadcast_q``: E4M3 ``Q K^T`` and ``P V`` with block scales, Q and K Hadamard-rotated, P quantized per
      row and key block; the backward straight through the quantization; numerics in
      :mod:`opengem.ops.reference.gdpa_fp8`). Slower than bf16 on an H200 (session 19, D = 128): the op
      0.64-0.87x on self-attention and 0.34-0.51x on cross-attention with K/V of 128-256, its kernel alone
      1.03-1.11x and 0.62-0.89x: the activation costs the same in both, and the quantize pass is added.
      ``"mxfp8"`` (every mode, ``broadcast_q`` included): OCP MX-E4M3 numerics, blocks of 32 with power-of-two
      scales, Q and K rotated and blocked along D, V along K/V's samples, P along the keys
      (:mod:`opengem.ops.reference.gdpa_mxfp8`); the kernels multiply the MX values on the 16-bit tensor cores
      (Hopper has no MX ones): MXFP8's numerics with more work than bf16 (``docs/fp8_attention.md`` has the
      times); backward straight through.
    * ``projection_bias``: ``[H * D]``, the bias q's projection already added into ``q``, there without a gradient
      (``q = F.linear(x, W, b.detach())``, then ``projection_bias=b``). Unused in the forward; the op returns b's
      gradient, dq's column sums, from the Triton backward's dQ programs (bf16; elsewhere from dq), which saves a pass
      over dq. Not with ``broadcast_q``. Given while the projection keeps its own bias gradient, b's gradient counts
      twice.
    """
    return _gdpa(q, k, v, q_offsets, k_offsets, max_len_q, max_len_k, activation, head_activations, pre_scale,
                 post_scale, norm, causal, num_targets, contextual_len, window, broadcast_q, backend, precision,
                 projection_bias, "gdpa", ArgNames())  # fmt: skip


def _gdpa(q, k, v, q_offsets, k_offsets, max_len_q, max_len_k, activation, head_activations, pre_scale, post_scale,
          norm, causal, num_targets, contextual_len, window, broadcast_q, backend, precision, projection_bias,
          fn: str, names: ArgNames) -> torch.Tensor:  # fmt: skip
    """:func:`gdpa` for the public function ``fn``, whose names of the offsets and max lengths are ``names``."""
    (q, k, v), autocast_off = cast_inputs(q, k, v)
    options = _op_options(q, k, v, q_offsets, k_offsets, max_len_q, max_len_k, activation, head_activations, pre_scale,
                          post_scale, norm, causal, num_targets, contextual_len, window, broadcast_q, backend,
                          precision, fn, names)  # fmt: skip
    if projection_bias is not None:
        if broadcast_q:
            raise ValueError("projection_bias is a jagged q's projection bias: broadcast_q's q has none here")
        check_projection_bias(projection_bias, q, q.shape[1] * q.shape[2], "q's heads * head_dim")
    with autocast_off:
        return torch.ops.opengem.gdpa_fwd(q, k, v, *options, projection_bias)


def gdpa_packed_kv(
    q: torch.Tensor,
    kv: torch.Tensor,
    q_offsets: torch.Tensor | None,
    k_offsets: torch.Tensor,
    max_len_q: int,
    max_len_k: int,
    *,
    activation: str = "silu",
    head_activations: Sequence[str] | None = None,
    pre_scale: float = 1.0,
    post_scale: float = 1.0,
    norm: str | float | None = None,
    causal: bool = False,
    num_targets: torch.Tensor | None = None,
    contextual_len: int = 0,
    window: int | None = None,
    broadcast_q: bool = False,
    backend: str = "auto",
    precision: str = "bf16",
    projection_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`gdpa` with ``k, v = kv.unbind(1)`` of one ``[Tk, 2, H_kv, D]`` tensor (a fused K/V projection's
    output viewed per head; the other arguments as :func:`gdpa`'s). The same output; the kernels write dK and dV
    into one packed ``[Tk, 2, H_kv, D]`` gradient, which the projection's backward takes as is (through
    ``unbind``, autograd would stack two gradients with a copy of 2 x ``[Tk, H_kv, D]``). ``projection_bias``
    ``[2 * H_kv * D]``: the K/V projection's bias, as :func:`gdpa`'s for q (its gradient, dkv's column sums, from the
    dK/dV programs)."""
    if kv.dim() != 4 or kv.shape[1] != 2:
        raise ValueError(f"kv must have shape [Tk, 2, H_kv, D], got {list(kv.shape)}")
    (q, kv), autocast_off = cast_inputs(q, kv)
    k, v = kv.unbind(1)
    options = _op_options(q, k, v, q_offsets, k_offsets, max_len_q, max_len_k, activation, head_activations, pre_scale,
                          post_scale, norm, causal, num_targets, contextual_len, window, broadcast_q, backend,
                          precision, "gdpa_packed_kv", ArgNames())  # fmt: skip
    if projection_bias is not None:
        check_projection_bias(projection_bias, kv, 2 * kv.shape[2] * kv.shape[3], "2 * kv heads * head_dim")
    with autocast_off:
        return torch.ops.opengem.gdpa_kv_fwd(q, kv, *options, projection_bias)


def _op_options(q, k, v, q_offsets, k_offsets, max_len_q, max_len_k, activation, head_activations, pre_scale,
                post_scale, norm, causal, num_targets, contextual_len, window, broadcast_q, backend, precision,
                fn: str, names: ArgNames) -> tuple:  # fmt: skip
    """The registered ops' arguments after the inputs, once the inputs are checked (see :func:`gdpa`); the errors
    name ``fn``, the public function called, and its ``names`` of the offsets and max lengths."""
    triton = triton_chosen(q.device, backend)  # checks the name first
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp8" and broadcast_q:
        raise ValueError("precision='fp8' runs self- and cross-attention, not broadcast_q")
    if not torch.compiler.is_compiling():  # Dynamo may trace the scales as symbolic floats
        check_bools(fn, causal=causal, broadcast_q=broadcast_q)
        check_finite_numbers(fn, pre_scale=pre_scale, post_scale=post_scale)
    heads = q.shape[1] if q.dim() == 3 else 0
    activations = _head_activations(activation, head_activations, heads)
    out_scale = float(post_scale) / _norm_value(norm, max_len_k, fn)
    check_mask_scalars(contextual_len, window)  # a negative contextual_len would not set `masked` below
    masked = causal or num_targets is not None or contextual_len > 0 or window is not None
    if broadcast_q:
        if q_offsets is not None:
            raise ValueError("q_offsets must be None with broadcast_q=True (q is shared by every sample)")
        if q.dim() == 3 and max_len_q != q.shape[0]:
            raise ValueError(f"max_len_q must equal q.shape[0] = {q.shape[0]} with broadcast_q, got {max_len_q}")
        if masked:
            raise ValueError("causal/num_targets/contextual_len/window apply to self-attention, not broadcast_q")
    elif q_offsets is None:
        raise ValueError("q_offsets is required unless broadcast_q=True")
    if not torch.compiler.is_compiling():
        _check_contents(q, k, v, q_offsets, k_offsets, max_len_q, max_len_k, broadcast_q, masked,
                        num_targets, contextual_len, window, names)
    if triton:
        check_triton_head_dim(q.shape[2])
        if precision == "fp8" and q.shape[2] not in FP8_HEAD_DIMS:
            raise ValueError(f"precision='fp8' needs head_dim in {FP8_HEAD_DIMS}, got {q.shape[2]}")
    self_offsets = q_offsets is None or q_offsets is k_offsets  # one tensor stays one (broadcast_q: k's)
    k_offsets = unit_stride(k_offsets)
    q_offsets = k_offsets if self_offsets else unit_stride(q_offsets)
    return (q_offsets, k_offsets, unit_stride(num_targets), max_len_q, max_len_k,
            [activation_id(n) for n in activations], float(pre_scale), out_scale, causal, contextual_len,
            -1 if window is None else window, broadcast_q, triton, precision)  # fmt: skip


def hstu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    max_len: int,
    *,
    alpha: float,
    causal: bool = True,
    num_targets: torch.Tensor | None = None,
    contextual_len: int = 0,
    window: int | None = None,
    norm: str | float = "max_len",
    backend: str = "auto",
) -> torch.Tensor:
    """HSTU attention ``SiLU(alpha * q . k) / N @ v`` with the recommendation mask: GDPA with SiLU.

    q, k, v ``[T, H, D]`` (k/v may have fewer heads: GQA) jagged by ``offsets [B + 1]``. Mapping from
    generative-recommenders' ``hstu_mha(max_seq_len, alpha, q, k, v, seq_offsets, causal, dropout_pr,
    training, num_targets, attn_scale, max_attn_len, contextual_seq_len, min_full_attn_seq_len,
    sort_by_length, kernel, enable_tma)``:

    * ``max_seq_len`` -> ``max_len`` (N = ``max_len`` through ``norm="max_len"``: hstu divides
      ``SiLU(alpha q.k)`` by ``max_seq_len``); ``alpha`` -> ``alpha``; ``seq_offsets`` -> ``offsets``;
      ``causal`` -> ``causal``; ``num_targets`` -> ``num_targets``; ``contextual_seq_len`` ->
      ``contextual_len``; ``max_attn_len`` -> ``window`` (hstu's 0, "no window", is our ``None``);
      ``kernel`` -> ``backend``; ``sort_by_length`` has no counterpart (the host scheduler always orders
      tiles longest first);
    * not supported: ``dropout_pr > 0``, ``attn_scale``, ``min_full_attn_seq_len``, and a V head dim
      different from Q/K's.

    Like hstu, every token attends to itself (the mask's diagonal).
    """
    if not torch.compiler.is_compiling():  # checked here so the error names alpha, not gdpa's pre_scale
        check_finite_numbers("hstu_attention", alpha=alpha)
    return _gdpa(q, k, v, offsets, offsets, max_len, max_len, "silu", None, alpha, 1.0, norm, causal, num_targets,
                 contextual_len, window, False, backend, "bf16", None, "hstu_attention", SELF_ATTENTION)


def _head_activations(activation: str, head_activations: Sequence[str] | None, heads: int) -> list[str]:
    """One name per head, or a single name for every head: that list does not depend on the head count,
    which a compiled region may see as a symbolic int (FSDP2-wrapped modules on torch 2.11)."""
    if head_activations is None:
        activation_id(activation)
        return [activation]
    names = list(head_activations)
    if len(names) != heads:
        raise ValueError(f"head_activations must give one activation per head ({heads}), got {len(names)}")
    for name in names:
        if name not in ACTIVATIONS:
            raise ValueError(f"head_activations: unknown activation {name!r}; expected one of {', '.join(ACTIVATIONS)}")
    return names


def _norm_value(norm: str | float | None, max_len_k: int, fn: str) -> float:
    if norm is None:
        return 1.0
    if norm == "max_len":
        return float(max(max_len_k, 1))
    if is_positive_finite(norm):  # inf had zeroed the whole output
        return float(norm)
    raise ValueError(f"{fn}: norm must be None, 'max_len' or a positive finite number, got {norm!r}")


def _check_contents(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor | None,
    k_offsets: torch.Tensor,
    max_len_q: int,
    max_len_k: int,
    broadcast_q: bool,
    masked: bool,
    num_targets: torch.Tensor | None,
    contextual_len: int,
    window: int | None,
    names: ArgNames,
) -> None:
    """Checks that read the offsets (host sync); skipped while torch.compile traces. The errors use the caller's
    ``names`` of the offsets and max lengths."""
    if broadcast_q:
        if q.dim() != 3:
            raise ValueError(f"q must have shape [Lq, heads, head_dim] with broadcast_q, got {tuple(q.shape)}")
        # validate q against a stand-in batch whose first sample holds the shared rows
        batch = k_offsets.numel() - 1
        stand_in = to_device(torch.tensor([0] + [q.shape[0]] * batch, dtype=k_offsets.dtype), k_offsets.device)
        check_attention_inputs(q, k, v, stand_in, k_offsets, q.shape[0], max_len_k, names)
        return
    check_attention_inputs(q, k, v, q_offsets, k_offsets, max_len_q, max_len_k, names)
    if masked:
        if q_offsets is not k_offsets and not torch.equal(host_copy(q_offsets), host_copy(k_offsets)):
            raise ValueError(
                "causal/num_targets/contextual_len/window apply to self-attention: q_offsets must equal k_offsets"
            )
        check_mask_options(k_offsets, num_targets, contextual_len, window)


def _args(head_acts: list[int], pre_scale: float, out_scale: float, causal: bool, contextual_len: int,
          window: int, broadcast_q: bool, max_len_q: int, max_len_k: int) -> GdpaArgs:
    return GdpaArgs(tuple(head_acts), pre_scale, out_scale, causal, contextual_len, None if window < 0 else window,
                    broadcast_q, max_len_q, max_len_k)


def _reference(q, k, v, q_offsets, k_offsets, num_targets, head_acts, pre_scale, out_scale, causal,
               contextual_len, window, broadcast_q) -> torch.Tensor:
    return gdpa_reference(
        q, k, v, q_offsets, k_offsets, head_activations=[ACTIVATIONS[i] for i in head_acts], pre_scale=pre_scale,
        out_scale=out_scale, causal=causal, num_targets=num_targets, contextual_len=contextual_len,
        window=None if window < 0 else window, broadcast_q=broadcast_q,
    )


@torch.library.custom_op("opengem::gdpa_fwd", mutates_args=())
def gdpa_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor, k_offsets: torch.Tensor,
    num_targets: torch.Tensor | None, max_len_q: int, max_len_k: int, head_acts: list[int], pre_scale: float,
    out_scale: float, causal: bool, contextual_len: int, window: int, broadcast_q: bool, use_triton: bool,
    precision: str = "bf16", projection_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """GDPA forward (``window = -1``: none; ``head_acts``: one id per head, or one for all; ``projection_bias``
    unused here, for its gradient). See :func:`gdpa`."""
    return _forward(q, k, v, q_offsets, k_offsets, num_targets, max_len_q, max_len_k, head_acts, pre_scale,
                    out_scale, causal, contextual_len, window, broadcast_q, use_triton, precision)  # fmt: skip


def _forward(q, k, v, q_offsets, k_offsets, num_targets, max_len_q, max_len_k, head_acts, pre_scale, out_scale,
             causal, contextual_len, window, broadcast_q, use_triton, precision) -> torch.Tensor:  # fmt: skip
    head_acts = _per_head(head_acts, q.shape[1])
    args = _args(head_acts, pre_scale, out_scale, causal, contextual_len, window, broadcast_q, max_len_q, max_len_k)
    if precision == "fp8":
        if use_triton:
            return gdpa_fp8.forward(q, k, v, q_offsets, k_offsets, num_targets, args)
        return gdpa_fp8_reference(q, k, v, q_offsets, k_offsets, **_fp8_reference_options(args, num_targets))
    if precision == "mxfp8":
        if use_triton:
            return gdpa_mxfp8.forward(q, k, v, q_offsets, k_offsets, num_targets, args)
        return gdpa_mxfp8_reference(q, k, v, q_offsets, k_offsets, **_mxfp8_reference_options(args, num_targets))
    if use_triton:
        return gdpa_forward(q, k, v, q_offsets, k_offsets, num_targets, args)
    return _reference(q, k, v, q_offsets, k_offsets, num_targets, head_acts, pre_scale, out_scale, causal,
                      contextual_len, window, broadcast_q)


@gdpa_fwd.register_fake
def _(q, k, v, q_offsets, k_offsets, num_targets, max_len_q, max_len_k, head_acts, pre_scale, out_scale, causal,
      contextual_len, window, broadcast_q, use_triton, precision="bf16", projection_bias=None):  # fmt: skip
    rows = (k_offsets.shape[0] - 1) * q.shape[0] if broadcast_q else q.shape[0]
    return q.new_empty((rows, q.shape[1], q.shape[2]))


@torch.library.custom_op("opengem::gdpa_bwd", mutates_args=())
def gdpa_bwd(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
    k_offsets: torch.Tensor, num_targets: torch.Tensor | None, max_len_q: int, max_len_k: int, head_acts: list[int],
    pre_scale: float, out_scale: float, causal: bool, contextual_len: int, window: int, broadcast_q: bool,
    use_triton: bool, precision: str = "bf16", column_sums: str = "",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GDPA backward: ``(dq, dk, dv, sums)`` (Triton passes, or the reference's closed form); ``sums``: with
    ``column_sums="q"`` dq's column sums ``[H D]``, with ``"kv"`` dk's then dv's ``[2 H_kv D]`` (fp32), else ``[0]``."""
    return _backward_with_sums(grad_out, q, k, v, q_offsets, k_offsets, num_targets, max_len_q, max_len_k, head_acts,
                               pre_scale, out_scale, causal, contextual_len, window, broadcast_q, use_triton, precision,
                               column_sums)  # fmt: skip


def _backward_with_sums(grad_out, q, k, v, q_offsets, k_offsets, num_targets, max_len_q, max_len_k, head_acts,
                        pre_scale, out_scale, causal, contextual_len, window, broadcast_q, use_triton, precision,
                        column_sums, grads=None):  # fmt: skip
    """:func:`_backward_impl` and the column sums ``gdpa_bwd`` describes: from the bf16 Triton passes' programs, else
    from the gradients."""
    options = (q_offsets, k_offsets, num_targets, max_len_q, max_len_k, head_acts, pre_scale, out_scale, causal,
               contextual_len, window, broadcast_q, use_triton, precision)  # fmt: skip
    if column_sums and use_triton and precision == "bf16":
        args = _args(_per_head(head_acts, q.shape[1]), pre_scale, out_scale, causal, contextual_len, window,
                     broadcast_q, max_len_q, max_len_k)  # fmt: skip
        dq, dk, dv, sums = gdpa_backward_with_column_sums(grad_out, q, k, v, q_offsets, k_offsets, num_targets, args,
                                                          column_sums, grads=grads)  # fmt: skip
        return dq, dk, dv, sums.flatten()
    dq, dk, dv = _backward_impl(grad_out, q, k, v, *options, grads=grads)
    if column_sums == "q":
        return dq, dk, dv, dq.sum(0, dtype=torch.float32).flatten()
    if column_sums == "kv":
        return dq, dk, dv, torch.stack([dk.sum(0, dtype=torch.float32), dv.sum(0, dtype=torch.float32)]).flatten()
    return dq, dk, dv, q.new_empty((0,), dtype=torch.float32)


def _backward_impl(grad_out, q, k, v, q_offsets, k_offsets, num_targets, max_len_q, max_len_k, head_acts, pre_scale,
                   out_scale, causal, contextual_len, window, broadcast_q, use_triton, precision,
                   grads=None):  # fmt: skip
    """``(dq, dk, dv)``, on the Triton path written into ``grads`` when given (preallocated views)."""
    head_acts = _per_head(head_acts, q.shape[1])
    args = _args(head_acts, pre_scale, out_scale, causal, contextual_len, window, broadcast_q, max_len_q, max_len_k)
    if precision == "fp8":
        if use_triton:
            return gdpa_fp8.backward(grad_out, q, k, v, q_offsets, k_offsets, num_targets, args, grads=grads)
        return gdpa_fp8_reference_backward(grad_out, q, k, v, q_offsets, k_offsets,
                                           **_fp8_reference_options(args, num_targets))  # fmt: skip
    if precision == "mxfp8":
        if use_triton:
            return gdpa_mxfp8.backward(grad_out, q, k, v, q_offsets, k_offsets, num_targets, args, grads=grads)
        return gdpa_mxfp8_reference_backward(grad_out, q, k, v, q_offsets, k_offsets,
                                             **_mxfp8_reference_options(args, num_targets))  # fmt: skip
    if use_triton:
        return gdpa_backward(grad_out, q, k, v, q_offsets, k_offsets, num_targets, args, grads=grads)
    return gdpa_reference_backward(
        grad_out, q, k, v, q_offsets, k_offsets, head_activations=[ACTIVATIONS[i] for i in head_acts],
        pre_scale=pre_scale, out_scale=out_scale, causal=causal, num_targets=num_targets,
        contextual_len=contextual_len, window=None if window < 0 else window, broadcast_q=broadcast_q,
    )


def _emulation_options(args: GdpaArgs, num_targets: torch.Tensor | None) -> dict:
    """The keyword arguments both low-precision emulations take for the options in ``args``."""
    return dict(head_activations=[ACTIVATIONS[i] for i in args.head_activations], pre_scale=args.pre_scale,
                out_scale=args.out_scale, causal=args.causal, num_targets=num_targets,
                contextual_len=args.contextual_len, window=args.window)


def _fp8_reference_options(args: GdpaArgs, num_targets: torch.Tensor | None) -> dict:
    """The FP8 emulation's keyword arguments: its blocks are the kernel's (it has no ``broadcast_q``)."""
    return {**_emulation_options(args, num_targets), "block": FP8_BLOCK}


def _mxfp8_reference_options(args: GdpaArgs, num_targets: torch.Tensor | None) -> dict:
    """The MXFP8 emulation's keyword arguments (MX blocks are 32 everywhere: none to name)."""
    return {**_emulation_options(args, num_targets), "broadcast_q": args.broadcast_q}


def _per_head(head_acts: list[int], heads: int) -> list[int]:
    return head_acts * heads if len(head_acts) == 1 else head_acts


def _sums_size(column_sums: str, q: torch.Tensor, k: torch.Tensor) -> int:
    return {"q": q.shape[1] * q.shape[2], "kv": 2 * k.shape[1] * k.shape[2]}.get(column_sums, 0)


@gdpa_bwd.register_fake
def _(grad_out, q, k, v, q_offsets, k_offsets, num_targets, max_len_q, max_len_k, head_acts, pre_scale, out_scale,
      causal, contextual_len, window, broadcast_q, use_triton, precision="bf16", column_sums=""):  # fmt: skip
    sums = q.new_empty((_sums_size(column_sums, q, k),), dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), sums


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, q_offsets, k_offsets, num_targets, *options, bias = inputs
    ctx.save_for_backward(q, k, v, q_offsets, k_offsets, num_targets)
    ctx.options = options
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, grad_out):
    q, k, v, q_offsets, k_offsets, num_targets = ctx.saved_tensors
    column_sums = "q" if ctx.bias_dtype is not None and ctx.needs_input_grad[-1] else ""
    dq, dk, dv, sums = torch.ops.opengem.gdpa_bwd(grad_out, q, k, v, q_offsets, k_offsets, num_targets, *ctx.options,
                                                  column_sums)  # fmt: skip
    return (dq, dk, dv) + (None,) * (3 + len(ctx.options)) + (sums.to(ctx.bias_dtype) if column_sums else None,)


gdpa_fwd.register_autograd(_backward, setup_context=_setup_context)


def _pairs(q: torch.Tensor, q_offsets, k_offsets, num_targets, causal, contextual_len, window, broadcast_q,
           max_len_k: int) -> int:
    queries = q.shape[0] * (k_offsets.shape[0] - 1) if broadcast_q else q.shape[0]
    return counted_or_bound(k_offsets, queries * max_len_k, lambda: _counted_pairs(
        q, q_offsets, k_offsets, num_targets, causal, contextual_len, window, broadcast_q))


def _counted_pairs(q: torch.Tensor, q_offsets, k_offsets, num_targets, causal, contextual_len, window, broadcast_q
                   ) -> int:
    k_host = host_copy(k_offsets)
    k_len = k_host[1:] - k_host[:-1]
    if broadcast_q:
        q_len = torch.full_like(k_len, q.shape[0])
    else:
        q_host = host_copy(q_offsets)
        q_len = q_host[1:] - q_host[:-1]
    masked = causal or num_targets is not None or contextual_len > 0 or window >= 0
    return visible_pairs(q_len, k_len, masked=masked, causal=causal, num_targets=num_targets,
                         contextual_len=contextual_len, window=None if window < 0 else window)


@register_flop_formula(torch.ops.opengem.gdpa_fwd, get_raw=True)
def _gdpa_fwd_flops(q, k, v, q_offsets, k_offsets, num_targets, max_len_q, max_len_k, head_acts, pre_scale,
                    out_scale, causal, contextual_len, window, broadcast_q, use_triton, precision="bf16",
                    projection_bias=None, *, out_val=None, **kwargs) -> int:
    pairs = _pairs(q, q_offsets, k_offsets, num_targets, causal, contextual_len, window, broadcast_q, max_len_k)
    return attention_flops(pairs, q.shape[1], q.shape[2])[0]


@register_flop_formula(torch.ops.opengem.gdpa_bwd, get_raw=True)
def _gdpa_bwd_flops(grad_out, q, k, v, q_offsets, k_offsets, num_targets, max_len_q, max_len_k, head_acts,
                    pre_scale, out_scale, causal, contextual_len, window, broadcast_q, use_triton, precision="bf16",
                    column_sums="", *, out_val=None, **kwargs) -> int:
    pairs = _pairs(q, q_offsets, k_offsets, num_targets, causal, contextual_len, window, broadcast_q, max_len_k)
    return attention_flops(pairs, q.shape[1], q.shape[2])[1]


# The packed-K/V ops: k, v = kv.unbind(1) of one [Tk, 2, H_kv, D] tensor; the backward writes dK and dV into one
# packed gradient (see :func:`gdpa_packed_kv`).


@torch.library.custom_op("opengem::gdpa_kv_fwd", mutates_args=())
def gdpa_kv_fwd(
    q: torch.Tensor, kv: torch.Tensor, q_offsets: torch.Tensor, k_offsets: torch.Tensor,
    num_targets: torch.Tensor | None, max_len_q: int, max_len_k: int, head_acts: list[int], pre_scale: float,
    out_scale: float, causal: bool, contextual_len: int, window: int, broadcast_q: bool, use_triton: bool,
    precision: str = "bf16", projection_bias: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """As ``opengem::gdpa_fwd`` on ``kv.unbind(1)`` (``projection_bias``: the K/V projection's, for its gradient)."""
    return _forward(q, *kv.unbind(1), q_offsets, k_offsets, num_targets, max_len_q, max_len_k, head_acts, pre_scale,
                    out_scale, causal, contextual_len, window, broadcast_q, use_triton, precision)  # fmt: skip


@gdpa_kv_fwd.register_fake
def _(q, kv, q_offsets, k_offsets, num_targets, max_len_q, max_len_k, head_acts, pre_scale, out_scale, causal,
      contextual_len, window, broadcast_q, use_triton, precision="bf16", projection_bias=None):  # fmt: skip
    rows = (k_offsets.shape[0] - 1) * q.shape[0] if broadcast_q else q.shape[0]
    return q.new_empty((rows, q.shape[1], q.shape[2]))


@torch.library.custom_op("opengem::gdpa_kv_bwd", mutates_args=())
def gdpa_kv_bwd(
    grad_out: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, q_offsets: torch.Tensor, k_offsets: torch.Tensor,
    num_targets: torch.Tensor | None, max_len_q: int, max_len_k: int, head_acts: list[int], pre_scale: float,
    out_scale: float, causal: bool, contextual_len: int, window: int, broadcast_q: bool, use_triton: bool,
    precision: str = "bf16", column_sums: str = "",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(dq, dkv, sums)``: the Triton passes write dK and dV into ``dkv``'s two views; ``sums`` as
    ``opengem::gdpa_bwd``'s."""
    options = (q_offsets, k_offsets, num_targets, max_len_q, max_len_k, head_acts, pre_scale, out_scale, causal,
               contextual_len, window, broadcast_q, use_triton, precision, column_sums)  # fmt: skip
    if use_triton:
        dq, dkv = torch.empty_like(q), torch.empty(kv.shape, dtype=kv.dtype, device=kv.device)
        *_, sums = _backward_with_sums(grad_out, q, *kv.unbind(1), *options, grads=(dq, *dkv.unbind(1)))
        return dq, dkv, sums
    dq, dk, dv, sums = _backward_with_sums(grad_out, q, *kv.unbind(1), *options)
    return dq, torch.stack([dk, dv], 1), sums


@gdpa_kv_bwd.register_fake
def _(grad_out, q, kv, q_offsets, k_offsets, num_targets, max_len_q, max_len_k, head_acts, pre_scale, out_scale,
      causal, contextual_len, window, broadcast_q, use_triton, precision="bf16", column_sums=""):  # fmt: skip
    sums = q.new_empty((_sums_size(column_sums, q, kv[:, 0]),), dtype=torch.float32)
    return torch.empty_like(q), torch.empty(kv.shape, dtype=kv.dtype, device=kv.device), sums


def _setup_kv_context(ctx, inputs, output) -> None:
    q, kv, q_offsets, k_offsets, num_targets, *options, bias = inputs
    ctx.save_for_backward(q, kv, q_offsets, k_offsets, num_targets)
    ctx.options = options
    ctx.bias_dtype = None if bias is None else bias.dtype


def _kv_backward(ctx, grad_out):
    q, kv, q_offsets, k_offsets, num_targets = ctx.saved_tensors
    column_sums = "kv" if ctx.bias_dtype is not None and ctx.needs_input_grad[-1] else ""
    dq, dkv, sums = torch.ops.opengem.gdpa_kv_bwd(grad_out, q, kv, q_offsets, k_offsets, num_targets, *ctx.options,
                                                  column_sums)  # fmt: skip
    return (dq, dkv) + (None,) * (3 + len(ctx.options)) + (sums.to(ctx.bias_dtype) if column_sums else None,)


gdpa_kv_fwd.register_autograd(_kv_backward, setup_context=_setup_kv_context)


@register_flop_formula(torch.ops.opengem.gdpa_kv_fwd, get_raw=True)
def _gdpa_kv_fwd_flops(q, kv, *rest, out_val=None, **kwargs) -> int:
    return _gdpa_fwd_flops(q, None, None, *rest)


@register_flop_formula(torch.ops.opengem.gdpa_kv_bwd, get_raw=True)
def _gdpa_kv_bwd_flops(grad_out, q, kv, *rest, out_val=None, **kwargs) -> int:
    return _gdpa_bwd_flops(grad_out, q, None, None, *rest)
