"""The kernels of ``benchmarks.diag.gluon_gdpa_dkdv`` (its docstring has the structure and the variants): GDPA's
dK/dV pass and the fused five-product backward in Gluon for Hopper, and their sm_90 build on the CPU. Needs triton 3.6
(the GPU image's; 3.9's Gluon API rejects it)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from benchmarks.diag.gluon_common import (FAST_GELU_SLOPE, descriptor_type, programs_per_sm, scheduled_item,
                                          sm90_resources, tma_reduce_add)
from benchmarks.gdpa import HEAD_DIM
from opengem.ops.gluon.hopper import fill_ring, launch_registers, stage_ring, wgmma_layout, wgmma_register_operand


# how a fused variant adds each query step's dQ^T tile into the fp32 sums: one element an instruction (``atom``), four
# (``red.global.add.v4.f32``), four from a dQ-writer partition while the MMA warps go on, or a whole tile by one TMA
# reduce-add from shared memory (FlashAttention-3's), asynchronous: no adds on any warp
DQ_ADDS = {"": 0, "atomic": 1, "red4": 2, "writer": 3, "tma": 4}  # "": dK and dV only


class Variant(NamedTuple):
    block_m: int  # query rows a step
    stages: int  # Q and dO buffers in the ring
    dq: str = ""  # a key of DQ_ADDS: dQ too (five products), added into fp32 by every key tile's program
    halves: bool = False  # an MMA partition a 64-key half (as the forward's two consumers), not one of 8 warps
    pipelined: bool = False  # step i+1's S^T issued behind step i's MMAs (``_key_grads_pipelined``; dQ only by TMA)
    block_n: int = 128  # keys a program: 128 (two warpgroups), or 64 in one warpgroup, two programs an SM (the tile
    # the Triton dK/dV pass picks on (a) at L <= 1024 and at L2048 s1.0: the SM interleaves two programs' MMAs)
    dq_slots: int = 2  # an MMA partition's shared-memory dQ tiles for the TMA reduces (1 lets 64-row key halves fit)

    @property
    def name(self) -> str:
        fused = "" if not self.dq else "_fused_dq" if self.dq == "atomic" else f"_fused_dq_{self.dq}"
        return (f"gluon_m{self.block_m}_s{self.stages}{fused}" + ("_2wg" if self.halves else "")
                + ("_pipelined" if self.pipelined else "") + ("" if self.block_n == 128 else f"_n{self.block_n}")
                + ("" if self.dq_slots == 2 else f"_{self.dq_slots}slot"))

    @property
    def fused_dq(self) -> bool:
        return self.dq != ""

    @property
    def num_warps(self) -> int:  # the kernel's (the default partition's)
        return 4 if self.halves or self.block_n == 64 else 8

    @property
    def programs_per_sm(self) -> int:
        return programs_per_sm(self.block_n)

    @property
    def ds_layout(self) -> gl.NVMMASharedLayout:
        """The shared layout of an MMA partition's dX^T tile (its keys by the step's query rows)."""
        keys = self.block_n // 2 if self.halves else self.block_n
        return gl.NVMMASharedLayout.get_default_for([keys, self.block_m], gl.bfloat16)

    @property
    def maxnreg(self) -> int:  # the warps (MMA, the loader's warpgroup, the writer's 4) of every program on an SM
        mma_warps = self.block_n // 16  # a warpgroup a 64 keys
        return launch_registers(mma_warps + 4 + (4 if self.dq == "writer" else 0), self.programs_per_sm)

    def check(self) -> None:
        if self.block_n not in (64, 128):
            raise ValueError(f"{self.name}: a program holds 128 keys (two warpgroups) or 64 (one)")
        if self.block_n == 64 and (self.halves or self.dq not in ("", "tma")):
            raise ValueError(f"{self.name}: 64-key programs are one warpgroup, with dQ only by TMA adds")
        if self.halves and self.dq in ("atomic", "red4"):  # each half would add its own partial: twice the adds
            raise ValueError(f"{self.name}: key halves add dQ only through the writer or the TMA")
        if self.pipelined and self.dq not in ("", "tma"):
            raise ValueError(f"{self.name}: the pipelined loop adds dQ only by TMA reduces")
        if self.dq_slots not in (1, 2) or (self.dq_slots == 1 and self.dq != "tma"):
            raise ValueError(f"{self.name}: one or two dQ slots, one only with TMA reduces")


# at sm_90: 64 rows spill 72 B (dK, dV, dP^T, phi' and P^T live across the MMAs), 32 rows none, 32 rows with the fused
# dQ 160 B (its atomics' addresses), with the vector adds 112 B (the dQ^T tile through shared memory into a layout of
# four consecutive head-dim columns a thread), with the writer partition 176 B (the MMA partition at 216 registers),
# with the writer and a partition a 64-key half 16 B; dK/dV only with key halves: 64 rows 24 B, 32 rows none;
# pipelined, 32 rows: none (64 rows with key halves spill 240 B, so they are not listed); dQ by TMA reduce-adds 64 B
# (155.9 KB of shared memory), with key halves 56 B (188.8 KB); 64-key programs (8 warps, 128 registers at launch, the
# MMA warpgroup 232, two an SM): 32 rows none (82.2 KB), 64 rows 80 B, with TMA dQ adds and 2 stages none (102.6 KB)
VARIANTS = (Variant(64, 2), Variant(32, 3), Variant(64, 2, halves=True), Variant(32, 3, halves=True),
            Variant(32, 3, pipelined=True), Variant(32, 3, halves=True, pipelined=True), Variant(32, 3, "atomic"),
            Variant(32, 3, "red4"), Variant(32, 3, "writer"), Variant(32, 3, "writer", halves=True),
            Variant(32, 3, "tma"), Variant(32, 3, "tma", halves=True), Variant(32, 3, "tma", pipelined=True),
            Variant(32, 3, "tma", halves=True, pipelined=True), Variant(32, 3, block_n=64), Variant(64, 2, block_n=64),
            Variant(32, 3, pipelined=True, block_n=64), Variant(32, 2, "tma", block_n=64),
            Variant(32, 2, "tma", pipelined=True, block_n=64), Variant(64, 2, "tma", halves=True, dq_slots=1))
KEY_TILES = sorted({variant.block_n for variant in VARIANTS})  # the schedules a run builds
DQ_WRITER_REGISTERS = gl.constexpr(48)  # a thread of the writer partition; the MMA partition gets the rest
# the second MMA partition of a key-halves variant (the first gets the rest): with the writer 216 (first 224), else 240
MMA_REGISTERS_HALVES = gl.constexpr(216)
MMA_REGISTERS_HALVES_NO_WRITER = gl.constexpr(240)


@gluon.jit
def _add_v4(ptrs, values, valid):
    """``*ptrs += values`` where ``valid``, four consecutive fp32 a thread in one ``red.global.add.v4.f32`` (sm_90):
    Triton 3.6 issues ``gl.atomic_add`` one element an instruction, with a return value."""
    return gl.inline_asm_elementwise(
        """{ .reg .pred p; setp.ne.b32 p, $12, 0;
        @p red.relaxed.gpu.global.add.v4.f32 [$4], {$8, $9, $10, $11};
        mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0; }""",
        "=r,=r,=r,=r,l,l,l,l,f,f,f,f,r,r,r,r", [ptrs.to(gl.int64, bitcast=True), values, valid], dtype=gl.int32,
        is_pure=False, pack=4)


@gluon.jit
def _add_dq_tile(DQ_ACC, dqt, q_row, q0, q_len, stride_t, head_col):
    """Add a ``[HEAD_DIM, rows]`` dQ^T tile (query rows ``q0 ..`` of the sample at ``q_row``), held four consecutive
    head-dim columns a thread, into the fp32 sums with :func:`_add_v4`; rows past ``q_len`` are skipped."""
    layout: gl.constexpr = dqt.type.layout
    q_cols = q0 + gl.arange(0, dqt.type.shape[1], layout=gl.SliceLayout(0, layout))
    d_idx = gl.expand_dims(gl.arange(0, dqt.type.shape[0], layout=gl.SliceLayout(1, layout)), 1)
    ptrs = DQ_ACC + gl.expand_dims((q_row + q_cols).to(gl.int64) * stride_t, 0) + head_col + d_idx
    valid = gl.expand_dims(q_cols < q_len, 0).to(gl.int32) + gl.zeros_like(dqt).to(gl.int32)
    _add_v4(ptrs, dqt, valid)


@gluon.jit
def _write_dq(dq_bufs, dq_bufs_b, dq_full, dq_free, DQ_ACC, stride_t, q_row, q_len, head_col, BLOCK_M: gl.constexpr,
              HALVES: gl.constexpr):
    """The dQ-writer partition (FlashAttention-3's): each query step's dQ^T tile, as the MMA partition left it in its
    two-slot ring (with ``HALVES``, an MMA partition a key half, the two halves' partials from their two rings,
    summed here), added into the fp32 sums, 16 query rows at a time, while the MMA warps go on."""
    CHUNK: gl.constexpr = 16
    layout: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, gl.num_warps()], [0, 1])
    for i in range(gl.cdiv(q_len, BLOCK_M)):
        slot = i % 2
        mbarrier.wait(dq_full.index(slot), (i // 2) & 1)
        for c in gl.static_range(BLOCK_M // CHUNK):
            dqt = dq_bufs.index(slot).slice(c * CHUNK, CHUNK, dim=1).load(layout)
            if HALVES:
                dqt += dq_bufs_b.index(slot).slice(c * CHUNK, CHUNK, dim=1).load(layout)
            _add_dq_tile(DQ_ACC, dqt, q_row, i * BLOCK_M + c * CHUNK, q_len, stride_t, head_col)
        mbarrier.arrive(dq_free.index(slot), count=1)


@gluon.jit
def _weights_t(st, i, n_tiles, q_len, slope, scale, a_layout: gl.constexpr):
    """From ``S^T`` of query step ``i``: ``P^T = phi(s S^T)`` as bf16 in the dV MMA's register-operand layout (query
    rows past the sample's end zeroed: the next sample's, or zeros past T) and ``phi'(s S^T)`` in fp32."""
    BLOCK_M: gl.constexpr = st.type.shape[1]
    gate_v = gl.minimum(gl.maximum(st * slope + 0.5, 0.0), 1.0)
    smooth = gate_v * gate_v * (3.0 - 2.0 * gate_v)
    pt = st * scale * smooth
    dphi = 4.0 * smooth - 3.0 * gate_v  # the one fp32 tile kept across the MMAs that follow
    if i == n_tiles - 1:
        cols = i * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st.type.layout))
        pt = gl.where(gl.expand_dims(cols < q_len, 0), pt, 0.0)
    return gl.convert_layout(pt.to(gl.bfloat16), a_layout), dphi


