"""GDPA's forward as a persistent, warp-specialized Gluon kernel for Hopper (FlashAttention-3's structure).

One program an SM loops over the (query tile of 128 rows, head) work items, longest samples first. A one-warp worker
TMA-loads each item's Q tile into a two-slot ring and its sample's K and V tiles into a ring of stages, running ahead
into the next item. Two 4-warp consumer partitions take 64 query rows each:
- tile j+1's ``S = Q K^T`` is issued before tile j's ``P V``, so ``phi(S)`` runs on the CUDA cores while ``P V``
  is on the tensor cores (the in-warpgroup overlap);
- a K buffer is freed as soon as its ``S`` retires;
- the two consumers take turns issuing their MMAs (ping-pong), so one's activation runs while the other's MMAs hold
  the tensor cores.

The Triton forward (``opengem.ops.triton.gdpa``) runs one 64- or 128-row tile a program. On an H100, issue 4's (a) rows,
this loop in the Gluon diag ran 1.00-1.14x it and 0.98-1.19x our JFA, same run (session 43,
``gluon_gdpa_forward_s47ab``, where the Triton peer was the whole op call and the Gluon kernel ran on a prebuilt
table). Inside the op, where the tuner times every candidate's launch alike, it lost on every (a) row: 0.78-0.94x the
best Triton candidate with each work item read in two dependent rounds of loads (``gdpa_s48a``), 0.84-0.99x with one
(:func:`_work_item`; session 45, ``gdpa_s48a2``). It serves unmasked, non-broadcast GDPA with one activation for all
heads, bf16, D = 128 (:func:`unsupported` says what else); with ``OPENGEM_GDPA_GLUON=auto`` (opt-in, since it has not
won a tuning yet), ``opengem.ops.triton.gdpa`` times it as one more candidate of its forward tuner.
"""

from __future__ import annotations

import numpy as np
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from opengem.ops.gluon import GDPA_FORWARD_BLOCK_M, GDPA_FORWARD_BLOCK_N, GDPA_FORWARD_STAGES
from opengem.ops.gluon.hopper import (fill_ring, launch_registers, stage_ring, wgmma_layout,
                                      wgmma_register_operand)
from opengem.ops.triton.activations import scaled_activation_value

HEAD_DIM = 128
BLOCK_M, BLOCK_N, STAGES = GDPA_FORWARD_BLOCK_M, GDPA_FORWARD_BLOCK_N, GDPA_FORWARD_STAGES
CONSUMER_WARPS = gl.constexpr(4)
LAUNCH_REGISTERS = launch_registers(2 * CONSUMER_WARPS.value + 4)  # the loader's warp padded to a warpgroup: 168
CONSUMER_REGISTERS = gl.constexpr(240)  # after setmaxnreg; the loader keeps 24


def unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, *, masked: bool,
                broadcast_q: bool, uniform_activation: bool, p_mx: bool, q_lengths: np.ndarray,
                k_lengths: np.ndarray) -> str | None:
    """Why this kernel cannot compute the call, or None: the conditions it was written and tested for."""
    if masked or broadcast_q or p_mx:
        return "masks, broadcast-Q and MX-quantized P take the Triton kernel"
    if not uniform_activation:
        return "per-head activations take the Triton kernel"
    if any(t.dtype != torch.bfloat16 or t.shape[2] != HEAD_DIM for t in (q, k, v, out)):
        return f"needs bf16 q, k, v and out with head_dim {HEAD_DIM}"
    if any(t.stride(2) != 1 or t.stride(1) != HEAD_DIM or t.stride(0) * 2 % 16 or t.data_ptr() % 16
           for t in (q, k, v, out)):
        return "needs heads packed along each row (stride(1) == head_dim) and 16-byte aligned rows"
    if bool(np.any((q_lengths > 0) & (k_lengths == 0))):
        return "a sample with queries and no keys takes the Triton kernel (its output is zeros)"
    return None


