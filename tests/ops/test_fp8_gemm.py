"""FP8 GEMM recipes on CPU: emulation semantics, quantizer layouts, the fused blockwise quantizer in the
Triton interpreter (bit-exact: it rounds with integer arithmetic), errors and the FLOP formula."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from opengem.ops.fp8_gemm import (
    FP8_RECIPES,
    dequantize_operand,
    fp8_matmul,
    hadamard_matrix,
    hadamard_rotate,
    quantize_operand,
    quantize_operand_with_transpose,
    scaled_gemm,
)
from opengem.ops.mx import mx_dequantize, mx_quantize
from opengem.ops.reference.mx import mx_quantize_reference


def test_mx_emulation_equals_dequantized_gemm() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(70, 160, generator=g), torch.randn(90, 160, generator=g)
    expected = mx_dequantize(mx_quantize(x), torch.float32) @ mx_dequantize(mx_quantize(w), torch.float32).t()
    out = fp8_matmul(x, w, "mxfp8", torch.float32)
    # only fp32 accumulation order may differ: bound by K * eps * sum |a||b|
    bound = 160 * 2.0**-23 * (expected.abs() + 1).max()
    assert (out - expected).abs().max() <= bound


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_recipe_errors_are_fp8_sized(recipe: str) -> None:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(64, 256, generator=g), torch.randn(48, 256, generator=g) * 0.02
    ref = x @ w.t()
    err = float((fp8_matmul(x, w, recipe) - ref).norm() / ref.norm())
    assert 0.005 < err < 0.06


def test_rowwise_scales_and_exact_emulation() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 64, generator=g)
    q = quantize_operand(x, "fp8_rowwise")
    torch.testing.assert_close(q.scale, x.abs().amax(1) / 448)
    assert (q.data.float().abs().amax(1) == 448).all()
    w = quantize_operand(torch.randn(7, 64, generator=g), "fp8_rowwise", weight=True)
    expected = (q.data.double() @ w.data.double().t()) * q.scale.double()[:, None] * w.scale.double()[None, :]
    torch.testing.assert_close(scaled_gemm(q, w, torch.float32).double(), expected, rtol=1e-5, atol=1e-5)


def test_blockwise_layouts_and_transpose() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(200, 300, generator=g)
    q = quantize_operand(w, "fp8_blockwise", weight=True)
    assert q.scale.shape == (2, 3) and q.blocks
    t = q.transpose()
    torch.testing.assert_close(dequantize_operand(t), dequantize_operand(q).t())
    a = quantize_operand(w, "fp8_blockwise")
    assert a.scale.shape == (200, 3) and not a.blocks
    with pytest.raises(ValueError, match="only fp8_blockwise weight operands"):
        a.transpose()


@pytest.mark.parametrize("block", [(128,), (128, 128)])
def test_blockwise_quantizer_triton_bit_exact(block: tuple[int, ...]) -> None:
    from opengem.ops.triton.mx import mx_quantize_triton

    g = torch.Generator().manual_seed(4)
    x = torch.randn(130, 200, generator=g) * torch.logspace(-30, 30, 130)[:, None]
    ref = mx_quantize_reference(x, block, "e4m3", "rceil")
    tri = mx_quantize_triton(x, block, "e4m3", "rceil")
    assert torch.equal(tri[0].view(torch.uint8), ref[0].view(torch.uint8)) and torch.equal(tri[1], ref[1])


def test_fused_dual_blockwise_quantizer_bit_exact() -> None:
    from opengem.ops.triton.fp8_gemm import blockwise_quantize_dual

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(150, 140, generator=g) * torch.logspace(-5, 5, 140)).to(torch.bfloat16)
    q, s, qt, st = blockwise_quantize_dual(x)
    rq, rs = mx_quantize_reference(x, (128,), "e4m3", "rceil")
    rqt, rst = mx_quantize_reference(x.t().contiguous(), (128,), "e4m3", "rceil")
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    assert torch.equal(qt.view(torch.uint8), rqt.view(torch.uint8)) and torch.equal(st, rst)


@pytest.mark.parametrize("columns", [200, 4100])  # one chunk per row (registers), and rows over 4096 (two passes)
@pytest.mark.parametrize("prologue", [None, "gelu", "gelu_backward"])
def test_rowwise_quantizer_kernel_matches_the_torch_path(columns: int, prologue: str | None) -> None:
    """The Triton row quantizer (interpreter here) against the CPU path of the same recipe: equal scales,
    E4M3 codes within one step where erf / exp round differently, the GELU outputs close."""
    from opengem.ops.fp8_gemm import _rowwise_torch, quantize_gelu
    from opengem.ops.triton.fp8_gemm import rowwise_quantize

    g = torch.Generator().manual_seed(6)
    rows = 5
    x = torch.randn(rows, columns, generator=g) * torch.logspace(-3, 3, rows)[:, None]
    u = torch.randn(rows, columns, generator=g)
    if prologue is None:
        q, scale, out = rowwise_quantize(x)
        ref_q, ref_scale = _rowwise_torch(x, False, None)
        assert out is None
    else:
        q, scale, out = rowwise_quantize(x, prologue, u if prologue == "gelu_backward" else None)
        ref_out, ref = quantize_gelu(x) if prologue == "gelu" else quantize_gelu(u, grad_out=x)
        ref_q, ref_scale = ref.data, ref.scale
        torch.testing.assert_close(out, ref_out, rtol=1e-3, atol=1e-4)  # erf / exp: NumPy vs torch
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    values, ref_values = q.float(), ref_q.float()
    # Triton 3.6's interpreter (not the GPU: tests/gpu/test_low_precision_gpu.py) rounds a value just below
    # a power of two (127.2) to half that power (64): the mantissa's carry misses the exponent; and it
    # flushes E4M3 subnormals that should round up to 2^-9. Only there may codes differ beyond one step
    # (erf / exp rounding in the GELUs; none without a prologue).
    carry = (values * 2 == ref_values) & (torch.frexp(ref_values).mantissa.abs() == 0.5)
    quirks = carry | ((values == 0) & (ref_values.abs() == 2.0**-9))
    codes, ref_codes = q.view(torch.uint8).int(), ref_q.view(torch.uint8).int()
    # -0 and +0 (codes 0x80 and 0x00) are the same value: in session 22's fresh environment (triton 3.9.0, NumPy
    # 2.4.6) the GELU of a large negative input came out -0.0 on one path and +0.0 on the other
    codes, ref_codes = codes.where(values != 0, 0), ref_codes.where(ref_values != 0, 0)
    steps = (codes - ref_codes).abs()[~quirks]
    assert steps.max() <= (0 if prologue is None else 1) and (steps == 0).float().mean() > 0.99
    assert quirks.float().mean() < 0.05


@pytest.mark.parametrize("columns", [8, 200, 4096, 5000])
def test_tuned_row_quantizer_keeps_programs_of_4k_to_16k_elements(monkeypatch, columns: int) -> None:
    """The autotuned launch (CUDA): the tuner of this column-block width holds candidates of 4096..16384
    elements per program (as many rows as allowed for narrow rows), persistent ones where a row fits one
    chunk, and no `prune_configs_by` (Dynamo of torch 2.11 fails on one launched twice in a trace), the grid
    follows the chosen config, and the result equals the default launch. Timings are faked (the interpreter has no benchmarker), in case Triton's disk
    cache has none."""
    import triton
    from triton.runtime.autotuner import Autotuner

    from opengem.ops.triton import fp8_gemm as g

    block_c = min(triton.next_power_of_2(columns), 4096)
    one_chunk = columns <= block_c
    tuner = g._ROW_TUNERS[block_c] if one_chunk else g._CHUNKED_ROW_TUNER
    assert tuner.early_config_prune is None and tuner.perf_model is None
    plain = [c for c in tuner.configs if not c.kwargs["PROGRAMS_PER_SM"]]
    persistent = [c for c in tuner.configs if c.kwargs["PROGRAMS_PER_SM"]]
    rows_kept = {c.kwargs["BLOCK_R"] for c in plain}
    assert plain and (all(4096 <= r * block_c <= 16384 for r in rows_kept) or rows_kept == {16})
    # persistent programs only where a row block stays in registers, of 4096 elements
    assert bool(persistent) == one_chunk and all(c.kwargs["BLOCK_R"] * block_c == max(4096, block_c)
                                                 for c in persistent)
    monkeypatch.setattr(Autotuner, "_bench", lambda self, *a, config, **k: [
        1.0 / (config.kwargs["BLOCK_R"] * (1 + config.kwargs["PROGRAMS_PER_SM"]))])  # a persistent one wins
    rows = 7
    x, u = torch.randn(rows, columns), torch.randn(rows, columns)
    q, scale, out = torch.empty(rows, columns, dtype=torch.float8_e4m3fn), torch.empty(rows), torch.empty(rows, columns)
    tuner[g._row_grid(rows, x.device)](
        x, u, out, q, scale, torch.empty(0, 0), rows, columns, 0, PROLOGUE=2, BLOCK_C=block_c, ONE_CHUNK=one_chunk,
        COMPILED=False, COL_SUM=False)
    assert bool(tuner.best_config.kwargs["PROGRAMS_PER_SM"]) == one_chunk
    ref_q, ref_scale, ref_out = g.rowwise_quantize(x, "gelu_backward", u)  # CPU tensors: the default launch
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale, ref_scale)
    assert torch.equal(out, ref_out)


def test_row_quantizer_gelu_is_accurate_over_the_whole_range(check_quantizer_gelu) -> None:
    """The quantizer's GELU (erfc-based normal CDF; interpreter here, the GPU's fast-math variant in
    tests/gpu) on fp32 rows, whose outputs stay fp32, against float64 over [-12, 8]: gelu within 2e-6
    relative from -3 up and 2e-5 in the far left tail (the exp argument's fp32 rounding grows with x^2; an
    erf-based fp32 GELU cancels there, to 2e-5 already at -3 and to zero below ~-6); gelu' within 2e-7."""
    check_quantizer_gelu("cpu", near=2e-6, tail=2e-5, derivative_abs=2e-7, derivative_rel=1e-6)


