"""BlockAttention Triton kernels on CUDA in bf16 against the fp32 reference (skipped without CUDA)."""

import math

import pytest
import torch
import triton
import triton.language as tl

from opengem.jagged import offsets_from_lengths
from opengem.ops.block_attention import Rotary, block_attention, block_attention_from_hidden
from opengem.ops.reference import block_attention as reference
from opengem.ops.reference.rotary import inv_freq, positions_in_sequence, time_phase
from opengem.ops.triton.block_attention import _rotary_cos_sin

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values in the kernel result"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


class _poison:
    """torch.empty returns NaN-filled memory while active, so unwritten kernel outputs show up."""

    def __enter__(self):
        self._det = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self._det)


def _check(lengths, heads=4, kv_heads=4, head_dim=128, block_size=64, rotary="none", activation="softmax"):
    g = torch.Generator(device="cuda").manual_seed(0)
    total = sum(lengths)
    offsets = offsets_from_lengths(torch.tensor(lengths, dtype=torch.int32)).cuda()
    make = lambda h: torch.randn(total, h, head_dim, generator=g, device="cuda").bfloat16().requires_grad_(True)  # noqa: E731
    q, k, v = make(heads), make(kv_heads), make(kv_heads)
    grad = torch.randn(total, heads, head_dim, generator=g, device="cuda").bfloat16()
    config, phase = None, None
    if rotary == "sequence":
        config, phase = Rotary(), positions_in_sequence(offsets, total).float()
    elif rotary == "positions":  # far apart inside a block: the kernel reduces the angles to [-pi, pi]
        positions = torch.randint(0, 100_000, (total,), generator=g, device="cuda")
        config, phase = Rotary(positions=positions), positions.float()
    elif rotary == "shifted":  # large but close inside a block: rotated relative to the block, unreduced
        positions = positions_in_sequence(offsets, total) * 3 + 90_000
        config, phase = Rotary(positions=positions), positions.float()
    elif rotary == "time":
        gaps = torch.rand(total, generator=g, device="cuda") * 1e6
        config, phase = Rotary(time_gaps=gaps, time_scale=60.0), time_phase(gaps, 60.0)
    scale = 0.05 if activation != "softmax" else None  # keeps unnormalized outputs O(1)
    with _poison():
        out = block_attention(
            q, k, v, offsets, max(lengths), block_size=block_size, rotary=config, activation=activation, scale=scale
        )
        got = (out, *torch.autograd.grad(out, (q, k, v), grad))
    ref_in = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    ref = reference.block_attention(
        *ref_in, offsets, block_size=block_size, scale=scale, activation=activation, rotary_phase=phase
    )
    want = (ref, *torch.autograd.grad(ref, ref_in, grad.float()))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.dtype == torch.bfloat16
        err = _relative_error(a, b)
        # bf16 inputs, P/dS rounded to bf16 for the tensor cores, rotated q/k rounded to bf16.
        assert err < (1e-2 if name == "out" else 2e-2), f"{name}: relative error {err:.3g}"


@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_block_sizes_and_head_dims(block_size, head_dim):
    _check([0, 1, 63, 64, 65, 300, 1000, 7], head_dim=head_dim, block_size=block_size)


@pytest.mark.parametrize("head_dim, block_size", [(32, 64), (256, 64), (256, 32)])
def test_other_head_dims(head_dim, block_size):
    _check([129, 3, 64], head_dim=head_dim, block_size=block_size)


@pytest.mark.parametrize("rotary", ["sequence", "positions", "shifted", "time"])
@pytest.mark.parametrize("block_size", [32, 64, 128])
def test_rotary(rotary, block_size):
    _check([5000, 70, 1], block_size=block_size, rotary=rotary)


@pytest.mark.parametrize("activation", reference.ACTIVATIONS)
def test_activations(activation):
    _check([100, 64, 3], activation=activation)


def test_gqa():
    _check([200, 31], heads=4, kv_heads=2, rotary="time")
    _check([200, 31], heads=4, kv_heads=1)


def test_large_batch():
    lengths = torch.randint(800, 2001, (256,), generator=torch.Generator().manual_seed(1)).tolist()
    _check(lengths, rotary="time")


