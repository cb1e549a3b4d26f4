"""norm_linear's Triton kernels on the GPU in bf16: as accurate as LayerNorm + Linear under autocast against fp64,
deterministic, rows of 16 to 512 (the kernels' range) and a row past it (the reference path)."""

import pytest
import torch
import torch.nn.functional as F

from opengem.ops.norm_linear import norm_linear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _leaves(rows: int, k: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(k + n)
    shapes = ((rows, k), (k,), (k,), (n, k), (n,))
    scales = (2.0, 0.2, 0.2, k**-0.5, 0.2)
    leaves = [torch.randn(s, device="cuda", generator=g) * c for s, c in zip(shapes, scales)]
    leaves[1] += 1
    return [t.requires_grad_() for t in leaves]


def _run(fn, leaves, dy, d_res):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        residual, y = fn(*leaves)
    return (y.detach(), *torch.autograd.grad((residual, y), leaves, (d_res, dy)))


def _unfused(x, gamma, beta, weight, bias):
    return x.view_as(x), F.linear(F.layer_norm(x, (x.shape[1],), gamma, beta), weight, bias)


def _fused(x, gamma, beta, weight, bias):
    return norm_linear(x, gamma, beta, weight, bias, pass_through=True)


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


@pytest.mark.parametrize("rows, k, n", [(4099, 256, 768), (3000, 512, 1536), (1025, 96, 200), (77, 16, 48),
                                        (513, 640, 64)])
def test_as_accurate_as_the_unfused_composition(rows, k, n):
    leaves = _leaves(rows, k, n)
    dy = torch.randn(rows, n, device="cuda").bfloat16()
    d_res = torch.randn(rows, k, device="cuda")
    x, gamma, beta, weight, bias = (t.detach().double().requires_grad_() for t in leaves)
    w16, b16 = weight.bfloat16().double(), bias.bfloat16().double()
    y = F.linear(F.layer_norm(x, (k,), gamma, beta), w16, b16)
    want = (y.detach(), *torch.autograd.grad((x.view_as(x), y), (x, gamma, beta, w16, b16), (d_res.double(),
                                                                                            dy.double())))
    fused, unfused = _run(_fused, leaves, dy, d_res), _run(_unfused, leaves, dy, d_res)
    for name, got, peer, ref in zip(("y", "dx", "dgamma", "dbeta", "dweight", "dbias"), fused, unfused, want):
        assert _error(got, ref) <= 1.5 * _error(peer, ref) + 1e-6, (name, _error(got, ref), _error(peer, ref))


def test_deterministic_gradients():
    leaves = _leaves(20000, 256, 256)
    dy = torch.randn(20000, 256, device="cuda").bfloat16()
    d_res = torch.randn(20000, 256, device="cuda")
    first, second = _run(_fused, leaves, dy, d_res), _run(_fused, leaves, dy, d_res)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_empty_rows_on_the_gpu():
    leaves = _leaves(0, 256, 64)
    out = _run(_fused, leaves, torch.empty(0, 64, device="cuda").bfloat16(), torch.empty(0, 256, device="cuda"))
    assert out[0].shape == (0, 64) and out[1].shape == (0, 256) and not out[4].any()
