"""GDPA's dK/dV pass (and a fused backward) in Gluon (Hopper, warp-specialized), against the Triton kernels on (a).

Issue 4's sparsity-1.0 backward (1.49-1.65x the compiled padded reference on an H100, bar 2x) needs the backward at
316-482 TFLOP/s; the Triton one runs two passes, dK/dV (four products a tile pair) and dQ (three). This diag asks
the first question of that route: how fast the dK/dV pass runs with a TMA-load worker and the MMAs issued
asynchronously, kernel time against kernel time. Nothing here is wired into ``opengem.ops.gdpa``.

Structure: one program per (key tile of 128 keys of one sample, head); K and V are loaded once; a one-warp worker
TMA-loads the sample's Q and dO tiles (64 or 32 rows) into a ring of stages; the default partition, two warpgroups of
64 keys each, computes per query tile ``S^T = K Q^T`` (both operands in shared memory), ``P^T = phi(s S^T)``, issues
``dV += P^T dO`` (P^T from registers) and ``dP^T = V dO^T`` back to back, then ``dX^T = dP^T * phi'(s S^T)`` and ``dK
+= dX^T Q``, and frees the stage. ``dK = s c sum`` and ``dV = c sum`` with ``c = 1 / max_len`` (``norm="max_len"``),
as the Triton kernel scales them. Query rows past the sample's end are the next sample's (2-D ``[T, H * D]``
descriptors), so the last query tile masks P^T's and dX^T's columns; key rows past the end are not stored.

The ``_fused_dq`` variant also computes dQ in the same programs, the five-product backward that a 2x bar needs (the
Triton op's two passes do seven): each query tile's ``dX^T`` goes to shared memory (it spans both warpgroups' keys),
``dQ^T = K^T dX^T`` runs on the tensor cores and is added into an fp32 ``[T, H, D]`` buffer with relaxed atomics
(not bitwise repeatable, unlike the op), scaled into bf16 after; it is timed against the op's whole backward. How the
adds are issued: by the MMA warps one element an instruction (``_fused_dq``), four (``_red4``, inline
``red.global.add.v4.f32``: session 41 measured 1.15x on the kernel), or by a 4-warp dQ-writer partition
(``_writer``, FlashAttention-3's structure) that takes each step's dQ^T tile from a two-slot shared-memory ring and
adds it four columns an instruction while the MMA warps go on (16 warps: the launch's registers drop to 128 a thread,
the MMA partition gets 216).

Self-attention, non-causal, no window, D = 128, bf16, fast_gelu. Needs triton 3.6 (see ``gluon_common``).

    PYTHONPATH=src:. python -m benchmarks.diag.gluon_gdpa_dkdv [--compile-only] [--workloads "a self L=1024"]
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from benchmarks.common import by_name_prefix, kernel_ms, offsets_of, relative_error, write_results
from benchmarks.diag.gluon_common import (FAST_GELU_SLOPE, SMOKE_LENGTHS, chosen_variants, descriptor_type,
                                          diag_parser, fill_ring, scheduled_item, sm90_resources, smoke_in_child,
                                          stage_ring, tile_schedule, wgmma_layout)
from benchmarks.gdpa import HEAD_DIM, HEADS, workloads  # issue 4's shapes
from opengem.ops import gdpa
from opengem.ops.attention_flops import attention_flops, visible_pairs

BLOCK_N = 128  # keys a program: 64 per warpgroup


# how a fused variant adds each query step's dQ^T tile into the fp32 sums: one element an instruction (``atom``), four
# (``red.global.add.v4.f32``), or four from a dQ-writer partition (FlashAttention-3's) while the MMA warps go on
DQ_ADDS = {"": 0, "atomic": 1, "red4": 2, "writer": 3}  # "": dK and dV only


class Variant(NamedTuple):
    block_m: int  # query rows a step
    stages: int  # Q and dO buffers in the ring
    dq: str = ""  # a key of DQ_ADDS: dQ too (five products), added into fp32 by every key tile's program

    @property
    def fused_dq(self) -> bool:
        return self.dq != ""

    @property
    def maxnreg(self) -> int:
        """Registers a thread at launch: the 64K register file over the warps (8 MMA, the loader's warpgroup, and
        the writer's 4), a multiple of 8; the partitions then move them with ``setmaxnreg``."""
        warps = 8 + 4 + (4 if self.dq == "writer" else 0)
        return 65536 // (32 * warps) // 8 * 8

    @property
    def name(self) -> str:
        suffix = {"": "", "atomic": "_fused_dq", "red4": "_fused_dq_red4", "writer": "_fused_dq_writer"}[self.dq]
        return f"gluon_m{self.block_m}_s{self.stages}{suffix}"


# at sm_90: 64 rows spill 72 B (dK, dV, dP^T, phi' and P^T live across the MMAs), 32 rows none, 32 rows with the fused
# dQ 160 B (its atomics' addresses), with the vector adds 112 B (the dQ^T tile through shared memory into a layout of
# four consecutive head-dim columns a thread)
VARIANTS = (Variant(64, 2), Variant(32, 3), Variant(32, 3, "atomic"), Variant(32, 3, "red4"),
            Variant(32, 3, "writer"))
DQ_WRITER_REGISTERS = gl.constexpr(48)  # a thread of the writer partition; the MMA partition gets the rest


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
def _write_dq(dq_bufs, dq_full, dq_free, DQ_ACC, stride_t, q_row, q_len, head_col, BLOCK_M: gl.constexpr):
    """The dQ-writer partition (FlashAttention-3's): each query step's dQ^T tile, as the MMA warps left it in the
    two-slot ring, added into the fp32 sums, 16 query rows at a time, while the MMA warps go on."""
    CHUNK: gl.constexpr = 16
    layout: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, gl.num_warps()], [0, 1])
    for i in range(gl.cdiv(q_len, BLOCK_M)):
        slot = i % 2
        mbarrier.wait(dq_full.index(slot), (i // 2) & 1)
        for c in gl.static_range(BLOCK_M // CHUNK):
            dqt = dq_bufs.index(slot).slice(c * CHUNK, CHUNK, dim=1).load(layout)
            _add_dq_tile(DQ_ACC, dqt, q_row, i * BLOCK_M + c * CHUNK, q_len, stride_t, head_col)
        mbarrier.arrive(dq_free.index(slot), count=1)


@gluon.jit
def _key_grads(k_smem, v_smem, q_bufs, do_bufs, q_ready, do_ready, q_empty, do_empty, ds_smem, dq_bufs, dq_full,
               dq_free, DK, DV, DQ_ACC, stride_t, key_row, keys, q_row, q_len, head_col, slope, scale, dk_scale,
               dv_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
               DQ_ADD: gl.constexpr, num_warps: gl.constexpr):
    """The MMA partition; ``DQ_ADD`` a value of ``DQ_ADDS`` (with 3, ``dq_bufs`` is the writer's ring; otherwise
    ``dq_bufs``, ``dq_full`` and ``dq_free`` are unused stand-ins)."""
    stages: gl.constexpr = q_bufs.type.shape[0]
    st_layout: gl.constexpr = wgmma_layout(BLOCK_M, num_warps)
    kv_layout: gl.constexpr = wgmma_layout(HEAD_DIM, num_warps)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    zero_st = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)  # also dQ^T's: HEAD_DIM == BLOCK_N rows
    key_rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, st_layout))
    d_rows = gl.expand_dims(key_rows, 1)  # dQ^T's rows are head-dim columns
    n_tiles = gl.cdiv(q_len, BLOCK_M)
    for i in range(n_tiles):
        s = i % stages
        phase = (i // stages) & 1
        mbarrier.wait(q_ready.index(s), phase)
        st = warpgroup_mma(k_smem, q_bufs.index(s).permute((1, 0)), zero_st, use_acc=False)
        gate_v = gl.minimum(gl.maximum(st * slope + 0.5, 0.0), 1.0)
        smooth = gate_v * gate_v * (3.0 - 2.0 * gate_v)
        pt = st * scale * smooth
        dphi = 4.0 * smooth - 3.0 * gate_v  # the one fp32 tile kept across the MMAs below
        if i == n_tiles - 1:  # query rows past the sample's end: the next sample's, or zeros past T
            cols = i * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
            pt = gl.where(gl.expand_dims(cols < q_len, 0), pt, 0.0)
        pt = gl.convert_layout(pt.to(gl.bfloat16), a_layout)
        mbarrier.wait(do_ready.index(s), phase)
        dv = warpgroup_mma(pt, do_bufs.index(s), dv, is_async=True)
        dpt = warpgroup_mma(v_smem, do_bufs.index(s).permute((1, 0)), zero_st, use_acc=False, is_async=True)
        dv, dpt, pt = warpgroup_mma_wait(0, deps=[dv, dpt, pt])
        dxt = dpt * dphi
        cols = i * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
        if i == n_tiles - 1:
            dxt = gl.where(gl.expand_dims(cols < q_len, 0), dxt, 0.0)
        if DQ_ADD > 0:  # keys past the sample's end (the next sample's) must not reach dQ
            dxt = gl.where(gl.expand_dims(key_rows < keys, 1), dxt, 0.0)
        dxt = dxt.to(gl.bfloat16)
        dxt_a = gl.convert_layout(dxt, a_layout)
        dk = warpgroup_mma(dxt_a, q_bufs.index(s), dk, is_async=True)
        if DQ_ADD > 0:
            # dQ^T = K^T dX^T: dX^T crosses the two warpgroups' key halves, so it goes through shared memory
            gl.thread_barrier()  # the other warpgroup's previous dQ MMA has read ds_smem
            ds_smem.store(dxt)
            fence_async_shared()
            gl.thread_barrier()
            dqt = warpgroup_mma(k_smem.permute((1, 0)), ds_smem, zero_st, use_acc=False)  # [HEAD_DIM, BLOCK_M]
            if DQ_ADD == 3:  # to the writer partition
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
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, kv_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, kv_layout))
    offsets = gl.expand_dims((key_row + offs_n).to(gl.int64) * stride_t, 1) + head_col + gl.expand_dims(offs_d, 0)
    valid = gl.expand_dims(offs_n < keys, 1)
    gl.store(DK + offsets, (dk * dk_scale).to(gl.bfloat16), mask=valid)
    gl.store(DV + offsets, (dv * dv_scale).to(gl.bfloat16), mask=valid)


