"""qkv_attention: the fused QKV projection + FP8 attention (Triton interpreter) against the unfused path."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from opengem.ops.jagged_attention import attention_pairs, jagged_attention_packed
from opengem.ops.qkv_attention import qkv_attention
from opengem.ops.triton import jagged_attention_fp8 as fp8_kernels
from tests.ops.test_jagged_attention import LENGTHS, MASKS, _mask_kwargs, _offsets, _rel

HEADS, HEAD_DIM, MODEL_DIM = 2, 32, 48


def _layer(seed: int = 0, bias: bool = True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(LENGTHS), MODEL_DIM, generator=gen)
    weight = torch.randn(3 * HEADS * HEAD_DIM, MODEL_DIM, generator=gen) / MODEL_DIM**0.5
    b = torch.randn(3 * HEADS * HEAD_DIM, generator=gen) if bias else None
    dout = torch.randn(sum(LENGTHS), HEADS, HEAD_DIM, generator=gen)
    return x, weight, b, dout


def _grads(fn, x, weight, bias, dout):
    leaves = [t.clone().requires_grad_() for t in (x, weight) + ((bias,) if bias is not None else ())]
    out = fn(*leaves)
    return out.detach(), torch.autograd.grad(out, leaves, dout)


@pytest.mark.parametrize("mask", ["causal", "full_window", "all_options"])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_fp8_projection_matches_the_unfused_fp8_path(mask, bias):
    """The fused kernel's output is the FP8 attention of its own projection (exactly: the same quantized blocks),
    that projection is ``F.linear``'s to fp32 rounding, and the gradients (JFA's backward from the FP8 forward,
    then the projection's) match the unfused FP8 path's."""
    x, weight, b, dout = _layer(bias=bias)
    offsets, max_len, kwargs = _offsets(LENGTHS), max(LENGTHS), _mask_kwargs(MASKS[mask])

    def fused(x, w, *bias):
        return qkv_attention(x, w, bias[0] if bias else None, offsets, max_len, num_heads=HEADS, backend="triton",
                             precision="fp8", fuse_projection=True, **kwargs)  # fmt: skip

    def unfused(x, w, *bias):
        qkv = torch.nn.functional.linear(x, w, bias[0] if bias else None).view(-1, 3, HEADS, HEAD_DIM)
        return jagged_attention_packed(qkv, offsets, max_len, backend="triton", precision="fp8", **kwargs)

    out, grads = _grads(fused, x, weight, b, dout)
    want_out, want_grads = _grads(unfused, x, weight, b, dout)
    assert out.shape == (sum(LENGTHS), HEADS, HEAD_DIM) and torch.isfinite(out).all()
    # a projected element an fp32 ulp from an E4M3 midpoint may round the other way: FP8-sized differences at most
    assert _rel(out, want_out) < 1e-2
    for got, want in zip(grads, want_grads):
        assert _rel(got, want) < 1e-2


def test_fused_output_is_attention_of_its_own_quantized_projection():
    from opengem.ops.jagged_attention import _problem
    from opengem.ops.triton.qkv_projection_fp8 import projected_attention_forward

    x, weight, b, _ = _layer(seed=1)
    offsets = _offsets(LENGTHS)
    _, pb = _problem(x, offsets, None, max(LENGTHS), True, 0, -1, HEAD_DIM**-0.5)
    out, lse, qkv = projected_attention_forward(x, weight, b, HEADS, pb)
    want_out, want_lse = torch.empty_like(out), torch.empty_like(lse)
    fp8_kernels.attend(fp8_kernels.quantize_qkv(*qkv.unbind(1), pb), want_out, want_lse, HEADS, pb)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_bf16_path_is_linear_then_packed_attention():
    x, weight, b, dout = _layer(seed=2)
    offsets = _offsets(LENGTHS)
    out, grads = _grads(lambda x, w, b: qkv_attention(x, w, b, offsets, 37, num_heads=HEADS, window=4), x, weight, b,
                        dout)  # fmt: skip
    want_out, want_grads = _grads(
        lambda x, w, b: jagged_attention_packed(torch.nn.functional.linear(x, w, b).view(-1, 3, HEADS, HEAD_DIM),
                                                offsets, 37, window=4), x, weight, b, dout)  # fmt: skip
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_bias_gradient_comes_from_the_attention_backward(monkeypatch, backend):
    """The projection adds the bias without a gradient of its own; the packed op returns it (dqkv's column sums):
    on the bf16 Triton path from the backward kernels' tiles (``backward_with_column_sums`` runs), elsewhere from
    dqkv. x's and W's gradients are the unfused path's bit for bit, the bias's to fp32 summation order. Also
    under ``torch.compile(fullgraph=True)``, and without a bias gradient when the bias needs none."""
    from opengem.ops.triton import jagged_attention as kernels

    calls = []
    original = kernels.backward_with_column_sums
    monkeypatch.setattr(kernels, "backward_with_column_sums", lambda *a, **k: (calls.append(1), original(*a, **k))[1])
    x, weight, b, dout = _layer(seed=6)
    offsets, kwargs = _offsets(LENGTHS), _mask_kwargs(MASKS["full_all_options"])

    def fused(x, w, b):
        return qkv_attention(x, w, b, offsets, 37, num_heads=HEADS, backend=backend, **kwargs)

    def unfused(x, w, b):
        qkv = torch.nn.functional.linear(x, w, b).view(-1, 3, HEADS, HEAD_DIM)
        return jagged_attention_packed(qkv, offsets, 37, backend=backend, **kwargs)

    want_out, (want_dx, want_dw, want_db) = _grads(unfused, x, weight, b, dout)
    for fn in (fused, torch.compile(fused, fullgraph=True, backend="aot_eager")):
        out, (dx, dw, db) = _grads(fn, x, weight, b, dout)
        torch.testing.assert_close(out, want_out, rtol=0, atol=0)
        torch.testing.assert_close(dx, want_dx, rtol=0, atol=0)
        torch.testing.assert_close(dw, want_dw, rtol=0, atol=0)
        torch.testing.assert_close(db, want_db, rtol=1e-5, atol=1e-5)
    assert len(calls) == (2 if backend == "triton" else 0)

    leaves = [x.clone().requires_grad_(), weight.clone().requires_grad_()]
    (dx,) = torch.autograd.grad(fused(leaves[0], leaves[1], b), leaves[0], dout)  # b needs no gradient
    torch.testing.assert_close(dx, want_dx, rtol=0, atol=0)
    assert len(calls) == (2 if backend == "triton" else 0)


def test_fused_flops_count_the_projection_and_the_attention():
    x, weight, b, dout = _layer(seed=3)
    offsets = _offsets(LENGTHS)
    leaves = [t.clone().requires_grad_() for t in (x, weight, b)]
    with FlopCounterMode(display=False) as counter:
        qkv_attention(*leaves, offsets, 37, num_heads=HEADS, backend="triton", precision="fp8",
                      fuse_projection=True).backward(dout)  # fmt: skip
    projection = 2 * x.shape[0] * MODEL_DIM * weight.shape[0]
    attention = 4 * HEADS * HEAD_DIM * attention_pairs(offsets, causal=True)
    assert counter.get_total_flops() == 3 * projection + 3.5 * attention  # backward: dx and dW GEMMs, 2.5x attention


@pytest.mark.parametrize(
    "change, message",
    [
        ({"x": torch.zeros(2, 3, 48)}, r"x \[T, d\] and weight \[3 \* num_heads \* D, d\] expected"),
        ({"weight": torch.zeros(190, 48)}, "got x .* and weight \\[190, 48\\]"),
        ({"bias": torch.zeros(5)}, r"bias must have shape \[192\], got \[5\]"),
        ({"max_len": 3}, "max_len = 3 is shorter"),
        ({"precision": "bf16"}, "fuse_projection fuses FP8 attention's quantization: it needs precision='fp8', got 'bf16'"),
    ],
)
def test_bad_inputs_raise(change, message):
    x, weight, b, _ = _layer()
    args = {"x": x, "weight": weight, "bias": b, "max_len": 37, "precision": "fp8"} | change
    with pytest.raises(ValueError, match=message):
        qkv_attention(args["x"], args["weight"], args["bias"], _offsets(LENGTHS), args["max_len"], num_heads=HEADS,
                      backend="triton", precision=args["precision"], fuse_projection=True)  # fmt: skip


def test_unfused_fp8_is_the_default(monkeypatch):
    """Without fuse_projection, FP8 qkv_attention (and the GEM self-attention layer in fp8) is cuBLAS's projection
    then the packed FP8 op, bit for bit: the fused kernel measured slower at these widths (module docstring)."""
    from opengem.jagged import Jagged
    from opengem.nn.gem_layers import SequenceSelfAttention
    from opengem.ops import qkv_attention as module

    calls = []
    monkeypatch.setattr(module, "_qkv_attention_fp8_fwd", lambda *args: calls.append(1))
    x, weight, b, dout = _layer(seed=5)
    offsets = _offsets(LENGTHS)
    out, grads = _grads(lambda x, w, b: qkv_attention(x, w, b, offsets, 37, num_heads=HEADS, backend="triton",
                                                      precision="fp8"), x, weight, b, dout)  # fmt: skip
    want_out, want_grads = _grads(
        lambda x, w, b: jagged_attention_packed(torch.nn.functional.linear(x, w, b).view(-1, 3, HEADS, HEAD_DIM),
                                                offsets, 37, backend="triton", precision="fp8"), x, weight, b, dout)  # fmt: skip
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)

    torch.manual_seed(0)
    layer = SequenceSelfAttention(64, 2, "jfa", window=8, block_size=16, contextual_len=2, ffn_mult=0,
                                  time_scale=1.0, backend="triton", precision="fp8")  # fmt: skip
    h = torch.randn(sum(LENGTHS), 64)
    got = layer(Jagged(h, offsets, offsets.clone(), max(LENGTHS)), torch.zeros(sum(LENGTHS))).values
    qkv = layer.qkv(layer.attn_norm(h)).view(-1, 3, 2, 32)
    attended = jagged_attention_packed(qkv, offsets, max(LENGTHS), causal=False, contextual_len=2, window=8,
                                       backend="triton", precision="fp8")  # fmt: skip
    torch.testing.assert_close(got, h + layer.out(attended.reshape(h.shape[0], -1)), rtol=0, atol=0)
    assert calls == []


def test_fused_path_compiles_fullgraph():
    x, weight, b, dout = _layer(seed=4)
    offsets = _offsets(LENGTHS)

    def attend(x, w, b):
        return qkv_attention(x, w, b, offsets, 37, num_heads=HEADS, window=6, backend="triton", precision="fp8",
                             fuse_projection=True)  # fmt: skip

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    out, grads = _grads(compiled, x, weight, b, dout)
    want_out, want_grads = _grads(attend, x, weight, b, dout)
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want)