def test_with_transpose_on_cpu_matches_separate_quantization() -> None:
    x = torch.randn(40, 96)
    for recipe in FP8_RECIPES:
        q, qt = quantize_operand_with_transpose(x, recipe)
        assert torch.equal(dequantize_operand(qt), dequantize_operand(quantize_operand(x.t(), recipe)))
        assert qt.data.shape == (96, 40) and q.data.shape == (40, 96)


def test_hadamard_rotation_is_orthonormal_and_preserves_products() -> None:
    signs = torch.tensor([1, -1] * 64)
    h = hadamard_matrix(signs)
    torch.testing.assert_close(h @ h.t(), torch.eye(128), rtol=0, atol=1e-6)
    a, b = torch.randn(4, 256), torch.randn(6, 256)
    torch.testing.assert_close(hadamard_rotate(a, h) @ hadamard_rotate(b, h).t(), a @ b.t(), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="multiple of 128"):
        hadamard_rotate(torch.randn(2, 100), h)


def test_bad_inputs() -> None:
    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="recipe must be one of"):
        fp8_matmul(x, x, "fp4")
    with pytest.raises(ValueError, match="x must be 2-D"):
        quantize_operand(torch.randn(2, 3, 32), "fp8_rowwise")
    with pytest.raises(ValueError, match="has no quantized operand"):
        quantize_operand(x, "bf16")
    with pytest.raises(ValueError, match="different recipes"):
        scaled_gemm(quantize_operand(x, "fp8_rowwise"), quantize_operand(x, "mxfp8"), torch.float32)
    with pytest.raises(ValueError, match="contraction dims differ"):
        scaled_gemm(quantize_operand(x, "mxfp8"), quantize_operand(torch.randn(4, 64), "mxfp8"), torch.float32)
    with pytest.raises(ValueError, match="x must be a floating-point tensor, got torch.int32"):
        fp8_matmul(x.int(), x.int(), "fp8_rowwise")  # had returned an int32 "product"
    with pytest.raises(ValueError, match="x must have K >= 1 columns"):
        fp8_matmul(torch.zeros(4, 0), torch.zeros(8, 0), "fp8_rowwise")
    with pytest.raises(ValueError, match="contraction dims differ: a has K=32, b has K=64"):
        fp8_matmul(x, torch.randn(8, 64), "bf16")  # the same message as the quantized recipes'
    qa, qb = quantize_operand(x, "fp8_rowwise"), quantize_operand(torch.randn(8, 32), "fp8_rowwise", weight=True)
    for bias in (torch.zeros(3), torch.zeros(1)):  # [1] had been broadcast silently
        with pytest.raises(ValueError, match=rf"bias must have shape \[8\] \(b's rows, N\), got \[{bias.numel()}\]"):
            scaled_gemm(qa, qb, torch.float32, bias=bias)
    with pytest.raises(ValueError, match="out_dtype must be a floating-point dtype"):
        scaled_gemm(qa, qb, torch.int32)


