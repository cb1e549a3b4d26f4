"""GEM's attention layers take their projections' bias gradients from the attention ops (``projection_bias``): every
parameter's gradient equals the layer's with plain ``nn.Linear`` bias gradients, on the Triton kernels (interpreter)
and the reference; a low-precision projection keeps its own."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import copy  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from opengem.jagged import Jagged  # noqa: E402
from opengem.nn import gem_layers  # noqa: E402
from opengem.nn.gem_layers import PersonalizedFFN, SeedPooling, SequenceSelfAttention  # noqa: E402

LENGTHS = [19, 1, 0, 33, 7]
DIM, HEADS = 64, 2


def _sequence(gen: torch.Generator) -> Jagged:
    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return Jagged(torch.randn(sum(LENGTHS), DIM, generator=gen), offsets, offsets.clone(), max(LENGTHS))


def _layer_and_call(kind: str, backend: str, gen: torch.Generator, precision: str = "bf16"):
    sequence = _sequence(gen)
    if kind == "pffn":
        layer = PersonalizedFFN(DIM, HEADS, backend=backend)
        context = torch.randn(len(LENGTHS), 4, DIM, generator=gen)
        return layer, lambda m: m(sequence, context).values
    if kind == "pooling":
        return SeedPooling(DIM, HEADS, num_seeds=3, backend=backend), lambda m: m(sequence)
    layer = SequenceSelfAttention(DIM, HEADS, "jfa", window=8, block_size=16, contextual_len=2, ffn_mult=0,
                                  time_scale=1.0, backend=backend, precision=precision)  # fmt: skip
    return layer, lambda m: m(sequence, torch.zeros(sum(LENGTHS))).values


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("kind", ["pffn", "pooling", "self_attention", "self_attention_fp8"])
def test_bias_gradients_from_the_attention_ops_equal_linears(monkeypatch, kind, backend):
    """(FP8 self-attention: the op's backward sums dqkv itself, the kernels' sums being the bf16 path's.)"""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    fp8 = kind.endswith("fp8")
    layer, call = _layer_and_call(kind.removesuffix("_fp8"), backend, gen, "fp8" if fp8 else "bf16")
    plain = copy.deepcopy(layer)
    handed = []
    original = gem_layers.projected
    monkeypatch.setattr(gem_layers, "projected", lambda linear, x: (lambda r: (handed.append(r[1]), r)[1])(
        original(linear, x)))  # fmt: skip
    out = call(layer)
    grad = torch.randn(out.shape, generator=gen)
    out.backward(grad)
    assert any(bias is not None for bias in handed)  # the layer handed a projection bias to its attention op
    monkeypatch.setattr(gem_layers, "projected", lambda linear, x: (linear(x), None))  # the plain route
    want = call(plain)
    want.backward(grad)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    for (name, p), (_, q) in zip(layer.named_parameters(), plain.named_parameters()):
        exact = not name.endswith("bias") or not any(p is b for b in handed)
        torch.testing.assert_close(p.grad, q.grad, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-5, msg=name)


def test_a_projection_that_is_not_a_plain_linear_keeps_its_own_bias_gradient():
    class Scaled(nn.Linear):  # stands for opengem.nn.low_precision.LowPrecisionLinear
        pass

    linear = Scaled(4, 6)
    out, bias = gem_layers.projected(linear, torch.randn(3, 4))
    assert bias is None and out.requires_grad
    plain = nn.Linear(4, 6)
    out, bias = gem_layers.projected(plain, torch.randn(3, 4))
    assert bias is plain.bias
    out.sum().backward()
    assert plain.bias.grad is None and plain.weight.grad is not None  # the op, not the projection, gives it
    assert gem_layers.projected(nn.Linear(4, 6, bias=False), torch.randn(3, 4))[1] is None
