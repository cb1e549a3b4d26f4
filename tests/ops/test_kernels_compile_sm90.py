"""The embedding forward and bf16 row update, FP8 attention and FP8 row-quantizer kernels compile for Hopper
(sm_90) on a CPU-only machine.

The interpreter runs kernels as Python and misses compile-time errors: a non-constexpr global in the FP8
attention's quantize pass compiled on no GPU until the first GPU run (session 3). Triton's frontend and
ptxas run here without a GPU (see also ``test_gdpa_compile.py``), in a subprocess without
``TRITON_INTERPRET`` (which replaces ``triton.jit`` kernels at import time).
"""

from tests.ops.aot import run_compiled

_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from opengem.ops.triton import embedding as e
from opengem.ops.triton import fp8_gemm as g
from opengem.ops.triton import jagged_attention_fp8 as f
from opengem.ops.triton import qkv_projection_fp8 as p


def compile_sm90(fn, signature, constexprs, num_warps=4, num_stages=2, maxnreg=None):
    signature = {**{name: signature.get(name, "i32") for name in fn.arg_names if name not in constexprs},
                 **{name: "constexpr" for name in constexprs}}
    options = dict(num_warps=num_warps, num_stages=num_stages) | ({"maxnreg": maxnreg} if maxnreg else {})
    return triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32), options=options)


update = {**{name: "*i64" for name in ("step", "sorted_keys", "run_ends", "pieces_before", "grad_starts",
                                        "weight_starts", "dims")},
          **{name: "*fp32" for name in ("grad_out", "partials", "row_state", "elem_state", "corrections", "skip",
                                         "grad_scales")},
          **{name: "fp32" for name in ("lr", "eps", "beta1", "beta2", "weight_decay", "one_minus_beta1",
                                        "one_minus_beta2")}, "weights": "*bf16", "rounding_seed": "i32"}
for stochastic in (False, True):  # a bf16 table's row update, rounded to nearest or stochastically
    ptx = compile_sm90(e._aggregate_update_kernel, update, dict(OPTIMIZER=1, SEGMENT=64, ALIGN=8, ROWS=16, UNROLL=4,
                                                                 BLOCK_D=128, STOCHASTIC=stochastic)).asm["ptx"]
    assert ("mul.lo" in ptx) == stochastic  # the rounding bits' hash: 32-bit products that wrap
    assert ("cvt.rn.bf16" in ptx) or stochastic  # to nearest (the stochastic path's cast is exact either way)

lookup = {"weights": "*fp32", "meta": "*i64", "ids": "*i64", "offsets": "*i64", "out": "*fp32"}
for block_n, num_warps in e._LOOKUP_TILES:  # every tuning candidate of the lookup, fp32 and bf16 tables
    compile_sm90(e._lookup_kernel.fn, lookup, dict(META_COLS=6, ALIGN=8, BLOCK_N=block_n, BLOCK_D=128), num_warps)
    compile_sm90(e._lookup_kernel.fn, {**lookup, "weights": "*bf16", "out": "*bf16"},
                 dict(META_COLS=6, ALIGN=8, BLOCK_N=block_n, BLOCK_D=128), num_warps)

bf16, fp8 = "*bf16", "*fp8e4nv"
quantize = {"Q": bf16, "K": bf16, "V": bf16, "Q8": fp8, "K8": fp8, "V8": fp8, "QS": "*fp32", "KS": "*fp32",
            "VS": "*fp32", "R": bf16, "offsets": "*i32", "block_base": "*i32", "items": "*i32"}
