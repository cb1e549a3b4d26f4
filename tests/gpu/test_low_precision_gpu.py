"""GPU checks of the low-precision kernels: bit-exact MX quantization, the fused quantizers, the
blockwise FP8 GEMM, cuBLAS rowwise GEMMs and LowPrecisionLinear against their emulations.

Kept cheap (the whole file runs in well under a minute with -n 4 on a cold Triton cache): small shapes,
one input per test so each kernel specialization compiles once, the blockwise GEMM untuned
(OPENGEM_FP8_AUTOTUNE=0; one test runs every tuning config once), references on the GPU or on small CPU
tensors. Failing checks say which elements differ and by how much.
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from opengem.nn.low_precision import NAMED_RECIPES, LowPrecisionLinear  # noqa: E402
from opengem.ops.fp8_gemm import (  # noqa: E402
    CUBLAS_BLOCKWISE_PROBE,
    FP8_RECIPES,
    cublas_blockwise_available,
    dequantize_operand,
    fp8_matmul,
    quantize_operand,
    quantize_operand_with_transpose,
    scaled_gemm,
)
from opengem.ops.mx import mx_dequantize, mx_quantize  # noqa: E402
from opengem.ops.reference.mx import mx_quantize_reference  # noqa: E402


@pytest.fixture(autouse=True)
def untuned(monkeypatch):
    """One compile per blockwise GEMM specialization instead of four plus tuning runs per shape."""
    monkeypatch.setenv("OPENGEM_FP8_AUTOTUNE", "0")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def bit_mismatches(name: str, x: torch.Tensor, got: torch.Tensor, want: torch.Tensor) -> str:
    """Empty if ``got`` and ``want`` (same shape, any dtype) hold the same bits, else where they differ:
    count, and for the first few elements the index, the input value and both bit patterns."""
    g, w = got.cpu().contiguous(), want.cpu().contiguous()
    if g.shape != w.shape:
        return f"{name}: shape {tuple(g.shape)} != expected {tuple(w.shape)}"
    gi = g.view(torch.uint8) if g.element_size() == 1 else g
    wi = w.view(torch.uint8) if w.element_size() == 1 else w
    bad = (gi != wi).nonzero()
    if bad.numel() == 0:
        return ""
    lines = [f"{name}: {bad.shape[0]} of {gi.numel()} differ"]
    for idx in bad[:8].tolist():
        value = x.cpu()[tuple(idx)].item() if x is not None and x.shape == g.shape else None
        lines.append(f"  at {tuple(idx)} input={value!r} got=0x{int(gi[tuple(idx)]):02x} "
                     f"expected=0x{int(wi[tuple(idx)]):02x}")
    return "\n".join(lines)


def mx_input(dtype: torch.dtype) -> torch.Tensor:
    """[263, 163]: ragged in both dims (partial 32-blocks and 32x32 tiles), each row scaled by 10^-40 ..
    10^37 (fp32/bf16 subnormal blocks through huge ones) and, in columns 0..31 of rows 32k (each alone in
    its 32x32 tile), special rows: zeros, -0, subnormals, 1e-30, near fp32 max, saturation and ties,
    the rceil boundary, +-inf, NaN."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(263, 163, generator=g) * torch.logspace(-40, 37, 263)[:, None]
    x[:, :32] = 0.0
    special = [
        torch.zeros(32), torch.full((32,), -0.0), torch.randn(32, generator=g) * 1e-39,
        torch.randn(32, generator=g) * 1e-30, torch.randn(32, generator=g).clamp(-3, 3) * 1e38,
        torch.tensor([448.0, 449.0, 479.0, 1.0625, 1.1875, -1.0625] + [2.0**-k for k in range(26)]),
        torch.tensor([1.75 * 2**5, 1.7500001 * 2**5] + [1.0] * 30),
        torch.tensor([float("inf")] + [1.0] * 31),
        torch.tensor([float("nan")] + [-2.0] * 31),
    ]
    for k, row in enumerate(special[:8]):
        x[32 * k, :32] = row
    x[262, :32] = special[8]  # the last, partial tile row
    return x.to(dtype)


