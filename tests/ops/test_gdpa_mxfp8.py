"""MXFP8 GDPA (``gdpa(..., precision="mxfp8")``): cross-attention and broadcast_q, kernels (interpreter) against
the exact emulation forward and backward, and the emulation against its recipe and fp32. Self-attention's kernel,
backward and packed K/V tests run both low precisions in ``test_gdpa_fp8``."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from opengem.ops.gdpa import gdpa
from opengem.ops.reference.attention_fp8 import rotation_size
from opengem.ops.reference.attention_mxfp8 import mx_along_keys
from opengem.ops.reference.gdpa import gdpa as reference
from opengem.ops.reference.gdpa_mxfp8 import gdpa_mxfp8
from tests.ops.test_jagged_attention import LENGTHS, MASKS, _inputs, _mask_kwargs, _offsets, _rel, poisoned  # noqa: F401
from tests.ops.test_jagged_attention_mxfp8 import _straight_through

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
