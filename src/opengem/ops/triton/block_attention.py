"""BlockAttention Triton kernels: one program per (block, head), a single ``BLOCK``-row tile.

The whole block fits one tile, so the forward computes ``S = Q K^T`` once, a plain (not online) softmax or
a pointwise activation, and ``O = P V``; nothing but O is written. The backward recomputes ``P`` from
Q and K, gets the softmax ``delta = rowsum(dP * P)`` in-register (no preprocessing pass, no LSE), and
writes dq, dk, dv. Rotary embedding is applied to the Q/K tiles after loading (rotate-half layout: the
two head-dim halves are separate tiles, so ``S = Q_lo K_lo^T + Q_hi K_hi^T``); the backward rotates
dq/dk back with the transposed rotation. Backward programs loop over the GQA group of their kv head so
dk/dv are accumulated in registers, never with atomics. The backward computes the rotary cos/sin twice
(for q/k, then for dq/dk) rather than keep it live: see :func:`_store_rotated_back`.

Schedule: ``[2, num_blocks]`` int32 (block start token, block length), one column per block across all
sequences, built once on the host from the offsets and cached. Rotary angles are taken relative to the
block (see :func:`_rotary_cos_sin`), so the kernels need no position of the block in its sequence.
"""

from __future__ import annotations

import os
from collections import OrderedDict

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from opengem.jagged.host import host_copy, to_device
from opengem.ops.activations import activation_id
from opengem.ops.triton.activations import activation_value_and_grad
from opengem.ops.triton.ragged_tiles import last_dim_contiguous

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)
# ACT: the id of opengem.ops.activations, or SOFTMAX (normalized over the block's keys)
SOFTMAX = tl.constexpr(-1)
# 2 pi split Cody-Waite style: k * _TWO_PI_HI is exact in fp32 for k < 2^15, so range reduction of
# angles up to ~1e5 rad keeps ~1e-6 accuracy before the hardware (SFU) sin/cos.
_TWO_PI_HI = tl.constexpr(6.28125)
_TWO_PI_LO = tl.constexpr(0.0019353071795864769)
_INV_TWO_PI = tl.constexpr(0.15915494309189535)
# The SFU's approximate sin/cos/log2 (libdevice fast_*) do not exist in the interpreter.
FAST_MATH = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


def _configs(backward: bool) -> list[triton.Config]:
    """Warps per (block, head) program; the backward also tries 4 warps capped at 168 registers, for three
    programs per SM (sm_90: 3 x 128 threads x 168 = 64,512 of 65,536 registers) where shared memory allows
    it too (228 KB, 1 KB reserved per program). Measured on an H200 (block 64, D 128, bf16, backward,
    session 6, before the early dK/dV stores): 4 warps 3.78 ms, 8 warps 5.52, 16 warps 7.51, 8 warps capped
    at 128 registers 4.10; session 7, with them: 4 warps 3.51 (in-sequence positions 4.01), 8 warps 3.86
    (4.17), capped 3.51 (3.87). Each backward shape comes with and without SHARE_BACK, which the autotuner
    picked for time gaps and given positions (3.850 and 3.911 ms against 3.893 and 4.123 without).

    The 4-warp backward shapes also come with LATE_V (v loaded just before dP = dO V^T, GROUP 1). sm_90
    compile (Triton 3.6, block 64, D 128; ``benchmarks.block_attention_sass``): shared memory 72 KB without
    rotary, 80 KB with it (the rotated q takes a register-to-MMA-layout round trip through shared memory
    while v's tile is live), so every rotary config ran two programs per SM, the cap notwithstanding, where
    the unrotated one runs three; with LATE_V every mode takes 64 KB, and the capped configs run three per
    SM (rotary spills 16-72 B). The autotuner then picked a capped LATE_V config in every mode, and the
    rotary backward cost fell from +10-14% to +4-10% (H200, session 9). The 8- and 16-warp shapes compute
    their 64-row dots on every warpgroup (``benchmarks.sass.replicated_dots``); they stay listed, never picked."""
    if os.environ.get("TRITON_INTERPRET") == "1":  # one config: Triton 3.6 would time even one pruned survivor
        return [triton.Config({"SHARE_BACK": True, "LATE_V": True} if backward else {}, num_warps=4)]  # newest path
    shapes = [dict(num_warps=w, num_stages=1) for w in (4, 8, 16)]
    if not backward:
        return [triton.Config({}, **shape) for shape in shapes]
    shapes += [dict(num_warps=4, num_stages=1, maxnreg=168)]
    return [
        triton.Config({"SHARE_BACK": share, "LATE_V": late}, **shape)
        for shape in shapes
        for share in (False, True)
        for late in ((False, True) if shape["num_warps"] == 4 else (False,))
    ]


