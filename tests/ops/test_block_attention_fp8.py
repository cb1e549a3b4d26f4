"""FP8 and MXFP8 BlockAttention (``block_attention(..., precision="fp8" | "mxfp8")``): the blocks as sequences of
their own through the FP8 (MXFP8) JFA / GDPA. The Triton path (interpreter) against the exact emulation (the same composition on the
reference path), both against fp32, gradients included, and the block offsets themselves."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from opengem.ops.block_attention import block_attention  # noqa: E402
from opengem.jagged.blocks import block_offsets  # noqa: E402
from tests.ops.test_block_attention import _inputs, _offsets, _rotary  # noqa: E402

LENGTHS = [0, 5, 64, 65, 130]  # empty, one partial block, exact, exact + 1, two and a bit


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_block_offsets_cut_every_sequence_from_its_first_token(dtype):
    offsets = _offsets(LENGTHS).to(dtype)
    got = block_offsets(offsets, 64)
    assert got.dtype == dtype and got.tolist() == [0, 5, 69, 133, 134, 198, 262, 264]
    assert block_offsets(_offsets([0, 0]).to(dtype), 32).tolist() == [0]
    assert block_offsets(_offsets([16, 16]).to(dtype), 16).tolist() == [0, 16, 32]
    assert block_offsets(offsets.clone(), 64) is got  # the layers of one batch share one tensor
    assert block_offsets(offsets, 32).tolist() == [0, 5, 37, 69, 101, 133, 134, 166, 198, 230, 262, 264]


@pytest.mark.parametrize("precision", ["fp8", "mxfp8"])
@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("rotary", ["none", "sequence", "time_gaps"])
def test_triton_matches_the_emulation_forward_and_backward(activation, rotary, precision):
    q, k, v, dout = _inputs(LENGTHS, heads=2, kv_heads=1, head_dim=32, seed=3)
    offsets = _offsets(LENGTHS)
    outs, grads = {}, {}
    for backend in ("triton", "reference"):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = block_attention(*leaves, offsets, 130, block_size=64, activation=activation,
                              rotary=_rotary(rotary, q.shape[0]), backend=backend, precision=precision)  # fmt: skip
        grads[backend] = torch.autograd.grad(out, leaves, dout)
        outs[backend] = out.detach()
    assert torch.isfinite(outs["triton"]).all() and _rel(outs["triton"], outs["reference"]) < 1e-5
    # GDPA's FP8 backward is the reference's to fp32 rounding; JFA's dQ and dK differ by the forward's quantized P
    # inside rowsum(dO * O) (as in test_jagged_attention_fp8: up to ~3e-2), its dV does not
    tolerances = (5e-2, 5e-2, 1e-4) if activation == "softmax" else (1e-4, 1e-4, 1e-4)
    for got, want, tolerance in zip(grads["triton"], grads["reference"], tolerances):
        assert torch.isfinite(got).all() and _rel(got, want) < tolerance
    fp32 = block_attention(q, k, v, offsets, 130, block_size=64, activation=activation,
                           rotary=_rotary(rotary, q.shape[0]), backend="reference")  # fmt: skip
    assert 0.01 < _rel(outs["reference"], fp32) < 0.1  # FP8's error, not a different op


@pytest.mark.parametrize("precision", ["fp8", "mxfp8"])
def test_blocks_stay_apart(precision):
    """A block's output does not move when another block of its sequence changes (its quantization scales
    are its own too)."""
    q, k, v, _ = _inputs([130], heads=1, kv_heads=1, head_dim=32, seed=4)
    offsets = _offsets([130])
    base = block_attention(q, k, v, offsets, 130, block_size=64, precision=precision, backend="triton")
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[70:90] *= 30.0
    v2[70:90] += 5.0
    moved = block_attention(q, k2, v2, offsets, 130, block_size=64, precision=precision, backend="triton")
    assert torch.equal(moved[:64], base[:64]) and torch.equal(moved[128:], base[128:])
    assert not torch.allclose(moved[64:128], base[64:128])


def test_precision_errors():
    q, k, v, _ = _inputs([5], heads=1, kv_heads=1, head_dim=16)
    with pytest.raises(ValueError, match="precision must be one of"):
        block_attention(q, k, v, _offsets([5]), 5, precision="int8")
    with pytest.raises(ValueError, match=r"head_dim"):
        block_attention(q, k, v, _offsets([5]), 5, precision="fp8", backend="triton")