def test_blockwise_gemm_flop_formula() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(256, 512, dtype=torch.float8_e4m3fn)
        b = torch.empty(384, 512, dtype=torch.float8_e4m3fn)
        sa, sb = torch.empty(256, 4, dtype=torch.uint8), torch.empty(3, 4, dtype=torch.uint8)
        with FlopCounterMode(display=False) as counter:
            out = torch.ops.opengem.fp8_blockwise_gemm(a, sa, b, sb, True, torch.bfloat16)
    assert out.shape == (256, 384) and counter.get_total_flops() == 2 * 256 * 512 * 384


def test_blackwell_scale_swizzle_follows_the_cublas_layout() -> None:
    from opengem.ops.fp8_gemm import _to_blocked

    rows, cols = 200, 7  # padded to 256 x 8: 2 x 2 tiles of 128 x 4
    scales = torch.arange(rows * cols, dtype=torch.int32).reshape(rows, cols)
    blocked = _to_blocked(scales)
    assert blocked.numel() == 256 * 8
    col_tiles = 2
    for i, j in [(0, 0), (1, 0), (31, 3), (32, 0), (127, 2), (128, 0), (199, 6), (45, 5)]:
        # cuBLAS block-scaling factor layout: 128x4 tiles, each stored as 32 rows of (4 x 4) interleaved
        offset = (i // 128) * col_tiles * 512 + (j // 4) * 512 + (i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4
        assert blocked[offset] == scales[i, j]


@pytest.mark.parametrize("columns", [1, 200, 4096])
@pytest.mark.parametrize("prologue", [None, "gelu", "gelu_backward"])
def test_persistent_row_programs_equal_the_plain_launch(columns: int, prologue: str | None) -> None:
    """Each persistent candidate of the tuner (programs striding over row blocks, the next block loaded ahead;
    interpreter here) writes the default launch's codes, scales and GELU outputs bit for bit, with more row
    blocks than programs so every program loops and the last block is partial."""
    import triton

    from opengem.ops.triton import fp8_gemm as g

    gen = torch.Generator().manual_seed(7)
    block_c = triton.next_power_of_2(columns)
    configs = g._persistent_programs(block_c)
    rows = 3 * configs[0].kwargs["BLOCK_R"] * configs[0].kwargs["PROGRAMS_PER_SM"] + 5
    x = torch.randn(rows, columns, generator=gen) * torch.logspace(-2, 2, rows)[:, None]
    u = torch.randn(rows, columns, generator=gen) if prologue == "gelu_backward" else None
    ref_q, ref_scale, ref_out = g.rowwise_quantize(x, prologue, u)
    for config in configs:
        q, scale = torch.empty(rows, columns, dtype=torch.float8_e4m3fn), torch.empty(rows)
        out = torch.empty_like(x) if prologue else torch.empty(0)
        grid = g._row_grid(rows, x.device)(config.kwargs)
        assert grid[0] < triton.cdiv(rows, config.kwargs["BLOCK_R"])  # fewer programs than blocks: they loop
        g._row_amax_quant_kernel[grid](
            x, x if u is None else u, out, q, scale, torch.empty(0, 0), rows, columns, 0,
            PROLOGUE=g.PROLOGUES[prologue], BLOCK_C=block_c, ONE_CHUNK=True, COMPILED=False, COL_SUM=False,
            **config.kwargs)
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale, ref_scale)
        assert ref_out is None or torch.equal(out, ref_out)


