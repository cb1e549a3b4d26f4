"""FP8 JFA forward: the Triton kernels (interpreter) against the exact emulation, the emulation against fp32.

Kernel vs emulation: the fp8 bits of V and its scales are compared for equality, those of the rotated Q and
K too, up to the rotation's fp32 sums (an element within an ulp of an E4M3 midpoint may round to the
neighbouring value); the outputs
differ only by fp32 rounding (sums in another order, exp2), except that a ``p * 256`` within a few fp32
ulps of an E4M3 rounding midpoint (about 2^-19 of the elements) may round the other way, moving its
row's output by up to ``|v| p / 16 / rowsum``. So: almost every element within 1e-4, all within max|v| / 8.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from opengem.ops.jagged_attention import _problem, jagged_attention
from opengem.ops.reference.attention import jagged_attention as reference
from opengem.ops.reference.attention_fp8 import jagged_attention_fp8 as emulation
from opengem.ops.reference import attention_fp8
from opengem.ops.reference.attention_fp8 import quantize_jagged_blocks, rotate, rotation, rotation_size
from opengem.ops.triton import jagged_attention_fp8 as kernels
from tests.ops.fp8_checks import assert_quantized_like
from tests.ops.test_jagged_attention import LENGTHS, MASKS, _inputs, _mask_kwargs, _offsets, _rel, poisoned  # noqa: F401


def _assert_matches_emulation(
    out: torch.Tensor, emulated: torch.Tensor, v: torch.Tensor, flips: bool = False
) -> None:
    """Equal to fp32 rounding, or with ``flips`` (random data) within what one-step E4M3 flips of rotated Q / K
    elements cause: the quantize pass may round a few of them the other way (``assert_quantized_like``), and
    one flipped key moves every query row that sees it (measured up to 5.9e-3 relative, against FP8's own
    ~4e-2 from fp32; a wrong scale or block shows as 1e-1 and more)."""
    assert torch.isfinite(out).all()
    diff = (out.double() - emulated.double()).abs()
    if diff.numel():
        assert diff.max() <= v.abs().max() / 8
        if flips:
            assert diff.norm() <= 1.5e-2 * emulated.double().norm()
        else:
            assert (diff <= 1e-4).double().mean() >= 0.99


def _forward_pair(lengths, heads, kv_heads, head_dim, seed=0, **kwargs):
    q, k, v, _ = _inputs(lengths, heads=heads, kv_heads=kv_heads, head_dim=head_dim, seed=seed)
    offsets, max_len = _offsets(lengths), max(lengths, default=0)
    out = jagged_attention(q, k, v, offsets, max_len, backend="triton", precision="fp8", **kwargs)
    emulated = jagged_attention(q, k, v, offsets, max_len, backend="reference", precision="fp8", **kwargs)
    return out, emulated, v


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("head_dim, dtype", [(32, torch.float32), (64, torch.float32), (64, torch.float16)])
def test_quantize_pass_matches_emulation(kv_heads, head_dim, dtype):
    lengths = [37, 0, 1, 64, 33]  # partial, empty, single-row and exact blocks of 32
    q, k, v, _ = _inputs(lengths, heads=2, kv_heads=kv_heads, head_dim=head_dim, seed=3)
    q[3] = 0.0  # a block with a zero row, and a scale of 2^-something from tiny values
    k[40:45] *= 1e-6
    q, k, v = (x.to(dtype) for x in (q, k, v))
    offsets = _offsets(lengths)
    _, pb = _problem(q, offsets, None, max(lengths), True, 0, -1, 1.0)
    q8, k8, v8, qs, ks, vs, block_base = kernels.quantize_qkv(q, k, v, pb)
    for x, data, scale, transposed in ((rotate(q), q8, qs, False), (rotate(k), k8, ks, False), (v, v8, vs, True)):
        want = quantize_jagged_blocks(x, offsets, kernels.BLOCK)
        got = kernels.unblock(data, scale, block_base, offsets.long(), transposed)
        assert_quantized_like(*got, *want, exact=transposed)  # V is not rotated


@pytest.mark.parametrize("head_dim, n", [(16, 16), (32, 32), (48, 16), (128, 128), (256, 128), (1, 1)])
def test_rotation_preserves_logits(head_dim, n):
    assert rotation_size(head_dim) == n
    r = rotation(n)
    assert set(r.unique().tolist()) <= {-1.0, 1.0}
    torch.testing.assert_close(r @ r.T, n * torch.eye(n))
    q, k = torch.randn(2, 5, head_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).unbind()
    want = n * (q @ k.T)  # exactly, but for the fp32 rounding of the rotated q and k
    torch.testing.assert_close(rotate(q).double() @ rotate(k).double().T, want, rtol=0, atol=1e-6 * n * head_dim)
    if n > 1:  # it does mix the channels
        assert not torch.allclose(rotate(q)[:, :n].abs(), q[:, :n].float().abs())


@pytest.mark.parametrize("mask", list(MASKS))
def test_kernel_matches_emulation(poisoned, mask):  # noqa: F811 (the imported fixture)
    _assert_matches_emulation(*_forward_pair(LENGTHS, 2, 1, 32, **_mask_kwargs(MASKS[mask])))


@pytest.mark.parametrize("causal", [False, True])
def test_kernel_matches_emulation_with_a_negative_scale(poisoned, causal):  # noqa: F811 (the imported fixture)
    """A negative logit scale: on tiles without a mask the kernel takes the row maximum of the scaled logits as
    the minimum of the raw products (the scale is one FMA in the exponent), so a maximum taken on the raw products
    would overflow exp2 here."""
    out, emulated, v = _forward_pair([70, 33, 96], 2, 1, 32, causal=causal, scale=-0.5)
    _assert_matches_emulation(out, emulated, v)
    assert torch.isfinite(out).all() and float(out.abs().max()) <= float(v.abs().max())


@settings(max_examples=10, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=4),
    heads=st.sampled_from([(1, 1), (2, 1), (2, 2)]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_emulation_property(lengths, heads, causal, seed):
    _assert_matches_emulation(*_forward_pair(lengths, *heads, 32, seed=seed, causal=causal), flips=True)


def test_emulation_error_against_fp32():
    """E4M3 Q, K, V and P: ~3-5% relative error on N(0, 1) inputs (measured 0.045 at D = 128, about 20x the
    bf16 kernel's 0.002, docs/fp8_attention.md); an error-free P or nothing quantized would show as much
    smaller."""
    lengths = [40, 7, 33]
    q, k, v, _ = _inputs(lengths, heads=2, kv_heads=2, head_dim=64, seed=5)
    offsets = _offsets(lengths)
    err = _rel(emulation(q, k, v, offsets, block=32), reference(q, k, v, offsets, 40))
    assert 0.01 < err < 0.1


def _outlier_inputs(lengths, head_dim, seed):
    """Q, K, V with 4 channels 10x the others, as real Q and K have (massive activations)."""
    q, k, v, _ = _inputs(lengths, heads=2, kv_heads=2, head_dim=head_dim, seed=seed)
    channels = torch.randperm(head_dim, generator=torch.Generator().manual_seed(seed))[:4]
    for x in (q, k, v):
        x[..., channels] *= 10
    return q, k, v


def test_rotation_cuts_the_error_of_outlier_channels(monkeypatch):
    """On outlier-heavy Q and K the Hadamard rotation is worth ~3-4x (0.19 -> 0.05 at D = 128)."""
    lengths = [200, 120]
    q, k, v = _outlier_inputs(lengths, 128, seed=11)
    offsets = _offsets(lengths)
    want = reference(q, k, v, offsets, 200)
    rotated = _rel(emulation(q, k, v, offsets, block=128), want)  # measured 0.050
    monkeypatch.setattr(attention_fp8, "rotate", lambda x: x.float())
    monkeypatch.setattr(attention_fp8, "rotation_size", lambda head_dim: 1)
    plain = _rel(emulation(q, k, v, offsets, block=128), want)  # measured 0.174
    assert rotated < 0.07 and plain > 2.5 * rotated


def _straight_through(x: torch.Tensor, offsets: torch.Tensor, block: int, rotated: bool) -> torch.Tensor:
    """``x`` (rotated by ``R``) forward as its quantized-and-scaled-back blocks, backward as the identity: an
    autograd construction of the straight-through operands, independent of the backward under test."""
    head_dim = x.shape[-1]
    n = rotation_size(head_dim)
    y = (x.reshape(*x.shape[:-1], head_dim // n, n) @ rotation(n)).reshape(x.shape) if rotated else x
    data, scale = quantize_jagged_blocks(rotate(x.detach()) if rotated else x.detach(), offsets, block)
    return y + (data.float() * scale[..., None] - y).detach()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_straight_through_operands_match_the_emulation(dtype):
    """The quantize pass writing dequantized values: the emulation's to the output dtype's rounding (the rotated
    scales may differ by fp32 ulps), but for the few rotated Q / K elements a rotation-order flip moves one E4M3
    step (a wrong block, scale or head shows everywhere)."""
    q, k, v, _ = _inputs(LENGTHS, heads=2, kv_heads=1, head_dim=64, seed=8, dtype=dtype)
    offsets = _offsets(LENGTHS)
    _, pb = _problem(q, offsets, None, 37, True, 0, -1, 0.125)
    got = kernels.straight_through_operands(q, k, v, pb)
    want = attention_fp8.straight_through_operands(q, k, v, offsets, kernels.BLOCK)
    tolerance = 1e-6 if dtype == torch.float32 else 2**-10
    for g, w, name in zip(got, want, "qkv"):
        assert g.dtype == dtype and g.shape == w.shape
        close = (g.double() - w.double()).abs() <= tolerance * w.double().abs()
        assert bool(close.all()) if name == "v" else close.double().mean() > 0.99 and _rel(g.float(), w) < 1e-2


@pytest.mark.parametrize("mask", ["causal", "all_options"])
def test_reference_backward_is_the_straight_through_gradient(mask):
    """The FP8 op's reference backward: autograd of softmax attention over the straight-through operands (logit
    scale / n), GQA included; so dQ and dK are rotated back and P is that of the forward's logits."""
    q, k, v, dout = _inputs(LENGTHS, heads=2, kv_heads=1, head_dim=64, seed=3)
    offsets, kwargs = _offsets(LENGTHS), _mask_kwargs(MASKS[mask])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = torch.autograd.grad(jagged_attention(*leaves, offsets, 37, backend="reference", precision="fp8", **kwargs),
                              leaves, dout)  # fmt: skip
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    st = [_straight_through(x, offsets, 32, rotated) for x, rotated in zip(leaves, (True, True, False))]
    want = torch.autograd.grad(reference(*st, offsets, 37, scale=64**-0.5 / rotation_size(64), **kwargs), leaves, dout)
    for g, w in zip(got, want):
        assert _rel(g, w) < 1e-5


