"""The kernels of ``benchmarks.diag.gluon_gdpa_forward`` (its docstring has the structure and the variants): a
warp-specialized GDPA forward in Gluon for Hopper, one program per (query tile, head) or persistent, and its sm_90
build on the CPU. Needs triton 3.6 (the GPU image's; 3.9's Gluon API rejects it)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from benchmarks.diag.gluon_common import (FAST_GELU_SLOPE, descriptor_type, fill_ring, launch_registers,
                                          programs_per_sm, scheduled_item, sm90_resources, stage_ring, wgmma_layout,
                                          wgmma_register_operand)
from benchmarks.gdpa import HEAD_DIM



class Variant(NamedTuple):
    block_n: int  # keys a tile
    stages: int  # K and V buffers in the ring
    consumers: int  # 1: one 8-warp partition; 2: a partition a warpgroup, K freed when its S MMA retires
    pingpong: bool = False  # two consumers take turns issuing their MMAs
    persistent: bool = False  # one program an SM over every (query tile, head), two consumers
    block_m: int = 128  # query rows a program (the schedule's tiles): 64 a warpgroup; 64 is one 4-warp consumer,
    # two programs an SM (the Triton forward's pick on (a) at L <= 1024: 64 rows, 32 keys, 4 warps)

    @property
    def name(self) -> str:  # every variant overlaps inside a warpgroup (session 40's plain ones: code at 2833bc9)
        return ("gluon_" + ("" if self.block_m == 128 else f"m{self.block_m}_") + f"n{self.block_n}_s{self.stages}"
                + "_overlap" + ("_2wg" if self.consumers == 2 else "") + ("_pingpong" if self.pingpong else "")
                + ("_persistent" if self.persistent else "")
                + ("" if self.programs_per_sm == 1 else f"_x{self.programs_per_sm}"))

    @property
    def num_warps(self) -> int:  # the kernel's (the default partition's): its rows' warpgroups, split by consumers
        return self.block_m // 16 // self.consumers

    @property
    def programs_per_sm(self) -> int:
        return programs_per_sm(self.block_m)

    @property
    def maxnreg(self) -> int:  # the consumers' warps and the loader's warpgroup, of every program an SM holds
        return launch_registers(self.block_m // 16 + 4, self.programs_per_sm)

    def check(self) -> None:
        if self.block_m == 64 and (self.consumers != 1 or self.persistent):
            raise ValueError(f"{self.name}: 64-row programs are one consumer warpgroup, one item each")


# session 40's best (one 8-warp consumer) and session 41's (s46b: two partitions taking turns, 1.10-1.11x the Triton
# kernel at L2048 on an H100, 0.92-1.01x at L1024), then the persistent form (a Q ring of two 32 KB slots, so 128-key
# tiles fit only 2 K/V stages), then 64-row programs, two an SM (sm_90: no stack; 65.8 / 82.2 / 82.1 KB of shared
# memory); the other variants' figures are in s45f's, s46a's and s46b's results, not rerun
VARIANTS = (Variant(64, 3, 1), Variant(128, 3, 2, pingpong=True), Variant(128, 2, 2, pingpong=True, persistent=True),
            Variant(64, 3, 2, pingpong=True, persistent=True), Variant(32, 3, 1, block_m=64),
            Variant(32, 4, 1, block_m=64), Variant(64, 2, 1, block_m=64))
TILE_ROWS = sorted({v.block_m for v in VARIANTS})  # the schedules a run builds


@gluon.jit
def _activate(scores, j, n_tiles, key_len, slope, scale, BLOCK_N: gl.constexpr, s_layout: gl.constexpr,
              p_layout: gl.constexpr):
    """``phi(scale * S)`` as bf16 in the second MMA's register-operand layout; keys past ``key_len`` give 0."""
    gate = gl.minimum(gl.maximum(scores * slope + 0.5, 0.0), 1.0)
    p = scores * scale * (gate * gate * (3.0 - 2.0 * gate))
    if j == n_tiles - 1:  # keys past the sample's end: the next sample's rows, or zeros past T
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        p = gl.where(gl.expand_dims(cols < key_len, 0), p, 0.0)
    return gl.convert_layout(p.to(gl.bfloat16), p_layout)