def share_back_applies(group: int, rot: int) -> bool:
    """Whether SHARE_BACK changes the backward's code: one query head per kv head, and rotary on."""
    return group == 1 and rot != 0


def late_v_applies(group: int) -> bool:
    """Whether LATE_V changes the backward's code: one query head per kv head (else v serves the group)."""
    return group == 1


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """16 warps only for 128-row tiles with D >= 128, whose S/P and dK/dV tiles overflow 8 warps' registers;
    SHARE_BACK and LATE_V only where they change the code."""
    large = kwargs["BLOCK"] == 128 and kwargs["HALF"] >= 64
    shares = share_back_applies(kwargs.get("GROUP"), kwargs.get("ROT", 0))
    late = late_v_applies(kwargs.get("GROUP"))
    kept = [c for c in configs if c.num_warps <= 8 or large]
    if "SHARE_BACK" not in configs[0].kwargs or len(configs) == 1:  # the forward, or the interpreter's one
        return kept
    return [c for c in kept if (shares or not c.kwargs["SHARE_BACK"]) and (late or not c.kwargs["LATE_V"])]


_KEY = ["BLOCK", "HALF", "GROUP", "ACT", "ROT", "REDUCE"]
_AUTOTUNE = dict(configs=_configs(backward=False), key=_KEY, prune_configs_by={"early_config_prune": _prune})
_AUTOTUNE_BWD = dict(_AUTOTUNE, configs=_configs(backward=True))


@triton.jit
def _sin_cos_approx(angle, FAST: tl.constexpr):
    """``(cos, sin)`` of fp32 angles: the SFU's ``cos.approx``/``sin.approx`` (one MUFU op each, abs. error
    ~2^-20 on [-pi, pi], ~1e-5 up to 128 rad) instead of the ~40-instruction polynomials tl.cos/tl.sin
    compile to; the interpreter (FAST false) has no libdevice and uses tl.cos/tl.sin."""
    if FAST:
        return libdevice.fast_cosf(angle), libdevice.fast_sinf(angle)
    else:
        return tl.cos(angle), tl.sin(angle)


@triton.jit
def _log_approx(x, FAST: tl.constexpr):
    """Natural log of fp32 ``x >= 1`` via the SFU's ``lg2.approx`` (rel. error ~2^-22), as above."""
    if FAST:
        return libdevice.fast_log2f(x) * _LN2
    else:
        return tl.log(x)


@triton.jit
def _rotary_cos_sin(
    PHASE, INV_FREQ, start, rows, valid, time_scale,
    HALF: tl.constexpr, ROT: tl.constexpr, REDUCE: tl.constexpr, SIGN: tl.constexpr,
):  # fmt: skip
    """fp32 cos/sin ``[BLOCK, HALF]`` of the rotation angle ``SIGN * phase * inv_freq[i]`` of each row of
    the block (SIGN -1: the inverse rotation, for dq/dk).

    ROT 1 (position in the sequence) rotates by the row *in the block* instead: rotations of one channel
    pair compose (``R(a + b) = R(a) R(b)``) and are orthogonal, so the block's start position rotates q
    and k alike and cancels in every score ``q_i . k_j`` and, once dq/dk are rotated back, in every
    gradient. ROT 2 (PHASE holds given positions) rotates by the position relative to the block's first
    row, for the same reason. ROT 3: time gaps, phase = log(1 + max(gap, 0) / time_scale) <= 89 for any
    fp32 gap. With inv_freq <= 1 (base >= 1), ROT 1 and 3 angles stay below 128 rad, where the SFU is
    accurate as is; so do ROT 2's unless positions inside the block span 128 or more, in which case the
    program reduces its angles to [-pi, pi] first, as REDUCE (the host sets it for base < 1) always does.
    """
    if ROT == 1:
        phase = rows.to(tl.float32)
    else:
        phase = tl.load(PHASE + start + rows, mask=valid, other=0.0).to(tl.float32)
        if ROT == 2:
            phase = tl.where(valid, phase - tl.load(PHASE + start).to(tl.float32), 0.0)
        if ROT == 3:  # one division per program, not per token
            phase = _log_approx(1.0 + tl.maximum(phase, 0.0) * (1.0 / time_scale), FAST_MATH)
    freq = tl.load(INV_FREQ + tl.arange(0, HALF)) * SIGN
    angle = phase[:, None] * freq[None, :]
    if REDUCE:
        angle = _reduce_angle(angle)
    elif ROT == 2:
        if tl.max(tl.abs(phase)) >= 128.0:  # one branch per program: most blocks hold nearby positions
            angle = _reduce_angle(angle)
    return _sin_cos_approx(angle, FAST_MATH)


