"""BlockAttention's kernels compiled for Hopper (sm_90) on a CPU-only machine keep the register budget their
design relies on (``benchmarks.block_attention_sass`` prints the full table):

- forward, time-aware rotary, 4 warps: at most 128 registers and no spills, so 4 programs fit an SM as
  without rotary (its fp32 rotation needed 147 registers: 3 programs per SM);
- backward, 4 warps (the autotuner's pick on an H200): dV, then dK, stored as soon as they are final, so
  well under 255 registers without rotary (Triton 3.6, the GPU image's: 168, three programs per SM;
  3.9: 191; 255 when stored at the end) and no spills with rotary, whose cos/sin is recomputed (for q/k,
  then for dK and for dQ, or once for both with SHARE_BACK) rather than kept live;
- backward, rotary, the extra autotuner config capped at 168 registers compiles within its cap (spills:
  none under Triton 3.6, 176 B under 3.9; the autotuner measures which wins);
- backward, rotary, LATE_V (v loaded where dP needs it): no more shared memory than without rotary, so
  three programs fit an SM (Triton 3.6: 64 KB, against 80 KB without LATE_V: two per SM).
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
common.update(SHARE_BACK=False, LATE_V=False)
off = compiled_cost(k._block_attention_bwd, 4, ROT=0, **common)
pos = compiled_cost(k._block_attention_bwd, 4, ROT=1, **common)
capped = compiled_cost(k._block_attention_bwd, 4, 168, ROT=3, **common)
shared = compiled_cost(k._block_attention_bwd, 4, ROT=1, **dict(common, SHARE_BACK=True))
late = compiled_cost(k._block_attention_bwd, 4, 168, ROT=1, **dict(common, LATE_V=True))
print(fwd["reg"], fwd["stack"], off["reg"], off["MUFU"], pos["stack"], pos["MUFU"], capped["reg"], capped["stack"],
      shared["stack"], shared["MUFU"], pos["shared"], late["shared"], off["shared"])
"""


def test_kernels_keep_their_register_budget_on_sm90():
    result = run_compiled(_SCRIPT.replace("REPO", repr(str(Path(__file__).resolve().parents[2]))))
    assert result.returncode == 0, result.stderr[-4000:]
    (fwd_regs, fwd_stack, off_regs, off_mufu, pos_stack, pos_mufu, capped_regs, capped_stack, shared_stack, shared_mufu,
     pos_smem, late_smem, off_smem) = map(int, result.stdout.split())  # fmt: skip
    assert fwd_regs <= 128 and fwd_stack == 0, result.stdout
    assert off_regs <= 192, result.stdout
    assert pos_stack == 0, result.stdout
    # 64 x 64 cos + sin per computation over 128 threads: 64 MUFU each; the backward computes three times,
    # twice with SHARE_BACK.
    assert pos_mufu - off_mufu == 3 * 64 and shared_mufu - off_mufu == 2 * 64 and shared_stack == 0, result.stdout
    assert capped_regs <= 168 and capped_stack <= 256, result.stdout
    # LATE_V: the rotary backward's shared memory at most the unrotated one's, three programs per SM (228 KB)
    assert late_smem <= off_smem and 3 * (late_smem + 1024) <= 228 * 1024, (pos_smem, result.stdout)
