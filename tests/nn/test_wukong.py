import torch

from opengem.nn.wukong import DenseExperts, WukongLayer


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


def test_dense_experts_sum_every_expert():
    experts = [torch.nn.Linear(4, 4) for _ in range(3)]
    x = torch.randn(5, 4)
    torch.testing.assert_close(DenseExperts(experts)(x), sum(e(x) for e in experts))