@triton.jit
def _reduce_angle(angle):
    """``angle`` minus the nearest multiple of 2 pi (Cody-Waite, with the split 2 pi above)."""
    turns = tl.floor(angle * _INV_TWO_PI + 0.5)
    return (angle - turns * _TWO_PI_HI) - turns * _TWO_PI_LO


@triton.jit
def _load_halves(ptr, valid):
    """Load a ``[BLOCK, HALF]`` tile and the one ``HALF`` columns after it (the rotate-half pair)."""
    lo = tl.load(ptr, mask=valid[:, None], other=0.0)
    hi = tl.load(ptr + lo.shape[1], mask=valid[:, None], other=0.0)
    return lo, hi


@triton.jit
def _store_halves(ptr, lo, hi, valid):
    """Store the two ``HALF``-column tiles of :func:`_load_halves`, cast to the tensor's dtype."""
    tl.store(ptr, lo.to(ptr.dtype.element_ty), mask=valid[:, None])
    tl.store(ptr + lo.shape[1], hi.to(ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _rotate(lo, hi, cos, sin):
    """Rotate a loaded q/k tile in its own dtype: 16-bit inputs use packed two-lane math (HFMA2), half the
    instructions of an fp32 round trip (~1.5 roundings of the input dtype instead of one: well inside the
    tolerance of a bf16 attention); fp32 inputs rotate in fp32."""
    c, s = cos.to(lo.dtype), sin.to(lo.dtype)
    return lo * c - hi * s, hi * c + lo * s


@triton.jit
def _back_cos_sin(PHASE, INV_FREQ, start, rows, valid, time_scale,
                  HALF: tl.constexpr, ROT: tl.constexpr, REDUCE: tl.constexpr):  # fmt: skip
    """cos/sin of the transposed rotation, for dq/dk. Recomputed rather than kept live from the rotation of
    q/k: ``[BLOCK, HALF]`` fp32 cos/sin held across the backward's dots spill at 4 warps (the negated
    angle keeps the compiler from merging this computation with the first one)."""
    return _rotary_cos_sin(PHASE, INV_FREQ, start, rows, valid, time_scale, HALF, ROT, REDUCE, -1.0)


@triton.jit
def _store_rotated(ptr, lo, hi, cos, sin, valid):
    """Rotate an fp32 tile pair by fp32 (or 16-bit) cos/sin and store it."""
    c, s = cos.to(tl.float32), sin.to(tl.float32)
    _store_halves(ptr, lo * c - hi * s, hi * c + lo * s, valid)


@triton.jit
def _store_rotated_back(ptr, lo, hi, PHASE, INV_FREQ, start, rows, valid, time_scale,
                        HALF: tl.constexpr, ROT: tl.constexpr, REDUCE: tl.constexpr):  # fmt: skip
    """Store an fp32 dq/dk tile pair, first rotated back when ROT is on."""
    if ROT != 0:
        cos, sin = _back_cos_sin(PHASE, INV_FREQ, start, rows, valid, time_scale, HALF, ROT, REDUCE)
        _store_rotated(ptr, lo, hi, cos, sin, valid)
    else:
        _store_halves(ptr, lo, hi, valid)


@triton.jit
def _weights(s, key_valid, scale, ACT: tl.constexpr):
    """Attention weights ``P [BLOCK, BLOCK]`` from raw scores ``s = q . k`` (fp32)."""
    if ACT == SOFTMAX:
        logits = tl.where(key_valid[None, :], s * (scale * _LOG2E), float("-inf"))
        p = tl.exp2(logits - tl.max(logits, 1)[:, None])
        p = p * (1.0 / tl.sum(p, 1))[:, None]
    else:
        p = tl.where(key_valid[None, :], activation_value_and_grad(s * scale, ACT)[0], 0.0)
    return p


@triton.jit
def _block_of(SCHED, num_blocks, blk):
    return tl.load(SCHED + blk), tl.load(SCHED + num_blocks + blk)


@triton.autotune(**_AUTOTUNE)
@triton.jit(do_not_specialize=["num_blocks"])
def _block_attention_fwd(
    Q, K, V, O, SCHED, PHASE, INV_FREQ,
    num_blocks, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    scale, time_scale,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, HALF: tl.constexpr, ACT: tl.constexpr, ROT: tl.constexpr,
    REDUCE: tl.constexpr,
):  # fmt: skip
    blk, head = tl.program_id(0), tl.program_id(1)
    kv_head = head // GROUP
    start, length = _block_of(SCHED, num_blocks, blk)
    rows = tl.arange(0, BLOCK)
    valid = rows < length  # rows past the block end load as zeros and are never stored
    tok = (start + rows).to(tl.int64)
    half = tl.arange(0, HALF)
    q_lo, q_hi = _load_halves(Q + tok[:, None] * stride_qt + head * stride_qh + half[None, :], valid)
    k_lo, k_hi = _load_halves(K + tok[:, None] * stride_kt + kv_head * stride_kh + half[None, :], valid)
    if ROT != 0:
        cos, sin = _rotary_cos_sin(PHASE, INV_FREQ, start, rows, valid, time_scale, HALF, ROT, REDUCE, 1.0)
        q_lo, q_hi = _rotate(q_lo, q_hi, cos, sin)
        k_lo, k_hi = _rotate(k_lo, k_hi, cos, sin)
    # S = Q K^T over the two head-dim halves.
    s = tl.dot(q_hi, tl.trans(k_hi), tl.dot(q_lo, tl.trans(k_lo)))
    p = _weights(s, valid, scale, ACT)
    dims = tl.arange(0, 2 * HALF)
    v = tl.load(V + tok[:, None] * stride_vt + kv_head * stride_vh + dims[None, :], mask=valid[:, None], other=0.0)
    o = tl.dot(p.to(v.dtype), v)
    tl.store(O + tok[:, None] * stride_ot + head * stride_oh + dims[None, :], o.to(O.dtype.element_ty), mask=valid[:, None])


@triton.autotune(**_AUTOTUNE_BWD)
@triton.jit(do_not_specialize=["num_blocks"])  # changes every batch: no recompile on its divisibility
def _block_attention_bwd(
    Q, K, V, DO, DQ, DK, DV, SCHED, PHASE, INV_FREQ,
    num_blocks, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_dkt, stride_dkh,
    scale, time_scale,
    GROUP: tl.constexpr, BLOCK: tl.constexpr, HALF: tl.constexpr, ACT: tl.constexpr, ROT: tl.constexpr,
    REDUCE: tl.constexpr, SHARE_BACK: tl.constexpr, LATE_V: tl.constexpr,
):  # fmt: skip
    """Program (block, kv head): dk/dv of the kv head, dq of each query head of its GQA group. SHARE_BACK
    (a tuning choice, GROUP 1 with rotary): one inverse cos/sin for dK and dQ instead of one each. (Keeping
    q's cos/sin live instead saves nothing: Triton recomputes them in the accumulators' layout.) LATE_V (a
    tuning choice, GROUP 1): v loaded where dP needs it, so its shared-memory tile is not live beside S's
    operands (see :func:`_configs`)."""
    blk, kv_head = tl.program_id(0), tl.program_id(1)
    start, length = _block_of(SCHED, num_blocks, blk)
    rows = tl.arange(0, BLOCK)
    valid = rows < length
    tok = (start + rows).to(tl.int64)
    half = tl.arange(0, HALF)
    dims = tl.arange(0, 2 * HALF)
    k_lo, k_hi = _load_halves(K + tok[:, None] * stride_kt + kv_head * stride_kh + half[None, :], valid)
    v_ptr = V + tok[:, None] * stride_vt + kv_head * stride_vh + dims[None, :]
    LATE: tl.constexpr = LATE_V and GROUP == 1
    if not LATE:
        v = tl.load(v_ptr, mask=valid[:, None], other=0.0)
    if ROT != 0:
        cos, sin = _rotary_cos_sin(PHASE, INV_FREQ, start, rows, valid, time_scale, HALF, ROT, REDUCE, 1.0)
        k_lo, k_hi = _rotate(k_lo, k_hi, cos, sin)
    dk_lo = tl.zeros((BLOCK, HALF), tl.float32)
    dk_hi = tl.zeros((BLOCK, HALF), tl.float32)
    dv = tl.zeros((BLOCK, 2 * HALF), tl.float32)
    dk_ptr = DK + tok[:, None] * stride_dkt + kv_head * stride_dkh + half[None, :]
    dv_ptr = DV + tok[:, None] * stride_dkt + kv_head * stride_dkh + dims[None, :]
    rotary = (PHASE, INV_FREQ, start, rows, valid, time_scale)  # runtime values only: tuples lose constexpr
    for g in range(GROUP):
        head = kv_head * GROUP + g
        q_lo, q_hi = _load_halves(Q + tok[:, None] * stride_qt + head * stride_qh + half[None, :], valid)
        if ROT != 0:  # the same cos/sin as k's: reused for GROUP 1, recomputed per head (not live) otherwise
            if GROUP > 1:
                cos, sin = _rotary_cos_sin(PHASE, INV_FREQ, start, rows, valid, time_scale, HALF, ROT, REDUCE, 1.0)
            q_lo, q_hi = _rotate(q_lo, q_hi, cos, sin)
        do_ptr = DO + tok[:, None] * stride_dot + head * stride_doh + dims[None, :]
        do = tl.load(do_ptr, mask=valid[:, None], other=0.0)
        # Recompute S and P exactly as the forward did.
        s = tl.dot(q_hi, tl.trans(k_hi), tl.dot(q_lo, tl.trans(k_lo)))
        p = _weights(s, valid, scale, ACT)
        dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv)  # dV = P^T dO
        if GROUP == 1:  # finished: stored now, its accumulator is not live through dS, dK and dQ
            tl.store(dv_ptr, dv.to(DV.dtype.element_ty), mask=valid[:, None])
        if LATE:
            v = tl.load(v_ptr, mask=valid[:, None], other=0.0)
        dp = tl.dot(do, tl.trans(v))  # dP = dO V^T
        if ACT == SOFTMAX:
            ds = p * (dp - tl.sum(dp * p, 1)[:, None])  # softmax: dS = P (dP - rowsum(dP P))
        else:
            ds = tl.where(valid[None, :], dp * activation_value_and_grad(s * scale, ACT)[1], 0.0)
        ds = (ds * scale).to(q_lo.dtype)
        dk_lo = tl.dot(tl.trans(ds), q_lo, dk_lo)  # dK = dS^T Q scale
        dk_hi = tl.dot(tl.trans(ds), q_hi, dk_hi)
        if GROUP == 1 and ROT != 0 and SHARE_BACK:  # likewise before dQ, which reuses dK's inverse rotation
            back_cos, back_sin = _back_cos_sin(*rotary, HALF, ROT, REDUCE)
            _store_rotated(dk_ptr, dk_lo, dk_hi, back_cos, back_sin, valid)
            back_cos, back_sin = back_cos.to(q_lo.dtype), back_sin.to(q_lo.dtype)  # live through dQ: 16 bits
            dq_ptr = DQ + tok[:, None] * stride_dqt + head * stride_dqh + half[None, :]
            _store_rotated(dq_ptr, tl.dot(ds, k_lo), tl.dot(ds, k_hi), back_cos, back_sin, valid)  # dQ = dS K scale
        else:
            if GROUP == 1:  # likewise before dQ (sm_90, 4 warps: 255 -> 168 registers)
                _store_rotated_back(dk_ptr, dk_lo, dk_hi, *rotary, HALF, ROT, REDUCE)
            dq_lo = tl.dot(ds, k_lo)  # dQ = dS K scale
            dq_hi = tl.dot(ds, k_hi)
            dq_ptr = DQ + tok[:, None] * stride_dqt + head * stride_dqh + half[None, :]
            _store_rotated_back(dq_ptr, dq_lo, dq_hi, *rotary, HALF, ROT, REDUCE)
    if GROUP > 1:  # dK and dV summed over the group's query heads
        _store_rotated_back(dk_ptr, dk_lo, dk_hi, *rotary, HALF, ROT, REDUCE)
        tl.store(dv_ptr, dv.to(DV.dtype.element_ty), mask=valid[:, None])


_SCHEDULE_CACHE: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
_SCHEDULE_CACHE_SIZE = 16


def block_schedule(offsets: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[2, num_blocks]`` int32 on offsets' device: (start token, length) per block.

    Built on the host (one device-to-host copy of the offsets) and cached per offsets tensor and
    version, so every layer of a step (forward and backward) reuses it; the cache holds a reference to
    the offsets so their storage cannot be recycled under a live key.
    """
    key = (offsets.data_ptr(), offsets._version, str(offsets.device), offsets.numel(), block_size)
    hit = _SCHEDULE_CACHE.get(key)
    if hit is not None and hit[0] is offsets:
        _SCHEDULE_CACHE.move_to_end(key)
        return hit[1]
    host = host_copy(offsets).to(torch.int64)
    lengths = host[1:] - host[:-1]
    blocks_per_seq = (lengths + block_size - 1) // block_size
    seq = torch.repeat_interleave(torch.arange(lengths.numel()), blocks_per_seq)
    first_block = torch.cumsum(blocks_per_seq, 0) - blocks_per_seq
    offset_in_seq = (torch.arange(seq.numel()) - first_block[seq]) * block_size
    schedule = torch.stack((host[:-1][seq] + offset_in_seq, torch.clamp(lengths[seq] - offset_in_seq, max=block_size)))
    schedule = to_device(schedule.to(torch.int32), offsets.device)
    _SCHEDULE_CACHE[key] = (offsets, schedule)
    if len(_SCHEDULE_CACHE) > _SCHEDULE_CACHE_SIZE:
        _SCHEDULE_CACHE.popitem(last=False)
    return schedule


def _common_args(
    q, k, schedule, rotary_values, inv_freq, scale, time_scale, activation_name, rotary_mode, reduce_angles, block_size
):  # fmt: skip
    head_dim = q.shape[-1]
    dummy = schedule  # any tensor: unused pointers are compiled out by the ROT constexpr
    meta = dict(
        GROUP=q.shape[1] // k.shape[1], BLOCK=block_size, HALF=head_dim // 2,
        ACT=SOFTMAX if activation_name == "softmax" else activation_id(activation_name), ROT=rotary_mode,
        REDUCE=bool(reduce_angles),
    )  # fmt: skip
    pointers = (rotary_values if rotary_values is not None else dummy, inv_freq if inv_freq is not None else dummy)
    return pointers, (float(scale), float(time_scale)), meta


def block_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    *,
    block_size: int,
    scale: float,
    activation_name: str,
    rotary_mode: int,
    rotary_values: torch.Tensor | None,
    inv_freq: torch.Tensor | None,
    time_scale: float,
    reduce_angles: bool,
) -> torch.Tensor:
    """Output ``[T, H, D]`` (q's dtype). q/k/v may be strided views (e.g. of a fused QKV projection).

    ``reduce_angles``: range-reduce every rotary angle before the SFU sin/cos (needed for ``inv_freq > 1``;
    blocks of given positions that span 128 or more reduce on their own; see :func:`_rotary_cos_sin`).
    """
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    out = q.new_empty(q.shape)
    schedule = block_schedule(offsets, block_size)
    num_blocks = schedule.shape[1]
    if num_blocks == 0:
        return out
    pointers, floats, meta = _common_args(
        q, k, schedule, rotary_values, inv_freq, scale, time_scale, activation_name, rotary_mode, reduce_angles,
        block_size,
    )  # fmt: skip
    _block_attention_fwd[(num_blocks, q.shape[1])](
        q, k, v, out, schedule, *pointers, num_blocks,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        *floats, **meta,
    )  # fmt: skip
    return out


def block_attention_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    *,
    block_size: int,
    scale: float,
    activation_name: str,
    rotary_mode: int,
    rotary_values: torch.Tensor | None,
    inv_freq: torch.Tensor | None,
    time_scale: float,
    reduce_angles: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` shaped like q, k, v (contiguous), in the inputs' dtype."""
    q, k, v, grad_out = (last_dim_contiguous(t) for t in (q, k, v, grad_out))
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), k.new_empty(k.shape)
    schedule = block_schedule(offsets, block_size)
    num_blocks = schedule.shape[1]
    if num_blocks == 0:
        return dq, dk, dv
    pointers, floats, meta = _common_args(
        q, k, schedule, rotary_values, inv_freq, scale, time_scale, activation_name, rotary_mode, reduce_angles,
        block_size,
    )  # fmt: skip
    _block_attention_bwd[(num_blocks, k.shape[1])](
        q, k, v, grad_out, dq, dk, dv, schedule, *pointers, num_blocks,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        grad_out.stride(0), grad_out.stride(1), dq.stride(0), dq.stride(1), dk.stride(0), dk.stride(1),
        *floats, **meta,
    )  # fmt: skip
    return dq, dk, dv
