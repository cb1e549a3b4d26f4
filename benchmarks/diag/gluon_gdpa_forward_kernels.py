"""The kernels of ``benchmarks.diag.gluon_gdpa_forward`` (its docstring has the structure and the variants): a
warp-specialized GDPA forward in Gluon for Hopper, one program per (query tile, head) on the op's consumer loop, or
the op's persistent kernel (``opengem.ops.gluon.gdpa_forward``), and their sm_90 builds on the CPU. Needs triton 3.6
(the GPU image's; 3.9's Gluon API rejects it)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from benchmarks.diag.gluon_common import descriptor_type, programs_per_sm, scheduled_item, sm90_resources, tile_schedule
from benchmarks.gdpa import HEAD_DIM
from opengem.ops.activations import ACTIVATIONS
from opengem.ops.gluon.hopper import fill_ring, launch_registers, stage_ring
from opengem.ops.gluon.gdpa_forward import attend_tile, gdpa_fwd_persistent_kernel, row_descriptor, turn_barriers
from opengem.ops.gluon.gdpa_forward import gdpa_forward as persistent_forward
from opengem.ops.triton.gdpa import gluon_work_items, work_order_setting

FAST_GELU = gl.constexpr(ACTIVATIONS.index("fast_gelu"))



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





@gluon.jit
def _attend(q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, my_turn, their_turn, Out, stride_ot, out_row,
            rows, key_len, head_col, scale, out_scale, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
            EARLY_K: gl.constexpr, PINGPONG: gl.constexpr, FIRST: gl.constexpr):
    """A consumer partition of a one-item program: the op's :func:`attend_tile` from the ring's start."""
    attend_tile(q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, my_turn, their_turn, Out, stride_ot,
                out_row, rows, key_len, head_col, scale, out_scale, 0, 0, FAST_GELU, True, BLOCK_N, HEAD_DIM, EARLY_K,
                PINGPONG, FIRST)


@gluon.jit
def gluon_gdpa_fwd_kernel(q_desc, k_desc, v_desc, Out, stride_ot, item_start, item_len, item_m, scale, out_scale,
                          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
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
    turns = turn_barriers()
    # the partitions' arguments written out: a tuple built with ``+`` turns constexprs into tensors
    if CONSUMERS == 1:  # one 8-warp partition: the two warpgroups meet at every barrier arrive (bar.sync 0, 256)
        gl.warp_specialize([
            (_attend, (q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns.index(0), turns.index(1),
                       Out, stride_ot, out_row, rows, length, head_col, scale, out_scale, BLOCK_N, HEAD_DIM,
                       False, False, True)),
            (fill_ring, (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, start, length, head_col,
                         0, BLOCK_N)),
        ], [1], [24])
    else:  # a 4-warp partition a warpgroup, each with its own 64 rows: they drift apart and free buffers alone
        half: gl.constexpr = BLOCK_M // 2
        gl.warp_specialize([
            (_attend, (q_smem.slice(0, half), k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns.index(0),
                       turns.index(1), Out, stride_ot, out_row, rows, length, head_col, scale, out_scale,
                       BLOCK_N, HEAD_DIM, True, PINGPONG, True)),
            (_attend, (q_smem.slice(half, half), k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns.index(1),
                       turns.index(0), Out, stride_ot, out_row + half, rows - half, length, head_col, scale,
                       out_scale, BLOCK_N, HEAD_DIM, True, PINGPONG, False)),
            (fill_ring, (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, start, length, head_col,
                         0, BLOCK_N)),
        ], [4, 1], [240, 24])


def schedule_for(variant: Variant, lengths: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A variant's launch schedule, built once outside the timed calls: :func:`tile_schedule`'s items in tiles of
    ``variant.block_m`` rows, or for a persistent variant the op's table of work items (the op's kernel)."""
    if not variant.persistent:
        return tile_schedule(lengths, variant.block_m, "cuda")
    host = lengths.to(torch.int64).numpy().tobytes()
    return (gluon_work_items(host, host, 0, 0, variant.block_m, "cuda", work_order_setting()),)


def gluon_gdpa_forward(q, k, v, schedule: tuple[torch.Tensor, ...], max_len: int, pre_scale: float,
                       variant: Variant = VARIANTS[0], programs: int | None = None,
                       poison: bool = False) -> torch.Tensor:
    """fast_gelu GDPA self-attention, ``norm="max_len"``: ``[T, H, 128]`` bf16 in and out; ``schedule`` from
    :func:`schedule_for`; ``programs``: a persistent variant's (default one an SM); ``poison``: the output starts as
    NaN, so a row never stored shows."""
    variant.check()
    T, H, D = q.shape
    contiguous = q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    if D != HEAD_DIM or q.dtype != torch.bfloat16 or not contiguous:
        raise ValueError(f"needs contiguous bf16 [T, H, {HEAD_DIM}] q, k, v; got {q.dtype} {tuple(q.shape)}")
    out = torch.full_like(q, float("nan")) if poison else torch.empty_like(q)
    block_m, block_n = variant.block_m, variant.block_n
    if variant.persistent:  # the op's kernel at this variant's key tile and stages
        return persistent_forward(q, k, v, out, schedule[0], FAST_GELU.value, True, pre_scale, 1.0 / max_len,
                                  programs, block_n=block_n, stages=variant.stages)
    item_start, item_len, item_m = schedule
    gluon_gdpa_fwd_kernel[(item_start.numel(), H)](
        row_descriptor(q, block_m), row_descriptor(k, block_n), row_descriptor(v, block_n), out, H * D, item_start,
        item_len, item_m, pre_scale, 1.0 / max_len, block_m, block_n, D, variant.stages, variant.consumers,
        variant.pingpong, num_warps=variant.num_warps, maxnreg=variant.maxnreg)
    return out


def compile_only(variant: Variant) -> dict[str, object]:
    """Build the kernel for sm_90 without a GPU; registers, stack, shared memory and key SASS opcodes."""
    variant.check()
    constants = {"BLOCK_N": variant.block_n, "HEAD_DIM": HEAD_DIM, "STAGES": variant.stages,
                 "num_warps": variant.num_warps}
    kv_type = descriptor_type(variant.block_n, HEAD_DIM)
    signature = {"q_desc": descriptor_type(variant.block_m, HEAD_DIM), "k_desc": kv_type, "v_desc": kv_type,
                 "Out": "*bf16", "stride_ot": "i32"}
    if variant.persistent:  # the op's kernel
        kernel = gdpa_fwd_persistent_kernel
        signature |= {"items": "*i32", "n_work": "i32", "heads": "i32"}
        constants |= {"GROUP": 1, "ACT": FAST_GELU.value, "FAST": True}
    else:
        kernel = gluon_gdpa_fwd_kernel
        signature |= {"item_start": "*i32", "item_len": "*i32", "item_m": "*i32"}
        constants |= {"BLOCK_M": variant.block_m, "CONSUMERS": variant.consumers, "PINGPONG": variant.pingpong}
    signature |= {"scale": "fp32", "out_scale": "fp32"}
    return sm90_resources(kernel, signature, constants, variant.num_warps, maxnreg=variant.maxnreg)
