"""bf16 weight shadows (opengem.nn.weight_shadows): the same numbers as autocast's per-use casts, bit for bit; with
fp32 weight gradients, the same forward and unrounded weight gradients."""

import contextlib
import copy

import pytest
import torch
from torch import nn

from opengem.nn.gem_layers import projected
from opengem.nn.weight_shadows import ShadowedLinear, refresh_shadows, shadow_linear_weights, shadows_in_use


def _pair(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    plain = nn.Sequential(nn.Linear(24, 32), nn.GELU(), nn.Linear(32, 8, bias=False), nn.LayerNorm(8))
    shadowed = nn.Sequential(nn.Linear(24, 32), nn.GELU(), nn.Linear(32, 8, bias=False), nn.LayerNorm(8))
    shadowed.load_state_dict(plain.state_dict())
    return plain, shadowed


def _output_and_grads(model: nn.Module, x: torch.Tensor, use: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), (shadows_in_use() if use else contextlib.nullcontext()):
        out = model(x)
    out.float().square().sum().backward()
    return out, [p.grad for p in model.parameters()]


def test_shadowed_layers_match_autocast_bit_for_bit():
    plain, shadowed = _pair()
    pairs = shadow_linear_weights(shadowed)
    # two weights and one bias shadowed; the LayerNorm (fp32 under autocast) untouched
    assert len(pairs) == 3 and all(shadow.dtype == torch.bfloat16 for _, shadow in pairs)
    assert [type(m) for m in shadowed] == [ShadowedLinear, nn.GELU, ShadowedLinear, nn.LayerNorm]
    assert shadowed.state_dict().keys() == plain.state_dict().keys()  # the shadows are not saved
    x = torch.randn(5, 24)
    want, want_grads = _output_and_grads(plain, x, use=False)
    got, got_grads = _output_and_grads(shadowed, x, use=True)
    assert got.dtype == want.dtype and torch.equal(got, want)
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == w.dtype == torch.float32 and torch.equal(g, w)


def test_shadows_follow_the_parameters_only_when_refreshed():
    plain, shadowed = _pair()
    pairs = shadow_linear_weights(shadowed)
    x = torch.randn(5, 24)
    with torch.no_grad():
        for model in (plain, shadowed):
            model[0].weight.mul_(2.0)
    stale, _ = _output_and_grads(shadowed, x, use=True)
    want, _ = _output_and_grads(plain, x, use=False)
    assert not torch.equal(stale, want)  # the shadow still holds the old weight
    refresh_shadows(pairs)
    fresh, _ = _output_and_grads(shadowed, x, use=True)
    assert torch.equal(fresh, want)
    outside, _ = _output_and_grads(shadowed, x, use=False)  # outside shadows_in_use: a plain Linear
    assert torch.equal(outside, want)


def test_projected_hands_the_bias_to_the_op_with_shadows():
    torch.manual_seed(1)
    plain = nn.Linear(16, 12)
    shadowed = nn.Linear(16, 12)
    shadowed.load_state_dict(plain.state_dict())
    shadow_linear_weights(shadowed)
    x = torch.randn(7, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_bias = projected(plain, x)
        with shadows_in_use():
            got, got_bias = projected(shadowed, x)
    assert torch.equal(got, want) and got_bias is shadowed.bias and want_bias is plain.bias
    got.float().sum().backward()
    want.float().sum().backward()
    assert shadowed.bias.grad is None  # the op, not the projection, gives the bias its gradient
    assert torch.equal(shadowed.weight.grad, plain.weight.grad)


@pytest.mark.parametrize("fp32_grads", [False, True])
def test_compiled_block_reads_the_shadows_without_a_graph_break(fp32_grads):
    """Compiled whole (fullgraph) with the shadows in use, a block computes what eager does: the plain layers under
    autocast bit for bit; with fp32 gradients, the same shadowed layers run eagerly."""
    plain, shadowed = _pair(2)
    shadow_linear_weights(shadowed, fp32_grads=fp32_grads)
    reference, use = (copy.deepcopy(shadowed), True) if fp32_grads else (plain, False)
    compiled = torch.compile(shadowed, backend="aot_eager", fullgraph=True)
    x = torch.randn(5, 24)
    want, want_grads = _output_and_grads(reference, x, use=use)
    got, got_grads = _output_and_grads(compiled, x, use=True)
    assert torch.equal(got, want)
    for g, w in zip(got_grads, want_grads):
        assert torch.equal(g, w)


def test_config_refuses_shadows_without_bf16():
    from opengem.train.config import load_config

    with pytest.raises(ValueError, match="weight_shadows holds bf16 copies for precision=bf16, got precision='fp32'"):
        load_config("gem-tiny", None, ["weight_shadows=true", "precision=fp32"])


def test_fp32_grads_keep_the_output_and_input_gradient_and_drop_the_weight_gradients_rounding():
    """The forward and the input's gradient are autocast's bit for bit; the weight and bias gradients are the fp32
    product and sum of the same bf16 operands, where autocast rounds them to bf16 first."""
    plain, shadowed = _pair(3)
    shadow_linear_weights(shadowed, fp32_grads=True)
    x = torch.randn(6, 5, 24, requires_grad=True)  # 3-d input: the GEMM runs on the flattened rows
    x_plain = x.detach().clone().requires_grad_()
    want, want_grads = _output_and_grads(plain, x_plain, use=False)
    got, got_grads = _output_and_grads(shadowed, x, use=True)
    assert torch.equal(got, want)
    assert x.grad.dtype == torch.float32 and torch.equal(x.grad, x_plain.grad)
    # the first layer's gradients from its own bf16 operands, in fp32 and unrounded
    first = shadowed[0]
    compute_x = x.detach().to(torch.bfloat16).reshape(-1, 24)
    with torch.autocast("cpu", dtype=torch.bfloat16), shadows_in_use():
        hidden = first(x.detach())
        out = shadowed[1:](hidden)
    grad_hidden = torch.autograd.grad(out.float().square().sum(), hidden)[0].reshape(-1, 32)
    torch.testing.assert_close(got_grads[0], grad_hidden.float().t() @ compute_x.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_grads[1], grad_hidden.float().sum(0), rtol=1e-6, atol=1e-6)
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=2**-7, atol=1e-5)  # within autocast's bf16 rounding of them
    assert not torch.equal(got_grads[0], want_grads[0])  # and not rounded as autocast's are


def test_fp32_grads_leave_the_bias_to_the_op_in_projected():
    torch.manual_seed(4)
    plain = nn.Linear(16, 12)
    shadowed = nn.Linear(16, 12)
    shadowed.load_state_dict(plain.state_dict())
    shadow_linear_weights(shadowed, fp32_grads=True)
    x = torch.randn(7, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, _ = projected(plain, x)
        with shadows_in_use():
            got, got_bias = projected(shadowed, x)
    assert torch.equal(got, want) and got_bias is shadowed.bias
    got.float().sum().backward()
    assert shadowed.bias.grad is None and shadowed.weight.grad.dtype == torch.float32
    ones = torch.ones(7, 12, dtype=torch.bfloat16)
    torch.testing.assert_close(shadowed.weight.grad, ones.float().t() @ x.bfloat16().float(), rtol=1e-6, atol=1e-6)


def test_config_refuses_fp32_grads_without_shadows():
    from opengem.train.config import load_config

    with pytest.raises(ValueError, match="fp32_weight_grads computes the weight-shadowed layers' gradients"):
        load_config("gem-tiny", None, ["weight_shadows=false", "fp32_weight_grads=true", "precision=bf16"])
    config = load_config("gem-tiny", None, ["weight_shadows=true", "fp32_weight_grads=true", "precision=bf16"])
    assert config.fp32_weight_grads and config.weight_shadows
    # weight_shadows left auto: the learner decides (on a GPU in one process; elsewhere it refuses by name)
    assert load_config("gem-tiny", None, ["fp32_weight_grads=true", "precision=bf16"]).weight_shadows is None


def test_fp32_product_on_cuda_is_one_fp32_output_gemm_that_traces():
    """The CUDA branch (no GPU needed: fake CUDA tensors): one ``aten.mm.dtype`` writing fp32, which fake tensors (so
    torch.compile) can trace."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from opengem.ops.fp32_gemm import fp32_product

    with FakeTensorMode():
        a = torch.empty(4096, 384, device="cuda", dtype=torch.bfloat16).t()  # transposed, as the weight gradient's
        b = torch.empty(4096, 256, device="cuda", dtype=torch.bfloat16)
        graph = make_fx(fp32_product)(a, b)
        out = fp32_product(a, b)
    assert [str(n.target) for n in graph.graph.nodes if n.op == "call_function"] == ["aten.mm.dtype"]
    assert out.dtype == torch.float32 and out.shape == (384, 256) and out.is_cuda


def test_bad_shadow_settings_are_refused_by_name():
    """Session 70's audit: int8 shadows had truncated every weight, "no" had been taken as True."""
    for dtype in (torch.int8, torch.float32, "bf16"):
        with pytest.raises(ValueError, match=r"shadow_linear_weights: dtype must be one of \(torch.bfloat16"):
            shadow_linear_weights(nn.Linear(2, 2), dtype=dtype)
    with pytest.raises(ValueError, match="shadow_linear_weights: shadow_grads must be a bool, got 'no'"):
        shadow_linear_weights(nn.Linear(2, 2), shadow_grads="no")
