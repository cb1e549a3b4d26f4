"""BlockAttention's rotary kernels compiled for Hopper (sm_90) on a CPU-only machine keep the costs their
design relies on (``benchmarks.block_attention_sass`` prints the full table):

- forward, time-aware rotary, 4 warps: at most 128 registers and no spills, so 4 programs fit an SM as
  without rotary (its fp32 rotation needed 147 registers: 3 programs per SM);
- backward, in-sequence positions: the cos/sin table replaces the SFU, so as many MUFU ops as without
  rotary, and no spills at 8 warps;
- backward, capped at 128 registers (two programs per SM): it compiles, spilling at most 160 bytes.
"""

from pathlib import Path

from tests.ops.aot import run_compiled

_SCRIPT = r"""
import sys
sys.path.insert(0, REPO)
from benchmarks.block_attention_sass import compiled_cost
from opengem.ops.triton import block_attention as k

common = dict(GROUP=1, BLOCK=64, HALF=64, ACT=k.SOFTMAX.value, REDUCE=False)
fwd = compiled_cost(k._block_attention_fwd, 4, ROT=3, **common)
off = compiled_cost(k._block_attention_bwd, 8, ROT=0, **common)
table = compiled_cost(k._block_attention_bwd, 8, ROT=1, **common)
capped = compiled_cost(k._block_attention_bwd, 8, 128, ROT=3, **common)
print(fwd["reg"], fwd["stack"], off["MUFU"], table["MUFU"], table["stack"], capped["reg"], capped["stack"])
"""


def test_rotary_kernels_keep_their_register_budget_on_sm90():
    result = run_compiled(_SCRIPT.replace("REPO", repr(str(Path(__file__).resolve().parents[2]))))
    assert result.returncode == 0, result.stderr[-4000:]
    fwd_regs, fwd_stack, off_mufu, table_mufu, table_stack, capped_regs, capped_stack = map(int, result.stdout.split())
    assert fwd_regs <= 128 and fwd_stack == 0, result.stdout
    assert table_mufu == off_mufu and table_stack == 0, result.stdout
    assert capped_regs <= 128 and capped_stack <= 160, result.stdout