@pytest.mark.parametrize("columns", [1, 200, 4096, 4100])  # 4100: rows over 4096, quantized then torch's sum
@pytest.mark.parametrize("prologue", [None, "gelu", "gelu_backward"])
def test_column_sums_come_with_the_plain_quantization(columns: int, prologue: str | None) -> None:
    """`rowwise_quantize_with_sums` (persistent column-summing programs, interpreter here; more row blocks than
    programs and fewer programs than rows of partial sums, whose extra rows must come back zeroed) writes the
    plain quantizer's codes, scales and GELU outputs bit for bit, and the fp32 column sums of what it stores."""
    import triton

    from opengem.ops.triton import fp8_gemm as g

    gen = torch.Generator().manual_seed(10)
    rows_per_block = max(1, 4096 // min(triton.next_power_of_2(columns), 4096))
    rows = 5 * rows_per_block + 3
    x = torch.randn(rows, columns, generator=gen) * torch.logspace(-2, 2, rows)[:, None]
    u = torch.randn(rows, columns, generator=gen) if prologue == "gelu_backward" else None
    q, scale, out, sums = g.rowwise_quantize_with_sums(x, prologue, u)
    ref_q, ref_scale, ref_out = g.rowwise_quantize(x, prologue, u)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale, ref_scale)
    assert ref_out is None or torch.equal(out, ref_out)
    expected = torch.sum(x if ref_out is None else ref_out, 0, dtype=torch.float64)
    assert sums.dtype == torch.float32 and sums.shape == (columns,)
    torch.testing.assert_close(sums.double(), expected, rtol=1e-5, atol=1e-4)
    empty = g.rowwise_quantize_with_sums(x[:0], prologue, None if u is None else u[:0])
    assert empty[0].shape == (0, columns) and torch.equal(empty[3], torch.zeros(columns))