@gluon.jit
def _score_grads_t(dpt, dphi, cols, key_rows, i, n_tiles, q_len, keys, MASK_KEYS: gl.constexpr):
    """``dX^T = dP^T * phi'`` as bf16 (``cols``: the step's query rows, ``key_rows``: the tile's keys), query rows
    past the sample's end zeroed; with ``MASK_KEYS`` (a fused dQ) also key rows past it (the next sample's keys must
    not reach dQ)."""
    dxt = dpt * dphi
    if i == n_tiles - 1:
        dxt = gl.where(gl.expand_dims(cols < q_len, 0), dxt, 0.0)
    if MASK_KEYS:
        dxt = gl.where(gl.expand_dims(key_rows < keys, 1), dxt, 0.0)
    return dxt.to(gl.bfloat16)


@gluon.jit
def _store_key_grads(DK, DV, dk, dv, stride_t, key_row, keys, head_col, dk_scale, dv_scale):
    """A key tile's dK and dV, scaled as the Triton kernel scales them, rows past the sample's end not stored."""
    layout: gl.constexpr = dk.type.layout
    offs_n = gl.arange(0, dk.type.shape[0], layout=gl.SliceLayout(1, layout))
    offs_d = gl.arange(0, dk.type.shape[1], layout=gl.SliceLayout(0, layout))
    offsets = gl.expand_dims((key_row + offs_n).to(gl.int64) * stride_t, 1) + head_col + gl.expand_dims(offs_d, 0)
    valid = gl.expand_dims(offs_n < keys, 1)
    gl.store(DK + offsets, (dk * dk_scale).to(gl.bfloat16), mask=valid)
    gl.store(DV + offsets, (dv * dv_scale).to(gl.bfloat16), mask=valid)