for dequantize in (False, True):  # the blocked E4M3 layout, or the straight-through values for the backward
    outputs = {"Q8": bf16, "K8": bf16, "V8": bf16} if dequantize else {}
    ptx = compile_sm90(f._quantize_kernel, {**quantize, **outputs}, dict(
        HEAD_DIM=128, BLOCK=128, ROT=64, PRECISION="tf32", EXACT=False, DEQUANTIZE=dequantize),
        num_warps=f.QUANTIZE_WARPS[128], maxnreg=f.QUANTIZE_MAXNREG[128]).asm["ptx"]
    assert "wgmma" in ptx or "mma" in ptx  # the rotation is one MMA
    assert f".maxnreg {f.QUANTIZE_MAXNREG[128]}" in ptx  # the shipped cap (three programs an SM)
project = {"X": bf16, "W": bf16, "Bias": bf16, "QKV": bf16, "Q8": fp8, "K8": fp8, "V8": fp8, "QS": "*fp32",
           "KS": "*fp32", "VS": "*fp32", "R": bf16, "offsets": "*i32", "block_base": "*i32", "items": "*i32"}
for block_k, warps, stages in p._TILES:  # every candidate of the fused QKV projection
    ptx = compile_sm90(p._project_quantize_kernel.fn, project, dict(
        HEAD_DIM=128, BLOCK=128, ROT=128, PRECISION="tf32", EXACT=False, HAS_BIAS=True, BLOCK_K=block_k),
        num_warps=warps, num_stages=stages).asm["ptx"]
    assert "wgmma" in ptx  # the projection and the rotation on the tensor cores
attend = {"Q8": fp8, "K8": fp8, "V8": fp8, "QS": "*fp32", "KS": "*fp32", "VS": "*fp32", "O": bf16,
          "LSE": "*fp32", "offsets": "*i32", "num_targets": "*i32", "block_base": "*i32", "sched_small": "*i32",
          "sched_large": "*i32", "scale_log2": "fp32"}
ptx = compile_sm90(f._fwd_fp8_kernel.fn, attend,
                   dict(HEAD_DIM=128, GROUP=1, CAUSAL=True, HAS_WINDOW=True, HAS_CONTEXT=True, HAS_TARGETS=True,
                        SMALL=False, NEGATIVE_SCALE=False, EXACT=False, BLOCK_M=128, BLOCK_N=128), num_warps=8,
                   num_stages=3).asm["ptx"]
assert "e4m3" in ptx  # E4M3 tensor-core MMAs
for m, warps, stages, maxnreg in [c for c in f._FWD_FP8 if len(c) == 4]:  # the register-capped candidates
    ptx = compile_sm90(f._fwd_fp8_kernel.fn, attend, dict(
        HEAD_DIM=128, GROUP=1, CAUSAL=True, HAS_WINDOW=False, HAS_CONTEXT=False, HAS_TARGETS=False, SMALL=False,
        NEGATIVE_SCALE=False, EXACT=False, BLOCK_M=m, BLOCK_N=128), warps, stages, maxnreg).asm["ptx"]
    assert f".maxnreg {maxnreg}" in ptx
from opengem.ops.triton import gdpa_fp8 as gf
gdpa_attend = {**{k: v for k, v in attend.items() if k not in ("LSE", "scale_log2")}, "HEAD_ACT": "*i32",
               "x_scale": "fp32", "out_scale": "fp32"}
gdpa_attend.update(k_offsets="*i32", k_block_base="*i32")
for act, fast, cross in ((3, True, False), (3, True, True), (7, True, False), (-1, True, True), (1, False, False)):
    # fast_gelu self / cross, silu (tanh.approx), per head, gelu
    for m, warps, stages in f._FWD_FP8[:2] if act == 3 else f._FWD_FP8[:1]:
        ptx = compile_sm90(gf._gdpa_fp8_fwd_kernel.fn, gdpa_attend, dict(
            HEAD_DIM=128, GROUP=1, CAUSAL=not cross, HAS_WINDOW=False, HAS_CONTEXT=False, HAS_TARGETS=not cross,
            SMALL=False, EXACT=False, ACT=act, FAST_ACT=fast, CROSS=cross, BLOCK_M=m, BLOCK_N=128),
            num_warps=warps, num_stages=stages).asm["ptx"]
        assert "e4m3" in ptx and "div.rn.f32" in ptx  # E4M3 MMAs; P's row scales correctly rounded
        assert ("tanh.approx.f32" in ptx) == (fast and act in (-1, 7))
