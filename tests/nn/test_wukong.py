import re

import pytest
import torch

from opengem.nn.wukong import DenseExperts, WukongLayer, unpadded_token_mixing


def test_optimized_fm_equals_pairwise_interactions():
    torch.manual_seed(0)
    layer = WukongLayer(num_tokens=5, dim=8, fm_tokens=3, lc_tokens=2, fm_rank=4, mlp_hidden=16)
    x = torch.randn(3, 5, 8)
    # X (X^T Y) == (X X^T) Y: the optimized form computes the same pairwise dot-product interactions
    pairwise = torch.bmm(x, x.transpose(1, 2)) @ layer.fm_projection
    optimized = torch.bmm(x, torch.einsum("bnd,nk->bdk", x, layer.fm_projection))
    torch.testing.assert_close(optimized, pairwise, rtol=1e-5, atol=1e-5)
    out = layer(x)
    assert out.shape == (3, 5, 8) and torch.isfinite(out).all()
    out.sum().backward()
    assert layer.fm_projection.grad is not None and layer.fm_projection.grad.abs().sum() > 0


def test_token_count_change_uses_a_residual_projection():
    layer = WukongLayer(num_tokens=6, dim=4, fm_tokens=2, lc_tokens=1, fm_rank=2, mlp_hidden=8)
    assert layer(torch.randn(2, 6, 4)).shape == (2, 3, 4)


@pytest.mark.parametrize("shape", [(4, 6, 8), (4, 5, 7), (5, 8)])
def test_inputs_not_shaped_like_the_layer_are_refused_naming_both(shape):
    # a wrong token count had failed in a bmm, a 2-D input with "batch2 must be a 3D tensor"
    layer = WukongLayer(num_tokens=5, dim=8, fm_tokens=3, lc_tokens=2, fm_rank=2, mlp_hidden=16)
    message = r"WukongLayer: x must be \[B, num_tokens = 5, dim = 8\], got " + re.escape(str(shape))
    with pytest.raises(ValueError, match=message):
        layer(torch.randn(shape))
    assert layer(torch.randn(0, 5, 8)).shape == (0, 5, 8)  # an empty batch is a shape, not an error


def test_dense_experts_sum_every_expert():
    experts = [torch.nn.Linear(4, 4) for _ in range(3)]
    x = torch.randn(5, 4)
    torch.testing.assert_close(DenseExperts(experts)(x), sum(e(x) for e in experts))


@pytest.mark.parametrize("num_tokens, fm_tokens, lc_tokens", [(39, 6, 5), (16, 8, 8), (7, 3, 4)])
def test_aligned_token_mixing_equals_the_plain_layer(num_tokens, fm_tokens, lc_tokens):
    """The token mixings as one batched GEMM (its left operand's rows zero-padded) compute the plain formulation's
    output and gradients."""
    torch.manual_seed(0)
    layer = WukongLayer(num_tokens, dim=8, fm_tokens=fm_tokens, lc_tokens=lc_tokens, fm_rank=4, mlp_hidden=16).double()
    x = torch.randn(3, num_tokens, 8, dtype=torch.float64, requires_grad=True)

    def plain(x: torch.Tensor) -> torch.Tensor:
        compressed = torch.einsum("bnd,nk->bdk", x, layer.fm_projection)
        fm = layer.fm_mlp(layer.fm_norm(torch.bmm(x, compressed).flatten(1))).view(3, fm_tokens, 8)
        lc = layer.lc(x.transpose(1, 2)).transpose(1, 2)
        residual = layer.residual(x.transpose(1, 2)).transpose(1, 2)
        return layer.norm(torch.cat([fm, lc], dim=1) + residual)

    grad = torch.randn(3, fm_tokens + lc_tokens, 8, dtype=torch.float64)
    results = []
    for forward in (layer, plain):
        layer.zero_grad()
        x.grad = None
        out = forward(x)
        out.backward(grad)
        results.append([out, x.grad, *(p.grad for p in layer.parameters())])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_unpadded_token_mixing_is_scoped_and_computes_the_same():
    """FLOP counting runs the layers unpadded (useful products only): same output, padding restored after."""
    torch.manual_seed(0)
    model = DenseExperts([WukongLayer(13, dim=8, fm_tokens=4, lc_tokens=5, fm_rank=4, mlp_hidden=16) for _ in range(2)])
    x = torch.randn(2, 13, 8)
    padded = model(x)
    with unpadded_token_mixing(model):
        assert [layer.token_align for layer in model.experts] == [1, 1]
        unpadded = model(x)
    assert [layer.token_align for layer in model.experts] == [8, 8]
    torch.testing.assert_close(unpadded, padded, rtol=1e-5, atol=1e-5)


def test_token_mixing_reads_the_tokens_as_they_are(op_log):
    """No padded or transposed copy of ``x`` (or of its gradient) in the forward and backward under bf16 autocast:
    every op whose output is ``x``'s size or more is a cast, a view, a GEMM or the sums that join the branches; and
    every GEMM writes rows of a multiple of 8 elements (the token count is 67)."""
    torch.manual_seed(0)
    layer = WukongLayer(67, dim=32, fm_tokens=6, lc_tokens=5, fm_rank=8, mlp_hidden=64)
    x = torch.randn(4, 67, 32, requires_grad=True)
    with op_log:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x)
        out.float().sum().backward()
    large = op_log.names(min_numel=x.numel())
    gemm_rows = {shape[-1] for shape in op_log.shapes("bmm")}
    assert "bmm" in large
    # every batched GEMM writes rows of a multiple of 8 elements (16 bytes of bf16: cuBLAS's aligned kernels)
    assert gemm_rows and all(width % 8 == 0 for width in gemm_rows), gemm_rows
    assert not large & {"constant_pad_nd", "clone", "copy_", "cat", "slice_backward", "index_put"}, large