@gluon.jit
def _activate(scores, j, n_tiles, key_len, scale, ACT: gl.constexpr, FAST: gl.constexpr, BLOCK_N: gl.constexpr,
              s_layout: gl.constexpr, p_layout: gl.constexpr):
    """``phi(scale * S)`` (the op's own activation code) as bf16 in the second MMA's register-operand layout; keys
    past ``key_len`` give 0."""
    p = scaled_activation_value(scores, scale, ACT, FAST)
    if j == n_tiles - 1:  # keys past the sample's end: the next sample's rows, or zeros past T
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        p = gl.where(gl.expand_dims(cols < key_len, 0), p, 0.0)
    return gl.convert_layout(p.to(gl.bfloat16), p_layout)


@gluon.jit
def take_turn(my_turn, group, FIRST: gl.constexpr):
    """Wait until this partition may issue its MMA group ``group``: the first partition's group g follows the other's
    group g - 1 (a fresh barrier counts as phase 1 complete), the second's follows the first's group g."""
    if FIRST:
        mbarrier.wait(my_turn, (group & 1) ^ 1)
    else:
        mbarrier.wait(my_turn, group & 1)


@gluon.jit
def attend_tile(q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, my_turn, their_turn, Out, stride_ot,
                out_row, rows, key_len, out_col, scale, out_scale, tile0, group0, ACT: gl.constexpr,
                FAST: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, EARLY_K: gl.constexpr,
                PINGPONG: gl.constexpr, FIRST: gl.constexpr):
    """One consumer partition's query rows (``q_smem``, 64 a warpgroup) against every key tile of the sample, with
    FlashAttention-3's in-warpgroup overlap: tile j+1's ``S`` is issued before tile j's ``P V``, and phi(S_{j+1}) runs
    on the CUDA cores while P_j V_j is still on the tensor cores. The key tiles take ring positions ``tile0``,
    ``tile0 + 1``, ... (a persistent program's tiles run through the ring across its work items) and ping-pong issue
    groups ``group0`` .. ``group0 + n_tiles``; ``key_len`` >= 1.

    With ``EARLY_K`` a K buffer is freed as soon as its ``S`` MMA retires, so the worker refills it while ``P V`` runs;
    otherwise K and V are freed together after ``P V``. With ``PINGPONG`` (two consumer partitions) the partitions
    take turns issuing their MMAs (FlashAttention-3's warp scheduler barrier): one's activation runs while the other's
    MMAs hold the tensor cores; ``FIRST`` says which goes first."""
    BLOCK_M: gl.constexpr = q_smem.type.shape[0]
    stages: gl.constexpr = k_bufs.type.shape[0]
    num_warps: gl.constexpr = gl.num_warps()  # this partition's
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N, num_warps)
    o_layout: gl.constexpr = wgmma_layout(HEAD_DIM, num_warps)
    p_layout: gl.constexpr = wgmma_register_operand(o_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    n_tiles = gl.cdiv(key_len, BLOCK_N)
    first = tile0 % stages
    mbarrier.wait(k_ready.index(first), (tile0 // stages) & 1)
    if PINGPONG:
        take_turn(my_turn, group0, FIRST)
    scores = warpgroup_mma(q_smem, k_bufs.index(first).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(their_turn, count=1)
    scores = warpgroup_mma_wait(0, deps=[scores])
    if EARLY_K:
        mbarrier.arrive(k_empty.index(first), count=1)
    p = _activate(scores, 0, n_tiles, key_len, scale, ACT, FAST, BLOCK_N, s_layout, p_layout)
    for j in range(n_tiles - 1):
        s = (tile0 + j) % stages
        nxt = (tile0 + j + 1) % stages
        mbarrier.wait(k_ready.index(nxt), ((tile0 + j + 1) // stages) & 1)
        mbarrier.wait(v_ready.index(s), ((tile0 + j) // stages) & 1)
        if PINGPONG:
            take_turn(my_turn, group0 + j + 1, FIRST)
        scores = warpgroup_mma(q_smem, k_bufs.index(nxt).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        acc = warpgroup_mma(p, v_bufs.index(s), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(their_turn, count=1)
        scores = warpgroup_mma_wait(1, deps=[scores])  # in-order retirement: S_{j+1} done, P_j V_j may run on
        if EARLY_K:
            mbarrier.arrive(k_empty.index(nxt), count=1)
        p_next = _activate(scores, j + 1, n_tiles, key_len, scale, ACT, FAST, BLOCK_N, s_layout, p_layout)
        acc, p = warpgroup_mma_wait(0, deps=[acc, p])  # P_j's registers stay live until its MMA retires
        if not EARLY_K:
            mbarrier.arrive(k_empty.index(s), count=1)
        mbarrier.arrive(v_empty.index(s), count=1)
        p = p_next
    last = (tile0 + n_tiles - 1) % stages
    mbarrier.wait(v_ready.index(last), ((tile0 + n_tiles - 1) // stages) & 1)
    if PINGPONG:
        take_turn(my_turn, group0 + n_tiles, FIRST)  # the last of n_tiles + 1 issue groups
    acc = warpgroup_mma(p, v_bufs.index(last), acc, is_async=True)
    if PINGPONG:
        mbarrier.arrive(their_turn, count=1)
    acc = warpgroup_mma_wait(0, deps=[acc])
    if not EARLY_K:
        mbarrier.arrive(k_empty.index(last), count=1)
    mbarrier.arrive(v_empty.index(last), count=1)
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    ptrs = Out + gl.expand_dims((out_row + offs_m).to(gl.int64) * stride_ot, 1) + out_col + gl.expand_dims(offs_d, 0)
    gl.store(ptrs, (acc * out_scale).to(gl.bfloat16), mask=gl.expand_dims(offs_m < rows, 1))


@gluon.jit
def turn_barriers():
    """The two ping-pong barriers: a partition waits on its own, then arrives on the other's."""
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turns.index(0), count=1)
    mbarrier.init(turns.index(1), count=1)
    return turns


@gluon.jit
def _work_item(w, items, heads, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Work item ``w``: ``(first query row, query rows from it to the sample's end, first key row, keys, head column,
    its K/V head's column)``; items are (query tile, head) pairs, the table's tiles outermost so the longest samples
    go first. The table's four numbers are independent loads: one round of latency before the item's first MMA."""
    row = items + (w // heads) * 4
    head = w % heads
    return (gl.load(row), gl.load(row + 1), gl.load(row + 2), gl.load(row + 3), head * HEAD_DIM,
            (head // GROUP) * HEAD_DIM)


@gluon.jit
def _attend_items(q_bufs, q_ready, q_empty, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, my_turn, their_turn,
                  Out, stride_ot, items, n_work, heads, scale, out_scale,
                  ROW0: gl.constexpr, GROUP: gl.constexpr, ACT: gl.constexpr, FAST: gl.constexpr,
                  BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, FIRST: gl.constexpr):
    """A consumer partition: rows ``ROW0 .. ROW0 + 63`` of every work item ``program_id, program_id + programs,
    ...``, their Q tile from the two-slot Q ring, their key tiles' ring positions and ping-pong groups carried over
    from item to item."""
    half: gl.constexpr = q_bufs.type.shape[1] // 2
    tile = 0
    group = 0
    k = 0
    for w in range(gl.program_id(0), n_work, gl.num_programs(0)):
        q_row, rows, k_start, k_len, out_col, kv_col = _work_item(w, items, heads, GROUP, HEAD_DIM)
        slot = k % 2
        mbarrier.wait(q_ready.index(slot), (k // 2) & 1)
        attend_tile(q_bufs.index(slot).slice(ROW0, half), k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, my_turn,
                    their_turn, Out, stride_ot, q_row + ROW0, rows - ROW0, k_len, out_col,
                    scale, out_scale, tile, group, ACT, FAST, BLOCK_N, HEAD_DIM, True, True, FIRST)
        mbarrier.arrive(q_empty.index(slot), count=1)  # attend_tile's last wait retired every MMA reading it
        n_tiles = gl.cdiv(k_len, BLOCK_N)
        tile += n_tiles
        group += n_tiles + 1
        k += 1


@gluon.jit
def _fill_items(q_desc, k_desc, v_desc, q_bufs, q_ready, q_empty, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
                items, n_work, heads, GROUP: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """The TMA-load worker: each work item's Q tile into the Q ring, then its sample's K and V tiles into the K/V
    ring, so the next item's loads start while the consumers finish the current one."""
    tile = 0
    k = 0
    for w in range(gl.program_id(0), n_work, gl.num_programs(0)):
        q_row, rows, k_start, k_len, q_col, kv_col = _work_item(w, items, heads, GROUP, HEAD_DIM)
        slot = k % 2
        mbarrier.wait(q_empty.index(slot), ((k // 2) & 1) ^ 1)
        mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_ready.index(slot), q_bufs.index(slot))
        fill_ring(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, k_start, k_len, kv_col, tile,
                  BLOCK_N)
        tile += gl.cdiv(k_len, BLOCK_N)
        k += 1


@gluon.jit
def gdpa_fwd_persistent_kernel(q_desc, k_desc, v_desc, Out, stride_ot, items, n_work, heads, scale, out_scale,
                               GROUP: gl.constexpr, ACT: gl.constexpr, FAST: gl.constexpr,
                               BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                               num_warps: gl.constexpr):
    """One program an SM over the (query tile, head) work items: two consumer partitions and a loader."""
    k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty = stage_ring(k_desc, v_desc, STAGES, 2)
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
    turns = turn_barriers()
    # the partitions' arguments written out: a tuple built with ``+`` turns constexprs into tensors (triton 3.6)
    gl.warp_specialize([
        (_attend_items, (q_bufs, q_ready, q_empty, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns.index(0),
                         turns.index(1), Out, stride_ot, items, n_work, heads, scale, out_scale, 0, GROUP, ACT, FAST,
                         BLOCK_N, HEAD_DIM, True)),
        (_attend_items, (q_bufs, q_ready, q_empty, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns.index(1),
                         turns.index(0), Out, stride_ot, items, n_work, heads, scale, out_scale, 64, GROUP, ACT, FAST,
                         BLOCK_N, HEAD_DIM, False)),
        (_fill_items, (q_desc, k_desc, v_desc, q_bufs, q_ready, q_empty, k_bufs, v_bufs, k_ready, v_ready, k_empty,
                       v_empty, items, n_work, heads, GROUP, BLOCK_N, HEAD_DIM)),
    ], [CONSUMER_WARPS, 1], [CONSUMER_REGISTERS, 24])


def row_descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """``t [T, H, D]`` (heads packed along each row) as a 2-D ``[T, H * D]`` tensor read in ``[rows, D]`` boxes: one
    head of ``rows`` tokens; rows past T read as zeros."""
    layout = gl.NVMMASharedLayout.get_default_for([rows, t.shape[2]], gl.bfloat16)
    return TensorDescriptor(t, [t.shape[0], t.shape[1] * t.shape[2]], [t.stride(0), 1], [rows, t.shape[2]], layout)


def gdpa_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, items: torch.Tensor,
                 activation: int, fast: bool, pre_scale: float, out_scale: float, programs: int | None = None, *,
                 block_n: int = BLOCK_N, stages: int = STAGES) -> torch.Tensor:
    """``out = out_scale * phi(pre_scale * Q K^T) V`` per sample; the caller checked :func:`unsupported`.
    ``items``: the int32 ``[tiles, 4]`` table of ``opengem.ops.triton.gdpa.gluon_work_items`` (query tiles of
    :data:`BLOCK_M` rows, longest first); ``programs``: persistent programs (default one an SM); ``block_n`` /
    ``stages``: the key tile and K/V ring (the Gluon diag times 128 keys in 2 stages too)."""
    heads = q.shape[1]
    n_work = items.shape[0] * heads
    if n_work == 0:  # no query rows (a sample with queries has keys: ``unsupported``)
        return out
    programs = min(n_work, programs or torch.cuda.get_device_properties(q.device).multi_processor_count)
    gdpa_fwd_persistent_kernel[(programs,)](
        row_descriptor(q, BLOCK_M), row_descriptor(k, block_n), row_descriptor(v, block_n), out, out.stride(0),
        items, n_work, heads, pre_scale, out_scale, heads // k.shape[1], activation,
        fast, block_n, HEAD_DIM, stages, num_warps=CONSUMER_WARPS.value, maxnreg=LAUNCH_REGISTERS)
    return out