@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
@pytest.mark.parametrize("rule", ["rceil", "floor"])
@pytest.mark.parametrize("block", [32, (32, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mx_quantize_bit_exact_on_gpu(elem: str, rule: str, block, dtype: torch.dtype) -> None:
    x = mx_input(dtype)
    ref = mx_quantize(x, block, elem, rule)  # CPU: reference
    out = mx_quantize(x.cuda(), block, elem, rule)  # CUDA: Triton
    report = "\n".join(filter(None, [bit_mismatches("data", x, out.data, ref.data),
                                     bit_mismatches("scales", None, out.scales, ref.scales)]))
    assert not report, report
    back = mx_dequantize(out)
    assert back.is_cuda and back.dtype == dtype


def test_blockwise_dual_quantizer_bit_exact_on_gpu() -> None:
    from opengem.ops.triton.fp8_gemm import blockwise_quantize_dual

    g = torch.Generator().manual_seed(2)
    # columns from bf16 subnormals to 1e30: tiny 1x128 tiles along R, mixed ones along C
    x = (torch.randn(300, 260, generator=g) * torch.logspace(-40, 30, 260)).to(torch.bfloat16)
    q, s, qt, st = blockwise_quantize_dual(x.cuda())
    rq, rs = mx_quantize_reference(x, (128,), "e4m3", "rceil")
    rqt, rst = mx_quantize_reference(x.t().contiguous(), (128,), "e4m3", "rceil")
    report = "\n".join(filter(None, [
        bit_mismatches("q", x, q, rq), bit_mismatches("scale", None, s, rs),
        bit_mismatches("qt", x.t(), qt, rqt), bit_mismatches("scale_t", None, st, rst)]))
    assert not report, report


def test_rowwise_quantizers_match_torch() -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    x = (torch.randn(777, 1000, device="cuda", generator=g)
         * torch.rand(777, 1, device="cuda", generator=g)).to(torch.bfloat16)
    q = quantize_operand(x, "fp8_rowwise")
    torch.testing.assert_close(q.scale, x.float().abs().amax(1) / 448, rtol=1e-6, atol=0)
    ref = (x.float() / q.scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    differ = (q.data.view(torch.uint8) != ref.view(torch.uint8)).float().mean().item()
    # x * (448 / amax) and x / (amax / 448) differ by an fp32 ulp or so: only fp8 rounding ties can flip,
    # mostly in rows whose amax is a power of two (448 / amax = 7 * 2^j is exact there, amax / 448 is not)
    assert differ < 1e-3, bit_mismatches("rowwise q", x, q.data, ref)
    qa, qt = quantize_operand_with_transpose(x, "fp8_rowwise")
    assert torch.equal(qa.data.view(torch.uint8), q.data.view(torch.uint8)), bit_mismatches("dual q", x, qa.data, q.data)
    assert torch.equal(qa.scale, q.scale)  # both amax / 448 correctly rounded
    # a transposed view quantized in place (no transposed copy) equals the quantization of its copy
    qv, qc = quantize_operand(x.t(), "fp8_rowwise"), quantize_operand(x.t().contiguous(), "fp8_rowwise")
    assert torch.equal(qv.data.view(torch.uint8), qc.data.view(torch.uint8)), bit_mismatches("x^T", x, qv.data, qc.data)
    assert torch.equal(qv.scale, qc.scale)
    torch.testing.assert_close(dequantize_operand(qa), x.float(), rtol=0.07, atol=1e-3)
    torch.testing.assert_close(dequantize_operand(qt), x.float().t(), rtol=0.07, atol=1e-3)
    torch.testing.assert_close(qt.scale, x.float().abs().amax(0) / 448, rtol=1e-6, atol=0)


@pytest.mark.parametrize("recipe", FP8_RECIPES)
@pytest.mark.parametrize("shape", [(512, 768, 1024), (300, 272, 400)])
def test_gpu_gemm_matches_emulation(recipe: str, shape: tuple[int, int, int]) -> None:
    """(512, 768, 1024) takes cuBLAS where it can (rowwise; blockwise if the probe passes), (300, 272, 400)
    is ragged: partial tiles, and the Triton blockwise kernel."""
    m, n, k = shape
    g = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(torch.bfloat16)
    qx, qw = quantize_operand(x, recipe), quantize_operand(w, recipe, weight=True)
    out = scaled_gemm(qx, qw, torch.float32)
    torch.cuda.synchronize()
    emulated = dequantize_operand(qx) @ dequantize_operand(qw).t()
    errors = {"vs_emulation": rel(out, emulated), "vs_exact": rel(out, x.float() @ w.float().t())}
    context = f"{recipe} {shape}: {errors}, cuBLAS blockwise probe {CUBLAS_BLOCKWISE_PROBE}"
    assert torch.isfinite(out).all(), context
    assert errors["vs_emulation"] < 5e-3, context  # bf16 output rounding / accumulation order only
    assert 0.005 < errors["vs_exact"] < 0.06, context


@pytest.mark.parametrize("fast_accum", [False, True])
def test_torch_op_rowwise_matmul_equals_the_custom_op_gemm(fast_accum: bool) -> None:
    """The traced linear's GEMM (`rowwise_matmul`: torch ops) against `scaled_gemm` on the Triton quantizers'
    operands, 300 rows (not a multiple of 16) with a bias: the same scales (to one ulp) and E4M3 values but for
    rounding ties, into the same cuBLAS call. bf16 inputs over a scale of amax / 448 land exactly on E4M3 ties
    often, and a scale one ulp apart resolves such a tie the other way: a tie moves one element by an E4M3 step
    (~6%). 1.7e-3 of the elements differed in session 23 (H200; the bound 1e-3 written before a GPU run failed), which
    moves the product by ~sqrt(2e-3) * 6% = 3e-3 (3.1e-3 in session 22), so the two are held to the same error
    against the fp32 product instead of to each other."""
    from opengem.ops.fp8_gemm import _rowwise_torch, rowwise_matmul

    g = torch.Generator(device="cuda").manual_seed(8)
    x = torch.randn(300, 512, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(384, 512, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    bias = torch.randn(384, device="cuda", generator=g).to(torch.bfloat16)
    for operand in (x, w):
        q_torch, scale_torch = _rowwise_torch(operand, False, None)
        q_triton = quantize_operand(operand, "fp8_rowwise")
        # torch divides a CUDA tensor by a Python number as a multiply by its reciprocal: one ulp off at most
        torch.testing.assert_close(scale_torch, q_triton.scale, rtol=2.5e-7, atol=0)
        a, b = q_torch.float(), q_triton.data.float()
        assert (a != b).float().mean().item() < 5e-3
        # ties only: a differing element is one E4M3 step off (3 mantissa bits; subnormal step 2^-9)
        assert ((a - b).abs() <= torch.maximum(a.abs(), b.abs()) / 8 + 2.0**-9).all()
    ours = rowwise_matmul(x, w, fast_accum, bias)
    custom = scaled_gemm(quantize_operand(x, "fp8_rowwise"), quantize_operand(w, "fp8_rowwise"), torch.bfloat16,
                         fast_accum=fast_accum, bias=bias)
    exact = x.float() @ w.float().t() + bias.float()
    assert rel(ours, custom) < 1e-2, rel(ours, custom)
    assert rel(ours, exact) < 1.1 * rel(custom, exact) + 1e-4, (rel(ours, exact), rel(custom, exact))


def test_cublas_blockwise_probe_answers() -> None:
    """The probe never raises: it says whether cuBLAS blockwise runs here and why not (printed with -rA)."""
    for b_blocks in (True, False):
        available = cublas_blockwise_available(b_blocks)
        assert isinstance(available, bool)
        assert CUBLAS_BLOCKWISE_PROBE[b_blocks].startswith("ok" if available else ("error", "mismatch"))
    print(f"cuBLAS blockwise probe: {CUBLAS_BLOCKWISE_PROBE}")


def test_blockwise_gemm_with_rowwise_b_scales() -> None:
    x = torch.randn(640, 1000, device="cuda")
    y = torch.randn(384, 1000, device="cuda")
    qx, qy = quantize_operand(x, "fp8_blockwise"), quantize_operand(y, "fp8_blockwise")
    out = scaled_gemm(qx, qy, torch.float32)
    err = rel(out, dequantize_operand(qx) @ dequantize_operand(qy).t())
    # sm90 FP8 tensor-core dots accumulate with reduced precision within each 128-wide K step (Triton's
    # default for fp8 there); scale or layout mistakes give errors of order 1
    assert err < 2e-3, f"rel error {err:.3g} vs the fp32 emulation"


def test_every_blockwise_tuning_config() -> None:
    import triton

    from opengem.ops.triton.fp8_gemm import GEMM_CONFIGS, GROUP_M, _blockwise_gemm_kernel

    x, w = torch.randn(300, 520, device="cuda"), torch.randn(200, 520, device="cuda")
    qx, qw = quantize_operand(x, "fp8_blockwise"), quantize_operand(w, "fp8_blockwise", weight=True)
    expected = dequantize_operand(qx) @ dequantize_operand(qw).t()
    for block_m, warps, stages in GEMM_CONFIGS:
        out = torch.full((300, 200), float("nan"), device="cuda")
        _blockwise_gemm_kernel[(triton.cdiv(300, block_m) * triton.cdiv(200, 128),)](
            qx.data, qw.data, qx.scale, qw.scale, out, 300, 200, 520, qx.scale.shape[1], triton.next_power_of_2(300),
            B_BLOCKS=True, BLOCK_M=block_m, GROUP_M=GROUP_M, num_warps=warps, num_stages=stages,
        )
        err = rel(out, expected)
        assert err < 2e-3, f"config {(block_m, warps, stages)}: rel error {err:.3g}"


@pytest.mark.parametrize("name", sorted(NAMED_RECIPES))
def test_low_precision_linear_on_gpu(name: str) -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(1024, 2048).cuda().to(torch.bfloat16)
    ref = torch.nn.Linear(1024, 2048).cuda()
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(1024, 1024, device="cuda")
    g = torch.randn(1024, 2048, device="cuda")
    xr = x.clone().requires_grad_()
    ref(xr).backward(g)
    layer = LowPrecisionLinear.from_linear(lin, name)
    xl = x.to(torch.bfloat16).requires_grad_()
    y = layer(xl)
    y.backward(g.to(torch.bfloat16))
    torch.cuda.synchronize()
    bound = 0.01 if name == "bf16" else 0.06
    errors = {"y": rel(y, ref(x)), "dx": rel(xl.grad, xr.grad), "dw": rel(lin.weight.grad, ref.weight.grad),
              "db": rel(lin.bias.grad, ref.bias.grad)}
    context = f"{name}: {errors}, cuBLAS blockwise probe {CUBLAS_BLOCKWISE_PROBE}"
    assert y.dtype == torch.bfloat16
    assert errors["y"] < bound and errors["dx"] < bound and errors["dw"] < bound, context
    assert errors["db"] < 0.01, context


def test_fused_gelu_quantizer_and_mlp_on_gpu() -> None:
    from opengem.nn.low_precision_mlp import LowPrecisionMLP
    from opengem.ops.fp8_gemm import quantize_gelu

    gen = torch.Generator(device="cuda").manual_seed(5)
    u = torch.randn(500, 3000, device="cuda", generator=gen).to(torch.bfloat16)
    g = torch.randn(500, 3000, device="cuda", generator=gen).to(torch.bfloat16)
    h, qh = quantize_gelu(u)
    torch.testing.assert_close(h, torch.nn.functional.gelu(u.float()).to(torch.bfloat16), rtol=1e-2, atol=1e-2)
    h_cpu, qh_cpu = quantize_gelu(u.cpu())
    err_h = rel(dequantize_operand(qh).cpu(), dequantize_operand(qh_cpu))
    assert err_h < 2e-3, f"gelu quantization vs CPU: {err_h:.3g}"
    du, qdu = quantize_gelu(u, grad_out=g)
    du_cpu, qdu_cpu = quantize_gelu(u.cpu(), grad_out=g.cpu())
    errors = {"du": rel(du.cpu(), du_cpu), "qdu": rel(dequantize_operand(qdu).cpu(), dequantize_operand(qdu_cpu))}
    assert errors["du"] < 1e-2 and errors["qdu"] < 2e-3, f"gelu backward vs CPU: {errors}"
    torch.manual_seed(0)
    fc1 = torch.nn.Linear(1024, 4096).cuda().to(torch.bfloat16)
    fc2 = torch.nn.Linear(4096, 1024).cuda().to(torch.bfloat16)
    ref = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
    ref.load_state_dict({"0.weight": fc1.weight, "0.bias": fc1.bias, "2.weight": fc2.weight, "2.bias": fc2.bias})
    x = torch.randn(1024, 1024, device="cuda")
    dy = torch.randn(1024, 1024, device="cuda")
    xr = x.clone().requires_grad_()
    ref(xr).backward(dy)
    bias_grads = {}
    for fuse_bias_grads in (False, True):  # bias gradients as sums of their own, or from the quantizing kernels
        mlp = LowPrecisionMLP(fc1, fc2, fuse_bias_grads=fuse_bias_grads)
        for p in mlp.parameters():
            p.grad = None
        xl = x.to(torch.bfloat16).requires_grad_()
        y = mlp(xl)
        y.backward(dy.to(torch.bfloat16))
        errors = {"y": rel(y, ref(x)), "dx": rel(xl.grad, xr.grad), "dw1": rel(fc1.weight.grad, ref[0].weight.grad),
                  "dw2": rel(fc2.weight.grad, ref[2].weight.grad), "db1": rel(fc1.bias.grad, ref[0].bias.grad),
                  "db2": rel(fc2.bias.grad, ref[2].bias.grad)}
        assert errors["y"] < 0.06 and errors["dx"] < 0.08, (fuse_bias_grads, errors)
        assert errors["dw1"] < 0.06 and errors["dw2"] < 0.06, (fuse_bias_grads, errors)
        assert errors["db1"] < 0.06 and errors["db2"] < 0.01, (fuse_bias_grads, errors)  # db2: dy is exact
        bias_grads[fuse_bias_grads] = (fc1.bias.grad.float(), fc2.bias.grad.float())
    for unfused, fused in zip(bias_grads[False], bias_grads[True]):  # the same values summed in another order
        assert rel(fused, unfused) < 1e-2


def test_row_quantizer_fast_math_gelu_is_accurate_over_the_whole_range(check_quantizer_gelu) -> None:
    """The compiled quantizer's GELU (erfc-based CDF with one-instruction reciprocal and exp2) on fp32 rows:
    gelu and gelu' against float64 over [-12, 8]; the approximate exp2's error grows with its argument
    (|w^2| up to ~104 in the tail), hence the looser bound than the interpreter's."""
    check_quantizer_gelu("cuda", near=1e-5, tail=1e-4, derivative_abs=1e-6, derivative_rel=1e-5)


def test_row_quantizer_keeps_nan_and_saturates_like_the_torch_path() -> None:
    """Compiled, the row quantizer leaves saturation to the E4M3 conversion (no clamp): a NaN stays a NaN (a
    max-based clamp turned it into -448; the torch path's amax makes its whole row NaN), the other values
    and the row scales stay finite, and each row's maximum still maps to 448."""
    from opengem.ops.fp8_gemm import _rowwise_torch
    from opengem.ops.triton.fp8_gemm import rowwise_quantize

    x = torch.randn(4, 256, device="cuda", generator=torch.Generator(device="cuda").manual_seed(9))
    x[1, 7] = float("nan")
    q, scale, _ = rowwise_quantize(x.to(torch.bfloat16))
    ref_q, ref_scale = _rowwise_torch(x.to(torch.bfloat16), False, None)
    assert torch.isnan(q.float()[1, 7]) and torch.isnan(ref_q.float()[1, 7])
    finite = ~torch.isnan(x)
    assert torch.isfinite(q.float()[finite]).all() and torch.isfinite(scale).all()
    assert (q.float().abs().nan_to_num(0).amax(dim=1) == 448).all()
    torch.testing.assert_close(scale[[0, 2, 3]], ref_scale[[0, 2, 3]], rtol=1e-6, atol=0)


@pytest.mark.parametrize("columns", [1024, 4096])
def test_persistent_row_quantizer_programs_are_bit_identical_to_the_plain_ones(columns: int) -> None:
    """Every persistent candidate of the row quantizer's tuners (compiled: registers capped or not, a row block
    loaded ahead; the column-summing ones too) writes the plain default launch's (untuned here) codes, scales
    and GELU outputs bit for bit, for x, the GELU and the GELU backward, with more row blocks than programs
    and a partial last block; the column-summing ones' sums equal torch's fp32 sums of the stored values.
    The tuner picks by speed alone, so a wrong candidate would be picked silently."""
    import triton

    from opengem.ops.triton import fp8_gemm as g

    gen = torch.Generator(device="cuda").manual_seed(12)
    candidates = [(config, False) for config in g._persistent_programs(columns)]
    candidates += [(config, True) for config in g._column_sum_programs(columns)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    most = max(config.kwargs["PROGRAMS_PER_SM"] for config, _ in candidates)
    rows = 3 * candidates[0][0].kwargs["BLOCK_R"] * most * sms + 7
    x = (torch.randn(rows, columns, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    u = torch.randn(rows, columns, device="cuda", generator=gen).to(torch.bfloat16)
    for prologue in (None, "gelu", "gelu_backward"):
        ref_q, ref_scale, ref_out = g.rowwise_quantize(x, prologue, u if prologue == "gelu_backward" else None)
        ref_sums = torch.sum(x if ref_out is None else ref_out, 0, dtype=torch.float32)
        for config, col_sum in candidates:
            q, scale = torch.empty_like(ref_q), torch.empty_like(ref_scale)
            out = torch.empty_like(x) if prologue else torch.empty(0, dtype=x.dtype, device="cuda")
            grid = g._row_grid(rows, x.device)(config.kwargs)
            assert grid[0] < triton.cdiv(rows, config.kwargs["BLOCK_R"])
            sum_rows = most * sms if col_sum else 0  # more rows than this grid's programs: the rest zeroed
            partial = torch.full((sum_rows, columns if col_sum else 0), float("nan"), device="cuda")
            g._row_amax_quant_kernel[grid](
                x, u, out, q, scale, partial, rows, columns, sum_rows, PROLOGUE=g.PROLOGUES[prologue],
                BLOCK_C=columns, ONE_CHUNK=True, COMPILED=True, COL_SUM=col_sum, num_warps=config.num_warps,
                maxnreg=config.maxnreg, **config.kwargs)
            where = f"{prologue} {config} column sums {col_sum}"
            assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)), bit_mismatches(where, x, q, ref_q)
            assert torch.equal(scale, ref_scale), where
            assert ref_out is None or torch.equal(out, ref_out), where
            if col_sum:
                assert (partial[grid[0]:] == 0).all(), where
                torch.testing.assert_close(partial.sum(0), ref_sums, rtol=1e-5, atol=1e-3, msg=where)


def test_column_sums_of_the_tuned_launch_on_gpu() -> None:
    """`rowwise_quantize_with_sums` autotuned (every column-summing candidate timed, the fastest kept): the same
    codes as the plain quantizer and torch's column sums, for x [rows, 1024] and the GELU backward at 4096."""
    from opengem.ops.triton.fp8_gemm import rowwise_quantize, rowwise_quantize_with_sums

    gen = torch.Generator(device="cuda").manual_seed(13)
    for columns, prologue in ((1024, None), (4096, "gelu_backward"), (6000, "gelu_backward")):
        x = torch.randn(3001, columns, device="cuda", generator=gen).to(torch.bfloat16)
        u = torch.randn(3001, columns, device="cuda", generator=gen).to(torch.bfloat16) if prologue else None
        q, scale, out, sums = rowwise_quantize_with_sums(x, prologue, u)
        ref_q, ref_scale, ref_out = rowwise_quantize(x, prologue, u)
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scale, ref_scale)
        assert ref_out is None or torch.equal(out, ref_out)
        stored = x if ref_out is None else ref_out
        torch.testing.assert_close(sums, torch.sum(stored, 0, dtype=torch.float32), rtol=1e-5, atol=1e-3)


def test_fp8_matmul_recipes_agree_with_mx_emulation_on_gpu() -> None:
    x, w = torch.randn(256, 512, device="cuda"), torch.randn(384, 512, device="cuda")
    expected = mx_dequantize(mx_quantize(x), torch.float32) @ mx_dequantize(mx_quantize(w), torch.float32).t()
    err = rel(fp8_matmul(x, w, "mxfp8", torch.float32), expected)
    assert err < 1e-2, err  # bf16 output of native/emulated GEMM


@pytest.mark.parametrize("path", ["inductor", "custom_op"])
def test_fp8_linears_under_torch_compile(monkeypatch, path: str) -> None:
    """FP8 linears and the fused FP8 MLP in one compiled graph (fullgraph, dynamic shapes as the trainer compiles),
    on 2,043 tokens (not a multiple of 16): the output and every gradient as close to the fp32 computation as
    eager's, through Inductor's torch-op path and through the custom ops. torch bugs met here: Dynamo failed on the
    row quantizer's `prune_configs_by` tuner launched several times in one trace (pytorch#177600); traced as an
    autograd.Function the FP8 linear's backward got zeros for its output gradient (sessions 12 and 21: a no-op
    ``to`` on the output); a module-level float inside the Function failed Dynamo under dynamic shapes (session 21)."""
    from opengem.nn.low_precision_mlp import LowPrecisionMLP

    monkeypatch.setenv("OPENGEM_FP8_COMPILE", path)
    torch.manual_seed(0)
    layers = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512)
    ).cuda().to(torch.bfloat16)  # fmt: skip
    for index in (0, 2):
        layers[index] = LowPrecisionLinear.from_linear(layers[index], "fp8_rowwise")
    mlp = LowPrecisionMLP(*(torch.nn.Linear(*dims).cuda().to(torch.bfloat16) for dims in ((512, 1024), (1024, 512))))
    mlp_torch_bias = LowPrecisionMLP(mlp.fc1, mlp.fc2, fuse_bias_grads=False)  # torch's bias reductions
    all_fp8 = LowPrecisionLinear(512, 512, recipe="fp8_rowwise_all", device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2043, 512, device="cuda", dtype=torch.bfloat16)
    for module in (layers, mlp, mlp_torch_bias, all_fp8):  # the MLPs share parameters: gradients cleared first
        module.zero_grad(set_to_none=True)
        eager_x, compiled_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        eager_y = module(eager_x)
        eager_y.float().square().mean().backward()
        eager_grads = [p.grad.clone() for p in module.parameters()]
        module.zero_grad()
        compiled_y = torch.compile(module, fullgraph=True, dynamic=True)(compiled_x)
        compiled_y.float().square().mean().backward()
        torch._dynamo.reset()
        compiled_grads = [p.grad.clone() for p in module.parameters()]
        exact_x = x.float().requires_grad_()
        exact_y, exact_params = _fp32_reference(module, exact_x)
        exact_y.square().mean().backward()
        # Inductor keeps fused intermediates (GELU) in fp32 and divides approximately, so its E4M3 roundings are
        # not eager's: dx differed by 3% between the two in session 22. Each is held to the fp32 computation, the
        # compiled path within 1.25x of eager's error (lost or zero gradients are off by ~100%)
        pairs = [(compiled_y, eager_y, exact_y), (compiled_x.grad, eager_x.grad, exact_x.grad),
                 *((c, e, p.grad) for c, e, p in zip(compiled_grads, eager_grads, exact_params))]
        for compiled, eager, exact in pairs:
            assert eager.abs().sum() > 0 and compiled.abs().sum() > 0
            assert rel(compiled, exact) < 1.25 * rel(eager, exact) + 2e-3, (rel(compiled, exact), rel(eager, exact))


def _fp32_reference(module: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``module``'s Linear / GELU chain in fp32 on fp32 copies of its parameters: (output, the copies in
    ``module.parameters()`` order, whose ``.grad`` the backward fills)."""
    copies = {id(p): p.detach().float().requires_grad_() for p in module.parameters()}
    for layer in [module] if isinstance(module, torch.nn.Linear) else list(module):
        if isinstance(layer, torch.nn.Linear):
            bias = None if layer.bias is None else copies[id(layer.bias)]
            x = torch.nn.functional.linear(x, copies[id(layer.weight)], bias)
        else:
            x = layer(x)
    return x, [copies[id(p)] for p in module.parameters()]
