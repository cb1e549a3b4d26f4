"""FP8 GDPA (``gdpa(..., precision="fp8")``, self- and cross-attention): the FP8 JFA's quantize pass and blocked
layout, E4M3 ``Q K^T`` and ``P V``; the backward straight through the quantization (:func:`backward`).
Cross-attention blocks Q by its offsets and K, V by theirs (``quantize_q_and_kv``).

The numerics are those of :mod:`opengem.ops.reference.gdpa_fp8`. The schedule, key loop and mask split are JFA's
(:mod:`opengem.ops.triton.jagged_attention_fp8`): the key tile is one block of the blocked layout, the query tile
lies inside one, so every tile has one scale per operand. No softmax: each tile's ``p = phi(x)`` is quantized with
one scale per row (its amax / 448), applied with V's block scale to that tile's fp32 ``P V`` before it is added
to the accumulator.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from opengem.ops.reference.attention_fp8 import rotation_size
from opengem.ops.triton import gdpa as gdpa_kernels
from opengem.ops.triton import jagged_attention as jfa
from opengem.ops.triton.activations import activation_value
from opengem.ops.triton.jagged_attention import (
    _INTERPRET,
    _KEY,
    _LARGE,
    _SMALL,
    Problem,
    _grid,
    _item,
    _key_tiles,
    _sample,
)
from opengem.ops.triton.jagged_attention_fp8 import (
    _FWD_FP8,
    BLOCK,
    E4M3_MAX,
    MIN_AMAX,
    _configs,
    _prune,
    quantize_q_and_kv,
    quantize_qkv,
    query_tile,
    rotated_back,
    rotated_gradient_buffers,
    straight_through_operands,
    straight_through_q_and_kv,
    to_e4m3,
)
from opengem.ops.triton.masks import tile_mask
from opengem.ops.triton.tuning import autotune


@triton.jit
def _gdpa_fp8_tiles(
    acc, q, K8, V8, KS, VS, kv_block0, x_scale, act, n_lo, n_hi, offs_m, offs_d, seq_len, hist_len,
    contextual_len, window,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_CONTEXT: tl.constexpr, EXACT: tl.constexpr, FAST_ACT: tl.constexpr,
):  # fmt: skip
    """Key tiles ``[n_lo, n_hi)`` (whole blocks) into ``acc`` (fp32, unscaled by ``out_scale``)."""
    offs_j = tl.arange(0, BLOCK_N)
    for n_start in range(n_lo, n_hi, BLOCK_N):
        blk = kv_block0 + n_start // BLOCK_N
        kT = tl.load(K8 + blk * BLOCK_N * HEAD_DIM + offs_j[None, :] * HEAD_DIM + offs_d[:, None])
        v = tl.load(V8 + blk * BLOCK_N * HEAD_DIM + offs_d[None, :] * BLOCK_N + offs_j[:, None])
        x = tl.dot(q, kT) * (x_scale * tl.load(KS + blk))
        p = activation_value(x, act, FAST_ACT)
        if MASKED:
            visible = tile_mask(
                offs_m, n_start + offs_j, seq_len, hist_len, contextual_len, window, CAUSAL, HAS_WINDOW, HAS_CONTEXT
            )
            p = tl.where(visible, p, 0.0)
        # one scale per row: amax / 448, both quotients correctly rounded as the emulation's
        amax = tl.maximum(tl.max(tl.abs(p), 1), MIN_AMAX)
        e4m3_max = amax * 0.0 + E4M3_MAX
        scaled = p * tl.math.div_rn(e4m3_max, amax)[:, None]
        if EXACT:  # integer rounding wants |x| <= 448; the hardware conversion saturates by itself
            scaled = tl.minimum(tl.maximum(scaled, -E4M3_MAX), E4M3_MAX)
        p_scale = tl.math.div_rn(amax, e4m3_max) * tl.load(VS + blk)
        acc += tl.dot(to_e4m3(scaled, EXACT), v) * p_scale[:, None]
    return acc


@autotune(configs=_configs(_FWD_FP8), key=[*_KEY, "ACT", "CROSS"], prune_configs_by={"early_config_prune": _prune})
@triton.jit(do_not_specialize=["contextual_len", "window", "heads", "num_blocks", "num_k_blocks"])
def _gdpa_fp8_fwd_kernel(
    Q8, K8, V8, QS, KS, VS, O, HEAD_ACT, offsets, num_targets, block_base, k_offsets, k_block_base,
    sched_small, sched_large, stride_ot, stride_oh, heads, num_blocks, num_k_blocks, x_scale, out_scale,
    contextual_len, window, LEN_BUCKET,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_CONTEXT: tl.constexpr, HAS_TARGETS: tl.constexpr, SMALL: tl.constexpr, EXACT: tl.constexpr,
    ACT: tl.constexpr, FAST_ACT: tl.constexpr, CROSS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One (query tile, head). Self-attention: K/V blocks are Q's (``k_* = offsets, block_base``), keys split
    into masked and fully visible tiles as JFA's. ``CROSS``: K/V blocked by ``k_offsets``, every key of the
    sample visible; the last block's rows past the sample are zeros, and ``phi(0) = 0`` for every activation,
    so they add nothing without a mask."""
    b, m_start, h = _item(sched_small, sched_large, heads, BLOCK_M, SMALL)
    start, seq_len, hist_len = _sample(offsets, num_targets, b, HAS_TARGETS)
    if ACT >= 0:  # one activation for all heads: folded at compile time
        act = ACT
    else:
        act = tl.load(HEAD_ACT + h)
    block0 = tl.load(block_base + b).to(tl.int64)
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q, q_scale = query_tile(Q8, QS, h, num_blocks, block0, m_start, BLOCK_M, BLOCK_N, HEAD_DIM)
    q_scale = q_scale * x_scale
    kv_block0 = (h // GROUP) * num_k_blocks + tl.load(k_block_base + b).to(tl.int64)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if CROSS:
        k_len = tl.load(k_offsets + b + 1) - tl.load(k_offsets + b)
        lo = k_len * 0
        f_lo = lo
        f_hi = tl.cdiv(k_len, BLOCK_N) * BLOCK_N
        hi = f_hi
    else:
        lo, f_lo, f_hi, hi = _key_tiles(
            m_start, seq_len, hist_len, contextual_len, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_CONTEXT
        )
    acc = _gdpa_fp8_tiles(  # keys [lo, f_lo), masked
        acc, q, K8, V8, KS, VS, kv_block0, q_scale, act, lo, f_lo, offs_m, offs_d, seq_len, hist_len,
        contextual_len, window, HEAD_DIM, BLOCK_N, True, CAUSAL, HAS_WINDOW, HAS_CONTEXT, EXACT, FAST_ACT
    )  # fmt: skip
    acc = _gdpa_fp8_tiles(  # keys [f_lo, f_hi), all visible
        acc, q, K8, V8, KS, VS, kv_block0, q_scale, act, f_lo, f_hi, offs_m, offs_d, seq_len, hist_len,
        contextual_len, window, HEAD_DIM, BLOCK_N, False, CAUSAL, HAS_WINDOW, HAS_CONTEXT, EXACT, FAST_ACT
    )  # fmt: skip
    acc = _gdpa_fp8_tiles(  # keys [f_hi, hi), masked
        acc, q, K8, V8, KS, VS, kv_block0, q_scale, act, f_hi, hi, offs_m, offs_d, seq_len, hist_len,
        contextual_len, window, HEAD_DIM, BLOCK_N, True, CAUSAL, HAS_WINDOW, HAS_CONTEXT, EXACT, FAST_ACT
    )  # fmt: skip
    tl.store(
        O + (start + offs_m[:, None]) * stride_ot + h * stride_oh + offs_d[None, :],
        (acc * out_scale).to(O.dtype.element_ty),
        mask=(offs_m < seq_len)[:, None],
    )


def problem(q: torch.Tensor, offsets: torch.Tensor, num_targets: torch.Tensor | None, args: gdpa_kernels.GdpaArgs,
            max_len: int) -> Problem:  # fmt: skip
    """JFA's schedule and mask options (same semantics) over ``offsets`` for the GDPA problem of ``args``;
    ``max_len`` (the longest sequence) buckets the tuning key."""
    return jfa.problem(offsets, num_targets, jfa.MaskOptions(args.causal, args.contextual_len, args.window), max_len,
                       1.0, q.device)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor, k_offsets: torch.Tensor,
            num_targets: torch.Tensor | None, args: gdpa_kernels.GdpaArgs) -> torch.Tensor:  # fmt: skip
    """FP8 forward: ``out [T, H, D]`` in q's dtype; cross-attention when ``k_offsets`` is not ``q_offsets``."""
    pb = problem(q, q_offsets, num_targets, args, args.max_len_q)
    (q, k, v), out, _, has_work = jfa.forward_buffers(q, k, v, pb)
    if has_work:
        attend(quantize(q, k, v, pb, _key_problem(k, q_offsets, k_offsets, num_targets, args)), out, pb, args)
    return out


