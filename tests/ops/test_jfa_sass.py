"""JFA's backward on 32-row inner tiles compiles for Hopper (sm_90) without spills on a CPU-only machine.

``benchmarks.jfa_sass`` found the tuner's 64 x 128 dK/dV tiles at 255 registers with 16-176 B of spills and the
32 x 128 ones with none (Triton 3.6 and 3.9). Timed on an H200 (session 26), the spill-free 32 x 128 lost by 10-17%
and 32 x 64 x 4 x 3 joined the dK/dV list.
This keeps that finding, and the benchmark's signature (descriptor boxes of query rows for Q and dO), true. It runs
in a subprocess without ``TRITON_INTERPRET`` (which replaces ``triton.jit`` kernels at import time).
"""

from tests.ops.aot import run_compiled

_SCRIPT = r"""
from benchmarks.jfa_sass import signature
from benchmarks.sass import sass_cost, with_constexpr_defaults
from opengem.ops.triton import jagged_attention as kernels

gem_masks = dict(HEAD_DIM=128, GROUP=1, CAUSAL=True, HAS_WINDOW=False, HAS_CONTEXT=False, HAS_TARGETS=True,
                 SMALL=False, PRECISION="tf32", USE_TMA=True, COLUMN_SUMS=False)
for name, (m, n, warps, stages) in (("dkdv", (32, 128, 8, 2)), ("dq", (64, 32, 4, 3))):
    kernel = kernels.KERNELS[name]
    constants = with_constexpr_defaults(kernel, dict(gem_masks, BLOCK_M=m, BLOCK_N=n))
    types = signature(kernel, constants, tma=True)
    assert types["Q_desc"] == f"tensordesc<bf16[1,1,{m},1,128]>", types["Q_desc"]
    cost = sass_cost(kernel, types, constants, warps, stages)
    assert cost["stack"] == 0 and cost["replicated"] == 0, (name, cost)
    print(name, cost["reg"], "registers")
"""


def test_narrower_backward_tiles_compile_for_sm90_without_spills():
    result = run_compiled(_SCRIPT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "dkdv" in result.stdout and "dq" in result.stdout