@gluon.jit
def gluon_gdpa_dkdv_kernel(q_desc, do_desc, k_desc, v_desc, DK, DV, DQ_ACC, stride_t, item_start, item_len, item_n,
                           slope, scale, dk_scale, dv_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                           HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, DQ_ADD: gl.constexpr,
                           DS_LAYOUT: gl.constexpr, num_warps: gl.constexpr):
    start, length, n_start = scheduled_item(item_start, item_len, item_n)
    head_col = gl.program_id(1) * HEAD_DIM
    q_bufs, do_bufs, q_ready, do_ready, q_empty, do_empty = stage_ring(q_desc, do_desc, STAGES)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, v_desc.block_type.shape, v_desc.layout)
    ds_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, BLOCK_M], DS_LAYOUT)  # dX^T, for the fused dQ
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [start + n_start, head_col], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [start + n_start, head_col], kv_bar, v_smem)
    mbarrier.wait(kv_bar, 0)
    # the partitions' arguments written out: a tuple built with ``+`` turns constexprs into tensors
    if DQ_ADD == 3:
        dq_bufs = gl.allocate_shared_memory(gl.float32, [2, HEAD_DIM, BLOCK_M],
                                            gl.SwizzledSharedLayout(1, 1, 1, order=[0, 1]))  # head-dim contiguous
        dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        dq_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(dq_full.index(i), count=1)
            mbarrier.init(dq_free.index(i), count=1)
        gl.warp_specialize([
            (_key_grads, (k_smem, v_smem, q_bufs, do_bufs, q_ready, do_ready, q_empty, do_empty, ds_smem, dq_bufs,
                          dq_full, dq_free, DK, DV, DQ_ACC, stride_t, start + n_start, length - n_start, start,
                          length, head_col, slope, scale, dk_scale, dv_scale, BLOCK_M, BLOCK_N, HEAD_DIM, DQ_ADD,
                          num_warps)),
            (fill_ring, (q_desc, do_desc, q_bufs, do_bufs, q_ready, do_ready, q_empty, do_empty, start, length,
                         head_col, 0, BLOCK_M)),
            (_write_dq, (dq_bufs, dq_full, dq_free, DQ_ACC, stride_t, start, length, head_col, BLOCK_M)),
        ], [1, 4], [24, DQ_WRITER_REGISTERS])
    else:
        gl.warp_specialize([
            (_key_grads, (k_smem, v_smem, q_bufs, do_bufs, q_ready, do_ready, q_empty, do_empty, ds_smem, ds_smem,
                          kv_bar, kv_bar, DK, DV, DQ_ACC, stride_t, start + n_start, length - n_start, start, length,
                          head_col, slope, scale, dk_scale, dv_scale, BLOCK_M, BLOCK_N, HEAD_DIM, DQ_ADD,
                          num_warps)),
            (fill_ring, (q_desc, do_desc, q_bufs, do_bufs, q_ready, do_ready, q_empty, do_empty, start, length,
                         head_col, 0, BLOCK_M)),
        ], [1], [24])