def test_from_hidden_and_compile():
    lengths, heads, head_dim, d_model = [300, 64, 17], 4, 128, 256
    total = sum(lengths)
    offsets = offsets_from_lengths(torch.tensor(lengths, dtype=torch.int32)).cuda()
    x = torch.randn(total, d_model, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(3 * heads * head_dim, d_model, device="cuda") / d_model**0.5).bfloat16().requires_grad_(True)
    rotary = Rotary(time_gaps=torch.rand(total, device="cuda") * 1e4)

    def layer(x, w):
        return block_attention_from_hidden(x, w, offsets, 300, heads, rotary=rotary).float().square().sum()

    eager = torch.autograd.grad(layer(x, w), (x, w))
    compiled_loss = torch.compile(layer, fullgraph=True)(x, w)
    compiled = torch.autograd.grad(compiled_loss, (x, w))
    q, k, v = (x.detach().float() @ w.detach().float().T).view(total, 3, heads, head_dim).unbind(1)
    ref = reference.block_attention(q, k, v, offsets, rotary_phase=time_phase(rotary.time_gaps, 1.0))
    out = block_attention_from_hidden(x, w, offsets, 300, heads, rotary=rotary)
    assert _relative_error(out, ref.reshape(total, -1)) < 1e-2
    for a, b in zip(compiled, eager):
        assert _relative_error(a, b) < 1e-2


@pytest.mark.parametrize("rotary", ["sequence", "positions", "time"])
@pytest.mark.parametrize("block_size", [64, 128])
def test_every_autotune_config(block_size, rotary, monkeypatch):
    """Autotuning picks one config per shape and the others could be picked on another GPU: check them all."""
    from opengem.ops.triton import block_attention as kernels

    for kernel in (kernels._block_attention_fwd, kernels._block_attention_bwd):
        for config in kernels._prune(list(kernel.configs), {}, BLOCK=block_size, HALF=64, GROUP=1, ROT=1):
            monkeypatch.setattr(kernel, "configs", [config])  # a single config skips benchmarking
            kernel.cache.clear()
            _check([300, 64, 5], block_size=block_size, rotary=rotary)


@triton.jit
def _cos_sin_kernel(
    PHASE, INV_FREQ, COS, SIN, total, time_scale,
    BLOCK: tl.constexpr, HALF: tl.constexpr, ROT: tl.constexpr, REDUCE: tl.constexpr, SIGN: tl.constexpr,
):  # fmt: skip
    start = tl.program_id(0) * BLOCK
    rows = tl.arange(0, BLOCK)
    valid = start + rows < total
    cos, sin = _rotary_cos_sin(PHASE, INV_FREQ, start, rows, valid, time_scale, HALF, ROT, REDUCE, SIGN)
    at = (start + rows)[:, None] * HALF + tl.arange(0, HALF)[None, :]
    tl.store(COS + at, cos, mask=valid[:, None])
    tl.store(SIN + at, sin, mask=valid[:, None])


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("rot, spread", [(1, None), (2, 100_000), (2, 100), (3, None)])
def test_rotary_cos_sin_accuracy(rot, spread, sign):
    """The SFU sin/cos (MUFU, no libdevice polynomial) against float64 at the largest angles each mode meets:
    rows of a 128 block (< 128 rad, unreduced); given positions relative to the block's first one, up to 1e5
    apart (the program reduces them) or within 100 of 1e5 (it does not); time gaps up to 1e30; and the
    inverse rotation's (negated angles) the same."""
    block, half, total, time_scale = 128, 64, 4096, 60.0
    g = torch.Generator(device="cuda").manual_seed(0)
    freq = inv_freq(2 * half, 10000.0, "cuda")
    if rot == 1:
        values = None
        phase = (torch.arange(total, device="cuda") % block).double()
    elif rot == 2:
        values = (100_000 - torch.randint(0, spread, (total,), generator=g, device="cuda")).float()
        phase = (values - values[:: block].repeat_interleave(block)).double()  # exact: integers below 2^24
    else:
        values = torch.exp(torch.rand(total, generator=g, device="cuda") * 70.0) - 1.0  # 0 .. 2.5e30
        phase = time_phase(values, time_scale).double()
    # The reference's fp32 angle (phase * inv_freq), evaluated exactly.
    angle = sign * (phase.float()[:, None] * freq[None, :]).double()
    cos, sin = (torch.full((total, half), math.nan, device="cuda") for _ in range(2))
    _cos_sin_kernel[(total // block,)](
        values if values is not None else freq, freq, cos, sin, total, time_scale, BLOCK=block, HALF=half, ROT=rot,
        REDUCE=False, SIGN=sign,
    )
    # rot 3: the phase itself carries lg2.approx's relative error (~2^-22 of <= 70) on top of the sin/cos one;
    # rot 2 within 100 of each other: unreduced angles below 100 rad, like rot 1's.
    bound = 1e-5 if rot == 2 and spread > 128 else {1: 3e-5, 2: 3e-5, 3: 6e-5}[rot]
    assert (cos.double() - angle.cos()).abs().max() < bound
    assert (sin.double() - angle.sin()).abs().max() < bound
