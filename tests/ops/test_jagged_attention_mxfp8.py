"""MXFP8 JFA (``precision="mxfp8"``): the MX operands against the MX reference, the emulation against fp32, the
kernels (interpreter) against the emulation, and the straight-through backward."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from opengem.ops.jagged_attention import jagged_attention, jagged_attention_packed
from opengem.ops.reference.attention import jagged_attention as reference
from opengem.ops.reference.attention_fp8 import rotate, rotation, rotation_size
from opengem.ops.reference.attention_mxfp8 import (
    mx_along_head_dim,
    mx_along_keys,
    mx_along_sequence,
    sequence_blocks,
    straight_through_operands,
)
from opengem.ops.reference.mx import mx_dequantize_reference, mx_quantize_reference
from opengem.ops.triton.jagged_attention_mxfp8 import mx_values
from tests.ops.test_jagged_attention import LENGTHS, MASKS, _inputs, _mask_kwargs, _offsets, _rel, poisoned  # noqa: F401


def test_head_dim_blocks_are_the_mx_reference_and_exact_in_bf16():
    x = torch.randn(50, 2, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 64)
    got = mx_along_head_dim(x)
    data, scales = mx_quantize_reference(x.reshape(-1, 64), (32,), "e4m3", "rceil")
    assert torch.equal(got, mx_dequantize_reference(data, scales, (32,)).reshape(x.shape))
    assert torch.equal(got.bfloat16().float(), got)  # 4 significant bits: the kernels' 16-bit operands are exact
    assert 0 < _rel(got, x) < 0.05


def test_sequence_blocks_start_at_each_sample_and_never_cross_samples():
    """Blocks of 32 tokens from each sample's first token: an outlier at a sample's token 35 coarsens its tokens
    32..39 only; the other sample and the first block are as when quantized alone."""
    lengths = [40, 0, 33]
    offsets = _offsets(lengths)
    block, count = sequence_blocks(offsets, 73)
    assert count == 2 + 0 + 2 and block.tolist() == [0] * 32 + [1] * 8 + [2] * 32 + [3]
    x = torch.randn(73, 1, 4, generator=torch.Generator().manual_seed(1))
    plain = mx_along_sequence(x, offsets)
    x[35, 0, 0] = 1e4
    spiked = mx_along_sequence(x, offsets)
    changed = (spiked != plain).any(-1).any(-1).nonzero().flatten().tolist()
    assert set(changed) <= set(range(32, 40)) and 35 in changed
    alone = mx_along_sequence(x[40:], _offsets([33]))
    assert torch.equal(spiked[40:], alone)
    x[50, 0, 1] = float("nan")  # a NaN makes its own block (tokens 40..71, channel 1) NaN, nothing else
    poisoned_block = mx_along_sequence(x, offsets)
    assert poisoned_block[40:72, 0, 1].isnan().all() and not poisoned_block[72:, 0, 1].isnan().any()
    assert not poisoned_block[:, 0, 0].isnan().any()


@pytest.mark.parametrize("dtype, head_dim", [(torch.float32, 64), (torch.float16, 64), (torch.float32, 16)])
def test_operand_pass_gives_the_emulations_bits(dtype, head_dim):
    """The Triton pass (``mx_values``: one launch per operand) against the emulation's ``straight_through_operands``:
    the same bits for fp32 inputs (rotated in fp64, rounded once) and 16-bit ones (exact products, fp32 sums of a
    few binades), on strided views (packed QKV), GQA, samples of 0, 1, 33 and 70 tokens, a NaN and an inf that
    poison their own rows / MX blocks only, and no tokens at all; D 16 as one zero-padded block of 32."""
    lengths = [70, 0, 1, 33]
    offsets = _offsets(lengths)
    gen = torch.Generator().manual_seed(21)
    qkv = (torch.randn(104, 3, 2, head_dim, generator=gen) * torch.logspace(-2, 2, head_dim)).to(dtype)
    q, k, v = qkv[:, 0], qkv[:, 1, :1], qkv[:, 2, :1]  # strided views; K and V one head (GQA)
    q[5, 1, head_dim // 2] = float("nan")
    v[80, 0, 3] = float("inf")
    got = mx_values(q, k, v, offsets)
    want = straight_through_operands(q, k, v, offsets)
    for g, w in zip(got, want):
        assert g.dtype == dtype and g.is_contiguous()
        assert torch.equal(g.isnan(), w.isnan()) and torch.equal(g.nan_to_num(), w.to(dtype).nan_to_num())
    assert got[0].isnan().sum() == head_dim and got[0][5, 1].isnan().all()  # the rotation spreads Q's NaN: its row
    assert got[2].isnan().sum() == 32 and got[2][71:103, 0, 3].isnan().all()  # V's: one channel of 32 tokens
    empty = torch.zeros(0, 2, head_dim, dtype=dtype)
    assert all(x.shape == (0, 2, head_dim) for x in mx_values(empty, empty, empty, _offsets([0, 0])))


def test_p_quantization_commutes_with_powers_of_two():
    """Why the kernel may quantize P per key tile against its running maximum: an integer maximum makes each
    rescale a power of two, and MX quantization commutes with those (the blocks' exponents move, the elements
    stay), so every tiling gives the emulation's P."""
    p = torch.rand(6, 96, generator=torch.Generator().manual_seed(2)) ** 8  # spread over many binades
    for k in (-1, -7, -30):
        assert torch.equal(mx_along_keys(p * 2.0**k), mx_along_keys(p) * 2.0**k)
    assert not torch.equal(mx_along_keys(p * 0.75), mx_along_keys(p) * 0.75)  # not for other factors