@gluon.jit
def _stage_dxt(ds_smem, dxt, dq_bufs, DQ_ADD: gl.constexpr):
    """``dX^T`` into ``ds_smem`` for the ``dQ^T = K^T dX^T`` MMA (in one 8-warp partition it spans both warpgroups),
    once the previous step's dQ MMA has read it (and, with TMA adds, the reduce of the step that last used the dQ slot
    this step fills has read it: the issuing thread waits, the barrier tells the others)."""
    if DQ_ADD == 4:
        slots: gl.constexpr = dq_bufs.type.shape[0]
        tma.store_wait(slots - 1)
    gl.thread_barrier()
    ds_smem.store(dxt)
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _reduce_dq_tile(DQ_ACC, dq_bufs, dqt, i, row, head_col, dq_scale):
    """Query step ``i``'s ``dQ^T`` (fp32 ``[HEAD_DIM, BLOCK_M]``, registers) times ``dq_scale`` into slot
    ``i % slots`` as a ``[BLOCK_M, HEAD_DIM]`` tile, added into the fp32 sums at ``row`` by one TMA reduce-add
    (``DQ_ACC``: a descriptor); rows past the sample's end add zeros (their dX^T columns are zero). Scaled here, the
    sums need only a cast after the kernel, one pass over them instead of two."""
    slots: gl.constexpr = dq_bufs.type.shape[0]
    dq_slot = dq_bufs.index(i % slots)
    dq_slot.permute((1, 0)).store(dqt * dq_scale)
    fence_async_shared()
    gl.thread_barrier()
    tma_reduce_add(DQ_ACC, [row, head_col], dq_slot)


@gluon.jit
def _key_grads(k_smem, v_smem, q_bufs, do_bufs, q_ready, do_ready, q_empty, do_empty, ds_smem, dq_bufs, dq_full,
               dq_free, DK, DV, DQ_ACC, stride_t, key_row, keys, q_row, q_len, head_col, slope, scale, dk_scale,
               dv_scale, DQ_ADD: gl.constexpr, PIPELINED: gl.constexpr):
    """An MMA partition: :func:`_key_grads_pipelined` (dK and dV, and dQ by TMA adds) or
    :func:`_key_grads_stepwise`."""
    if PIPELINED:
        _key_grads_pipelined(k_smem, v_smem, q_bufs, do_bufs, q_ready, do_ready, q_empty, do_empty, ds_smem, dq_bufs,
                             DK, DV, DQ_ACC, stride_t, key_row, keys, q_row, q_len, head_col, slope, scale, dk_scale,
                             dv_scale, DQ_ADD)
    else:
        _key_grads_stepwise(k_smem, v_smem, q_bufs, do_bufs, q_ready, do_ready, q_empty, do_empty, ds_smem, dq_bufs,
                            dq_full, dq_free, DK, DV, DQ_ACC, stride_t, key_row, keys, q_row, q_len, head_col, slope,
                            scale, dk_scale, dv_scale, DQ_ADD)


