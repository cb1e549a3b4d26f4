"""Checks shared by the CPU (interpreter) and GPU tests of the FP8 attention quantize pass; no side effects
on import (the CPU test modules set TRITON_INTERPRET, which the GPU tests must not inherit)."""

import torch


def assert_quantized_like(
    got_data: torch.Tensor, got_scale: torch.Tensor, want_data: torch.Tensor, want_scale: torch.Tensor, exact: bool
) -> None:
    """Same E4M3 bits and scales; unless ``exact``, up to one E4M3 step on a few elements and a few fp32 ulps
    on the scales (the Hadamard rotation's fp32 sums run in another order than the emulation's)."""
    got_bits, want_bits = got_data.contiguous().view(torch.uint8), want_data.view(torch.uint8)
    if exact:
        assert torch.equal(got_bits, want_bits) and torch.equal(got_scale, want_scale)
        return
    torch.testing.assert_close(got_scale, want_scale, rtol=2e-6, atol=0)
    assert (got_bits != want_bits).double().mean() <= 1e-3
    got, want = got_data.float(), want_data.float()
    assert ((got - want).abs() <= want.abs().clamp_min(2.0**-6) / 8).all()