def _forward(lengths, heads, kv_heads, head_dim, backend, dtype=torch.float32, seed=0, **kwargs):
    q, k, v, _ = _inputs(lengths, heads=heads, kv_heads=kv_heads, head_dim=head_dim, seed=seed, dtype=dtype)
    out = jagged_attention(q, k, v, _offsets(lengths), max(lengths), backend=backend, precision="mxfp8", **kwargs)
    return out, (q, k, v)


@pytest.mark.parametrize("mask", list(MASKS))
def test_kernel_matches_emulation(poisoned, mask):  # noqa: F811 (the imported fixture)
    """The forward kernel (key tiles of 32, P quantized inside its loop) against the emulation (P quantized once
    per row): equal to fp32 rounding, GQA and every mask option included."""
    kwargs = _mask_kwargs(MASKS[mask])
    got, _ = _forward(LENGTHS, 2, 1, 32, "triton", **kwargs)
    want, _ = _forward(LENGTHS, 2, 1, 32, "reference", **kwargs)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() < 1e-5


def test_kernel_matches_emulation_at_head_dim_16():
    """D 16, the Triton path's smallest: Q and K quantize as one zero-padded block of 32 along D, as the emulation."""
    got, _ = _forward(LENGTHS, 2, 1, 16, "triton")
    want, _ = _forward(LENGTHS, 2, 1, 16, "reference")
    assert (got - want).abs().max() < 1e-5


def test_kernel_matches_emulation_in_fp16():
    got, _ = _forward([70, 3, 41], 2, 2, 64, "triton", dtype=torch.float16, causal=False)
    want, _ = _forward([70, 3, 41], 2, 2, 64, "reference", dtype=torch.float16, causal=False)
    assert got.dtype == torch.float16 and _rel(got.float(), want.float()) < 2e-3


def test_emulation_error_against_fp32_and_fp8s():
    """MX-E4M3 Q, K, V and P: ~5% relative error on N(0, 1) inputs, as the FP8 recipe (one scale per 128 rows);
    on outlier-channel Q and K the rotation keeps it there (without it, MX along D measured 0.17 at D = 128)."""
    lengths = [200, 120]
    q, k, v, _ = _inputs(lengths, heads=2, kv_heads=2, head_dim=128, seed=11)
    offsets = _offsets(lengths)
    for outliers in (False, True):
        if outliers:
            channels = torch.randperm(128, generator=torch.Generator().manual_seed(11))[:4]
            for x in (q, k, v):
                x[..., channels] *= 10
        want = reference(q, k, v, offsets, 200)
        err = _rel(jagged_attention(q, k, v, offsets, 200, backend="reference", precision="mxfp8"), want)
        fp8 = _rel(jagged_attention(q, k, v, offsets, 200, backend="reference", precision="fp8"), want)
        assert 0.02 < err < 0.08 and err < 1.5 * fp8, (outliers, err, fp8)


