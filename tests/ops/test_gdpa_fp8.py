"""FP8 GDPA (``gdpa(..., precision="fp8")``, self- and cross-attention): the Triton kernel (interpreter) against
the exact emulation, the emulation against fp32, the straight-through backward, and the errors. The tests that
hold for any low precision run MXFP8 GDPA too (its own: ``test_gdpa_mxfp8``).

Kernel and emulation share the quantize pass and quantize P alike (one scale per row of each key block), so they
differ by fp32 rounding only (sums in another order), unless an element lands within an ulp of an E4M3 rounding
midpoint; on these seeds they agree to ~1e-7.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from opengem.ops.gdpa import gdpa, gdpa_packed_kv
from opengem.ops.reference.attention_fp8 import rotation_size
from opengem.ops.reference.gdpa import gdpa as reference
from opengem.ops.reference.gdpa_fp8 import gdpa_fp8, quantize_rows
from tests.ops.test_jagged_attention import LENGTHS, MASKS, _inputs, _mask_kwargs, _offsets, _rel, poisoned  # noqa: F401
from tests.ops.test_jagged_attention_fp8 import _straight_through
from tests.ops.test_jagged_attention_mxfp8 import _straight_through as _mx_straight_through

OPTIONS = dict(pre_scale=0.25, post_scale=0.5, norm="max_len")
ACTIVATIONS = {"fast_gelu": dict(activation="fast_gelu"), "per_head": dict(head_activations=["silu", "gelu_tanh"])}


def _gdpa(q, k, v, offsets, backend, precision="fp8", **kwargs):
    return gdpa(q, k, v, offsets, offsets, 37, 37, backend=backend, precision=precision, **OPTIONS, **kwargs)


def _straight_through_operands(precision: str, leaves: list[torch.Tensor], offsets: torch.Tensor) -> list:
    """The operands each precision multiplies (rotated Q and K, and V, quantized and scaled back), forward as
    those and backward as the identity (times ``R``): independent of the backwards under test."""
    if precision == "fp8":
        return [_straight_through(x, offsets, 32, rotated) for x, rotated in zip(leaves, (True, True, False))]
    return [_mx_straight_through(x, offsets, rotated) for x, rotated in zip(leaves, (True, True, False))]


@pytest.mark.parametrize("precision", ["fp8", "mxfp8"])
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("mask", ["full", "causal", "all_options", "full_all_options"])
def test_kernel_matches_emulation(poisoned, mask, activation, precision):  # noqa: F811 (the imported fixture)
    """MXFP8: key tiles of 32 (looping and resident K/V) quantize P in exactly the emulation's blocks."""
    q, k, v, _ = _inputs(LENGTHS, heads=2, kv_heads=1, head_dim=32, seed=1)
    offsets = _offsets(LENGTHS)
    kwargs = {**_mask_kwargs(MASKS[mask]), **ACTIVATIONS[activation]}
    out = _gdpa(q, k, v, offsets, "triton", precision, **kwargs)
    emulated = _gdpa(q, k, v, offsets, "reference", precision, **kwargs)
    assert torch.isfinite(out).all() and _rel(out, emulated) < 1e-5


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_cross_attention_kernel_matches_emulation_and_backward(poisoned, kv_heads):  # noqa: F811 (the fixture)
    """Long jagged Q against short K/V blocked by their own offsets (K/V lengths 0, 1, a partial block and two
    blocks); the emulation's per-sample cross path against its self-attention path on equal offsets; the
    straight-through gradients of kernel and reference."""
    q_lengths, k_lengths = [37, 5, 20, 0, 9], [3, 0, 1, 40, 33]
    q, _, _, dout = _inputs(q_lengths, heads=2, kv_heads=kv_heads, head_dim=32, seed=7)
    _, k, v, _ = _inputs(k_lengths, heads=2, kv_heads=kv_heads, head_dim=32, seed=8)
    q_offsets, k_offsets = _offsets(q_lengths), _offsets(k_lengths)
    grads, outs = {}, {}
    for backend in ("triton", "reference"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = gdpa(*leaves, q_offsets, k_offsets, 37, 40, backend=backend, precision="fp8", activation="silu",
                   pre_scale=0.3, norm="max_len")
        grads[backend] = torch.autograd.grad(out, leaves, dout)
        outs[backend] = out.detach()
    assert torch.isfinite(outs["triton"]).all() and _rel(outs["triton"], outs["reference"]) < 1e-5
    assert torch.equal(outs["triton"][37:42], outs["triton"][37:42] * 0)  # sample 1 has no keys
    for got, want in zip(grads["triton"], grads["reference"]):
        assert torch.isfinite(got).all() and _rel(got, want) < 1e-5
    same = _offsets([10, 30])
    qs, ks, vs, _ = _inputs([10, 30], heads=2, kv_heads=kv_heads, head_dim=32, seed=9)
    options = dict(block=32, head_activations=["silu", "relu2"], pre_scale=0.3)
    assert _rel(gdpa_fp8(qs, ks, vs, same, same.clone(), **options), gdpa_fp8(qs, ks, vs, same, **options)) < 1e-6


def test_emulation_is_the_documented_recipe():
    """Against a direct transcription of the module docstring for one sample of one block (rotation, block scales,
    P quantized per row) and against fp32: ~3-6% relative error, like the FP8 JFA's."""
    lengths = [30]
    q, k, v, _ = _inputs(lengths, heads=1, kv_heads=1, head_dim=32, seed=2)
    offsets = _offsets(lengths)
    got = gdpa_fp8(q, k, v, offsets, block=32, head_activations=["silu"], pre_scale=0.5, out_scale=0.1)
    qs, ks, vs = (_straight_through(x, offsets, 32, rotated) for x, rotated in zip((q, k, v), (True, True, False)))
    p = torch.nn.functional.silu((qs[:, 0] @ ks[:, 0].T) * 0.5 / rotation_size(32))
    p8, p_scale = quantize_rows(p)
    want = 0.1 * (p8 * p_scale) @ vs[:, 0]
    assert _rel(got[:, 0], want) < 1e-6
    fp32 = reference(q, k, v, offsets, offsets, head_activations=["silu"], pre_scale=0.5, out_scale=0.1)
    assert 0.01 < _rel(got, fp32) < 0.1


def test_row_scales_keep_small_rows_exact_in_relative_terms():
    """Each row of P takes its own scale: a row 1e-6 times another keeps E4M3's relative precision."""
    p = torch.tensor([[1.0, -0.3, 0.7], [1e-6, -3e-7, 7e-7]])
    p8, scale = quantize_rows(p)
    assert torch.equal(p8[0], p8[1]) and scale[1, 0] == pytest.approx(1e-6 / 448)
    assert _rel(p8 * scale, p) < 2e-2


@pytest.mark.parametrize("precision", ["fp8", "mxfp8"])
@pytest.mark.parametrize("mask", ["causal", "all_options"])
def test_reference_backward_is_the_straight_through_gradient(mask, precision):
    """The op's reference backward: autograd of fp32 GDPA over the straight-through operands (pre_scale / n),
    GQA included, dQ and dK rotated back."""
    q, k, v, dout = _inputs(LENGTHS, heads=2, kv_heads=1, head_dim=64, seed=3)
    offsets, kwargs = _offsets(LENGTHS), _mask_kwargs(MASKS[mask])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = _gdpa(*leaves, offsets, "reference", precision, activation="silu", **kwargs)
    got = torch.autograd.grad(out, leaves, dout)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    st = _straight_through_operands(precision, leaves, offsets)
    want_out = gdpa(*st, offsets, offsets, 37, 37, backend="reference", activation="silu",
                    pre_scale=OPTIONS["pre_scale"] / rotation_size(64), post_scale=0.5, norm="max_len", **kwargs)
    want = torch.autograd.grad(want_out, leaves, dout)
    for g, w in zip(got, want):
        assert _rel(g, w) < 1e-5


@pytest.mark.parametrize("precision", ["fp8", "mxfp8"])
@pytest.mark.parametrize("mask", ["full", "all_options"])
def test_triton_backward_is_the_reference_one(poisoned, mask, precision):  # noqa: F811 (the imported fixture)
    """Both are GDPA's exact gradient over the same straight-through operands (no log-sum-exp in GDPA), so they
    agree to fp32 rounding; a missing 1 / n or rotation back would show as O(1)."""
    q, k, v, dout = _inputs(LENGTHS, heads=2, kv_heads=1, head_dim=32, seed=4)
    offsets, kwargs = _offsets(LENGTHS), _mask_kwargs(MASKS[mask])
    grads = {}
    for backend in ("triton", "reference"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = _gdpa(*leaves, offsets, backend, precision, activation="fast_gelu", **kwargs)
        grads[backend] = torch.autograd.grad(out, leaves, dout)
    for got, want in zip(grads["triton"], grads["reference"]):
        assert torch.isfinite(got).all() and _rel(got, want) < 1e-5


@pytest.mark.parametrize("precision", ["fp8", "mxfp8"])
def test_packed_kv_gradient_equals_the_unbound_one(poisoned, precision):  # noqa: F811 (the imported fixture)
    q, k, v, dout = _inputs(LENGTHS, heads=2, kv_heads=2, head_dim=32, seed=6)
    offsets = _offsets(LENGTHS)
    kv = torch.stack([k, v], 1).requires_grad_()
    q_leaf = q.clone().requires_grad_()
    out = gdpa_packed_kv(q_leaf, kv, offsets, offsets, 37, 37, backend="triton", precision=precision, causal=True)
    dq, dkv = torch.autograd.grad(out, (q_leaf, kv), dout)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out_unbound = gdpa(*leaves, offsets, offsets, 37, 37, backend="triton", precision=precision, causal=True)
    grads = torch.autograd.grad(out_unbound, leaves, dout)
    assert torch.equal(out, out_unbound) and torch.equal(dq, grads[0]) and torch.equal(dkv, torch.stack(grads[1:], 1))


def test_errors_and_flops():
    lengths = [5, 3]
    q, k, v, _ = _inputs(lengths, heads=1, kv_heads=1, head_dim=16)
    offsets = _offsets(lengths)
    with pytest.raises(ValueError, match="precision must be one of"):
        gdpa(q, k, v, offsets, offsets, 5, 5, precision="fp4")
    with pytest.raises(ValueError, match=r"needs head_dim in \(32, 64, 128, 256\), got 16"):
        gdpa(q, k, v, offsets, offsets, 5, 5, backend="triton", precision="fp8")
    with pytest.raises(ValueError, match="not broadcast_q"):
        gdpa(q[:2], k, v, None, offsets, 2, 5, broadcast_q=True, precision="fp8")
    with FlopCounterMode(display=False) as counter:
        gdpa(q, k, v, offsets, offsets, 5, 5, precision="fp8", causal=True)
    assert counter.get_total_flops() == 4 * 16 * (15 + 6)  # causal pairs of lengths 5 and 3, as in bf16


def test_torch_compile_fullgraph_cpu():
    q, k, v, dout = _inputs([6, 2], heads=2, kv_heads=1, head_dim=32)
    offsets = _offsets([6, 2])

    def attend(q, k, v):
        return gdpa(q, k, v, offsets, offsets, 6, 6, precision="fp8", causal=True, activation="silu")

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")(*leaves)
    eager_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    eager = attend(*eager_leaves)
    assert torch.equal(compiled, eager)
    for got, want in zip(torch.autograd.grad(compiled, leaves, dout), torch.autograd.grad(eager, eager_leaves, dout)):
        assert torch.equal(got, want)
