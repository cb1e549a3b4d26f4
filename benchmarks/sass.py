"""Static cost of a Triton kernel on Hopper without a GPU: compile it for sm_90 (Triton's bundled ptxas) and
count registers, local-memory spills, shared memory, resident programs per SM and SASS instructions per
thread. Used by ``benchmarks.block_attention_sass``, ``benchmarks.gdpa_sass`` and ``benchmarks.jfa_sass``; not under
``TRITON_INTERPRET=1`` (kernels would compile their interpreter variant).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

TARGET = GPUTarget("cuda", 90, 32)
COUNTED = ("MUFU", "FFMA", "FMUL", "LDG", "LDL", "STL")


def jit_function(kernel) -> JITFunction:
    while not isinstance(kernel, JITFunction):  # unwrap the autotuner
        kernel = kernel.fn
    return kernel


def with_constexpr_defaults(kernel, constants: dict) -> dict:
    """``constants`` plus the defaults of the kernel's constexpr parameters it leaves out, as a launch that does not
    pass them gets them (a signature typing them as runtime arguments would compile branches no launch takes)."""
    params = jit_function(kernel).params
    return {**{p.name: p.default for p in params if p.is_constexpr and p.has_default}, **constants}


def launch_signature(
    kernel, constants: dict, tma: bool, head_dim: int, query_descs: set[str], pointers: dict[str, str],
    float_scalars: set[str],
) -> dict[str, str]:
    """Argument types of an attention kernel as the launcher specializes a bf16 call: ``constants`` are constexprs;
    ``*_desc`` arguments ragged descriptors (``tma``) of ``BLOCK_M`` rows for ``query_descs``, else ``BLOCK_N``, or
    plain pointers; ``pointers`` the non-bf16 pointer types by name; other capitalized names bf16 tensors;
    ``float_scalars`` fp32, every other scalar i32."""
    def kind(name: str) -> str:
        if name in constants:
            return "constexpr"
        if name.endswith("_desc"):
            rows = constants["BLOCK_M"] if name in query_descs else constants["BLOCK_N"]
            return f"tensordesc<bf16[1,1,{rows},1,{head_dim}]>" if tma else "*bf16"
        if name in pointers:
            return pointers[name]
        if name[0].isupper():
            return "*bf16"
        return "fp32" if name in float_scalars else "i32"

    return {name: kind(name) for name in jit_function(kernel).arg_names}


def disassemble(cubin: bytes) -> tuple[str, str]:
    """``(SASS, resource usage)`` of a compiled kernel, from Triton's bundled ``cuobjdump``."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        sass = subprocess.run([cuobjdump, "-sass", file.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([cuobjdump, "-res-usage", file.name], capture_output=True, text=True, check=True).stdout
    return sass, usage


def sass_cost(
    kernel, signature: dict[str, str], constants: dict, num_warps: int, num_stages: int = 1, maxnreg: int | None = None
) -> dict[str, int]:
    """Registers, spill stack bytes, shared memory, SASS instructions per thread and selected opcodes of one
    variant. Pointers and ``stride*`` arguments are marked 16-divisible, as the launcher specializes
    contiguous ``[T, H, D]`` tensors."""
    fn = jit_function(kernel)
    aligned = [i for i, name in enumerate(fn.arg_names) if signature[name].startswith("*") or name.startswith("stride")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages) | ({"maxnreg": maxnreg} if maxnreg else {})
    compiled = triton.compile(source, target=TARGET, options=options)
    sass, usage = disassemble(compiled.asm["cubin"])
    opcodes = Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass, re.M))
    resources = {key.lower(): int(value) for key, value in re.findall(r"(REG|STACK):(\d+)", usage)}
    return dict(**resources, shared=compiled.metadata.shared, instructions=sum(opcodes.values()),
                replicated=len(replicated_dots(compiled.asm["ttgir"])), **{op: opcodes.get(op, 0) for op in COUNTED})


def replicated_dots(ttgir: str) -> list[str]:
    """The Hopper MMA dots of a compiled kernel (its ``ttgir``) whose tile has fewer rows than the warps along M
    cover (16 rows per warp): every warpgroup past the rows computes the same product again. Triton lays a
    chained dot's warps all along M, so a 64-row attention tile at 8 warps runs its first dot twice."""
    warps_m = {name: int(rows) for name, rows in
               re.findall(r"^(#mma\d*) = #ttg\.nvidia_mma<\{[^}]*warpsPerCTA = \[(\d+), \d+\]", ttgir, re.M)}
    found = []
    for rows, cols, layout in re.findall(r"ttng\.warp_group_dot .*-> tensor<(\d+)x(\d+)xf32, (#mma\d*)>", ttgir):
        if int(rows) < 16 * warps_m[layout]:
            found.append(f"{rows}x{cols} dot on {warps_m[layout]} warps along M")
    return found


def programs_per_sm(cost: dict[str, int], num_warps: int) -> int:
    """Resident programs per sm_90 SM: 64k registers, 228 KB of shared memory (1 KB reserved per program)."""
    by_registers = 65536 // (cost["reg"] * 32 * num_warps)
    by_shared = 228 * 1024 // (cost["shared"] + 1024)
    return min(by_registers, by_shared)


def cost_columns(cost: dict[str, int], num_warps: int) -> str:
    """``regs | spill stack B | shared KB | programs / SM | replicated dots | SASS instr/thread`` of one variant."""
    return (f"{cost['reg']} | {cost['stack']} | {cost['shared'] / 1024:.0f} | {programs_per_sm(cost, num_warps)} | "
            f"{cost['replicated']} | {cost['instructions']}")
