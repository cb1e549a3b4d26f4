"""JFA's fused backward (dQ added by the key-tile programs into an fp32 buffer) on the GPU, bf16 / fp16 against the
fp32 reference, every tile it may tune to forced alone, and the two-pass one kept where determinism is asked."""

import pytest
import torch

from opengem.ops.jagged_attention import jagged_attention_packed
from opengem.ops.triton import jagged_attention as kernels
from opengem.ops.triton import jagged_attention_fused_backward as fused
from tests.gpu.test_jagged_attention_gpu import (  # noqa: F401 (poisoned_outputs, untuned: fixtures)
    MASKS,
    _batch,
    _check,
    _check_samples,
    _forward_backward,
    _mask_kwargs,
    _power_law_lengths,
    _rel,
    poisoned_outputs,
    untuned,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def fused_selected(monkeypatch):
    monkeypatch.setattr(fused, "BACKWARD", "fused")


@pytest.fixture(params=["atomic", "tma"])
def dq_adds(request, monkeypatch):
    """Each way of adding dQ's shares: reductions from registers, TMA reductions from shared memory."""
    monkeypatch.setattr(fused, "DQ_ADDS", request.param)
    return request.param


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_bf16_matches_reference(dq_adds, mask, head_dim):
    lengths = [300, 0, 1, 129, 64, 17, 511]
    _check(lengths, 4, 2, head_dim, torch.bfloat16, 1e-2, **_mask_kwargs(MASKS[mask], lengths))


def test_fp16_and_fp32_mqa_and_pointer_loads(monkeypatch):
    lengths = [200, 3, 77]
    _check(lengths, 4, 1, 128, torch.float16, 5e-3, causal=True)
    _check(lengths, 4, 1, 64, torch.float32, 1e-5, causal=True, window=20)
    monkeypatch.setattr(kernels, "TMA_PASSES", kernels._tma_passes("none"))
    _check(lengths, 4, 2, 128, torch.bfloat16, 1e-2, causal=True)


@pytest.mark.parametrize("tile", fused._FUSED)
@pytest.mark.parametrize("pointer_loads", [False, True])
def test_every_tile_forced_alone_on_a_long_causal_batch(poisoned_outputs, monkeypatch, dq_adds, tile, pointer_loads):
    monkeypatch.setattr(fused._fused_bwd_kernel, "configs", [kernels.tile_config("dkdv", *tile,
                                                                                 pointer_loads=pointer_loads)])
    lengths = [4100, 2, 1500, 129, 64, 63, 3001]
    _check_samples(lengths, range(len(lengths)), 1.5e-2, causal=True)


@pytest.mark.parametrize("window", [None, 256])
def test_benchmark_shape_class_long_power_law_batch(poisoned_outputs, monkeypatch, dq_adds, window):
    """JFA's workloads (a) and (d), tuned: the autotuner's timing runs add into dQ too, then reset it."""
    monkeypatch.delenv("OPENGEM_JFA_AUTOTUNE")
    fused._fused_bwd_kernel.cache.clear()
    lengths = _power_law_lengths()
    _check_samples(lengths, [0, lengths.index(16384), len(lengths) - 1], 2e-2, causal=True, window=window)


def test_packed_gradient_and_the_two_pass_one_agree():
    """The fused backward writes the packed [T, 3, H, D] gradient's views; the two-pass one's gradients agree."""
    lengths = [300, 0, 1, 129, 511]
    gen = torch.Generator(device="cuda").manual_seed(2)
    qkv = torch.randn(sum(lengths), 3, 2, 128, generator=gen, device="cuda").to(torch.bfloat16)
    dout = torch.randn(sum(lengths), 2, 128, generator=gen, device="cuda").to(torch.bfloat16)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    leaf = qkv.clone().requires_grad_()
    out = jagged_attention_packed(leaf, offsets, 511, causal=True)
    (dqkv,) = torch.autograd.grad(out, leaf, dout)
    fused.BACKWARD = "two_pass"
    try:
        want = _forward_backward(*qkv.unbind(1), dout, offsets, 511, causal=True)
    finally:
        fused.BACKWARD = "fused"
    for i, name in enumerate(("dq", "dk", "dv")):
        assert _rel(dqkv[:, i], want[1 + i]) < 2e-3, name  # dq's sums in another order, rounded to bf16 once


def test_deterministic_algorithms_give_bitwise_repeats():
    q, k, v, dout, offsets = _batch([700, 33, 1200], 4, 2, 128, torch.bfloat16, seed=5)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        first = _forward_backward(q, k, v, dout, offsets, 1200, causal=True)
        second = _forward_backward(q, k, v, dout, offsets, 1200, causal=True)
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