def _key_problem(k: torch.Tensor, q_offsets: torch.Tensor, k_offsets: torch.Tensor, num_targets: torch.Tensor | None,
                 args: gdpa_kernels.GdpaArgs) -> Problem | None:  # fmt: skip
    """Cross-attention's blocks of K/V (by ``k_offsets``), or None for self-attention: a masked problem (the op
    checked its offsets equal) or one whose offsets are one tensor."""
    if args.masked(num_targets) or k_offsets is q_offsets:
        return None
    return problem(k, k_offsets, None, args, args.max_len_k)


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pb: Problem, k_pb: Problem | None) -> tuple:
    """``(q8, k8, v8, q_scale, k_scale, v_scale, q_block_base, k_offsets, k_block_base)`` for :func:`attend`:
    one quantize pass for self-attention (``k_pb`` None; K/V blocked as Q: ``k_offsets`` None), one for Q and
    one for K/V for cross-attention."""
    if k_pb is None:
        *blocked, block_base = quantize_qkv(q, k, v, pb)
        return (*blocked, block_base, None, block_base)
    (q8, qs, q_base), (k8, v8, ks, vs, k_base) = quantize_q_and_kv(q, k, v, pb, k_pb)
    return q8, k8, v8, qs, ks, vs, q_base, k_pb.offsets, k_base