@pytest.mark.parametrize("precision", ["fp8", "mxfp8"])
@pytest.mark.parametrize("mask", ["causal", "all_options"])
def test_triton_backward_is_the_straight_through_one(poisoned, mask, precision):  # noqa: F811 (the fixture)
    """The kernels' FP8 (MXFP8) backward against the reference's: dV the same but for P's rounding ties (P from the
    forward's logits and log-sum-exp); dQ and dK within what the forward's quantized P does to rowsum(dO * O)
    (measured <= 3e-2 on outlier channels; a missing 1 / n or rotation back shows as O(1)). dV's bound: where P * 256
    sits on an E4M3 rounding boundary, the interpreter's exp2 (NumPy's) and torch's differ in the last bit and P
    moves one E4M3 step (1/16): 5 key rows of 74 and dV 1.6e-4 off on an AMD EPYC with NumPy 2.4, under 1e-4 on
    the CI machine."""
    q, k, v, dout = _inputs(LENGTHS, heads=2, kv_heads=1, head_dim=64, seed=4)
    offsets, kwargs = _offsets(LENGTHS), _mask_kwargs(MASKS[mask])
    grads = {}
    for backend in ("triton", "reference"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = jagged_attention(*leaves, offsets, 37, backend=backend, precision=precision, **kwargs)
        grads[backend] = torch.autograd.grad(out, leaves, dout)
    (dq, dk, dv), (want_dq, want_dk, want_dv) = grads["triton"], grads["reference"]
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert _rel(dv, want_dv) < 1e-3
    assert _rel(dq, want_dq) < 5e-2 and _rel(dk, want_dk) < 5e-2


def test_fp8_backward_beats_the_forward_only_one_on_outlier_channels():
    """Against the fp32 gradient on outlier-channel inputs, the straight-through backward errs a fraction of
    the one that recomputes P from the bf16 Q and K against the FP8 forward's log-sum-exp (its rows of P then
    sum to 1 +- ~20%: 0.32-0.51 error on dQ / dK against 0.14-0.16, benchmarks/diag/fp8_attention_backward.py)."""
    from opengem.ops.triton import jagged_attention as jfa_kernels

    lengths = [96, 40]
    q, k, v = _outlier_inputs(lengths, 64, seed=13)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    offsets = _offsets(lengths)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    true = torch.autograd.grad(reference(*leaves, offsets, 96), leaves, dout)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    fp8 = torch.autograd.grad(jagged_attention(*leaves, offsets, 96, backend="triton", precision="fp8"), leaves, dout)
    _, pb = _problem(q, offsets, None, 96, True, 0, -1, 64**-0.5)
    out, lse = kernels.forward(q, k, v, pb)
    forward_only = jfa_kernels.backward(dout, q, k, v, out, lse, pb)
    for new, old, want in list(zip(fp8, forward_only, true))[:2]:
        assert _rel(new, want) < 0.6 * _rel(old, want)


@pytest.mark.parametrize("backward_precision", ["bf16", "fp8"])  # the E4M3-product backward too
def test_packed_fp8_gradient_equals_the_unbound_one(poisoned, backward_precision):  # noqa: F811 (the fixture)
    from opengem.ops.jagged_attention import jagged_attention_packed

    q, k, v, dout = _inputs(LENGTHS, heads=2, kv_heads=2, head_dim=32, seed=6)
    offsets = _offsets(LENGTHS)
    precisions = dict(precision="fp8", backward_precision=backward_precision)
    packed = torch.stack([q, k, v], 1).requires_grad_()
    (dqkv,) = torch.autograd.grad(jagged_attention_packed(packed, offsets, 37, backend="triton", **precisions),
                                  packed, dout)  # fmt: skip
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    grads = torch.autograd.grad(jagged_attention(*leaves, offsets, 37, backend="triton", **precisions), leaves, dout)
    assert torch.equal(dqkv, torch.stack(grads, 1))


@triton.jit
def _cast_kernel(x_ptr, exact_ptr, plain_ptr, n: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, n))
    tl.store(exact_ptr + tl.arange(0, n), kernels.to_e4m3(x, True))
    tl.store(plain_ptr + tl.arange(0, n), x.to(tl.float8e4nv, fp_downcast_rounding="rtne"))


