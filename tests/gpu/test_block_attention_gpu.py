"""BlockAttention Triton kernels on CUDA in bf16 against the fp32 reference (skipped without CUDA)."""

import pytest
import torch

from opengem.jagged import offsets_from_lengths
from opengem.ops.block_attention import Rotary, block_attention, block_attention_from_hidden
from opengem.ops.reference import block_attention as reference
from opengem.ops.reference.rotary import positions_in_sequence, time_phase

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


@pytest.mark.parametrize("rotary", ["sequence", "time"])
@pytest.mark.parametrize("block_size", [32, 64])
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


@pytest.mark.parametrize("block_size", [64, 128])
def test_every_autotune_config(block_size, monkeypatch):
    """Autotuning picks one config per shape and the others could be picked on another GPU: check them all."""
    from opengem.ops.triton import block_attention as kernels

    for kernel in (kernels._block_attention_fwd, kernels._block_attention_bwd):
        configs = kernels._prune(list(kernel.configs), {}, BLOCK=block_size, HALF=64)
        for config in configs:
            monkeypatch.setattr(kernel, "configs", [config])  # a single config skips benchmarking
            _check([300, 64, 5], block_size=block_size, rotary="time")
