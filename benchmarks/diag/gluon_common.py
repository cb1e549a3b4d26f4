"""What the Gluon diags (``gluon_gdpa_forward``, ``gluon_gdpa_dkdv``) share: the tile schedule, the TMA ring, the
sm_90 build on a CPU with its SASS resources, smoke calls in child processes (a hung kernel costs a timeout, not the
chain) and the command line.

Gluon has no interpreter, and its API moves between Triton releases: these kernels are written for triton 3.6, the
GPU image's (3.9's Gluon rejects them); build them on the CPU under a 3.6 install (``--compile-only``).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Callable

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton._C.libtriton import ir
from triton.experimental.gluon.language._core import builtin

from benchmarks.gdpa import HEAD_DIM, HEADS  # issue 4's shapes
from benchmarks.sass import disassemble
from opengem.ops.activations import FAST_GELU_RADIUS
from opengem.ops.triton.jagged_attention import _tiles as jfa_tiles

# v = sat(x * slope + 1/2); phi(x) = x * v^2 (3 - 2 v), phi'(x) = 4 v^2 (3 - 2 v) - 3 v (opengem.ops.triton.activations)
FAST_GELU_SLOPE = 0.5 / FAST_GELU_RADIUS
SMOKE_TIMEOUT_S = 120  # one variant's compile and a small call; past it the variant is taken as hung
SMOKE_LENGTHS = (1, 37, 64, 127, 128, 129, 200, 300)  # single, partial and several tiles of 64 and 128 rows


@gluon.jit
def scheduled_item(item_start, item_len, item_tile):
    """This program's ``(sample start, sample length, tile start)`` from :func:`tile_schedule`'s arrays."""
    item = gl.program_id(0)
    return gl.load(item_start + item), gl.load(item_len + item), gl.load(item_tile + item)


@builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """``global[coord box] += src`` by the TMA (``cp.reduce.async.bulk.tensor ... .add``, FlashAttention-3's dQ path):
    asynchronous, in its bulk group, so ``tma.store_wait`` orders the reuse of ``src``. Triton 3.6's Gluon builder
    has the op (``create_async_tma_reduce``); its Python API does not wrap it."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


def tile_schedule(lengths: torch.Tensor, block: int, device) -> tuple[torch.Tensor, ...]:
    """``(start, length, tile_start)`` int32 per (sample, tile of ``block`` rows), longest samples first, so the last
    wave's stragglers are short ones; built once per batch, outside the timed calls."""
    lengths = lengths.to(torch.int64)
    starts = torch.cumsum(lengths, 0) - lengths
    sample, tile_start = jfa_tiles(lengths, block)  # JFA's enumeration of the tiles holding tokens
    order = torch.argsort(-lengths[sample], stable=True)
    return tuple(t[order].to(device=device, dtype=torch.int32) for t in (starts[sample], lengths[sample], tile_start))


def descriptor_type(rows: int, cols: int, dtype: str = "bf16") -> str:
    """The signature type of a TMA descriptor of ``[rows, cols]`` boxes with Gluon's default NVMMA layout."""
    layout = gl.NVMMASharedLayout.get_default_for([rows, cols], {"bf16": gl.bfloat16, "fp32": gl.float32}[dtype])
    return f"tensordesc<{dtype}[{rows},{cols}],{layout!r}>"


def programs_per_sm(tile: int) -> int:
    """The programs an SM a Gluon diag kernel is launched for, from its tile of query rows (forward) or keys (dK/dV):
    one of 128 (two warpgroups), two of 64 (one warpgroup; three would launch at 80 registers, which ptxas refuses
    for these loops)."""
    return 128 // tile


def random_heads(lengths: torch.Tensor, count: int, seed: int) -> tuple[torch.Tensor, ...]:
    """``count`` bf16 ``[sum(lengths), HEADS, HEAD_DIM]`` tensors of N(0, 1) on the GPU, one seeded generator."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = int(lengths.sum())
    return tuple(torch.randn(rows, HEADS, HEAD_DIM, generator=gen, device="cuda").bfloat16() for _ in range(count))


def sm90_resources(kernel, signature: dict[str, str], constants: dict, num_warps: int, maxnreg: int) -> dict:
    """Build ``kernel`` for sm_90 without a GPU: registers (``maxnreg``; partitions move it with ``setmaxnreg``),
    stack, shared memory, warps and counts of the SASS that matters here."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    source = GluonASTSource(kernel, signature | {name: "constexpr" for name in constants}, constexprs=constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "maxnreg": maxnreg})
    sass, usage = disassemble(compiled.asm["cubin"])
    resources = {key.lower(): int(value) for key, value in re.findall(r"(REG|STACK):(\d+)", usage)}
    opcodes = {op: len(re.findall(rf"\b{op}\b", sass)) for op in ("HGMMA", "UTMALDG", "UTMAREDG", "LDL", "STL")}
    partition_registers = sorted({int(n, 16) for n in re.findall(r"USETMAXREG\.\w+\.CTAPOOL[^;]*?(0x[0-9a-f]+)", sass)})
    return dict(resources, shared=compiled.metadata.shared, warps=compiled.metadata.num_warps,
                partition_registers=partition_registers, **opcodes)


def smoke_in_child(module: str, name: str, bound: float) -> str | None:
    """Run ``python -m module --smoke name`` (which prints ``smoke error E``) with a timeout: ``None`` when it
    returned an error under ``bound``, else what went wrong."""
    command = [sys.executable, "-m", module, "--smoke", name]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"no result within {SMOKE_TIMEOUT_S} s (hung)"
    found = re.search(r"smoke error ([0-9.eE+-]+|inf|nan)", done.stdout)
    if done.returncode != 0 or not found:
        return f"exit {done.returncode}: {(done.stderr or done.stdout).strip()[-400:]}"
    if not float(found.group(1)) < bound:
        return f"wrong: relative error {found.group(1)} against the Triton op"
    return None


def healthy_variants(module: str, chosen: list) -> tuple[list, dict[str, str]]:
    """The variants (each with a ``name``) whose smoke call in a child process (``python -m module --smoke NAME``)
    returns an error under 2e-2 in time; the others with what went wrong."""
    healthy, failed = [], {}
    for variant in chosen:
        problem = smoke_in_child(module, variant.name, 2e-2)
        if problem is None:
            healthy.append(variant)
        else:
            failed[variant.name] = problem
        print(variant.name, problem or "ok", flush=True)
    return healthy, failed


def diag_main(doc: str, variants: tuple, smoke: Callable, compile_only: Callable, run: Callable,
              configure: Callable[[argparse.ArgumentParser], None] | None = None) -> None:
    """A Gluon diag's entry point: the internal ``--smoke NAME`` (prints ``smoke error E`` for
    :func:`smoke_in_child`), ``--compile-only`` (each chosen variant's sm_90 resources), else ``run(args,
    chosen variants)``; ``configure`` adds the diag's own options."""
    parser = diag_parser(doc, [v.name for v in variants])
    if configure is not None:
        configure(parser)
    args = parser.parse_args()
    chosen = chosen_variants(variants, args.variants)
    if args.smoke:
        print(f"smoke error {smoke(next(v for v in variants if v.name == args.smoke))}", flush=True)
    elif args.compile_only:
        for variant in chosen:
            print(variant.name, compile_only(variant))
    else:
        run(args, chosen)


def diag_parser(doc: str, variant_names: list[str]) -> argparse.ArgumentParser:
    """The Gluon diags' command line: ``--compile-only``, ``--workloads`` (name prefixes of issue 4's workload (a)),
    ``--variants`` and the internal ``--smoke VARIANT`` that :func:`smoke_in_child` runs."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--compile-only", action="store_true", help="build for sm_90 on the CPU, print resources")
    parser.add_argument("--workloads", type=lambda text: text.split(","), default=None)
    parser.add_argument("--variants", type=lambda text: text.split(","), default=None,
                        help=f"comma-separated variant names (default: all): {', '.join(variant_names)}")
    parser.add_argument("--smoke", choices=variant_names, default=None,
                        help="(internal) one variant's smoke call, printing its error")
    return parser


def chosen_variants(variants: tuple, names: list[str] | None) -> list:
    """The ``variants`` (each with a ``name``) that ``--variants`` names, in its order; all when it is not given."""
    if names is None:
        return list(variants)
    by_name = {v.name: v for v in variants}
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {sorted(by_name)}")
    return [by_name[name] for name in names]
