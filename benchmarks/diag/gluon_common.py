"""What the Gluon diags (``gluon_gdpa_forward``, ``gluon_gdpa_dkdv``) share: the tile schedule, the sm_90 build on a
CPU with its SASS resources, and smoke calls in child processes (a hung kernel costs a timeout, not the chain).

Gluon has no interpreter, and its API moves between Triton releases: these kernels are written for triton 3.6, the
GPU image's (3.9's Gluon rejects them); build them on the CPU under a 3.6 install (``--compile-only``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.experimental.gluon import language as gl

HEAD_DIM = 128
FAST_GELU_SLOPE = 0.5 / 1.88  # v = sat(x * slope + 1/2); phi(x) = x * v^2 (3 - 2 v), phi'(x) = 4 v^2 (3 - 2 v) - 3 v
SMOKE_TIMEOUT_S = 120  # one variant's compile and a small call; past it the variant is taken as hung
SMOKE_LENGTHS = (1, 37, 64, 127, 128, 129, 200, 300)  # single, partial and several tiles of 64 and 128 rows


def tile_schedule(lengths: torch.Tensor, block: int, device) -> tuple[torch.Tensor, ...]:
    """``(start, length, tile_start)`` int32 per (sample, tile of ``block`` rows), longest samples first, so the last
    wave's stragglers are short ones; built once per batch, outside the timed calls."""
    lengths = lengths.to(torch.int64)
    starts = torch.cumsum(lengths, 0) - lengths
    tiles = (lengths + block - 1) // block
    sample = torch.repeat_interleave(torch.arange(lengths.numel()), tiles)
    first_tile = torch.cumsum(tiles, 0) - tiles
    tile_start = (torch.arange(int(tiles.sum())) - first_tile[sample]) * block
    order = torch.argsort(-lengths[sample], stable=True)
    return tuple(t[order].to(device=device, dtype=torch.int32) for t in (starts[sample], lengths[sample], tile_start))


def descriptor_type(rows: int, cols: int) -> str:
    """The signature type of a bf16 TMA descriptor of ``[rows, cols]`` boxes with Gluon's default NVMMA layout."""
    layout = gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)
    return f"tensordesc<bf16[{rows},{cols}],{layout!r}>"


def sm90_resources(kernel, signature: dict[str, str], constants: dict, num_warps: int, maxnreg: int) -> dict:
    """Build ``kernel`` for sm_90 without a GPU: registers (``maxnreg``; partitions move it with ``setmaxnreg``),
    stack, shared memory, warps and counts of the SASS that matters here."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    source = GluonASTSource(kernel, signature | {name: "constexpr" for name in constants}, constexprs=constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "maxnreg": maxnreg})
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([cuobjdump, "-sass", cubin.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([cuobjdump, "-res-usage", cubin.name], capture_output=True, text=True, check=True).stdout
    resources = {key.lower(): int(value) for key, value in re.findall(r"(REG|STACK):(\d+)", usage)}
    opcodes = {op: len(re.findall(rf"\b{op}\b", sass)) for op in ("HGMMA", "UTMALDG", "LDL", "STL")}
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