def test_column_sum_candidates_are_persistent_and_their_partials_cover_every_grid() -> None:
    """Only persistent programs sum columns (a plain program's partial sums would be a row block each), all of
    4096-element blocks, and the partial-sum rows the host allocates cover the widest candidate grid."""
    from opengem.ops.triton import fp8_gemm as g

    for block_c in (1, 256, 1024, 4096):
        configs = g._column_sum_programs(block_c)
        assert configs and all(c.kwargs["PROGRAMS_PER_SM"] > 0 for c in configs)
        assert all(c.kwargs["BLOCK_R"] * block_c == max(4096, block_c) for c in configs)
        assert max(c.kwargs["PROGRAMS_PER_SM"] for c in configs) <= g.MAX_COLUMN_SUM_PROGRAMS_PER_SM
        described = [(c.kwargs, c.num_warps, c.maxnreg) for c in configs]
        assert [(c.kwargs, c.num_warps, c.maxnreg) for c in g._COLUMN_SUM_TUNERS[block_c].configs] == described


def test_transposed_view_quantizes_like_its_contiguous_copy() -> None:
    """`quantize_operand` of a transposed view (W^T, the weights' input-gradient operand) on CUDA reads W in
    place (`rowwise_quantize_dual` without rows) instead of copying W^T: its kernels (interpreter here) give
    the codes and correctly rounded scales of the plain quantizer on the copy, bit for bit."""
    from opengem.ops.triton.fp8_gemm import rowwise_quantize, rowwise_quantize_dual

    g = torch.Generator().manual_seed(8)
    w = torch.randn(96, 200, generator=g) * torch.logspace(-2, 2, 200)  # per-column magnitudes: per-row of W^T
    q, scale, qt, scale_t = rowwise_quantize_dual(w, with_rows=False)
    ref_q, ref_scale, _ = rowwise_quantize(w.t().contiguous())
    assert q is None and scale is None
    assert torch.equal(qt.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale_t, ref_scale)


def test_rowwise_matmul_in_torch_ops_has_the_rowwise_recipes_numerics() -> None:
    """`rowwise_matmul` (the traced FP8 linear's GEMM): the same E4M3 rows and scales as `quantize_operand`, and
    the product of the dequantized operands up to the bf16 output's rounding, bias included, on ragged rows."""
    from opengem.ops.fp8_gemm import rowwise_matmul

    g = torch.Generator().manual_seed(12)
    a, b = torch.randn(21, 48, generator=g) * 3, torch.randn(32, 48, generator=g) * 0.1
    bias = torch.randn(32, generator=g)
    out = rowwise_matmul(a, b, fast_accum=False, bias=bias)
    qa, qb = quantize_operand(a, "fp8_rowwise"), quantize_operand(b, "fp8_rowwise")
    expected = dequantize_operand(qa) @ dequantize_operand(qb).t() + bias
    assert out.dtype == torch.bfloat16 and out.shape == (21, 32)
    torch.testing.assert_close(out.float(), expected, rtol=8e-3, atol=1e-2)
    assert (out.float() - (a @ b.t() + bias)).norm() / (a @ b.t() + bias).norm() > 1e-3  # quantized, not exact


