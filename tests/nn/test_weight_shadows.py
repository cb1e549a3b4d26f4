"""bf16 weight shadows (opengem.nn.weight_shadows): the same numbers as autocast's per-use casts, bit for bit."""

import contextlib

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


def test_compiled_block_reads_the_shadows_without_a_graph_break():
    plain, shadowed = _pair(2)
    shadow_linear_weights(shadowed)
    compiled = torch.compile(shadowed, backend="aot_eager", fullgraph=True)
    x = torch.randn(5, 24)
    want, want_grads = _output_and_grads(plain, x, use=False)
    got, got_grads = _output_and_grads(compiled, x, use=True)
    assert torch.equal(got, want)
    for g, w in zip(got_grads, want_grads):
        assert torch.equal(g, w)


def test_config_refuses_shadows_without_bf16():
    from opengem.train.config import load_config

    with pytest.raises(ValueError, match="weight_shadows holds bf16 copies for precision=bf16, got precision='fp32'"):
        load_config("gem-tiny", None, ["weight_shadows=true", "precision=fp32"])