def test_interpreter_fp8_cast_and_the_exact_one():
    """Why the interpreter needs the integer rounding: its own cast breaks on mantissa carries."""
    values = torch.tensor(
        [1.9375, 0.5, -3.0, 1.0625, 1.1875, 2.0**-9, 2.0**-10 * 3, 300.0, 447.0, 0.0], dtype=torch.float32
    )
    values = torch.cat([values, torch.randn(54) * 20]).clamp(-448, 448)
    exact = torch.empty(64, dtype=torch.float8_e4m3fn)
    plain = torch.empty(64, dtype=torch.float8_e4m3fn)
    _cast_kernel[(1,)](values, exact, plain, n=64)
    want = values.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(exact.view(torch.uint8), want)
    assert plain.float()[0] == 1.0  # 1.9375 should round to 2.0: the carry lands in the exponent's low bit
    assert not np.array_equal(plain.view(torch.uint8).numpy(), want.numpy())


def test_options_and_errors():
    lengths = [5, 3]
    q, k, v, _ = _inputs(lengths, heads=1, kv_heads=1, head_dim=16)
    offsets = _offsets(lengths)
    with pytest.raises(ValueError, match="precision must be one of"):
        jagged_attention(q, k, v, offsets, 5, precision="fp4")
    with pytest.raises(ValueError, match="head_dim must be at least 32 for precision='fp8'"):
        jagged_attention(q, k, v, offsets, 5, backend="triton", precision="fp8")
    with FlopCounterMode(display=False) as counter:
        jagged_attention(q, k, v, offsets, 5, precision="fp8")
    assert counter.get_total_flops() == 4 * 16 * (15 + 6)  # causal pairs of lengths 5 and 3


