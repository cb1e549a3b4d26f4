"""Static cost of GDPA's kernels on Hopper, both load paths (ragged TMA descriptors, masked pointer loads),
without a GPU: registers, spills, shared memory, programs per SM and SASS instructions per thread of every
tuning candidate (:func:`benchmarks.sass.sass_cost`), bf16, D 128, fast_gelu, no mask (issue 4's workloads
(a) and (b)); resident-K/V candidates at K/V 256.

``PYTHONPATH=src:. python -m benchmarks.gdpa_sass`` (CPU is enough; not under ``TRITON_INTERPRET=1``;
``GDPA_SASS_COLUMN_SUMS=1``: the backward variants that also write their column sums; ``GDPA_SASS_QUERY_CHUNKS=1``:
the dK/dV variants that may take one chunk of a long sample's query rows).
"""

from __future__ import annotations

import os

from benchmarks.sass import COUNTED, cost_columns, jit_function, launch_signature, sass_cost, with_constexpr_defaults
from opengem.ops.triton import gdpa as host
from opengem.ops.triton import gdpa_kernels as kernels

D = 128
INT_POINTERS = {"Q_OFF", "K_OFF", "TARGETS", "HEAD_ACT", "WORK_B", "WORK_T", "CHUNK_B", "WORK_CHUNK", "GROUPS"}
UNMASKED = dict(GROUP=1, D=D, ACT=3, MASKED=False, CAUSAL=False, HAS_TARGETS=False, HAS_WINDOW=False,
                HAS_CONTEXT=False, PRECISION="tf32", FAST_ACT=True)


def signature(kernel, constants: dict, tma: bool) -> dict[str, str]:
    """Argument types of a GDPA kernel as the launcher specializes a bf16 call (``tma``: descriptor arguments);
    ``constants`` with the defaults of the constexprs a launch leaves out (``sass.with_constexpr_defaults``)."""
    pointers = {**dict.fromkeys(INT_POINTERS, "*i32"), "DQ_PARTIAL": "*fp32", "SUMS": "*fp32", "PARTIAL": "*fp32"}
    return launch_signature(kernel, constants, tma, constants["D"], {"Q_desc", "DO_desc"}, pointers,
                            {"pre_scale", "out_scale", "dq_scale"})


def has_tma_path(kernel) -> bool:
    """Whether the kernel loads through TMA descriptors under ``USE_TMA`` (the short-query dK/dV has pointers only)."""
    return "USE_TMA" in jit_function(kernel).arg_names


def _variants():
    """(pass, label, kernel, constants, config) of every GPU tuning candidate."""
    for config in host._FWD_RESIDENT + host._FWD:
        resident = config.block_n == 0
        block_n = 256 if resident else config.block_n
        tiles = config.tiles if resident else 1
        label = f"{config.block_m}x{'K/V 256 resident' if resident else block_n} tiles {tiles}"
        yield "fwd", label, kernels.gdpa_fwd_kernel, dict(
            UNMASKED, BLOCK_M=config.block_m, BLOCK_N=block_n, TILES=tiles,
            BROADCAST_Q=False, KV_RESIDENT=resident), config
    for name, kernel, configs, extra in (("dkdv", kernels.gdpa_bwd_dkdv_kernel, host._DKDV, {"BROADCAST_Q": False}),
                                         ("dq", kernels.gdpa_bwd_dq_kernel, host._DQ, {})):
        for config in configs:
            yield name, f"{config.block_m}x{config.block_n}", kernel, dict(
                UNMASKED, BLOCK_M=config.block_m, BLOCK_N=config.block_n, **extra), config
    for config in host._DQ_RESIDENT:  # GEM's PFFN: 32 keys a sample, resident
        yield "dq", f"{config.block_m}x32 resident tiles {config.tiles}", kernels.gdpa_bwd_dq_kernel, dict(
            UNMASKED, BLOCK_M=config.block_m, BLOCK_N=32, KV_RESIDENT=True, TILES=config.tiles), config
    for config in host._DKDV_SHORT_Q:  # seed pooling: 16 broadcast seeds, one query tile (pointer loads only)
        yield "dkdv", f"16 seeds x{config.block_n} tiles {config.tiles}", kernels.gdpa_bwd_dkdv_short_q_kernel, dict(
            GROUP=1, D=D, ACT=3, PRECISION="tf32", FAST_ACT=True, BLOCK_M=16, BLOCK_N=config.block_n,
            TILES=config.tiles, BROADCAST_Q=True), config


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: this compiles the GPU kernels")
    print("pass | tiles | warps | stages | loads | regs | spill stack B | shared KB | programs / SM | "
          "replicated dots | SASS instr/thread (vs pointer) | " + " | ".join(COUNTED))
    # GDPA_SASS_COLUMN_SUMS=1: the dQ and dK/dV variants that also write their column sums (a projection bias's grad)
    sums = os.environ.get("GDPA_SASS_COLUMN_SUMS") == "1"
    query_chunks = os.environ.get("GDPA_SASS_QUERY_CHUNKS") == "1"
    for name, label, kernel, constants, config in _variants():
        base = None
        has_tma = has_tma_path(kernel)
        if sums and name != "fwd":
            constants = dict(constants, COLUMN_SUMS=True)
        if query_chunks and kernel is kernels.gdpa_bwd_dkdv_kernel:
            constants = dict(constants, QUERY_CHUNKS=True)
        for tma in (False, True) if has_tma else (False,):
            consts = with_constexpr_defaults(kernel, dict(constants, USE_TMA=tma) if has_tma else constants)
            cost = sass_cost(kernel, signature(kernel, consts, tma), consts, config.num_warps, config.num_stages)
            base = base or cost["instructions"]
            counts = " | ".join(str(cost[op]) for op in COUNTED)
            print(f"{name} | {label} | {config.num_warps} | {config.num_stages} | {'tma' if tma else 'pointer'} | "
                  f"{cost_columns(cost, config.num_warps)} ({cost['instructions'] / base - 1:+.0%}) | {counts}",
                  flush=True)


if __name__ == "__main__":
    main()