@gluon.jit
def _take_turn(my_turn, group, FIRST: gl.constexpr):
    """Wait until this partition may issue its MMA group ``group``: the first partition's group g follows the other's
    group g - 1 (a fresh barrier counts as phase 1 complete), the second's follows the first's group g."""
    if FIRST:
        mbarrier.wait(my_turn, (group & 1) ^ 1)
    else:
        mbarrier.wait(my_turn, group & 1)


@gluon.jit
def _attend_tile(q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, my_turn, their_turn, Out, stride_ot,
                 out_row, rows, key_len, head_col, slope, scale, out_scale, tile0, group0, BLOCK_N: gl.constexpr,
                 HEAD_DIM: gl.constexpr, EARLY_K: gl.constexpr, PINGPONG: gl.constexpr, FIRST: gl.constexpr):
    """One consumer partition's query rows (``q_smem``, 64 a warpgroup) against every key tile of the sample, with
    FlashAttention-3's in-warpgroup overlap: tile j+1's ``S`` is issued before tile j's ``P V``, and phi(S_{j+1}) runs
    on the CUDA cores while P_j V_j is still on the tensor cores. The key tiles take ring positions ``tile0``,
    ``tile0 + 1``, ... (a persistent program's tiles run through the ring across its work items) and ping-pong issue
    groups ``group0`` .. ``group0 + n_tiles``.

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
        _take_turn(my_turn, group0, FIRST)
    scores = warpgroup_mma(q_smem, k_bufs.index(first).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    if PINGPONG:
        mbarrier.arrive(their_turn, count=1)
    scores = warpgroup_mma_wait(0, deps=[scores])
    if EARLY_K:
        mbarrier.arrive(k_empty.index(first), count=1)
    p = _activate(scores, 0, n_tiles, key_len, slope, scale, BLOCK_N, s_layout, p_layout)
    for j in range(n_tiles - 1):
        s = (tile0 + j) % stages
        nxt = (tile0 + j + 1) % stages
        mbarrier.wait(k_ready.index(nxt), ((tile0 + j + 1) // stages) & 1)
        mbarrier.wait(v_ready.index(s), ((tile0 + j) // stages) & 1)
        if PINGPONG:
            _take_turn(my_turn, group0 + j + 1, FIRST)
        scores = warpgroup_mma(q_smem, k_bufs.index(nxt).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        acc = warpgroup_mma(p, v_bufs.index(s), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(their_turn, count=1)
        scores = warpgroup_mma_wait(1, deps=[scores])  # in-order retirement: S_{j+1} done, P_j V_j may run on
        if EARLY_K:
            mbarrier.arrive(k_empty.index(nxt), count=1)
        p_next = _activate(scores, j + 1, n_tiles, key_len, slope, scale, BLOCK_N, s_layout, p_layout)
        acc, p = warpgroup_mma_wait(0, deps=[acc, p])  # P_j's registers stay live until its MMA retires
        if not EARLY_K:
            mbarrier.arrive(k_empty.index(s), count=1)
        mbarrier.arrive(v_empty.index(s), count=1)
        p = p_next
    last = (tile0 + n_tiles - 1) % stages
    mbarrier.wait(v_ready.index(last), ((tile0 + n_tiles - 1) // stages) & 1)
    if PINGPONG:
        _take_turn(my_turn, group0 + n_tiles, FIRST)  # the last of n_tiles + 1 issue groups
    acc = warpgroup_mma(p, v_bufs.index(last), acc, is_async=True)
    if PINGPONG:
        mbarrier.arrive(their_turn, count=1)
    acc = warpgroup_mma_wait(0, deps=[acc])
    if not EARLY_K:
        mbarrier.arrive(k_empty.index(last), count=1)
    mbarrier.arrive(v_empty.index(last), count=1)
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    ptrs = Out + gl.expand_dims((out_row + offs_m).to(gl.int64) * stride_ot, 1) + head_col + gl.expand_dims(offs_d, 0)
    gl.store(ptrs, (acc * out_scale).to(gl.bfloat16), mask=gl.expand_dims(offs_m < rows, 1))


@gluon.jit
def _attend(q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, my_turn, their_turn, Out, stride_ot, out_row,
            rows, key_len, head_col, slope, scale, out_scale, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
            EARLY_K: gl.constexpr, PINGPONG: gl.constexpr, FIRST: gl.constexpr):
    """A consumer partition of a one-item program: :func:`_attend_tile` from the ring's start."""
    _attend_tile(q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, my_turn, their_turn, Out, stride_ot,
                 out_row, rows, key_len, head_col, slope, scale, out_scale, 0, 0, BLOCK_N, HEAD_DIM, EARLY_K,
                 PINGPONG, FIRST)


