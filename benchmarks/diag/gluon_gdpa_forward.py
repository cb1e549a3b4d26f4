"""A warp-specialized GDPA forward in Gluon (Hopper), against the Triton kernel and JFA on issue 4's workload (a).

Issue 4's forward bar against JFA (>= 1.1x) fails on the sparsity-0.5 rows at L >= 512 (1.02-1.10x, H100, session
40), and every route past the Triton kernels' ceilings names warp specialization, which Triton 3.6's ``tl.range``
does not build on Hopper. This is the first kernel on that route, kept out of ``opengem.ops`` until the GPU says it is
right and faster: GDPA's forward has no row statistics (``O = c * sum_j phi(s * q k_j) v_j``), so it is the simplest
attention loop to move.

Structure: one program per (query tile of one sample, head); a one-warp worker partition TMA-loads the sample's K and
V tiles into a ring of shared-memory stages (``ready`` / ``empty`` mbarriers per tile); two warpgroups of 64 query
rows each run ``S = Q K^T`` on the tensor cores, ``P = phi(S)`` in registers (fast_gelu's smoothstep form, as
``opengem.ops.triton.activations``), hand P to ``O += P V`` from registers and free the buffers. The ``OVERLAP``
variants overlap inside a warpgroup, as FlashAttention-3 does (tile j+1's ``S`` issued before tile j's ``P V``). The
warp scheduler overlaps one warpgroup's activation with the other's MMAs; with ``consumers=1`` the two warpgroups
are one 8-warp partition and meet at every barrier arrive (session 40's form), with ``consumers=2`` each is its own
partition, drifts from the other and frees a K buffer as soon as its ``S`` retires. Q, K and V are read through 2-D
``[T, H * D]`` descriptors: key rows past a sample's end belong to the next sample (or read as zeros past T), so the
last key tile masks P's columns; query rows past the end are not stored.

Self-attention only (``q_offsets == k_offsets``), non-causal, no window, D = 128, bf16, ``norm="max_len"``. Needs
triton 3.6 (the GPU image's; 3.9's Gluon API rejects it). ``--compile-only`` builds it for sm_90 without a GPU and
prints its SASS resources (run it under a triton 3.6 install); on a GPU it checks the output against the Triton op and
the fp32 reference, then times every variant, the Triton op and JFA interleaved on (a), rewriting
``benchmarks/results/gluon_gdpa_forward.json`` after each workload.

    PYTHONPATH=src:. python -m benchmarks.diag.gluon_gdpa_forward [--compile-only] [--workloads "a self L=1024"]
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from benchmarks.common import (bench_ms, by_name_prefix, interleaved_ms, offsets_of, paired_speedup, relative_error,
                               write_results)
from benchmarks.diag.gluon_common import (FAST_GELU_SLOPE, SMOKE_LENGTHS, chosen_variants, descriptor_type,
                                          diag_parser, fill_ring, scheduled_item, sm90_resources, smoke_in_child,
                                          stage_ring, tile_schedule, wgmma_layout)
from benchmarks.gdpa import BATCH, HEAD_DIM, HEADS, workloads  # issue 4's shapes
from opengem.ops import gdpa, jagged_attention
from opengem.ops.attention_flops import attention_flops, visible_pairs

BLOCK_M = 128  # query rows a program: 64 per warpgroup; the schedule's tiles


class Variant(NamedTuple):
    block_n: int  # keys a tile
    stages: int  # K and V buffers in the ring
    overlap: bool  # FlashAttention-3's in-warpgroup overlap
    consumers: int  # 1: one 8-warp partition; 2: a partition a warpgroup, K freed when its S MMA retires
    pingpong: bool = False  # two overlapped consumers take turns issuing their MMAs

    @property
    def name(self) -> str:
        return (f"gluon_n{self.block_n}_s{self.stages}" + ("_overlap" if self.overlap else "")
                + ("_2wg" if self.consumers == 2 else "") + ("_pingpong" if self.pingpong else ""))

    @property
    def num_warps(self) -> int:  # the kernel's (the default partition's): 8, or 4 with a second consumer partition
        return 8 // self.consumers


# session 40's best (one 8-warp consumer), session 41's best two-partition form (s46a: 1.00-1.07x the Triton kernel at
# L >= 1024 on an H100, 1.03-1.09x the first), then the same with the partitions taking turns; the other variants'
# figures are in s45f's and s46a's results, not rerun
VARIANTS = (Variant(64, 3, True, 1), Variant(128, 3, True, 2), Variant(128, 3, True, 2, pingpong=True),
            Variant(128, 2, True, 2, pingpong=True), Variant(64, 3, True, 2, pingpong=True))


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
def _attend(q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, my_turn, their_turn, Out, stride_ot, out_row,
            rows, key_len, head_col, slope, scale, out_scale, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
            OVERLAP: gl.constexpr, EARLY_K: gl.constexpr, PINGPONG: gl.constexpr, FIRST: gl.constexpr):
    """One consumer partition: ``q_smem``'s rows (64 a warpgroup) against every key tile of the sample. With
    ``EARLY_K`` a K buffer is freed as soon as its ``S`` MMA retires, so the worker refills it while ``P V`` runs;
    otherwise K and V are freed together after ``P V``. With ``PINGPONG`` (two consumer partitions, overlapped loop)
    the partitions take turns issuing their MMAs (FlashAttention-3's warp scheduler barrier): one's activation runs
    while the other's MMAs hold the tensor cores; ``FIRST`` (1 or 0) says which goes first."""
    BLOCK_M: gl.constexpr = q_smem.type.shape[0]
    stages: gl.constexpr = k_bufs.type.shape[0]
    num_warps: gl.constexpr = gl.num_warps()  # this partition's
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N, num_warps)
    o_layout: gl.constexpr = wgmma_layout(HEAD_DIM, num_warps)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    n_tiles = gl.cdiv(key_len, BLOCK_N)
    if OVERLAP:
        # FlashAttention-3's in-warpgroup overlap: tile j+1's S is issued before tile j's P V, and phi(S_{j+1})
        # runs on the CUDA cores while P_j V_j is still on the tensor cores
        mbarrier.wait(k_ready.index(0), 0)
        if PINGPONG:
            _take_turn(my_turn, 0, FIRST)
        scores = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        if PINGPONG:
            mbarrier.arrive(their_turn, count=1)
        scores = warpgroup_mma_wait(0, deps=[scores])
        if EARLY_K:
            mbarrier.arrive(k_empty.index(0), count=1)
        p = _activate(scores, 0, n_tiles, key_len, slope, scale, BLOCK_N, s_layout, p_layout)
        for j in range(n_tiles - 1):
            s = j % stages
            nxt = (j + 1) % stages
            mbarrier.wait(k_ready.index(nxt), ((j + 1) // stages) & 1)
            mbarrier.wait(v_ready.index(s), (j // stages) & 1)
            if PINGPONG:
                _take_turn(my_turn, j + 1, FIRST)
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
        last = n_tiles - 1
        mbarrier.wait(v_ready.index(last % stages), (last // stages) & 1)
        if PINGPONG:
            _take_turn(my_turn, n_tiles, FIRST)  # the last of n_tiles + 1 issue groups
        acc = warpgroup_mma(p, v_bufs.index(last % stages), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(their_turn, count=1)
        acc = warpgroup_mma_wait(0, deps=[acc])
        if not EARLY_K:
            mbarrier.arrive(k_empty.index(last % stages), count=1)
        mbarrier.arrive(v_empty.index(last % stages), count=1)
    else:
        for j in range(n_tiles):
            s = j % stages
            phase = (j // stages) & 1
            mbarrier.wait(k_ready.index(s), phase)
            scores = warpgroup_mma(q_smem, k_bufs.index(s).permute((1, 0)), zero_s, use_acc=False)
            if EARLY_K:
                mbarrier.arrive(k_empty.index(s), count=1)
            p = _activate(scores, j, n_tiles, key_len, slope, scale, BLOCK_N, s_layout, p_layout)
            mbarrier.wait(v_ready.index(s), phase)
            acc = warpgroup_mma(p, v_bufs.index(s), acc, is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
            if not EARLY_K:
                mbarrier.arrive(k_empty.index(s), count=1)
            mbarrier.arrive(v_empty.index(s), count=1)
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    ptrs = Out + gl.expand_dims((out_row + offs_m).to(gl.int64) * stride_ot, 1) + head_col + gl.expand_dims(offs_d, 0)
    gl.store(ptrs, (acc * out_scale).to(gl.bfloat16), mask=gl.expand_dims(offs_m < rows, 1))


@gluon.jit
def gluon_gdpa_fwd_kernel(q_desc, k_desc, v_desc, Out, stride_ot, item_start, item_len, item_m, slope, scale,
                          out_scale, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                          STAGES: gl.constexpr, OVERLAP: gl.constexpr, CONSUMERS: gl.constexpr,
                          PINGPONG: gl.constexpr, num_warps: gl.constexpr):
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
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # PINGPONG: whose MMAs go next
    mbarrier.init(turns.index(0), count=1)
    mbarrier.init(turns.index(1), count=1)
    # the partitions' arguments written out: a tuple built with ``+`` turns constexprs into tensors
    if CONSUMERS == 1:  # one 8-warp partition: the two warpgroups meet at every barrier arrive (bar.sync 0, 256)
        gl.warp_specialize([
            (_attend, (q_smem, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns.index(0), turns.index(1),
                       Out, stride_ot, out_row, rows, length, head_col, slope, scale, out_scale, BLOCK_N, HEAD_DIM,
                       OVERLAP, False, False, True)),
            (fill_ring, (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, start, length, head_col,
                         BLOCK_N)),
        ], [1], [24])
    else:  # a 4-warp partition a warpgroup, each with its own 64 rows: they drift apart and free buffers alone
        half: gl.constexpr = BLOCK_M // 2
        gl.warp_specialize([
            (_attend, (q_smem.slice(0, half), k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns.index(0),
                       turns.index(1), Out, stride_ot, out_row, rows, length, head_col, slope, scale, out_scale,
                       BLOCK_N, HEAD_DIM, OVERLAP, True, PINGPONG, True)),
            (_attend, (q_smem.slice(half, half), k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, turns.index(1),
                       turns.index(0), Out, stride_ot, out_row + half, rows - half, length, head_col, slope, scale,
                       out_scale, BLOCK_N, HEAD_DIM, OVERLAP, True, PINGPONG, False)),
            (fill_ring, (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, start, length, head_col,
                         BLOCK_N)),
        ], [4, 1], [240, 24])


def gluon_gdpa_forward(q, k, v, schedule: tuple[torch.Tensor, ...], max_len: int, pre_scale: float,
                       variant: Variant = VARIANTS[0]) -> torch.Tensor:
    """fast_gelu GDPA self-attention, ``norm="max_len"``: ``[T, H, 128]`` bf16 in and out; ``schedule`` from
    :func:`tile_schedule` in tiles of ``BLOCK_M`` rows."""
    T, H, D = q.shape
    contiguous = q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    if D != HEAD_DIM or q.dtype != torch.bfloat16 or not contiguous:
        raise ValueError(f"needs contiguous bf16 [T, H, {HEAD_DIM}] q, k, v; got {q.dtype} {tuple(q.shape)}")
    out = torch.empty_like(q)
    q_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], gl.bfloat16)
    block_n = variant.block_n
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, D], gl.bfloat16)
    q_desc = TensorDescriptor.from_tensor(q.view(T, H * D), [BLOCK_M, D], q_layout)
    k_desc = TensorDescriptor.from_tensor(k.view(T, H * D), [block_n, D], kv_layout)
    v_desc = TensorDescriptor.from_tensor(v.view(T, H * D), [block_n, D], kv_layout)
    item_start, item_len, item_m = schedule
    grid = (item_start.numel(), H)
    gluon_gdpa_fwd_kernel[grid](q_desc, k_desc, v_desc, out, H * D, item_start, item_len, item_m,
                                pre_scale * FAST_GELU_SLOPE, pre_scale, 1.0 / max_len, BLOCK_M, block_n, D,
                                variant.stages, variant.overlap, variant.consumers, variant.pingpong,
                                num_warps=variant.num_warps, maxnreg=168)
    return out


def compile_only(variant: Variant) -> dict[str, object]:
    """Build the kernel for sm_90 without a GPU; registers, stack, shared memory and key SASS opcodes."""
    constants = {"BLOCK_M": BLOCK_M, "BLOCK_N": variant.block_n, "HEAD_DIM": HEAD_DIM, "STAGES": variant.stages,
                 "OVERLAP": variant.overlap, "CONSUMERS": variant.consumers, "PINGPONG": variant.pingpong,
                 "num_warps": variant.num_warps}
    kv_type = descriptor_type(variant.block_n, HEAD_DIM)
    signature = {"q_desc": descriptor_type(BLOCK_M, HEAD_DIM), "k_desc": kv_type, "v_desc": kv_type,
                 "Out": "*bf16", "stride_ot": "i32",
                 "item_start": "*i32", "item_len": "*i32", "item_m": "*i32", "slope": "fp32", "scale": "fp32",
                 "out_scale": "fp32"}
    return sm90_resources(gluon_gdpa_fwd_kernel, signature, constants, variant.num_warps, maxnreg=168)


def _errors(q, k, v, lengths: torch.Tensor, max_len: int, scale: float, variants,
            samples: int = 32) -> dict[str, float]:
    """Both kernels against the fp32 reference on the first ``samples`` samples (the reference is slow)."""
    sub = lengths[:samples]
    rows = int(sub.sum())
    q, k, v = q[:rows].contiguous(), k[:rows].contiguous(), v[:rows].contiguous()
    offsets = offsets_of(sub, q.device)
    options = dict(activation="fast_gelu", pre_scale=scale, norm=float(max_len))
    want = gdpa(q.float(), k.float(), v.float(), offsets, offsets, max_len, max_len, backend="reference", **options)
    triton_out = gdpa(q, k, v, offsets, offsets, max_len, max_len, backend="triton", **options)
    schedule = tile_schedule(sub, BLOCK_M, q.device)
    return {"triton_vs_fp32": relative_error(triton_out, want)} | {
        f"{variant.name}_vs_fp32": relative_error(gluon_gdpa_forward(q, k, v, schedule, max_len, scale, variant), want)
        for variant in variants}


def smoke(variant: Variant) -> float:
    """One variant on a small jagged batch (single, partial and several key tiles) against the Triton op: the
    relative error. :func:`healthy_variants` runs it in a child process, so a hang costs a timeout."""
    lengths = torch.tensor(SMOKE_LENGTHS)
    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(int(lengths.sum()), HEADS, HEAD_DIM, generator=gen, device="cuda").bfloat16()
               for _ in range(3))
    offsets, max_len, scale = offsets_of(lengths, "cuda"), int(lengths.max()), 1 / math.sqrt(HEAD_DIM)
    want = gdpa(q, k, v, offsets, offsets, max_len, max_len, activation="fast_gelu", pre_scale=scale, norm="max_len")
    got = gluon_gdpa_forward(q, k, v, tile_schedule(lengths, BLOCK_M, "cuda"), max_len, scale, variant)
    torch.cuda.synchronize()
    return relative_error(got, want)


def healthy_variants(chosen: list[Variant]) -> tuple[list[Variant], dict[str, str]]:
    """The variants whose smoke call returns an error under 2e-2 in time; the others with what went wrong."""
    healthy, failed = [], {}
    for variant in chosen:
        name = variant.name
        problem = smoke_in_child("benchmarks.diag.gluon_gdpa_forward", name, 2e-2)
        if problem is None:
            healthy.append(variant)
        else:
            failed[name] = problem
        print(name, problem or "ok", flush=True)
    return healthy, failed


def run(prefixes: list[str] | None, rounds: int, chosen: list[Variant]) -> list[dict[str, object]]:
    variants, failed = healthy_variants(chosen)
    rows: list[dict[str, object]] = []
    if failed:
        rows.append({"workload": "smoke (lengths 1..300)", "failed": failed})
        print(write_results("gluon_gdpa_forward", rows), flush=True)
    if not variants:
        return rows
    for w in by_name_prefix([w for w in workloads(False) if w.name.startswith("a ")], prefixes, "--workloads"):
        gen = torch.Generator(device="cuda").manual_seed(1)
        total = int(w.q_lengths.sum())
        q, k, v = (torch.randn(total, HEADS, HEAD_DIM, generator=gen, device="cuda").bfloat16() for _ in range(3))
        offsets, max_len = offsets_of(w.q_lengths, "cuda"), int(w.q_lengths.max())
        scale = 1 / math.sqrt(HEAD_DIM)
        schedule = tile_schedule(w.q_lengths, BLOCK_M, "cuda")
        fns = {
            "triton": lambda: gdpa(q, k, v, offsets, offsets, max_len, max_len, activation="fast_gelu",
                                   pre_scale=scale, norm="max_len"),
            "jfa": lambda: jagged_attention(q, k, v, offsets, max_len, causal=False, scale=scale),
        } | {variant.name: partial(gluon_gdpa_forward, q, k, v, schedule, max_len, scale, variant)
             for variant in variants}
        with torch.no_grad():
            errors = _errors(q, k, v, w.q_lengths, max_len, scale, variants)
            want = fns["triton"]()
            errors |= {f"{name}_vs_triton": relative_error(fn(), want) for name, fn in fns.items() if "gluon" in name}
            fns["jfa"]()  # its tuner runs here, not inside a timed round
            times = interleaved_ms(fns, rounds=rounds, bench=bench_ms)
        flops, _ = attention_flops(visible_pairs(w.q_lengths, w.k_lengths), HEADS, HEAD_DIM)
        row = {"workload": w.name, "batch": BATCH, **errors,
               **{f"{name}_ms": min(t) for name, t in times.items()},
               **{f"{name}_tflops": flops / min(t) / 1e9 for name, t in times.items()},
               "triton_x_jfa": paired_speedup(times["jfa"], times["triton"])}
        for name in (n for n in fns if "gluon" in n):
            row[f"{name}_x_triton"] = paired_speedup(times["triton"], times[name])
            row[f"{name}_x_jfa"] = paired_speedup(times["jfa"], times[name])
        print(row, flush=True)
        rows.append(row)
        print(write_results("gluon_gdpa_forward", rows), flush=True)  # a hang later keeps the rows so far
    return rows


def main() -> None:
    parser = diag_parser(__doc__, [v.name for v in VARIANTS])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    chosen = chosen_variants(VARIANTS, args.variants)
    if args.smoke:
        variant = next(v for v in VARIANTS if v.name == args.smoke)
        print(f"smoke error {smoke(variant)}", flush=True)
        return
    if args.compile_only:
        for variant in chosen:
            print(variant.name, compile_only(variant))
        return
    run(args.workloads, args.rounds, chosen)


if __name__ == "__main__":
    main()
