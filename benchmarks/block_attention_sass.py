"""Static cost of BlockAttention's rotary modes, without a GPU: compile the kernels for sm_90 (Triton's
bundled ptxas) and count registers, local-memory spills, shared memory, resident programs per SM and SASS
instructions per thread.

Both kernels are straight-line code per (block, head) program for GROUP = 1, so their static counts are
the dynamic ones. Instructions per thread x warps x programs / (4 schedulers x SMs x clock) is the issue time,
to compare with the memory time of this bandwidth-bound kernel. Compiled as the launcher specializes a
contiguous bf16 ``[T, 4, 128]`` call: block 64, 16-byte aligned pointers and strides. Run on any machine (CPU is enough):
``PYTHONPATH=src python -m benchmarks.block_attention_sass``. Not run under ``TRITON_INTERPRET=1``
(the kernels would compile their interpreter variant).
"""

from __future__ import annotations

import os

from benchmarks.sass import COUNTED, jit_function, programs_per_sm, sass_cost
from opengem.ops.triton import block_attention as kernels

MODES = ((0, "off"), (1, "in-sequence positions"), (2, "given positions"), (3, "time gaps"))
POINTER_TYPES = {"SCHED": "*i32", "PHASE": "*fp32", "INV_FREQ": "*fp32"}


def _signature(fn, constants: dict) -> dict[str, str]:
    def kind(name: str) -> str:
        if name in constants:
            return "constexpr"
        if name in POINTER_TYPES:
            return POINTER_TYPES[name]
        if name.isupper():
            return "*bf16"  # Q, K, V, O, DO, DQ, DK, DV
        return "fp32" if name in ("scale", "time_scale") else "i32"

    return {name: kind(name) for name in fn.arg_names}


def compiled_cost(kernel, num_warps: int, maxnreg: int | None = None, **constants) -> dict[str, int]:
    """:func:`benchmarks.sass.sass_cost` of one BlockAttention variant (``maxnreg``: the register cap of an
    autotuner config that sets one), one pipeline stage."""
    signature = _signature(jit_function(kernel), constants)
    return sass_cost(kernel, signature, constants, num_warps, 1, maxnreg)


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: this compiles the GPU kernels")
    print("kernel | warps | rotary | regs | spill stack B | shared KB | programs / SM | SASS instr/thread (vs off) | "
          + " | ".join(COUNTED))
    # every config the autotuner may pick (the GPU's list: this never runs under the interpreter)
    kinds = (("fwd", kernels._block_attention_fwd, False), ("bwd", kernels._block_attention_bwd, True))
    for name, kernel, config in [(n, k, c) for n, k, backward in kinds for c in kernels._configs(backward)]:
        warps = f"{config.num_warps}" + (f" (max {config.maxnreg} regs)" if config.maxnreg else "")
        warps += " shared inverse" if config.kwargs.get("SHARE_BACK") else ""
        warps += " late v" if config.kwargs.get("LATE_V") else ""
        base = None
        for mode, label in MODES:
            if config.kwargs.get("SHARE_BACK") and not kernels.share_back_applies(1, mode):  # the unshared code
                base = compiled_cost(kernel, config.num_warps, config.maxnreg, GROUP=1, BLOCK=64, HALF=64,
                                     ACT=kernels.SOFTMAX.value, ROT=0, REDUCE=False, SHARE_BACK=False,
                                     LATE_V=config.kwargs["LATE_V"])["instructions"]
                continue
            cost = compiled_cost(kernel, config.num_warps, config.maxnreg, GROUP=1, BLOCK=64, HALF=64,
                                 ACT=kernels.SOFTMAX.value, ROT=mode, REDUCE=False, **config.kwargs)
            base = base or cost["instructions"]
            ratio = f"{cost['instructions']} ({cost['instructions'] / base - 1:+.0%})"
            counts = " | ".join(str(cost[op]) for op in COUNTED)
            resident = programs_per_sm(cost, config.num_warps)
            print(f"{name} | {warps} | {label} | {cost['reg']} | {cost['stack']} | {cost['shared'] / 1024:.0f} | {resident} | "
                  f"{ratio} | {counts}", flush=True)


if __name__ == "__main__":
    main()