def test_torch_compile_fullgraph_cpu():
    lengths = [6, 2]
    q, k, v, _ = _inputs(lengths, heads=2, kv_heads=1, head_dim=32)
    offsets = _offsets(lengths)

    def attend(q, k, v):
        return jagged_attention(q, k, v, offsets, 6, precision="fp8")

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), attend(q, k, v))


def test_backward_precision_is_checked():
    """An unknown backward precision, or E4M3 products under a forward that has none (bf16, MXFP8), is refused
    with the choices; no gradient is computed silently in another precision."""
    q, k, v, _ = _inputs([4], heads=1, kv_heads=1, head_dim=32)
    offsets = _offsets([4])
    with pytest.raises(ValueError, match=r"backward_precision must be one of \('bf16', 'fp8'\), got 'fp16'"):
        jagged_attention(q, k, v, offsets, 4, precision="fp8", backward_precision="fp16")
    for precision in ("bf16", "mxfp8"):
        with pytest.raises(ValueError, match=rf"exists for precision='fp8' only, got precision='{precision}'"):
            jagged_attention(q, k, v, offsets, 4, precision=precision, backward_precision="fp8")


@pytest.mark.parametrize("mask", ["causal", "full", "all_options"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backward_with_fp8_products_matches_its_emulation(poisoned, mask, dtype):  # noqa: F811
    """``backward_precision="fp8"``: E4M3 S and dP (dO quantized per block) in the kernels against the emulation,
    GQA included; both differ from the straight-through backward by dO's quantization (a few %, dV not at all)."""
    q, k, v, dout = _inputs(LENGTHS, heads=2, kv_heads=1, head_dim=32, seed=21)
    q, k, v, dout = (x.to(dtype) for x in (q, k, v, dout))
    offsets, kwargs = _offsets(LENGTHS), _mask_kwargs(MASKS[mask])
    grads = {}
    for products in (True, False):
        for backend in ("triton", "reference"):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = jagged_attention(*leaves, offsets, 37, backend=backend, precision="fp8",
                                   backward_precision="fp8" if products else "bf16", **kwargs)  # fmt: skip
            grads[products, backend] = torch.autograd.grad(out, leaves, dout)
    tolerance = 1e-3 if dtype == torch.float32 else 2e-2  # fp16: the kernels' 16-bit dS, P and operands
    for got, want in zip(grads[True, "triton"], grads[True, "reference"]):
        assert got.dtype == dtype and torch.isfinite(got).all() and _rel(got, want) < tolerance
    for name, products, straight in zip("qkv", grads[True, "reference"], grads[False, "reference"]):
        if name == "v":
            assert _rel(products, straight) < 1e-6  # dV = P^T dO with the unquantized dO
        else:
            assert 1e-3 < _rel(products, straight) < 0.1

