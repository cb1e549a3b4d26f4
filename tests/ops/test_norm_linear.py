"""norm_linear: the reference and the Triton kernels (interpreter, fp32 / fp16) against fp64 autograd of
``linear(layer_norm(x))``; the pass-through gradient, a detached bias, autocast, bad input, torch.compile."""

import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from opengem.ops.norm_linear import norm_linear

os.environ.setdefault("TRITON_INTERPRET", "1")

BACKENDS = ["reference", "triton"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch) -> str:
    monkeypatch.setenv("OPENGEM_NORM_LINEAR_BACKEND", request.param)
    return request.param


def _inputs(rows: int, k: int, n: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * 2 + 0.3
    gamma = 1 + 0.2 * torch.randn(k, generator=g)
    beta = 0.2 * torch.randn(k, generator=g)
    weight = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    bias = (0.2 * torch.randn(n, generator=g)).to(dtype)
    return [t.requires_grad_() for t in (x, gamma, beta, weight, bias)]


def _fp64(leaves: list[torch.Tensor], dy: torch.Tensor, d_res: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    x, gamma, beta, weight, bias = (t.detach().double().requires_grad_() for t in leaves)
    y = F.linear(F.layer_norm(x, (x.shape[1],), gamma, beta), weight, bias)
    outputs, grads = ((x.view_as(x), y), (d_res.double(), dy.double())) if d_res is not None else ((y,), (dy.double(),))
    return (y.detach(), *torch.autograd.grad(outputs, (x, gamma, beta, weight, bias), grads))


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.detach().double() - want).norm() / want.norm())


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("rows, k, n", [(37, 96, 80), (20, 256, 48), (5, 16, 16)])
@pytest.mark.parametrize("pass_through", [True, False])
def test_matches_fp64_autograd(backend, dtype, tolerance, rows, k, n, pass_through):
    leaves = _inputs(rows, k, n, dtype)
    dy = torch.randn(rows, n).to(dtype)
    d_res = torch.randn(rows, k) if pass_through else None
    out = norm_linear(*leaves, pass_through=pass_through)
    if pass_through:
        residual, y = out
        grads = torch.autograd.grad((residual, y), leaves, (d_res, dy))
    else:
        y = out
        grads = torch.autograd.grad(y, leaves, dy)
    want = _fp64(leaves, dy, d_res)
    assert y.dtype == dtype and y.shape == (rows, n)
    for name, got, ref in zip(("y", "dx", "dgamma", "dbeta", "dweight", "dbias"), (y, *grads), want):
        assert _error(got, ref) < tolerance, (name, _error(got, ref))
    assert [g.dtype for g in grads] == [t.dtype for t in leaves]


def test_unused_pass_through_and_residual_sum(backend):
    """The pass-through's gradient is added to the norm's input gradient; left unused, it adds nothing."""
    leaves = _inputs(24, 64, 32, torch.float32)
    dy, d_res = torch.randn(24, 32), torch.randn(24, 64)
    residual, y = norm_linear(*leaves, pass_through=True)
    with_res = torch.autograd.grad((residual, y), leaves[0], (d_res, dy))[0]
    without = torch.autograd.grad(norm_linear(*leaves), leaves[0], dy)[0]
    torch.testing.assert_close(with_res - without, d_res, rtol=1e-5, atol=1e-5)
    _, y = norm_linear(*leaves, pass_through=True)
    torch.testing.assert_close(torch.autograd.grad(y, leaves[0], dy)[0], without)


def test_detached_bias_gets_no_gradient_and_rows_of_any_leading_shape(backend):
    x, gamma, beta, weight, bias = _inputs(30, 32, 24, torch.float32)
    y = norm_linear(x.view(5, 6, 32), gamma, beta, weight, bias.detach())
    assert y.shape == (5, 6, 24)
    y.sum().backward()
    assert bias.grad is None and x.grad.shape == (30, 32) and weight.grad is not None
    torch.testing.assert_close(y.view(30, 24), F.linear(F.layer_norm(x, (32,), gamma, beta), weight, bias))


def test_empty_rows(backend):
    x, gamma, beta, weight, bias = _inputs(0, 32, 24, torch.float32)
    y = norm_linear(x, gamma, beta, weight, bias)
    assert y.shape == (0, 24)
    y.sum().backward()
    assert x.grad.shape == (0, 32) and torch.count_nonzero(weight.grad) == 0 and torch.count_nonzero(gamma.grad) == 0