def gluon_gdpa_dkdv(q, k, v, dout, schedule: tuple[torch.Tensor, ...], max_len: int, pre_scale: float,
                    variant: Variant) -> tuple[torch.Tensor | None, ...]:
    """``(dQ or None, dK, dV)`` of fast_gelu GDPA self-attention with ``norm="max_len"``; ``schedule``:
    ``tile_schedule`` of the lengths in tiles of ``BLOCK_N`` keys. With ``variant.fused_dq`` dQ is added in fp32 by
    every key tile's program (atomics: not bitwise repeatable), then scaled into bf16."""
    block_m, stages, fused_dq = variant.block_m, variant.stages, variant.fused_dq
    T, H, D = q.shape
    tensors = (q, k, v, dout)
    if D != HEAD_DIM or any(t.dtype != torch.bfloat16 or not t.is_contiguous() or t.shape != q.shape for t in tensors):
        raise ValueError(f"needs contiguous bf16 [T, H, {HEAD_DIM}] q, k, v and dout of one shape")

    def desc(t: torch.Tensor, rows: int):
        layout = gl.NVMMASharedLayout.get_default_for([rows, D], gl.bfloat16)
        return TensorDescriptor.from_tensor(t.view(T, H * D), [rows, D], layout)

    dk, dv = torch.empty_like(k), torch.empty_like(v)
    if fused_dq:
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # the fp32 dQ sums
    else:
        dq_acc = torch.empty(1, dtype=torch.float32, device=q.device)  # a stand-in the kernel never touches
    item_start, item_len, item_n = schedule
    out_scale = 1.0 / max_len
    gluon_gdpa_dkdv_kernel[(item_start.numel(), H)](
        desc(q, block_m), desc(dout, block_m), desc(k, BLOCK_N), desc(v, BLOCK_N), dk, dv, dq_acc, H * D, item_start,
        item_len, item_n, pre_scale * FAST_GELU_SLOPE, pre_scale, pre_scale * out_scale, out_scale, block_m, BLOCK_N,
        D, stages, DQ_ADDS[variant.dq], gl.NVMMASharedLayout.get_default_for([BLOCK_N, block_m], gl.bfloat16),
        num_warps=8, maxnreg=variant.maxnreg)
    dq = (dq_acc * (pre_scale * out_scale)).to(torch.bfloat16) if fused_dq else None
    return dq, dk, dv


