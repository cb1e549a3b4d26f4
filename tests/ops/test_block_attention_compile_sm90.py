"""BlockAttention's rotary kernels compiled for Hopper (sm_90) on a CPU-only machine keep the register budget
their launch policy relies on (``benchmarks.block_attention_sass`` prints the full table).

- forward, time-aware rotary, 4 warps: at most 128 registers, so 4 programs fit an SM as without rotary
  (its fp32 rotation needed 147 registers: 3 programs per SM);
- backward, rotary, one program over the 4 kv heads of a block (``_kv_heads_per_program``): the head loop
  keeps the block's sin/cos live; at most 64 bytes of spills.
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
heads = k._kv_heads_per_program(4, 3, 64, 128)
bwd = compiled_cost(k._block_attention_bwd, 8, ROT=3, HEADS=heads, **common)
print("fwd", fwd["reg"], fwd["stack"], "bwd", bwd["reg"], bwd["stack"], "heads", heads)
"""


def test_rotary_kernels_keep_their_register_budget_on_sm90():
    result = run_compiled(_SCRIPT.replace("REPO", repr(str(Path(__file__).resolve().parents[2]))))
    assert result.returncode == 0, result.stderr[-4000:]
    words = result.stdout.split()
    fwd_regs, fwd_stack, bwd_stack, heads = int(words[1]), int(words[2]), int(words[5]), int(words[7])
    assert heads == 4  # block 64 x D 128 with rotary: one backward program per block
    assert fwd_regs <= 128 and fwd_stack == 0, result.stdout
    assert bwd_stack <= 64, result.stdout
