"""Static cost of JFA's backward kernels on Hopper without a GPU: registers, spills, shared memory, programs per SM
and SASS instructions per thread (:func:`benchmarks.sass.sass_cost`) of the tuner's dK/dV and dQ tiles beside
narrower inner tiles (32 query rows per dK/dV step, 32 keys per dQ step: GDPA's backward picks), bf16, D 128, TMA
and pointer loads, non-causal and causal.

``PYTHONPATH=src:. python -m benchmarks.jfa_sass`` (CPU is enough; not under ``TRITON_INTERPRET=1``;
``JFA_SASS_COLUMN_SUMS=1``: the variants that also write the gradients' column sums, a bias's gradient). The
GPU image runs Triton 3.6: install it beside the venv's (``pip install --target /tmp/t36 triton==3.6.0 --no-deps``)
and put it first on ``PYTHONPATH`` for its figures.
"""

from __future__ import annotations

import os

from triton.runtime.errors import PTXASError

from benchmarks.sass import cost_columns, launch_signature, sass_cost, with_constexpr_defaults
from opengem.ops.triton import jagged_attention as kernels

D = 128
NARROWER = {"dkdv": [(32, 128, 8, 2), (32, 128, 8, 3), (32, 64, 4, 3), (32, 64, 4, 2)],
            "dq": [(64, 32, 4, 3), (64, 32, 4, 2), (128, 32, 8, 3)]}
_POINTERS = {"LSE": "*fp32", "Delta": "*fp32", "Sums": "*fp32",
             **dict.fromkeys(("offsets", "num_targets", "sched_small", "sched_large", "tile_starts"), "*i32")}


def signature(kernel, constants: dict, tma: bool) -> dict[str, str]:
    """Argument types of a JFA kernel as the launcher specializes a bf16 call (``tma``: descriptor arguments)."""
    return launch_signature(kernel, constants, tma, D, {"Q_desc", "DO_desc", "O_desc"}, _POINTERS,
                            {"scale", "scale_log2"})


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: this compiles the GPU kernels")
    print("pass | mask | tile (M, N, warps, stages) | loads | regs | spill stack B | shared KB | programs / SM | "
          "replicated dots | SASS instr/thread")
    fixed = dict(HEAD_DIM=D, GROUP=1, HAS_WINDOW=False, HAS_CONTEXT=False, HAS_TARGETS=False, SMALL=kernels._SMALL,
                 PRECISION="tf32", COLUMN_SUMS=os.environ.get("JFA_SASS_COLUMN_SUMS") == "1")
    for name, curated in (("dkdv", kernels._DKDV), ("dq", kernels._DQ)):
        kernel = kernels.KERNELS[name]
        for causal in (False, True):
            for m, n, warps, stages in [*curated, *(t for t in NARROWER[name] if t not in curated)]:
                for tma in (True, False):
                    constants = with_constexpr_defaults(kernel, dict(fixed, CAUSAL=causal, USE_TMA=tma, BLOCK_M=m,
                                                                     BLOCK_N=n))
                    try:
                        columns = cost_columns(sass_cost(kernel, signature(kernel, constants, tma), constants, warps,
                                                         stages), warps)
                    except PTXASError as error:  # (Triton 3.6's ptxas crashes on a few variants on some hosts)
                        columns = f"ptxas failed: {str(error).splitlines()[0]}"
                    print(f"{name} | {'causal' if causal else 'full'} | {(m, n, warps, stages)} | "
                          f"{'tma' if tma else 'pointer'} | {columns}", flush=True)


if __name__ == "__main__":
    main()