def test_bad_operands_and_matrices_are_refused_by_name() -> None:
    """Session 70's audit: each of these had been accepted (a wrong result) or failed inside torch unnamed."""
    from opengem.ops.fp8_gemm import QuantizedOperand, quantize_gelu, quantize_operand_with_column_sums

    x, w = torch.randn(8, 64), torch.randn(16, 64)
    qa, qb = quantize_operand(x, "fp8_rowwise"), quantize_operand(w, "fp8_rowwise")
    for scale in (qa.scale[:1], qa.scale[:, None]):  # [1] had been broadcast over every row, [8, 1] gave 3-D out
        with pytest.raises(ValueError, match=r"a.scale must be a torch.float32 tensor of shape \[8\]"):
            scaled_gemm(QuantizedOperand(qa.data, scale, "fp8_rowwise"), qb, torch.float32)
    with pytest.raises(ValueError, match="b.data must be a 2-D float8_e4m3fn tensor"):
        scaled_gemm(qa, QuantizedOperand(qb.data.float(), qb.scale, "fp8_rowwise"), torch.float32)
    with pytest.raises(ValueError, match="a.recipe must be one of"):
        scaled_gemm(QuantizedOperand(qa.data, qa.scale, "fp9"), QuantizedOperand(qb.data, qb.scale, "fp9"),
                    torch.float32)
    qm = quantize_operand(x, "mxfp8")
    with pytest.raises(ValueError, match=r"a.scale must be a torch.uint8 tensor of shape \[8, 2\]"):
        scaled_gemm(QuantizedOperand(qm.data, qm.scale[:1], "mxfp8"), quantize_operand(w, "mxfp8"), torch.float32)
    qw = quantize_operand(w, "fp8_blockwise", weight=True)
    with pytest.raises(ValueError, match=r"b.scale must be a torch.uint8 tensor of shape \[1, 1\]"):
        scaled_gemm(quantize_operand(x, "fp8_blockwise"), QuantizedOperand(qw.data, qw.scale.float(),
                                                                            "fp8_blockwise", True), torch.float32)
    with pytest.raises(ValueError, match="u must be a floating-point tensor, got torch.int64"):
        quantize_gelu(torch.ones(2, 4, dtype=torch.int64))  # had returned GELU values truncated to 0
    with pytest.raises(ValueError, match="u must have K >= 1 columns"):
        quantize_gelu(torch.ones(2, 0))
    with pytest.raises(ValueError, match="x must be a floating-point tensor, got torch.int64"):
        quantize_operand_with_column_sums(torch.ones(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="x must be a 2-D tensor"):
        quantize_operand_with_transpose(torch.ones(2, 2, 4), "fp8_rowwise")
    with pytest.raises(ValueError, match="out_dtype must be a floating-point dtype, got torch.int32"):
        fp8_matmul(x, w, "bf16", torch.int32)  # had returned an int32 "product"
    with pytest.raises(ValueError, match="a and b must be floating-point tensors of one dtype for recipe 'bf16'"):
        fp8_matmul(x, w.half(), "bf16")
    with pytest.raises(ValueError, match=r"rotation must be a square \[n, n\] matrix, got \(128, 64\)"):
        hadamard_rotate(torch.randn(4, 128), torch.randn(128, 64))
    with pytest.raises(ValueError, match="quantize_operand: weight must be a bool, got 'no'"):
        quantize_operand(x, "fp8_blockwise", weight="no")


def test_unknown_activation_is_refused_by_name() -> None:
    from opengem.ops.activations import activation_grad, activation_value

    for fn in (activation_value, activation_grad):  # a bare KeyError had named neither argument nor choices
        with pytest.raises(ValueError, match="unknown activation 'gelu2'; expected one of identity"):
            fn("gelu2", torch.ones(2))