from opengem.ops.triton import jagged_attention_fp8_backward as fb
backward = {"Q8": fp8, "K8": fp8, "V8": fp8, "DO8": fp8, "QS": "*fp32", "KS": "*fp32", "VS": "*fp32", "DOS": "*fp32",
            "O": bf16, "DO": bf16, "LSE": "*fp32", "Delta": "*fp32", "DQ": bf16, "DK": bf16, "DV": bf16,
            "offsets": "*i32", "num_targets": "*i32", "block_base": "*i32", "sched_small": "*i32",
            "sched_large": "*i32", "scale": "fp32", "scale_log2": "fp32"}
masks = dict(HEAD_DIM=128, GROUP=1, CAUSAL=True, HAS_WINDOW=True, HAS_CONTEXT=True, HAS_TARGETS=True, SMALL=64)
for kernel, candidates in ((fb._dq_fp8_kernel, fb._DQ), (fb._dkdv_fp8_kernel, fb._DKDV)):  # every candidate
    for block_m, warps, stages in candidates:
        ptx = compile_sm90(kernel.fn, backward, dict(masks, BLOCK_M=block_m, BLOCK_N=128), warps, stages).asm["ptx"]
        assert "e4m3" in ptx and "bf16" in ptx  # E4M3 S and dP; 16-bit dS products
rowwise = {"x_ptr": bf16, "u_ptr": bf16, "out_ptr": bf16, "q_ptr": fp8, "scale_ptr": "*fp32", "sum_ptr": "*fp32"}
for prologue in (1, 2):  # the GELU quantizers of the FP8 MLP (inline rcp / ex2): rows in registers or re-read,
    # and persistent programs, with and without column sums
    for one_chunk, programs, col_sum in ((True, 0, False), (False, 0, False), (True, 4, False), (True, 2, True)):
        ptx = compile_sm90(g._row_amax_quant_kernel, rowwise, dict(
            PROLOGUE=prologue, BLOCK_R=2, BLOCK_C=4096, ONE_CHUNK=one_chunk, PROGRAMS_PER_SM=programs, COMPILED=True,
            COL_SUM=col_sum), num_warps=8).asm["ptx"]
        assert "rcp.approx.ftz.f32" in ptx and "ex2.approx.ftz.f32" in ptx
tiles = {"x_ptr": bf16, "q_ptr": fp8, "qt_ptr": fp8, "row_amax_ptr": "*i32", "col_amax_ptr": "*i32",
         "row_scale_ptr": "*fp32", "col_scale_ptr": "*fp32"}
for do_row in (True, False):  # the transposing quantizer (x^T, e.g. W^T for input gradients), scales written too
    ptx = compile_sm90(g._tile_quant_kernel, tiles, dict(DO_ROW=do_row, BLOCK=64)).asm["ptx"]
    assert "div.rn.f32" in ptx