def test_autocast_rounds_like_layer_norm_then_linear():
    """Under autocast the GEMM runs in the autocast dtype with the norm in fp32, as ``nn.Linear(nn.LayerNorm)``."""
    x, gamma, beta, weight, bias = _inputs(16, 32, 24, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = norm_linear(x, gamma, beta, weight, bias)
        want = F.linear(F.layer_norm(x, (32,), gamma, beta), weight, bias)
    assert y.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(y, want, rtol=2e-2, atol=2e-2)
    y.float().sum().backward()
    assert weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(gamma=torch.ones(31)), r"norm_weight must have shape \[32\]"),
    (lambda a: a.update(beta=torch.ones(2, 16)), r"norm_bias must have shape \[32\]"),
    (lambda a: a.update(weight=torch.ones(24, 31)), r"weight must have shape \[N, 32\]"),
    (lambda a: a.update(bias=torch.ones(23)), r"bias must have shape \[24\]"),
    (lambda a: a.update(x=torch.ones(4, 32, dtype=torch.int64)), "x must be a floating tensor"),
    (lambda a: a.update(eps=0.0), "eps must be positive"),
    (lambda a: a.update(weight=torch.ones(24, 32, device="meta")), "must be on one device"),
])  # fmt: skip
def test_bad_input_names_the_argument(change, message):
    args = {"x": torch.ones(4, 32), "gamma": torch.ones(32), "beta": torch.zeros(32), "weight": torch.ones(24, 32),
            "bias": torch.zeros(24), "eps": 1e-5}  # fmt: skip
    change(args)
    with pytest.raises(ValueError, match=message):
        norm_linear(args["x"], args["gamma"], args["beta"], args["weight"], args["bias"], eps=args["eps"])


def test_compiles_without_graph_breaks_and_counts_its_gemm():
    leaves = _inputs(40, 64, 48, torch.float32)
    projection = torch.randn(64, 48) / 48

    def block(x, gamma, beta, weight, bias):  # a pre-norm residual block
        residual, y = norm_linear(x, gamma, beta, weight, bias, pass_through=True)
        return residual + F.linear(torch.relu(y), projection)

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    want = torch.autograd.grad(block(*leaves).square().sum(), leaves)
    got = torch.autograd.grad(compiled(*leaves).square().sum(), leaves)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    with FlopCounterMode(display=False) as counter:
        norm_linear(*leaves).sum().backward()
    # forward GEMM, input-gradient GEMM (both the op's formula) and the weight gradient's mm: 3 x 2 M N K
    assert counter.get_total_flops() == 3 * 2 * 40 * 64 * 48


def test_tiles_pruned_to_the_row_width():
    """The GPU's tuners keep only tiles whose row block fits at the launch's K_PAD (a keyword argument there)."""
    import triton

    from opengem.ops.triton.norm_linear import SHARED_MEMORY, _pruned_to, shared_bytes

    def prune_forward(configs: list, k_pad: int) -> list:
        return _pruned_to(128 * 256, forward=True)["early_config_prune"](configs, {}, K_PAD=k_pad)

    tiles = [triton.Config({"BLOCK_M": m, "BLOCK_N": 64}) for m in (16, 32, 64, 128)]
    prune = _pruned_to(64 * 256, forward=False)["early_config_prune"]
    assert [c.kwargs["BLOCK_M"] for c in prune(tiles, {}, K_PAD=256)] == [16, 32, 64]
    assert [c.kwargs["BLOCK_M"] for c in prune(tiles, {}, K_PAD=512)] == [16, 32]
    assert [c.kwargs["BLOCK_M"] for c in prune(tiles[2:], {}, K_PAD=4096)] == [64]
    # shared memory: the forward's row block plus a [K, BLOCK_N] weight tile per stage (session 39's K 512 failure)
    wide = triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_stages=3)
    assert shared_bytes(wide, 512, forward=True) == 2 * (64 * 512 + 3 * 512 * 128) > SHARED_MEMORY
    assert prune_forward([wide, tiles[0]], 512) == [tiles[0]]
    assert prune_forward([wide], 512) == [wide]  # nothing fits: the least demanding, whose launch names the limit
