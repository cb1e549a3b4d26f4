"""Building blocks of the Gluon kernels for Hopper: warpgroup-MMA layouts, a TMA-loaded ring of shared-memory stages
with its barriers, and the register share-out of a warp-specialized launch."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma


@gluon.constexpr_function
def wgmma_layout(n, num_warps):
    """The accumulator layout of a warpgroup MMA with ``n`` columns, the rows split over ``num_warps`` warps (two
    warpgroups of 4 warps: 64 rows each)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def wgmma_register_operand(accumulator):
    """The layout of a bf16 left operand read from registers by a warpgroup MMA whose accumulator has layout
    ``accumulator`` (P V in the forward, dV and dK in the backward: a tile computed in registers fed on)."""
    return gl.DotOperandLayout(operand_index=0, parent=accumulator, k_width=2)


@gluon.jit
def stage_ring(a_desc, b_desc, STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """``STAGES`` shared-memory stages for two TMA-loaded tiles, with a ``ready`` and an ``empty`` barrier per tile
    and stage: the first tile's MMA can start before the second lands, and a tile read only by the first MMA can be
    refilled before the second retires. ``empty`` completes when ``CONSUMERS`` partitions have each arrived once."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    a_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    a_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(a_ready.index(i), count=1)
        mbarrier.init(b_ready.index(i), count=1)
        mbarrier.init(a_empty.index(i), count=CONSUMERS)
        mbarrier.init(b_empty.index(i), count=CONSUMERS)
    return a_bufs, b_bufs, a_ready, b_ready, a_empty, b_empty


@gluon.jit
def fill_ring(a_desc, b_desc, a_bufs, b_bufs, a_ready, b_ready, a_empty, b_empty, row0, rows, head_col, tile0,
              BLOCK: gl.constexpr):
    """The TMA-load worker: rows ``[row0, row0 + rows)`` of one head, ``BLOCK`` at a time, of both tensors into the
    :func:`stage_ring` stages, each tile once the consumers have freed its buffer; the first tile takes ring position
    ``tile0`` (0 in a one-item program; a persistent program's tiles run on through the ring)."""
    stages: gl.constexpr = a_bufs.type.shape[0]
    for i in range(gl.cdiv(rows, BLOCK)):
        s = (tile0 + i) % stages
        free_phase = (((tile0 + i) // stages) & 1) ^ 1  # a fresh barrier counts as phase 1 complete
        mbarrier.wait(a_empty.index(s), free_phase)
        mbarrier.expect(a_ready.index(s), a_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [row0 + i * BLOCK, head_col], a_ready.index(s), a_bufs.index(s))
        mbarrier.wait(b_empty.index(s), free_phase)
        mbarrier.expect(b_ready.index(s), b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(b_desc, [row0 + i * BLOCK, head_col], b_ready.index(s), b_bufs.index(s))


def launch_registers(warps: int, programs: int = 1) -> int:
    """Registers a thread at launch (``maxnreg``) for ``programs`` CTAs an SM of ``warps`` warps each (every
    partition, each padded to a warpgroup): the 64K register file shared out, a multiple of 8; the partitions then
    move them with ``setmaxnreg``."""
    return 65536 // (32 * warps * programs) // 8 * 8
