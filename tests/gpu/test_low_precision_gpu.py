"""GPU checks of the low-precision kernels: bit-exact MX quantization, the fused quantizers, the
blockwise FP8 GEMM, cuBLAS rowwise GEMMs and LowPrecisionLinear against their CPU emulations."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from opengem.nn.low_precision import NAMED_RECIPES, LowPrecisionLinear  # noqa: E402
from opengem.ops.fp8_gemm import (  # noqa: E402
    FP8_RECIPES,
    dequantize_operand,
    fp8_matmul,
    quantize_operand,
    quantize_operand_with_transpose,
    scaled_gemm,
)
from opengem.ops.mx import mx_dequantize, mx_quantize  # noqa: E402
from opengem.ops.reference.mx import mx_quantize_reference  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def special_rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    rows = [torch.zeros(32), torch.randn(32, generator=g) * 1e-39, torch.randn(32, generator=g) * 1e-30,
            torch.randn(32, generator=g).clamp(-3, 3) * 1e38, torch.linspace(-470, 470, 32),
            torch.tensor([float("inf")] + [1.0] * 31), torch.tensor([float("nan")] + [2.0] * 31),
            torch.tensor([448.0, 449.0, 479.0, 1.0625, 1.1875, -1.0625] + [2.0**-k for k in range(26)])]
    return torch.stack(rows)


@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
@pytest.mark.parametrize("rule", ["rceil", "floor"])
@pytest.mark.parametrize("block", [32, (32, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mx_quantize_bit_exact_on_gpu(elem: str, rule: str, block, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    wide_range = torch.randn(1000, 4100, generator=g) * torch.logspace(-40, 37, 1000)[:, None]
    cases = [wide_range, torch.randn(3, 33, generator=g)]
    if block == 32 and dtype == torch.float32:
        cases.append(special_rows())
    for x in cases:
        x = x.to(dtype)
        ref = mx_quantize(x, block, elem, rule)  # CPU: reference
        out = mx_quantize(x.cuda(), block, elem, rule)  # CUDA: Triton
        assert torch.equal(out.data.cpu().view(torch.uint8), ref.data.view(torch.uint8))
        assert torch.equal(out.scales.cpu(), ref.scales)
    back = mx_dequantize(out)
    assert back.is_cuda and back.dtype == dtype


def test_blockwise_dual_quantizer_bit_exact_on_gpu() -> None:
    from opengem.ops.triton.fp8_gemm import blockwise_quantize_dual

    x = (torch.randn(1000, 700) * torch.logspace(-20, 20, 700)).to(torch.bfloat16)
    q, s, qt, st = (t.cpu() for t in blockwise_quantize_dual(x.cuda()))
    rq, rs = mx_quantize_reference(x, (128,), "e4m3", "rceil")
    rqt, rst = mx_quantize_reference(x.t().contiguous(), (128,), "e4m3", "rceil")
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    assert torch.equal(qt.view(torch.uint8), rqt.view(torch.uint8)) and torch.equal(st, rst)


def test_rowwise_quantizers_match_torch() -> None:
    x = torch.randn(777, 1000, device="cuda").to(torch.bfloat16) * torch.rand(777, 1, device="cuda").to(torch.bfloat16)
    q = quantize_operand(x, "fp8_rowwise")
    torch.testing.assert_close(q.scale, x.float().abs().amax(1) / 448, rtol=1e-6, atol=0)
    ref = (x.float() / q.scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    mismatch = (q.data.float() != ref.float()).float().mean().item()
    assert mismatch < 1e-3  # only where the approximate fp32 division lands on a rounding tie
    qa, qt = quantize_operand_with_transpose(x, "fp8_rowwise")
    torch.testing.assert_close(dequantize_operand(qa), x.float(), rtol=0.07, atol=1e-3)
    torch.testing.assert_close(dequantize_operand(qt), x.float().t(), rtol=0.07, atol=1e-3)
    torch.testing.assert_close(qt.scale, x.float().abs().amax(0) / 448, rtol=1e-6, atol=0)


@pytest.mark.parametrize("recipe", FP8_RECIPES)
@pytest.mark.parametrize("shape", [(512, 768, 1024), (300, 272, 400), (4096, 4096, 4096)])
def test_gpu_gemm_matches_cpu_emulation(recipe: str, shape: tuple[int, int, int]) -> None:
    m, n, k = shape
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") * k**-0.5).to(torch.bfloat16)
    qx, qw = quantize_operand(x, recipe), quantize_operand(w, recipe, weight=True)
    out = scaled_gemm(qx, qw, torch.float32)
    emulated = dequantize_operand(qx) @ dequantize_operand(qw).t()
    assert rel(out, emulated) < 5e-3  # bf16 output rounding / accumulation order only
    assert 0.005 < rel(out, x.float() @ w.float().t()) < 0.06
    assert torch.isfinite(out).all()


def test_blockwise_gemm_with_rowwise_b_scales() -> None:
    x = torch.randn(640, 1000, device="cuda")
    y = torch.randn(384, 1000, device="cuda")
    qx, qy = quantize_operand(x, "fp8_blockwise"), quantize_operand(y, "fp8_blockwise")
    out = scaled_gemm(qx, qy, torch.float32)
    assert rel(out, dequantize_operand(qx) @ dequantize_operand(qy).t()) < 1e-5


@pytest.mark.parametrize("name", sorted(NAMED_RECIPES))
def test_low_precision_linear_on_gpu(name: str) -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(1024, 2048).cuda().to(torch.bfloat16)
    ref = torch.nn.Linear(1024, 2048).cuda()
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(4096, 1024, device="cuda")
    g = torch.randn(4096, 2048, device="cuda")
    xr = x.clone().requires_grad_()
    ref(xr).backward(g)
    layer = LowPrecisionLinear.from_linear(lin, name)
    xl = x.to(torch.bfloat16).requires_grad_()
    y = layer(xl)
    y.backward(g.to(torch.bfloat16))
    bound = 0.01 if name == "bf16" else 0.06
    assert y.dtype == torch.bfloat16
    assert rel(y, ref(x)) < bound and rel(xl.grad, xr.grad) < bound and rel(lin.weight.grad, ref.weight.grad) < bound
    assert rel(lin.bias.grad, ref.bias.grad) < 0.01


def test_fused_gelu_quantizer_and_mlp_on_gpu() -> None:
    from opengem.nn.low_precision_mlp import LowPrecisionMLP
    from opengem.ops.fp8_gemm import quantize_gelu

    u = torch.randn(1000, 3000, device="cuda").to(torch.bfloat16)
    g = torch.randn(1000, 3000, device="cuda").to(torch.bfloat16)
    h, qh = quantize_gelu(u)
    torch.testing.assert_close(h, torch.nn.functional.gelu(u.float()).to(torch.bfloat16), rtol=1e-2, atol=1e-2)
    h_cpu, qh_cpu = quantize_gelu(u.cpu())
    assert rel(dequantize_operand(qh).cpu(), dequantize_operand(qh_cpu)) < 2e-3
    du, qdu = quantize_gelu(u, grad_out=g)
    du_cpu, qdu_cpu = quantize_gelu(u.cpu(), grad_out=g.cpu())
    assert rel(du.cpu(), du_cpu) < 1e-2 and rel(dequantize_operand(qdu).cpu(), dequantize_operand(qdu_cpu)) < 2e-3
    torch.manual_seed(0)
    fc1 = torch.nn.Linear(1024, 4096).cuda().to(torch.bfloat16)
    fc2 = torch.nn.Linear(4096, 1024).cuda().to(torch.bfloat16)
    ref = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
    ref.load_state_dict({"0.weight": fc1.weight, "0.bias": fc1.bias, "2.weight": fc2.weight, "2.bias": fc2.bias})
    x = torch.randn(2048, 1024, device="cuda")
    dy = torch.randn(2048, 1024, device="cuda")
    xr = x.clone().requires_grad_()
    ref(xr).backward(dy)
    mlp = LowPrecisionMLP(fc1, fc2)
    xl = x.to(torch.bfloat16).requires_grad_()
    y = mlp(xl)
    y.backward(dy.to(torch.bfloat16))
    assert rel(y, ref(x)) < 0.06 and rel(xl.grad, xr.grad) < 0.08
    assert rel(fc1.weight.grad, ref[0].weight.grad) < 0.06 and rel(fc2.weight.grad, ref[2].weight.grad) < 0.06


def test_fp8_matmul_recipes_agree_with_mx_emulation_on_gpu() -> None:
    x, w = torch.randn(256, 512, device="cuda"), torch.randn(384, 512, device="cuda")
    expected = mx_dequantize(mx_quantize(x), torch.float32) @ mx_dequantize(mx_quantize(w), torch.float32).t()
    assert rel(fp8_matmul(x, w, "mxfp8", torch.float32), expected) < 1e-2  # bf16 output of native/emulated GEMM