def compile_only(variant: Variant) -> dict[str, object]:
    block_m = variant.block_m
    constants = {"BLOCK_M": block_m, "BLOCK_N": BLOCK_N, "HEAD_DIM": HEAD_DIM, "STAGES": variant.stages,
                 "DQ_ADD": DQ_ADDS[variant.dq],
                 "DS_LAYOUT": gl.NVMMASharedLayout.get_default_for([BLOCK_N, block_m], gl.bfloat16), "num_warps": 8}
    signature = {"q_desc": descriptor_type(block_m, HEAD_DIM), "do_desc": descriptor_type(block_m, HEAD_DIM),
                 "k_desc": descriptor_type(BLOCK_N, HEAD_DIM), "v_desc": descriptor_type(BLOCK_N, HEAD_DIM),
                 "DK": "*bf16", "DV": "*bf16", "DQ_ACC": "*fp32", "stride_t": "i32", "item_start": "*i32",
                 "item_len": "*i32", "item_n": "*i32", "slope": "fp32", "scale": "fp32", "dk_scale": "fp32",
                 "dv_scale": "fp32"}
    return sm90_resources(gluon_gdpa_dkdv_kernel, signature, constants, num_warps=8, maxnreg=variant.maxnreg)


def _triton_grads(q, k, v, dout, offsets, max_len: int, scale: float) -> tuple[torch.Tensor, ...]:
    """The op's ``(dQ, dK, dV)`` (both Triton passes)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = gdpa(q, k, v, offsets, offsets, max_len, max_len, activation="fast_gelu", pre_scale=scale, norm="max_len")
    out.backward(dout)
    return q.grad, k.grad, v.grad


def _problem(lengths: torch.Tensor, seed: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, dout = (torch.randn(int(lengths.sum()), HEADS, HEAD_DIM, generator=gen, device="cuda").bfloat16()
                     for _ in range(4))
    return dict(q=q, k=k, v=v, dout=dout, offsets=offsets_of(lengths, "cuda"), max_len=int(lengths.max()),
                scale=1 / math.sqrt(HEAD_DIM), schedule=tile_schedule(lengths, BLOCK_N, "cuda"))


def _gluon(p: dict, variant: Variant) -> tuple[torch.Tensor | None, ...]:
    return gluon_gdpa_dkdv(p["q"], p["k"], p["v"], p["dout"], p["schedule"], p["max_len"], p["scale"], variant)


def _errors(p: dict, variants) -> dict[str, float]:
    want = _triton_grads(p["q"], p["k"], p["v"], p["dout"], p["offsets"], p["max_len"], p["scale"])
    errors = {}
    for variant in variants:
        for name, got, ref in zip(("dq", "dk", "dv"), _gluon(p, variant), want):
            if got is not None:
                errors[f"{variant.name}_{name}_vs_triton"] = relative_error(got, ref)
    return errors


def smoke(variant: Variant) -> float:
    errors = _errors(_problem(torch.tensor(SMOKE_LENGTHS), seed=2), [variant])
    torch.cuda.synchronize()
    return max(errors.values())


def run(prefixes: list[str] | None, chosen: list[Variant]) -> list[dict[str, object]]:
    failed = {v.name: smoke_in_child("benchmarks.diag.gluon_gdpa_dkdv", v.name, 2e-2) for v in chosen}
    variants = [v for v in chosen if failed[v.name] is None]
    rows: list[dict[str, object]] = [{"workload": "smoke (lengths 1..300)", "failed": failed}]
    print(rows[0], flush=True)
    print(write_results("gluon_gdpa_dkdv", rows), flush=True)
    for w in by_name_prefix([w for w in workloads(False) if w.name.startswith("a ")], prefixes, "--workloads"):
        if not variants:
            break
        p = _problem(w.q_lengths, seed=1)
        triton_kernels = kernel_ms(lambda: _triton_grads(p["q"], p["k"], p["v"], p["dout"], p["offsets"], p["max_len"],
                                                         p["scale"]))
        triton_dkdv = sum(ms for name, ms in triton_kernels.items() if "dkdv" in name)
        triton_backward = sum(ms for name, ms in triton_kernels.items() if "gdpa_bwd" in name)
        forward_flops, backward_flops = attention_flops(visible_pairs(w.q_lengths, w.k_lengths), HEADS, HEAD_DIM)
        pass_flops = 2 * forward_flops  # dK/dV's four products a visible pair against the forward's two
        row = {"workload": w.name, **_errors(p, variants), "triton_dkdv_ms": triton_dkdv,
               "triton_dkdv_tflops": pass_flops / triton_dkdv / 1e9, "triton_backward_ms": triton_backward,
               "triton_backward_tflops": backward_flops / triton_backward / 1e9, "triton_kernels_ms": triton_kernels}
        for variant in variants:
            with torch.no_grad():
                kernels = kernel_ms(lambda: _gluon(p, variant))
            name = variant.name
            if variant.fused_dq:  # the fused kernel against the whole Triton backward; its zero fill and dQ cast included
                ms = sum(kernels.values())
                row |= {f"{name}_ms": ms, f"{name}_kernels_ms": kernels,
                        f"{name}_tflops": backward_flops / ms / 1e9, f"{name}_x_triton_backward": triton_backward / ms}
            else:
                ms = sum(t for kernel, t in kernels.items() if "gluon_gdpa_dkdv" in kernel)
                row |= {f"{name}_ms": ms, f"{name}_tflops": pass_flops / ms / 1e9,
                        f"{name}_x_triton": triton_dkdv / ms}
        print(row, flush=True)
        rows.append(row)
        print(write_results("gluon_gdpa_dkdv", rows), flush=True)  # a hang later keeps the rows so far
    return rows


def main() -> None:
    parser = diag_parser(__doc__, [v.name for v in VARIANTS])
    args = parser.parse_args()
    chosen = chosen_variants(VARIANTS, args.variants)
    if args.compile_only:
        for variant in chosen:
            print(variant.name, compile_only(variant))
    elif args.smoke:
        variant = next(v for v in VARIANTS if v.name == args.smoke)
        print(f"smoke error {smoke(variant)}", flush=True)
    else:
        run(args.workloads, chosen)


if __name__ == "__main__":
    main()