@gluon.jit
def _key_grads_stepwise(k_smem, v_smem, q_bufs, do_bufs, q_ready, do_ready, q_empty, do_empty, ds_smem, dq_bufs,
                        dq_full, dq_free, DK, DV, DQ_ACC, stride_t, key_row, keys, q_row, q_len, head_col, slope,
                        scale, dk_scale, dv_scale, DQ_ADD: gl.constexpr):
    """An MMA partition over ``k_smem``'s ``BLOCK_N`` keys (128, or a 64-key half); ``DQ_ADD`` a value of
    ``DQ_ADDS`` (with 3, ``dq_bufs`` is this partition's two-slot ring to the writer, with 4 its two slots for the TMA
    reduces; ``dq_full`` and ``dq_free`` serve only 3, and otherwise ``dq_bufs`` is an unused stand-in too)."""
    stages: gl.constexpr = q_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = q_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = k_smem.type.shape[0]
    HEAD_DIM: gl.constexpr = k_smem.type.shape[1]
    num_warps: gl.constexpr = gl.num_warps()  # this partition's
    st_layout: gl.constexpr = wgmma_layout(BLOCK_M, num_warps)
    kv_layout: gl.constexpr = wgmma_layout(HEAD_DIM, num_warps)
    a_layout: gl.constexpr = wgmma_register_operand(kv_layout)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    zero_st = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)
    zero_dqt = gl.zeros([HEAD_DIM, BLOCK_M], gl.float32, st_layout)
    key_rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
    d_rows = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, st_layout)), 1)  # dQ^T's rows
    n_tiles = gl.cdiv(q_len, BLOCK_M)
    for i in range(n_tiles):
        s = i % stages
        phase = (i // stages) & 1
        mbarrier.wait(q_ready.index(s), phase)
        st = warpgroup_mma(k_smem, q_bufs.index(s).permute((1, 0)), zero_st, use_acc=False)
        pt, dphi = _weights_t(st, i, n_tiles, q_len, slope, scale, a_layout)
        mbarrier.wait(do_ready.index(s), phase)
        dv = warpgroup_mma(pt, do_bufs.index(s), dv, is_async=True)
        dpt = warpgroup_mma(v_smem, do_bufs.index(s).permute((1, 0)), zero_st, use_acc=False, is_async=True)
        dv, dpt, pt = warpgroup_mma_wait(0, deps=[dv, dpt, pt])
        cols = i * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
        dxt = _score_grads_t(dpt, dphi, cols, key_rows, i, n_tiles, q_len, keys, DQ_ADD > 0)
        dxt_a = gl.convert_layout(dxt, a_layout)
        dk = warpgroup_mma(dxt_a, q_bufs.index(s), dk, is_async=True)
        if DQ_ADD > 0:
            _stage_dxt(ds_smem, dxt, dq_bufs, DQ_ADD)
            dqt = warpgroup_mma(k_smem.permute((1, 0)), ds_smem, zero_dqt, use_acc=False)  # [HEAD_DIM, BLOCK_M]
            if DQ_ADD == 4:
                _reduce_dq_tile(DQ_ACC, dq_bufs, dqt, i, q_row + i * BLOCK_M, head_col, dk_scale)  # dQ's scale too
            elif DQ_ADD == 3:  # to the writer partition
                slot = i % 2
                mbarrier.wait(dq_free.index(slot), ((i // 2) & 1) ^ 1)
                dq_bufs.index(slot).store(dqt)
                mbarrier.arrive(dq_full.index(slot), count=1)
            elif DQ_ADD == 2:  # four consecutive head-dim columns a thread (the MMA layout holds pairs of query rows)
                dq_layout: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, num_warps], [0, 1])
                _add_dq_tile(DQ_ACC, gl.convert_layout(dqt, dq_layout), q_row, i * BLOCK_M, q_len, stride_t, head_col)
            else:
                dq_ptrs = DQ_ACC + gl.expand_dims((q_row + cols).to(gl.int64) * stride_t, 0) + head_col + d_rows
                gl.atomic_add(dq_ptrs, dqt, mask=gl.expand_dims(cols < q_len, 0), sem="relaxed")
        dk, dxt_a = warpgroup_mma_wait(0, deps=[dk, dxt_a])  # dX^T's registers stay live until its MMA retires
        mbarrier.arrive(q_empty.index(s), count=1)
        mbarrier.arrive(do_empty.index(s), count=1)
    if DQ_ADD == 4:
        tma.store_wait(0)  # the last reduces have read their slots before the program's shared memory goes
    _store_key_grads(DK, DV, dk, dv, stride_t, key_row, keys, head_col, dk_scale, dv_scale)


@gluon.jit
def _key_products(dxt, dk, q_smem, k_smem, ds_smem, dq_bufs, zero_dqt, a_layout: gl.constexpr, DQ_ADD: gl.constexpr):
    """Issue ``dK += dX^T Q`` (``dX^T`` from registers) and, with TMA dQ adds, ``dQ^T = K^T dX^T`` (``dX^T`` through
    ``ds_smem``), both asynchronous; ``(dk, dX^T operand, dqt)``, ``dqt`` = ``zero_dqt`` without dQ. (dK's operand
    from ``ds_smem`` too spilled more at sm_90 in one partition: 216 B against 192.)"""
    dxt_a = gl.convert_layout(dxt, a_layout)
    dk = warpgroup_mma(dxt_a, q_smem, dk, is_async=True)
    dqt = zero_dqt
    if DQ_ADD == 4:
        _stage_dxt(ds_smem, dxt, dq_bufs, DQ_ADD)
        dqt = warpgroup_mma(k_smem.permute((1, 0)), ds_smem, zero_dqt, use_acc=False, is_async=True)
    return dk, dxt_a, dqt


@gluon.jit
def _key_grads_pipelined(k_smem, v_smem, q_bufs, do_bufs, q_ready, do_ready, q_empty, do_empty, ds_smem, dq_bufs, DK,
                         DV, DQ_ACC, stride_t, key_row, keys, q_row, q_len, head_col, slope, scale, dk_scale, dv_scale,
                         DQ_ADD: gl.constexpr):
    """dK and dV (with ``DQ_ADD`` 4 also dQ, added by TMA reduces: FlashAttention-3's backward loop), software-pipelined
    inside the warpgroup (FlashAttention-3's in-warpgroup overlap): step i+1's ``S^T`` is issued behind step i's
    ``dV`` and ``dP^T`` MMAs, so ``dX^T_i`` is formed while it runs, and ``P^T_{i+1}`` while ``dK += dX^T_i Q_i`` (and
    ``dQ^T_i``) run. In-order retirement orders the waits."""
    stages: gl.constexpr = q_bufs.type.shape[0]
    BLOCK_M: gl.constexpr = q_bufs.type.shape[1]
    BLOCK_N: gl.constexpr = k_smem.type.shape[0]
    HEAD_DIM: gl.constexpr = k_smem.type.shape[1]
    st_layout: gl.constexpr = wgmma_layout(BLOCK_M, gl.num_warps())
    kv_layout: gl.constexpr = wgmma_layout(HEAD_DIM, gl.num_warps())
    a_layout: gl.constexpr = wgmma_register_operand(kv_layout)
    BEHIND_NEXT_S: gl.constexpr = 2 if DQ_ADD == 4 else 1  # MMAs issued after S^T_{i+1}: dK (and dQ^T)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    zero_st = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)
    zero_dqt = gl.zeros([HEAD_DIM, BLOCK_M], gl.float32, st_layout)
    key_rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
    n_tiles = gl.cdiv(q_len, BLOCK_M)
    mbarrier.wait(q_ready.index(0), 0)
    st = warpgroup_mma(k_smem, q_bufs.index(0).permute((1, 0)), zero_st, use_acc=False)
    pt, dphi = _weights_t(st, 0, n_tiles, q_len, slope, scale, a_layout)
    for i in range(n_tiles - 1):
        s = i % stages
        nxt = (i + 1) % stages
        mbarrier.wait(do_ready.index(s), (i // stages) & 1)
        dv = warpgroup_mma(pt, do_bufs.index(s), dv, is_async=True)
        dpt = warpgroup_mma(v_smem, do_bufs.index(s).permute((1, 0)), zero_st, use_acc=False, is_async=True)
        mbarrier.wait(q_ready.index(nxt), ((i + 1) // stages) & 1)
        st = warpgroup_mma(k_smem, q_bufs.index(nxt).permute((1, 0)), zero_st, use_acc=False, is_async=True)
        dv, dpt, pt = warpgroup_mma_wait(1, deps=[dv, dpt, pt])  # dV_i and dP^T_i retired; S^T_{i+1} may run on
        cols = i * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
        dxt = _score_grads_t(dpt, dphi, cols, key_rows, i, n_tiles, q_len, keys, DQ_ADD > 0)
        dk, dxt_a, dqt = _key_products(dxt, dk, q_bufs.index(s), k_smem, ds_smem, dq_bufs, zero_dqt, a_layout, DQ_ADD)
        st = warpgroup_mma_wait(BEHIND_NEXT_S, deps=[st])  # S^T_{i+1} retired; dK_i (and dQ^T_i) may run on
        pt, dphi = _weights_t(st, i + 1, n_tiles, q_len, slope, scale, a_layout)
        dk = _retire_step(dk, dxt_a, dqt, q_empty, do_empty, s, DQ_ACC, dq_bufs, i, q_row + i * BLOCK_M, head_col,
                          dk_scale, DQ_ADD)
    last = n_tiles - 1
    s = last % stages
    mbarrier.wait(do_ready.index(s), (last // stages) & 1)
    dv = warpgroup_mma(pt, do_bufs.index(s), dv, is_async=True)
    dpt = warpgroup_mma(v_smem, do_bufs.index(s).permute((1, 0)), zero_st, use_acc=False, is_async=True)
    dv, dpt, pt = warpgroup_mma_wait(0, deps=[dv, dpt, pt])
    cols = last * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
    dxt = _score_grads_t(dpt, dphi, cols, key_rows, last, n_tiles, q_len, keys, DQ_ADD > 0)
    dk, dxt_a, dqt = _key_products(dxt, dk, q_bufs.index(s), k_smem, ds_smem, dq_bufs, zero_dqt, a_layout, DQ_ADD)
    dk = _retire_step(dk, dxt_a, dqt, q_empty, do_empty, s, DQ_ACC, dq_bufs, last, q_row + last * BLOCK_M, head_col,
                      dk_scale, DQ_ADD)
    if DQ_ADD == 4:
        tma.store_wait(0)  # the last reduces have read their slots before the program's shared memory goes
    _store_key_grads(DK, DV, dk, dv, stride_t, key_row, keys, head_col, dk_scale, dv_scale)


@gluon.jit
def _retire_step(dk, dxt_a, dqt, q_empty, do_empty, s, DQ_ACC, dq_bufs, i, row, head_col, dq_scale,
                 DQ_ADD: gl.constexpr):
    """The end of a pipelined step: its ``dK`` (and ``dQ^T``) MMAs retired (``dX^T``'s registers live until then),
    ``dQ^T`` handed to the TMA, the stage freed."""
    dk, dxt_a, dqt = warpgroup_mma_wait(0, deps=[dk, dxt_a, dqt])
    if DQ_ADD == 4:
        _reduce_dq_tile(DQ_ACC, dq_bufs, dqt, i, row, head_col, dq_scale)
    mbarrier.arrive(q_empty.index(s), count=1)
    mbarrier.arrive(do_empty.index(s), count=1)
    return dk


@gluon.jit
def _dq_ring(PARTITIONS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr):
    """An MMA partition's two-slot ring of fp32 dQ^T tiles to the writer and the barriers all
    the rings share: ``dq_full`` completes when all ``PARTITIONS`` MMA partitions have stored their tile,
    ``dq_free`` when the writer has added them. (One buffer of all partitions' rings, sliced, crashes triton 3.6.)"""
    head_dim_contiguous: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0, 1])
    dq_bufs = gl.allocate_shared_memory(gl.float32, [2, HEAD_DIM, BLOCK_M], head_dim_contiguous)
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(dq_full.index(i), count=PARTITIONS)
        mbarrier.init(dq_free.index(i), count=1)
    return dq_bufs, dq_full, dq_free


@gluon.jit
def _tma_dq_ring(DQ_ACC, stand_in, DQ_ADD: gl.constexpr, DQ_SLOTS: gl.constexpr):
    """With TMA reduce-adds (``DQ_ADD`` 4, ``DQ_ACC`` a descriptor), an MMA partition's ``DQ_SLOTS`` slots of dQ
    tiles for them; else ``stand_in``, unused."""
    if DQ_ADD == 4:
        return gl.allocate_shared_memory(gl.float32, [DQ_SLOTS] + DQ_ACC.block_type.shape, DQ_ACC.layout)
    else:
        return stand_in


@gluon.jit
def _load_key_tile(k_desc, v_desc, row, head_col):
    """This program's K and V tiles, loaded once."""
    k_smem = gl.allocate_shared_memory(k_desc.dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, v_desc.block_type.shape, v_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row, head_col], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [row, head_col], kv_bar, v_smem)
    mbarrier.wait(kv_bar, 0)
    return k_smem, v_smem, kv_bar


@gluon.jit
def _key_halves(k_smem, v_smem, q_desc, do_desc, DK, DV, DQ_ACC, stride_t, start, length, key_row, keys, head_col,
                slope, scale, dk_scale, dv_scale, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, DQ_ADD: gl.constexpr,
                PIPELINED: gl.constexpr, DS_LAYOUT: gl.constexpr, DQ_SLOTS: gl.constexpr):
    """An MMA partition a 64-key half, as the forward's two consumers: they share the Q/dO ring (freed by both) and
    stop meeting at every barrier; each keeps its own dX^T tile, and with the writer its own dQ^T ring (the writer
    sums the two partials)."""
    half: gl.constexpr = k_smem.type.shape[0] // 2
    HEAD_DIM: gl.constexpr = k_smem.type.shape[1]
    q_bufs, do_bufs, q_ready, do_ready, q_empty, do_empty = stage_ring(q_desc, do_desc, STAGES, 2)
    ds_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, half, BLOCK_M], DS_LAYOUT)  # each half's dX^T
    # the partitions' arguments written out: a tuple built with ``+`` turns constexprs into tensors
    if DQ_ADD == 3:
        dq_bufs, dq_full, dq_free = _dq_ring(2, HEAD_DIM, BLOCK_M)
        dq_bufs_b = gl.allocate_shared_memory(gl.float32, dq_bufs.type.shape, dq_bufs.layout)  # the second half's
        gl.warp_specialize([
            (_key_grads, (k_smem.slice(0, half), v_smem.slice(0, half), q_bufs, do_bufs, q_ready, do_ready, q_empty,
                          do_empty, ds_bufs.index(0), dq_bufs, dq_full, dq_free, DK, DV, DQ_ACC, stride_t,
                          key_row, keys, start, length, head_col, slope, scale, dk_scale, dv_scale, DQ_ADD, PIPELINED)),
            (_key_grads, (k_smem.slice(half, half), v_smem.slice(half, half), q_bufs, do_bufs, q_ready, do_ready,
                          q_empty, do_empty, ds_bufs.index(1), dq_bufs_b, dq_full, dq_free, DK, DV, DQ_ACC,
                          stride_t, key_row + half, keys - half, start, length, head_col, slope, scale, dk_scale,
                          dv_scale, DQ_ADD, PIPELINED)),
            (fill_ring, (q_desc, do_desc, q_bufs, do_bufs, q_ready, do_ready, q_empty, do_empty, start, length,
                         head_col, 0, BLOCK_M)),
            (_write_dq, (dq_bufs, dq_bufs_b, dq_full, dq_free, DQ_ACC, stride_t, start, length, head_col, BLOCK_M,
                         True)),
        ], [4, 1, 4], [MMA_REGISTERS_HALVES, 24, DQ_WRITER_REGISTERS])
    else:  # dK and dV only, stepwise or pipelined, or each half's dQ partial added by its own TMA reduces
        dq_ring_a = _tma_dq_ring(DQ_ACC, ds_bufs, DQ_ADD, DQ_SLOTS)
        dq_ring_b = _tma_dq_ring(DQ_ACC, ds_bufs, DQ_ADD, DQ_SLOTS)
        gl.warp_specialize([
            (_key_grads, (k_smem.slice(0, half), v_smem.slice(0, half), q_bufs, do_bufs, q_ready, do_ready, q_empty,
                          do_empty, ds_bufs.index(0), dq_ring_a, q_ready, q_ready, DK, DV, DQ_ACC, stride_t, key_row,
                          keys, start, length, head_col, slope, scale, dk_scale, dv_scale, DQ_ADD, PIPELINED)),
            (_key_grads, (k_smem.slice(half, half), v_smem.slice(half, half), q_bufs, do_bufs, q_ready, do_ready,
                          q_empty, do_empty, ds_bufs.index(1), dq_ring_b, q_ready, q_ready, DK, DV, DQ_ACC, stride_t,
                          key_row + half, keys - half, start, length, head_col, slope, scale, dk_scale, dv_scale,
                          DQ_ADD, PIPELINED)),
            (fill_ring, (q_desc, do_desc, q_bufs, do_bufs, q_ready, do_ready, q_empty, do_empty, start, length,
                         head_col, 0, BLOCK_M)),
        ], [4, 1], [MMA_REGISTERS_HALVES_NO_WRITER, 24])


@gluon.jit
def _key_whole(k_smem, v_smem, kv_bar, q_desc, do_desc, DK, DV, DQ_ACC, stride_t, start, length, key_row, keys,
               head_col, slope, scale, dk_scale, dv_scale, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
               DQ_ADD: gl.constexpr, PIPELINED: gl.constexpr, DS_LAYOUT: gl.constexpr, DQ_SLOTS: gl.constexpr):
    """One MMA partition over all the program's keys (128 in 8 warps, session 40's form, or 64 in 4); with the writer,
    a 4-warp writer partition."""
    BLOCK_N: gl.constexpr = k_smem.type.shape[0]
    HEAD_DIM: gl.constexpr = k_smem.type.shape[1]
    q_bufs, do_bufs, q_ready, do_ready, q_empty, do_empty = stage_ring(q_desc, do_desc, STAGES, 1)
    ds_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, BLOCK_M], DS_LAYOUT)  # dX^T, for the fused dQ
    if DQ_ADD == 3:
        dq_bufs, dq_full, dq_free = _dq_ring(1, HEAD_DIM, BLOCK_M)
        gl.warp_specialize([
            (_key_grads, (k_smem, v_smem, q_bufs, do_bufs, q_ready, do_ready, q_empty, do_empty, ds_smem, dq_bufs,
                          dq_full, dq_free, DK, DV, DQ_ACC, stride_t, key_row, keys, start, length, head_col, slope,
                          scale, dk_scale, dv_scale, DQ_ADD, PIPELINED)),
            (fill_ring, (q_desc, do_desc, q_bufs, do_bufs, q_ready, do_ready, q_empty, do_empty, start, length,
                         head_col, 0, BLOCK_M)),
            (_write_dq, (dq_bufs, dq_bufs, dq_full, dq_free, DQ_ACC, stride_t, start, length, head_col, BLOCK_M,
                         False)),
        ], [1, 4], [24, DQ_WRITER_REGISTERS])
    else:  # dK and dV only, or dQ added by TMA reduces
        dq_ring = _tma_dq_ring(DQ_ACC, ds_smem, DQ_ADD, DQ_SLOTS)
        gl.warp_specialize([
            (_key_grads, (k_smem, v_smem, q_bufs, do_bufs, q_ready, do_ready, q_empty, do_empty, ds_smem, dq_ring,
                          kv_bar, kv_bar, DK, DV, DQ_ACC, stride_t, key_row, keys, start, length, head_col, slope,
                          scale, dk_scale, dv_scale, DQ_ADD, PIPELINED)),
            (fill_ring, (q_desc, do_desc, q_bufs, do_bufs, q_ready, do_ready, q_empty, do_empty, start, length,
                         head_col, 0, BLOCK_M)),
        ], [1], [24])


@gluon.jit
def gluon_gdpa_dkdv_kernel(q_desc, do_desc, k_desc, v_desc, DK, DV, DQ_ACC, stride_t, item_start, item_len, item_n,
                           slope, scale, dk_scale, dv_scale, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                           DQ_ADD: gl.constexpr, HALVES: gl.constexpr, PIPELINED: gl.constexpr,
                           DS_LAYOUT: gl.constexpr, DQ_SLOTS: gl.constexpr, num_warps: gl.constexpr):
    """One program per (key tile of one sample, head)."""
    start, length, n_start = scheduled_item(item_start, item_len, item_n)
    head_col = gl.program_id(1) * k_desc.block_type.shape[1]
    key_row, keys = start + n_start, length - n_start
    k_smem, v_smem, kv_bar = _load_key_tile(k_desc, v_desc, key_row, head_col)
    if HALVES:
        _key_halves(k_smem, v_smem, q_desc, do_desc, DK, DV, DQ_ACC, stride_t, start, length, key_row, keys, head_col,
                    slope, scale, dk_scale, dv_scale, BLOCK_M, STAGES, DQ_ADD, PIPELINED, DS_LAYOUT,
                    DQ_SLOTS)
    else:
        _key_whole(k_smem, v_smem, kv_bar, q_desc, do_desc, DK, DV, DQ_ACC, stride_t, start, length, key_row, keys,
                   head_col, slope, scale, dk_scale, dv_scale, BLOCK_M, STAGES, DQ_ADD, PIPELINED, DS_LAYOUT,
                   DQ_SLOTS)


def gluon_gdpa_dkdv(q, k, v, dout, schedule: tuple[torch.Tensor, ...], max_len: int, pre_scale: float,
                    variant: Variant, poison: bool = False) -> tuple[torch.Tensor | None, ...]:
    """``(dQ or None, dK, dV)`` of fast_gelu GDPA self-attention with ``norm="max_len"``; ``schedule``:
    ``tile_schedule`` of the lengths in tiles of ``variant.block_n`` keys. With ``variant.fused_dq`` dQ is added in
    fp32 by every key tile's program (atomics or TMA reduce-adds: not bitwise repeatable), then scaled into bf16.
    ``poison``: dK and dV start as NaN, so a row the kernel never stores shows (``torch.empty_like`` may hand back
    the previous variant's, or the reference's, freed gradients: session 43's `_n64` rows)."""
    variant.check()
    block_m, fused_dq = variant.block_m, variant.fused_dq
    T, H, D = q.shape
    tensors = (q, k, v, dout)
    if D != HEAD_DIM or any(t.dtype != torch.bfloat16 or not t.is_contiguous() or t.shape != q.shape for t in tensors):
        raise ValueError(f"needs contiguous bf16 [T, H, {HEAD_DIM}] q, k, v and dout of one shape")

    def desc(t: torch.Tensor, rows: int):
        layout = gl.NVMMASharedLayout.get_default_for([rows, D], gl.bfloat16)
        return TensorDescriptor.from_tensor(t.view(T, H * D), [rows, D], layout)

    dk, dv = (torch.full_like(t, math.nan) if poison else torch.empty_like(t) for t in (k, v))
    if fused_dq:
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # the fp32 dQ sums
    else:
        dq_acc = torch.empty(1, dtype=torch.float32, device=q.device)  # a stand-in the kernel never touches
    dq_target = dq_acc  # with TMA reduce-adds, a descriptor of [block_m, D] tiles of it
    if variant.dq == "tma":
        tile_layout = gl.NVMMASharedLayout.get_default_for([block_m, D], gl.float32)
        dq_target = TensorDescriptor.from_tensor(dq_acc.view(T, H * D), [block_m, D], tile_layout)
    item_start, item_len, item_n = schedule
    out_scale = 1.0 / max_len
    gluon_gdpa_dkdv_kernel[(item_start.numel(), H)](
        desc(q, block_m), desc(dout, block_m), desc(k, variant.block_n), desc(v, variant.block_n), dk, dv, dq_target,
        H * D, item_start, item_len, item_n, pre_scale * FAST_GELU_SLOPE, pre_scale, pre_scale * out_scale, out_scale,
        block_m, variant.stages, DQ_ADDS[variant.dq], variant.halves, variant.pipelined, variant.ds_layout,
        variant.dq_slots, num_warps=variant.num_warps, maxnreg=variant.maxnreg)
    dq = None
    if variant.dq == "tma":  # scaled in the kernel
        dq = dq_acc.to(torch.bfloat16)
    elif fused_dq:
        dq = (dq_acc * (pre_scale * out_scale)).to(torch.bfloat16)
    return dq, dk, dv


def compile_only(variant: Variant) -> dict[str, object]:
    """Build the kernel for sm_90 without a GPU; registers, stack, shared memory and key SASS opcodes."""
    variant.check()
    block_m = variant.block_m
    constants = {"BLOCK_M": block_m, "STAGES": variant.stages, "DQ_ADD": DQ_ADDS[variant.dq],
                 "HALVES": variant.halves, "PIPELINED": variant.pipelined, "DS_LAYOUT": variant.ds_layout,
                 "DQ_SLOTS": variant.dq_slots,
                 "num_warps": variant.num_warps}
    signature = {"q_desc": descriptor_type(block_m, HEAD_DIM), "do_desc": descriptor_type(block_m, HEAD_DIM),
                 "k_desc": descriptor_type(variant.block_n, HEAD_DIM),
                 "v_desc": descriptor_type(variant.block_n, HEAD_DIM),
                 "DK": "*bf16", "DV": "*bf16",
                 "DQ_ACC": descriptor_type(block_m, HEAD_DIM, "fp32") if variant.dq == "tma" else "*fp32",
                 "stride_t": "i32", "item_start": "*i32", "item_len": "*i32", "item_n": "*i32", "slope": "fp32",
                 "scale": "fp32", "dk_scale": "fp32", "dv_scale": "fp32"}
    return sm90_resources(gluon_gdpa_dkdv_kernel, signature, constants, variant.num_warps, maxnreg=variant.maxnreg)
