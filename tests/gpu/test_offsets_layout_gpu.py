"""Offsets given as a strided view (``wide[::2]``, not contiguous) on the GPU: the Triton kernels read offsets
through a bare pointer, so each attention op must give what it gives for the same offsets stored contiguously.
``validate_offsets`` accepts either layout; this checks that the kernels behind it do too."""

import os

os.environ.setdefault("OPENGEM_GDPA_TUNE", "0")
os.environ.setdefault("OPENGEM_JFA_AUTOTUNE", "0")

import pytest
import torch

from opengem.ops import block_attention, gdpa, jagged_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

LENGTHS = [130, 7, 0, 64, 255]


def offsets_pair() -> tuple[torch.Tensor, torch.Tensor]:
    offsets = torch.tensor([0, *LENGTHS], device="cuda").cumsum(0).to(torch.int32)
    wide = torch.full((2 * offsets.numel(),), -7, dtype=torch.int32, device="cuda")
    wide[::2] = offsets
    strided = wide[::2]
    assert not strided.is_contiguous() and torch.equal(strided, offsets)
    return offsets, strided


def inputs(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (sum(LENGTHS), 2, 128)
    return [torch.randn(shape, generator=gen, device="cuda").bfloat16().requires_grad_(True) for _ in range(3)]


def output_and_grads(op, offsets: torch.Tensor, seed: int) -> list[torch.Tensor]:
    q, k, v = inputs(seed)
    out = op(q, k, v, offsets)
    forward = out.detach().clone()  # as the forward wrote it: session 66 read GDPA's output after the backward
    out.backward(torch.ones_like(out))
    assert torch.equal(out.detach(), forward), "the backward changed the forward's output"
    return [forward, q.grad, k.grad, v.grad]


@pytest.mark.parametrize("name", ["gdpa", "jagged_attention", "block_attention"])
def test_strided_offsets_give_what_contiguous_ones_give(name: str) -> None:
    longest = max(LENGTHS)
    ops = {
        "gdpa": lambda q, k, v, o: gdpa(q, k, v, o, o, longest, longest, norm="max_len"),
        "jagged_attention": lambda q, k, v, o: jagged_attention(q, k, v, o, longest),
        "block_attention": lambda q, k, v, o: block_attention(q, k, v, o, longest, block_size=64),
    }
    contiguous, strided = offsets_pair()
    expected = output_and_grads(ops[name], contiguous, seed=1)
    got = output_and_grads(ops[name], strided, seed=1)
    for label, want, have in zip(("out", "dq", "dk", "dv"), expected, got):
        assert torch.isfinite(want.float()).all(), label
        torch.testing.assert_close(have, want, rtol=0, atol=0, msg=f"{name} {label}")