print("compiled")
"""


def test_kernels_compile_for_sm90_without_a_gpu():
    result = run_compiled(_SCRIPT)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-4000:]

_JFA_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from benchmarks.sass import with_constexpr_defaults
from opengem.ops.triton import jagged_attention as j

MASKS = dict(GROUP=1, CAUSAL=True, HAS_WINDOW=True, HAS_CONTEXT=True, HAS_TARGETS=True, SMALL=64, PRECISION="tf32",
             HEAD_DIM=128)


def ptx(name, kernel, block_m, block_n, num_warps, tma, **extra):
    fn = kernel.fn
    constexprs = with_constexpr_defaults(fn, dict(MASKS, USE_TMA=tma, BLOCK_M=block_m, BLOCK_N=block_n, **extra))
    rows_m, rows_n = j._TILE_ROWS[name]

    def kind(arg):
        if arg in constexprs:
            return "constexpr"
        if arg.endswith("_desc"):
            block = block_m if arg[:-5] in rows_m else block_n
            return f"tensordesc<bf16[1,1,{block},1,128]>" if tma else "*bf16"
        if arg in ("LSE", "Delta", "Sums"):
            return "*fp32"
        if arg in ("offsets", "num_targets", "sched_small", "sched_large", "tile_starts"):
            return "*i32"
        if arg[0].isupper():
            return "*bf16"
        return "fp32" if arg in ("scale", "scale_log2") else "i32"

    signature = {arg: kind(arg) for arg in fn.arg_names}
    source = ASTSource(fn, signature, constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=3)).asm["ptx"]


TMA_LOAD = "cp.async.bulk.tensor"
assert TMA_LOAD in ptx("fwd", j._fwd_kernel, 128, 64, 8, True, NEGATIVE_SCALE=False)
assert TMA_LOAD not in ptx("fwd", j._fwd_kernel, 128, 64, 8, False, NEGATIVE_SCALE=True)
for block_m, block_n, warps, tma in ((128, 64, 8, True), (128, 128, 8, True), (64, 64, 4, False)):  # P quantized to MX
    mx = ptx("fwd", j._fwd_kernel, block_m, block_n, warps, tma, NEGATIVE_SCALE=False, P_MX=True, EXACT=False)
    assert "e4m3x2" in mx  # P rounded by the hardware's E4M3 conversion
from opengem.ops.triton import jagged_attention_mxfp8 as mx_ops
for dtype, rotation, rotate, along_sequence, rows, warps in (  # MXFP8's operand pass: Q/K rotated, V along the sequence
    ("bf16", "bf16", True, False, 128, 8), ("bf16", "bf16", False, True, 32, 4), ("fp32", "fp64", True, False, 128, 8),
):
    operand = {"X": f"*{dtype}", "OUT": f"*{dtype}", "R": f"*{rotation}", "block_starts": "*i32"}
    constexprs = dict(HEAD_DIM=128, BLOCK_T=rows, ROT=128, ROTATE=rotate, ALONG_SEQUENCE=along_sequence, EXACT=False,
                      HEAD_DIM_BLOCK=32)
    kernel = mx_ops._mx_operand_kernel
    signature = {arg: "constexpr" if arg in constexprs else operand.get(arg, "i32") for arg in kernel.arg_names}
    source = ASTSource(kernel, signature, constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=1))
    assert "e4m3x2" in compiled.asm["ptx"]  # elements rounded by the hardware's E4M3 conversion
for sums in (False, True):  # COLUMN_SUMS: the backward also writes the gradients' column sums (a QKV bias's gradient)
    assert TMA_LOAD in ptx("dq", j._dq_kernel, 128, 64, 8, True, COLUMN_SUMS=sums)
    assert TMA_LOAD in ptx("dkdv", j._dkdv_kernel, 64, 128, 8, True, POINTER_LOADS=False, COLUMN_SUMS=sums)
    assert TMA_LOAD not in ptx("dkdv", j._dkdv_kernel, 64, 128, 8, True, POINTER_LOADS=True, COLUMN_SUMS=sums)
    ptx("dq", j._dq_kernel, 64, 64, 4, False, COLUMN_SUMS=sums)  # 64-row tiles: no second small tile to zero
print("compiled")
"""


def test_jfa_tma_and_pointer_paths_compile_for_sm90():
    """Every JFA pass with ragged TMA loads (5-D descriptors, every mask option), dK/dV's pointer-load configs
    beside them, and MXFP8's forward quantizing P and its operand pass (``precision="mxfp8"``) compile for Hopper;
    the interpreter tests cannot see a GPU-only compile error."""
    result = run_compiled(_JFA_SCRIPT)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-4000:]