def attend(quantized: tuple, out: torch.Tensor, pb: Problem, args: gdpa_kernels.GdpaArgs) -> None:
    """The attention kernel alone, from :func:`quantize`'s output, into ``out [T, H, D]``."""
    q8, k8, v8, qs, ks, vs, block_base, k_offsets, k_block_base = quantized
    heads, head_dim, kv_heads = out.shape[1], out.shape[2], k8.shape[0]
    cross = k_offsets is not None
    acts = args.head_activations
    single = len(set(acts)) == 1
    head_act = pb.offsets if single else gdpa_kernels._head_activation_tensor(acts, str(out.device))
    items = pb.sched.query_tiles
    _gdpa_fp8_fwd_kernel[_grid(items, heads, "BLOCK_M")](
        q8, k8, v8, qs, ks, vs, out, head_act, pb.offsets, pb.targets_arg(), block_base,
        k_offsets if cross else pb.offsets, k_block_base,
        items[_SMALL], items[_LARGE], out.stride(0), out.stride(1), heads, q8.shape[1], k8.shape[1],
        args.pre_scale / rotation_size(head_dim), args.out_scale,
        **pb.runtime(), HEAD_DIM=head_dim, GROUP=heads // kv_heads, CAUSAL=pb.opts.causal,
        HAS_WINDOW=pb.opts.window is not None, HAS_CONTEXT=pb.opts.contextual_len > 0,
        HAS_TARGETS=pb.num_targets is not None, SMALL=_SMALL, EXACT=_INTERPRET, ACT=acts[0] if single else -1,
        FAST_ACT=out.dtype != torch.float32 and gdpa_kernels.fast_activations(), CROSS=cross,
        BLOCK_N=BLOCK,
    )  # fmt: skip


def backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offsets: torch.Tensor,
             k_offsets: torch.Tensor, num_targets: torch.Tensor | None, args: gdpa_kernels.GdpaArgs,
             grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The FP8 forward's backward straight through its quantization (the emulation's ``gdpa_fp8_backward``):
    GDPA's bf16 backward on the dequantized rotated Q and K, and V, with ``pre_scale / n`` and P recomputed
    unquantized; then dQ and dK rotated back (``R^T``). ``grads`` as in GDPA's backward."""
    pb = problem(q, q_offsets, num_targets, args, args.max_len_q)
    k_pb = _key_problem(k, q_offsets, k_offsets, num_targets, args)
    if k_pb is None:
        q_st, k_st, v_st = straight_through_operands(q, k, v, pb)
    else:
        q_st, k_st, v_st = straight_through_q_and_kv(q, k, v, pb, k_pb)
    buffers = rotated_gradient_buffers(q_st, k_st, v, grads)
    rotated = dataclasses.replace(args, pre_scale=args.pre_scale / rotation_size(q.shape[2]))  # (q R)(k R)^T = n q k^T
    gdpa_kernels.gdpa_backward(grad_out, q_st, k_st, v_st, q_offsets, k_offsets, num_targets, rotated, grads=buffers)
    return rotated_back(*buffers, grads)
