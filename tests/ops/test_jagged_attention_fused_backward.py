"""JFA's fused backward (dQ added into an fp32 buffer by the key-tile programs): interpreter against the reference
and the two-pass kernels, and when it runs."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from opengem.ops.jagged_attention import jagged_attention, jagged_attention_packed
from opengem.ops.triton import jagged_attention as kernels
from opengem.ops.triton import jagged_attention_fused_backward as fused
from tests.ops.test_jagged_attention import (  # noqa: F401 (poisoned: the imported fixture)
    LENGTHS,
    MASKS,
    _check_against_reference,
    _inputs,
    _mask_kwargs,
    _offsets,
    _run,
    poisoned,
)


@pytest.fixture
def fused_backward(monkeypatch):
    """The fused backward selected, and a count of its runs (so a test knows which backward ran)."""
    monkeypatch.setattr(fused, "BACKWARD", "fused")
    calls = []
    run = fused.fused_backward

    def counted(*args, **kwargs):
        calls.append(1)
        return run(*args, **kwargs)

    monkeypatch.setattr(fused, "fused_backward", counted)
    return calls


@pytest.mark.parametrize("mask", list(MASKS))
def test_fused_matches_reference_fp32_gqa(poisoned, fused_backward, mask):  # noqa: F811
    q, k, v, dout = _inputs(LENGTHS, heads=2, kv_heads=1)
    _check_against_reference(LENGTHS, q, k, v, dout, 1e-5, **_mask_kwargs(MASKS[mask]))
    assert fused_backward


@pytest.mark.parametrize("mask", ["causal", "full_window", "all_options"])
def test_fused_matches_reference_fp16_and_pointer_loads(poisoned, fused_backward, monkeypatch, mask):  # noqa: F811
    q, k, v, dout = _inputs(LENGTHS, heads=4, kv_heads=2, dtype=torch.float16, seed=1)
    _check_against_reference(LENGTHS, q, k, v, dout, 2e-2, **_mask_kwargs(MASKS[mask]))
    monkeypatch.setattr(kernels, "TMA_PASSES", kernels._tma_passes("none"))
    _check_against_reference(LENGTHS, q, k, v, dout, 2e-2, **_mask_kwargs(MASKS[mask]))
    assert len(fused_backward) == 2


def test_fused_equals_two_pass_mqa_head_dim_32(fused_backward, monkeypatch):
    """The same gradients as the two-pass kernels (fp32: only the order of dQ's sums differs)."""
    lengths = [40, 3, 0, 33]
    q, k, v, dout = _inputs(lengths, heads=3, kv_heads=1, head_dim=32, seed=2)
    offsets = _offsets(lengths, torch.int64)
    _, fused_grads = _run(q, k, v, dout, offsets, 40, "triton", causal=True, window=9)
    monkeypatch.setattr(fused, "BACKWARD", "two_pass")
    _, two_pass_grads = _run(q, k, v, dout, offsets, 40, "triton", causal=True, window=9)
    assert len(fused_backward) == 1
    for name, got, want in zip(("dq", "dk", "dv"), fused_grads, two_pass_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)


def test_fused_writes_the_packed_gradient(poisoned, fused_backward):  # noqa: F811
    """Into a [T, 3, H, D] gradient's strided views, as the two-pass backward does (dQ through its scaling pass)."""
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(sum(LENGTHS), 3, 2, 16, generator=gen)
    dout = torch.randn(sum(LENGTHS), 2, 16, generator=gen)
    offsets, max_len = _offsets(LENGTHS), max(LENGTHS)
    packed = qkv.clone().requires_grad_()
    out = jagged_attention_packed(packed, offsets, max_len, backend="triton", causal=True)
    (dqkv,) = torch.autograd.grad(out, packed, dout)
    _, want = _run(*qkv.unbind(1), dout, offsets, max_len, "reference", causal=True)
    torch.testing.assert_close(dqkv, torch.stack(want, 1), rtol=1e-5, atol=1e-5)
    assert fused_backward


def test_deterministic_algorithms_keep_the_two_pass_backward(fused_backward):
    q, k, v, dout = _inputs(LENGTHS)
    torch.use_deterministic_algorithms(True)
    try:
        _run(q, k, v, dout, _offsets(LENGTHS), max(LENGTHS), "triton", causal=True)
    finally:
        torch.use_deterministic_algorithms(False)
    assert not fused_backward
    _run(q, k, v, dout, _offsets(LENGTHS), max(LENGTHS), "triton", causal=True)
    assert fused_backward


def test_backward_setting_is_checked():
    assert fused.backward_setting("fused") == "fused"
    with pytest.raises(ValueError, match="OPENGEM_JFA_BACKWARD must be one of .*got 'atomic'"):
        fused.backward_setting("atomic")


def test_empty_batch_runs_no_kernel(fused_backward):
    q, k, v, dout = _inputs([0, 0])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = jagged_attention(*leaves, _offsets([0, 0]), 0, backend="triton")
    grads = torch.autograd.grad(out.sum(), leaves, allow_unused=True)
    assert all(g is None or g.numel() == 0 for g in grads) and not fused_backward