@gluon.jit
def _work_item(w, item_start, item_len, item_m, heads, HEAD_DIM: gl.constexpr):
    """Work item ``w`` of a persistent program: ``(sample start, sample length, tile start, head column)``; items
    are (query tile, head) pairs, the schedule's tiles outermost so the longest samples still go first."""
    item = w // heads
    return (gl.load(item_start + item), gl.load(item_len + item), gl.load(item_m + item),
            (w % heads) * HEAD_DIM)


@gluon.jit
def _attend_items(q_bufs, q_ready, q_empty, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, my_turn, their_turn,
                  Out, stride_ot, item_start, item_len, item_m, n_work, heads, slope, scale, out_scale,
                  ROW0: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, PINGPONG: gl.constexpr,
                  FIRST: gl.constexpr):
    """A consumer partition of a persistent program: rows ``ROW0 .. ROW0 + 63`` of every work item
    ``program_id, program_id + programs, ...``, their Q tile from the two-slot Q ring, their key tiles' ring
    positions and ping-pong groups carried over from item to item."""
    half: gl.constexpr = q_bufs.type.shape[1] // 2
    tile = 0
    group = 0
    k = 0
    for w in range(gl.program_id(0), n_work, gl.num_programs(0)):
        start, length, m_start, head_col = _work_item(w, item_start, item_len, item_m, heads, HEAD_DIM)
        slot = k % 2
        mbarrier.wait(q_ready.index(slot), (k // 2) & 1)
        _attend_tile(q_bufs.index(slot).slice(ROW0, half), k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, my_turn,
                     their_turn, Out, stride_ot, start + m_start + ROW0, length - m_start - ROW0, length, head_col,
                     slope, scale, out_scale, tile, group, BLOCK_N, HEAD_DIM, True, PINGPONG, FIRST)
        mbarrier.arrive(q_empty.index(slot), count=1)  # _attend_tile's last wait retired every MMA reading it
        n_tiles = gl.cdiv(length, BLOCK_N)
        tile += n_tiles
        group += n_tiles + 1
        k += 1


@gluon.jit
def _fill_items(q_desc, k_desc, v_desc, q_bufs, q_ready, q_empty, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty,
                item_start, item_len, item_m, n_work, heads, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    """The TMA-load worker of a persistent program: each work item's Q tile into the Q ring, then its sample's K and V
    tiles into the K/V ring, so the next item's loads start while the consumers finish the current one."""
    tile = 0
    k = 0
    for w in range(gl.program_id(0), n_work, gl.num_programs(0)):
        start, length, m_start, head_col = _work_item(w, item_start, item_len, item_m, heads, HEAD_DIM)
        slot = k % 2
        mbarrier.wait(q_empty.index(slot), ((k // 2) & 1) ^ 1)
        mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [start + m_start, head_col], q_ready.index(slot), q_bufs.index(slot))
        fill_ring(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, start, length, head_col, tile,
                  BLOCK_N)
        tile += gl.cdiv(length, BLOCK_N)
        k += 1


@gluon.jit
def _turn_barriers():
    """The two ping-pong barriers: a partition waits on its own, then arrives on the other's."""
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turns.index(0), count=1)
    mbarrier.init(turns.index(1), count=1)
    return turns


@gluon.jit
def gluon_gdpa_fwd_kernel(q_desc, k_desc, v_desc, Out, stride_ot, item_start, item_len, item_m, slope, scale,
                          out_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                          STAGES: gl.constexpr, CONSUMERS: gl.constexpr, PINGPONG: gl.constexpr,
                          num_warps: gl.constexpr):
    """One program per (query tile, head)."""
    start, length, m_start = scheduled_item(item_start, item_len, item_m)
    head_col = gl.program_id(1) * HEAD_DIM
    k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty = stage_ring(k_desc, v_desc, STAGES, CONSUMERS)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [start + m_start, head_col], q_bar, q_smem)
    mbarrier.wait(q_bar, 0)
    out_row, rows = start + m_start, length - m_start
    turns = _turn_barriers()
    # the partitions' arguments written out: a tuple built with ``+`` turns constexprs into tensors
    if CONSUMERS == 1:  # one 8-warp partition: the two warpgroups meet at every barrier arrive (bar.sync 0, 256)
        gl.warp_specialize([
            (_attend, (q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns.index(0), turns.index(1),
                       Out, stride_ot, out_row, rows, length, head_col, slope, scale, out_scale, BLOCK_N, HEAD_DIM,
                       False, False, True)),
            (fill_ring, (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, start, length, head_col,
                         0, BLOCK_N)),
        ], [1], [24])
    else:  # a 4-warp partition a warpgroup, each with its own 64 rows: they drift apart and free buffers alone
        half: gl.constexpr = BLOCK_M // 2
        gl.warp_specialize([
            (_attend, (q_smem.slice(0, half), k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns.index(0),
                       turns.index(1), Out, stride_ot, out_row, rows, length, head_col, slope, scale, out_scale,
                       BLOCK_N, HEAD_DIM, True, PINGPONG, True)),
            (_attend, (q_smem.slice(half, half), k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns.index(1),
                       turns.index(0), Out, stride_ot, out_row + half, rows - half, length, head_col, slope, scale,
                       out_scale, BLOCK_N, HEAD_DIM, True, PINGPONG, False)),
            (fill_ring, (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, start, length, head_col,
                         0, BLOCK_N)),
        ], [4, 1], [240, 24])


@gluon.jit
def gluon_gdpa_fwd_persistent_kernel(q_desc, k_desc, v_desc, Out, stride_ot, item_start, item_len, item_m, n_work,
                                     heads, slope, scale, out_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                     HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
                                     num_warps: gl.constexpr):
    """One program an SM looping over the (query tile, head) work items, two consumer partitions: the per-program
    start (barrier set-up, the Q load, the first K/V tiles) is paid once, and the loader runs ahead into the next
    item, which matters where samples are short (sparsity 0.5, L <= 1024)."""
    k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty = stage_ring(k_desc, v_desc, STAGES, 2)
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
    turns = _turn_barriers()
    gl.warp_specialize([
        (_attend_items, (q_bufs, q_ready, q_empty, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns.index(0),
                         turns.index(1), Out, stride_ot, item_start, item_len, item_m, n_work, heads, slope, scale,
                         out_scale, 0, BLOCK_N, HEAD_DIM, PINGPONG, True)),
        (_attend_items, (q_bufs, q_ready, q_empty, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns.index(1),
                         turns.index(0), Out, stride_ot, item_start, item_len, item_m, n_work, heads, slope, scale,
                         out_scale, 64, BLOCK_N, HEAD_DIM, PINGPONG, False)),
        (_fill_items, (q_desc, k_desc, v_desc, q_bufs, q_ready, q_empty, k_bufs, v_bufs, k_ready, v_ready, k_empty,
                       v_empty, item_start, item_len, item_m, n_work, heads, BLOCK_N, HEAD_DIM)),
    ], [4, 1], [240, 24])


def gluon_gdpa_forward(q, k, v, schedule: tuple[torch.Tensor, ...], max_len: int, pre_scale: float,
                       variant: Variant = VARIANTS[0], programs: int | None = None) -> torch.Tensor:
    """fast_gelu GDPA self-attention, ``norm="max_len"``: ``[T, H, 128]`` bf16 in and out; ``schedule`` from
    :func:`tile_schedule` in tiles of ``variant.block_m`` rows; ``programs``: a persistent variant's (default one an
    SM)."""
    variant.check()
    T, H, D = q.shape
    contiguous = q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    if D != HEAD_DIM or q.dtype != torch.bfloat16 or not contiguous:
        raise ValueError(f"needs contiguous bf16 [T, H, {HEAD_DIM}] q, k, v; got {q.dtype} {tuple(q.shape)}")
    out = torch.empty_like(q)
    block_m, block_n = variant.block_m, variant.block_n
    q_layout = gl.NVMMASharedLayout.get_default_for([block_m, D], gl.bfloat16)
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, D], gl.bfloat16)
    q_desc = TensorDescriptor.from_tensor(q.view(T, H * D), [block_m, D], q_layout)
    k_desc = TensorDescriptor.from_tensor(k.view(T, H * D), [block_n, D], kv_layout)
    v_desc = TensorDescriptor.from_tensor(v.view(T, H * D), [block_n, D], kv_layout)
    item_start, item_len, item_m = schedule
    scales = (pre_scale * FAST_GELU_SLOPE, pre_scale, 1.0 / max_len)
    if variant.persistent:
        n_work = item_start.numel() * H
        programs = min(n_work, programs or torch.cuda.get_device_properties(q.device).multi_processor_count)
        gluon_gdpa_fwd_persistent_kernel[(programs,)](
            q_desc, k_desc, v_desc, out, H * D, item_start, item_len, item_m, n_work, H, *scales, block_m, block_n,
            D, variant.stages, variant.pingpong, num_warps=variant.num_warps, maxnreg=variant.maxnreg)
    else:
        gluon_gdpa_fwd_kernel[(item_start.numel(), H)](
            q_desc, k_desc, v_desc, out, H * D, item_start, item_len, item_m, *scales, block_m, block_n, D,
            variant.stages, variant.consumers, variant.pingpong, num_warps=variant.num_warps, maxnreg=variant.maxnreg)
    return out


def compile_only(variant: Variant) -> dict[str, object]:
    """Build the kernel for sm_90 without a GPU; registers, stack, shared memory and key SASS opcodes."""
    variant.check()
    constants = {"BLOCK_M": variant.block_m, "BLOCK_N": variant.block_n, "HEAD_DIM": HEAD_DIM, "STAGES": variant.stages,
                 "PINGPONG": variant.pingpong, "num_warps": variant.num_warps}
    kv_type = descriptor_type(variant.block_n, HEAD_DIM)
    signature = {"q_desc": descriptor_type(variant.block_m, HEAD_DIM), "k_desc": kv_type, "v_desc": kv_type,
                 "Out": "*bf16", "stride_ot": "i32", "item_start": "*i32", "item_len": "*i32", "item_m": "*i32"}
    if variant.persistent:
        kernel = gluon_gdpa_fwd_persistent_kernel
        signature |= {"n_work": "i32", "heads": "i32"}
    else:
        kernel = gluon_gdpa_fwd_kernel
        constants["CONSUMERS"] = variant.consumers
    signature |= {"slope": "fp32", "scale": "fp32", "out_scale": "fp32"}
    return sm90_resources(kernel, signature, constants, variant.num_warps, maxnreg=variant.maxnreg)