def _straight_through(x: torch.Tensor, offsets: torch.Tensor, rotated: bool) -> torch.Tensor:
    """``x`` (rotated) forward as its MX values, backward as the identity (times ``R`` when rotated): an autograd
    construction independent of the backward under test."""
    head_dim = x.shape[-1]
    n = rotation_size(head_dim)
    if rotated:
        y = (x.reshape(*x.shape[:-1], head_dim // n, n) @ rotation(n)).reshape(x.shape)
        values = mx_along_head_dim(rotate(x.detach()))
    else:
        y, values = x, mx_along_sequence(x.detach(), offsets)
    return y + (values - y).detach()


@pytest.mark.parametrize("mask", ["causal", "all_options"])
def test_reference_backward_is_the_straight_through_gradient(mask):
    q, k, v, dout = _inputs(LENGTHS, heads=2, kv_heads=1, head_dim=64, seed=3)
    offsets, kwargs = _offsets(LENGTHS), _mask_kwargs(MASKS[mask])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = jagged_attention(*leaves, offsets, 37, backend="reference", precision="mxfp8", **kwargs)
    got = torch.autograd.grad(out, leaves, dout)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    st = [_straight_through(x, offsets, rotated) for x, rotated in zip(leaves, (True, True, False))]
    want = torch.autograd.grad(reference(*st, offsets, 37, scale=64**-0.5 / rotation_size(64), **kwargs), leaves, dout)
    for g, w in zip(got, want):
        assert _rel(g, w) < 1e-5


def test_packed_op_equals_the_unbound_one(poisoned):  # noqa: F811 (the imported fixture)
    q, k, v, dout = _inputs(LENGTHS, heads=2, kv_heads=2, head_dim=32, seed=5)
    offsets = _offsets(LENGTHS)
    qkv = torch.stack([q, k, v], 1).requires_grad_()
    packed = jagged_attention_packed(qkv, offsets, 37, backend="triton", precision="mxfp8")
    (dqkv,) = torch.autograd.grad(packed, qkv, dout)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = jagged_attention(*leaves, offsets, 37, backend="triton", precision="mxfp8")
    grads = torch.autograd.grad(out, leaves, dout)
    assert torch.equal(packed, out)
    for i, g in enumerate(grads):
        assert torch.equal(dqkv[:, i], g)


def test_unknown_precision_is_refused_with_the_choices():
    q, k, v, _ = _inputs([4], heads=1, kv_heads=1, head_dim=32)
    with pytest.raises(ValueError, match=r"precision must be one of \('bf16', 'fp8', 'mxfp8'\), got 'mxfp4'"):
        jagged_attention(q, k, v, _offsets([4]), 4, precision="mxfp4")



def test_torch_compile_fullgraph_with_gradients_cpu():
    """The MXFP8 op under ``torch.compile(fullgraph=True)``: no graph break, the eager output and gradients."""
    lengths = [6, 2]
    q, k, v, dout = _inputs(lengths, heads=2, kv_heads=1, head_dim=32)
    offsets = _offsets(lengths)

    def attend(q, k, v):
        return jagged_attention(q, k, v, offsets, 6, precision="mxfp8")

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    results = {}
    for name, fn in (("eager", attend), ("compiled", compiled)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        results[name] = (out, *torch.autograd.grad(out, leaves, dout))
    for got, want in zip(results["compiled"], results["eager"]):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_empty_batches(backend):
    """No tokens (no samples, or empty ones): empty outputs and gradients, JFA and GDPA alike."""
    from opengem.ops.gdpa import gdpa

    for lengths in ([], [0, 0]):
        offsets = _offsets(lengths)
        q = torch.zeros(0, 2, 32, requires_grad=True)
        out = jagged_attention(q, q, q, offsets, 0, backend=backend, precision="mxfp8")
        pooled = gdpa(q, q, q, offsets, offsets, 0, 0, backend=backend, precision="mxfp8")
        (grad,) = torch.autograd.grad(out.sum() + pooled.sum(), q)
        assert out.shape == pooled.shape == grad.shape == (0, 2, 32)
