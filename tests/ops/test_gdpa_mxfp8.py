"""MXFP8 GDPA (``gdpa(..., precision="mxfp8")``: self-, cross-attention and broadcast_q): the Triton kernels
(interpreter) against the exact emulation, the emulation against fp32 and its recipe, the straight-through
backward."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from opengem.ops.gdpa import gdpa, gdpa_packed_kv
from opengem.ops.reference.attention_fp8 import rotation_size
from opengem.ops.reference.attention_mxfp8 import mx_along_keys
from opengem.ops.reference.gdpa import gdpa as reference
from opengem.ops.reference.gdpa_mxfp8 import gdpa_mxfp8
from tests.ops.test_jagged_attention import LENGTHS, MASKS, _inputs, _mask_kwargs, _offsets, _rel, poisoned  # noqa: F401
from tests.ops.test_jagged_attention_mxfp8 import _straight_through

OPTIONS = dict(pre_scale=0.25, post_scale=0.5, norm="max_len")
ACTIVATIONS = {"fast_gelu": dict(activation="fast_gelu"), "per_head": dict(head_activations=["silu", "gelu_tanh"])}


def _gdpa(q, k, v, offsets, backend, **kwargs):
    return gdpa(q, k, v, offsets, offsets, 37, 37, backend=backend, precision="mxfp8", **OPTIONS, **kwargs)


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("mask", ["full", "causal", "all_options", "full_all_options"])
def test_kernel_matches_emulation(poisoned, mask, activation):  # noqa: F811 (the imported fixture)
    """Key tiles of 32 (looping and resident K/V) quantize P in exactly the emulation's blocks: equal to fp32
    rounding."""
    q, k, v, _ = _inputs(LENGTHS, heads=2, kv_heads=1, head_dim=32, seed=1)
    offsets = _offsets(LENGTHS)
    kwargs = {**_mask_kwargs(MASKS[mask]), **ACTIVATIONS[activation]}
    out = _gdpa(q, k, v, offsets, "triton", **kwargs)
    emulated = _gdpa(q, k, v, offsets, "reference", **kwargs)
    assert torch.isfinite(out).all() and _rel(out, emulated) < 1e-5


def test_cross_attention_and_broadcast_q_match_emulation_forward_and_backward(poisoned):  # noqa: F811
    """Long jagged Q against short K/V (lengths 0, 1, partial and two MX blocks; V blocked by K/V's offsets),
    and seed pooling (one Q for every sample): kernels against the emulation, forward and straight-through
    backward (both GDPA's exact gradient over the same operands)."""
    q_lengths, k_lengths = [37, 5, 20, 0, 9], [3, 0, 1, 40, 33]
    q, _, _, dout = _inputs(q_lengths, heads=2, kv_heads=1, head_dim=32, seed=7)
    _, k, v, _ = _inputs(k_lengths, heads=2, kv_heads=1, head_dim=32, seed=8)
    seeds, _, _, seed_dout = _inputs([4], heads=2, kv_heads=1, head_dim=32, seed=9)
    q_offsets, k_offsets = _offsets(q_lengths), _offsets(k_lengths)
    cases = {
        "cross": (q, q_offsets, 37, dout, dict(activation="silu", pre_scale=0.3, norm="max_len")),
        "broadcast": (seeds, None, 4, seed_dout.repeat(5, 1, 1), dict(activation="gelu", broadcast_q=True)),
    }
    for name, (query, query_offsets, max_q, grad, options) in cases.items():
        outs, grads = {}, {}
        for backend in ("triton", "reference"):
            leaves = [t.clone().requires_grad_() for t in (query, k, v)]
            out = gdpa(*leaves, query_offsets, k_offsets, max_q, 40, backend=backend, precision="mxfp8", **options)
            outs[backend], grads[backend] = out.detach(), torch.autograd.grad(out, leaves, grad)
        assert torch.isfinite(outs["triton"]).all() and _rel(outs["triton"], outs["reference"]) < 1e-5, name
        for got, want in zip(grads["triton"], grads["reference"]):
            assert torch.isfinite(got).all() and _rel(got, want) < 1e-5, name


def test_emulation_is_the_documented_recipe():
    """Against a direct transcription of the module docstring for one sample (rotated MX Q and K, V in blocks of
    32 tokens, P in blocks of 32 keys per row) and against fp32: ~3-6% relative error, as the FP8 recipe's."""
    lengths = [45]
    q, k, v, _ = _inputs(lengths, heads=1, kv_heads=1, head_dim=32, seed=2)
    offsets = _offsets(lengths)
    got = gdpa_mxfp8(q, k, v, offsets, offsets, head_activations=["silu"], pre_scale=0.5, out_scale=0.1)
    qs, ks, vs = (_straight_through(x, offsets, rotated) for x, rotated in zip((q, k, v), (True, True, False)))
    p = torch.nn.functional.silu((qs[:, 0] @ ks[:, 0].T) * 0.5 / rotation_size(32))
    want = 0.1 * mx_along_keys(p) @ vs[:, 0]
    assert _rel(got[:, 0], want) < 1e-6
    fp32 = reference(q, k, v, offsets, offsets, head_activations=["silu"], pre_scale=0.5, out_scale=0.1)
    assert 0.01 < _rel(got, fp32) < 0.1


@pytest.mark.parametrize("mask", ["causal", "all_options"])
def test_reference_backward_is_the_straight_through_gradient(mask):
    q, k, v, dout = _inputs(LENGTHS, heads=2, kv_heads=1, head_dim=64, seed=3)
    offsets, kwargs = _offsets(LENGTHS), _mask_kwargs(MASKS[mask])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = torch.autograd.grad(_gdpa(*leaves, offsets, "reference", activation="silu", **kwargs), leaves, dout)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    st = [_straight_through(x, offsets, rotated) for x, rotated in zip(leaves, (True, True, False))]
    want_out = gdpa(*st, offsets, offsets, 37, 37, backend="reference", activation="silu",
                    pre_scale=OPTIONS["pre_scale"] / rotation_size(64), post_scale=0.5, norm="max_len", **kwargs)
    want = torch.autograd.grad(want_out, leaves, dout)
    for g, w in zip(got, want):
        assert _rel(g, w) < 1e-5


@pytest.mark.parametrize("mask", ["full", "all_options"])
def test_triton_backward_is_the_reference_one(poisoned, mask):  # noqa: F811 (the imported fixture)
    q, k, v, dout = _inputs(LENGTHS, heads=2, kv_heads=1, head_dim=32, seed=4)
    offsets, kwargs = _offsets(LENGTHS), _mask_kwargs(MASKS[mask])
    grads = {}
    for backend in ("triton", "reference"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = _gdpa(*leaves, offsets, backend, activation="fast_gelu", **kwargs)
        grads[backend] = torch.autograd.grad(out, leaves, dout)
    for got, want in zip(grads["triton"], grads["reference"]):
        assert torch.isfinite(got).all() and _rel(got, want) < 1e-5


def test_packed_kv_gradient_equals_the_unbound_one(poisoned):  # noqa: F811 (the imported fixture)
    q, k, v, dout = _inputs(LENGTHS, heads=2, kv_heads=2, head_dim=32, seed=6)
    offsets = _offsets(LENGTHS)
    kv = torch.stack([k, v], 1).requires_grad_()
    q_leaf = q.clone().requires_grad_()
    out = gdpa_packed_kv(q_leaf, kv, offsets, offsets, 37, 37, backend="triton", precision="mxfp8", causal=True)
    dq, dkv = torch.autograd.grad(out, (q_leaf, kv), dout)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out_unbound = gdpa(*leaves, offsets, offsets, 37, 37, backend="triton", precision="mxfp8", causal=True)
    grads = torch.autograd.grad(out_unbound, leaves, dout)
    assert torch.equal(out, out_unbound) and torch.equal(dq, grads[0]) and torch.equal(dkv, torch.stack(grads[1:], 1))
