"""FP8 JFA on the GPU: the hardware E4M3 rounding assumption, the quantize pass (Hadamard-rotated Q and K), the
kernel against the exact emulation, the error against the fp32 reference next to the bf16 kernel's, on N(0, 1)
and on outlier-heavy inputs (docs/fp8_attention.md has the CPU-measured table), and the straight-through
backward."""

import pytest
import torch
import triton
import triton.language as tl

from opengem.ops.jagged_attention import _problem, jagged_attention
from opengem.ops.reference.attention import jagged_attention as reference
from opengem.ops.reference.attention_fp8 import jagged_attention_fp8 as emulation
from opengem.ops.reference.attention_fp8 import quantize_jagged_blocks, rotate
from opengem.ops.triton import jagged_attention_fp8 as kernels
from tests.ops.fp8_checks import assert_quantized_like

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MASKS = {
    "causal": {"causal": True},
    "full": {"causal": False},
    "causal_window": {"causal": True, "window": 64},
    "full_window": {"causal": False, "window": 37},
    "targets_context": {"causal": True, "contextual_len": 10, "targets": True},
    "all_options": {"causal": True, "window": 50, "contextual_len": 7, "targets": True},
}
LENGTHS = [300, 0, 1, 128, 77, 513]  # several blocks of 128, empty, single token, exact and partial blocks


@pytest.fixture(autouse=True)
def untuned(monkeypatch):
    monkeypatch.setenv("OPENGEM_JFA_AUTOTUNE", "0")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _batch(lengths, heads=4, kv_heads=4, head_dim=128, seed=0, outliers=False):
    """N(0, 1) bf16 inputs; ``outliers``: 4 channels of Q, K and V 10x the others (real Q and K look so)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (
        torch.randn(sum(lengths), h, head_dim, generator=gen, device="cuda") for h in (heads, kv_heads, kv_heads)
    )
    if outliers:
        channels = torch.randperm(head_dim, generator=gen, device="cuda")[:4]
        for x in (q, k, v):
            x[..., channels] *= 10
    q, k, v = (x.bfloat16() for x in (q, k, v))
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return q, k, v, offsets


def _mask_kwargs(spec: dict, lengths: list[int]) -> dict:
    kwargs = {key: value for key, value in spec.items() if key != "targets"}
    if spec.get("targets"):
        kwargs["num_targets"] = torch.tensor([min(n, 5) for n in lengths], device="cuda")
    return kwargs


@triton.jit
def _cast_kernel(x_ptr, hw_ptr, exact_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n)
    tl.store(hw_ptr + i, kernels.to_e4m3(x, False), mask=i < n)
    tl.store(exact_ptr + i, kernels.to_e4m3(x, True), mask=i < n)


def test_hardware_e4m3_rounding_is_torchs():
    """The assumption behind the emulation of P: cvt.rn.satfinite rounds like torch's float8_e4m3fn cast."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    p = torch.rand(1 << 20, generator=gen, device="cuda") ** 8  # P-like values, many subnormal after * 256
    ties = torch.arange(0, 1 << 12, device="cuda", dtype=torch.float32) / 64  # exact E4M3 midpoints among them
    x = torch.cat(
        [p * 256, ties.clamp(max=448), -ties.clamp(max=448), torch.randn(1 << 16, generator=gen, device="cuda") * 100]
    )
    x = x.clamp(-448, 448)
    hw, exact = (torch.empty(x.shape, dtype=torch.float8_e4m3fn, device="cuda") for _ in range(2))
    _cast_kernel[(triton.cdiv(x.numel(), 1024),)](x, hw, exact, x.numel(), BLOCK=1024)
    want = x.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(hw.view(torch.uint8), want)
    assert torch.equal(exact.view(torch.uint8), want)


@pytest.mark.parametrize("kv_heads", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_quantize_pass_matches_emulation(kv_heads, head_dim):
    """V bit for bit; rotated Q and K up to the rotation's fp32 summation order (a bf16 MMA here)."""
    q, k, v, offsets = _batch(LENGTHS, kv_heads=kv_heads, head_dim=head_dim)
    _, pb = _problem(q, offsets, None, max(LENGTHS), True, 0, -1, 1.0)
    q8, k8, v8, qs, ks, vs, block_base = kernels.quantize_qkv(q, k, v, pb)
    for x, data, scale, transposed in ((rotate(q), q8, qs, False), (rotate(k), k8, ks, False), (v, v8, vs, True)):
        want = quantize_jagged_blocks(x, offsets, kernels.BLOCK)
        got = kernels.unblock(data, scale, block_base, offsets.long(), transposed)
        assert_quantized_like(*got, *want, exact=transposed)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 128), (4, 1, 64), (2, 2, 256), (2, 1, 32)])
def test_kernel_matches_emulation(mask, heads, kv_heads, head_dim):
    """Kernel and emulation share every fp8 bit of Q, K, V; they differ by fp32 rounding (ex2.approx, the MMA's
    accumulation order), which flips a few P roundings: far below fp8's own error (~4e-2). Measured on an H200
    (session 3): up to 5.8e-3 at D = 256 (sums of 256 products), below 5e-3 at D <= 128."""
    q, k, v, offsets = _batch(LENGTHS, heads, kv_heads, head_dim, seed=1)
    kwargs = _mask_kwargs(MASKS[mask], LENGTHS)
    out = jagged_attention(q, k, v, offsets, max(LENGTHS), precision="fp8", **kwargs)
    want = emulation(q, k, v, offsets, block=kernels.BLOCK, **kwargs)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert _rel(out, want) < (1e-2 if head_dim > 128 else 5e-3)


@pytest.mark.parametrize("mask", ["causal", "all_options"])
@pytest.mark.parametrize("tile", range(len(kernels._FWD_FP8)))
def test_every_forward_tile_matches_emulation(mask, tile):
    """Each tuning candidate forced alone (the tests above run the untuned default): the register-capped ones
    (``maxnreg``, 24 B of sm_90 spills) included."""
    kernel = kernels._fwd_fp8_kernel
    q, k, v, offsets = _batch(LENGTHS, seed=2)
    kwargs = _mask_kwargs(MASKS[mask], LENGTHS)
    every = kernel.configs
    kernel.configs = [every[tile]]
    kernel.cache.clear()
    try:
        out = jagged_attention(q, k, v, offsets, max(LENGTHS), precision="fp8", **kwargs)
    finally:
        kernel.configs = every
        kernel.cache.clear()
    want = emulation(q, k, v, offsets, block=kernels.BLOCK, **kwargs)
    assert _rel(out, want) < 5e-3


def _power_law_lengths(total: int, seed: int) -> list[int]:
    """Workload (a)-like: heavy-tailed lengths in [100, 4096] (pdf ~ x^-1.5), about ``total`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < total:
        u = float(torch.rand((), generator=gen))
        lengths.append(int((100**-0.5 + u * (4096**-0.5 - 100**-0.5)) ** -2))
    return lengths


def _errors(seed: int, outliers: bool = False) -> tuple[float, float]:
    lengths = _power_law_lengths(20_000, seed)
    q, k, v, offsets = _batch(lengths, seed=seed, outliers=outliers)
    want = reference(q.float(), k.float(), v.float(), offsets, max(lengths))
    errors = [_rel(jagged_attention(q, k, v, offsets, max(lengths), precision=p), want) for p in ("bf16", "fp8")]
    return errors[0], errors[1]


def test_error_against_fp32_reference():
    """E4M3 Q, K, V and P: the CPU emulation measured 4.5e-2 relative (bf16 kernel ~2e-3) at D = 128."""
    bf16_error, fp8_error = _errors(seed=0)
    assert bf16_error < 5e-3
    assert fp8_error < 6e-2


def test_error_on_outlier_channels():
    """The Hadamard rotation keeps outlier-heavy Q and K near the N(0, 1) error: emulation 5.3e-2 (1.9e-1
    without the rotation)."""
    bf16_error, fp8_error = _errors(seed=0, outliers=True)
    assert bf16_error < 5e-3
    assert fp8_error < 8e-2


def test_error_ratio_to_bf16_matches_the_recipe_study():
    """Issue 12 wants fp8 error <= 3x bf16's; E4M3 operands give ~20x on N(0, 1) and no recipe without a
    two-term split reaches 3x (docs/fp8_attention.md). This pins the measured ratio so that a regression
    (or an improvement, which should update the study) shows."""
    bf16_error, fp8_error = _errors(seed=1)
    assert 8 * bf16_error < fp8_error < 40 * bf16_error


def test_backward_after_fp8_forward():
    """The straight-through backward on N(0, 1) inputs: within FP8's error of the fp32 gradient (CPU: ~5e-2)."""
    lengths = [300, 1, 129]
    q, k, v, offsets = _batch(lengths, heads=2, kv_heads=2)
    dout = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    grads = torch.autograd.grad(jagged_attention(*leaves, offsets, 300, precision="fp8"), leaves, dout)
    ref_leaves = [t.float().requires_grad_() for t in (q, k, v)]
    ref_grads = torch.autograd.grad(reference(*ref_leaves, offsets, 300), ref_leaves, dout.float())
    for got, want in zip(grads, ref_grads):
        assert got.dtype == torch.bfloat16 and _rel(got, want) < 0.15


def test_straight_through_operands_match_the_emulation():
    """The quantize kernel writing dequantized bf16 (the backward's operands): V the emulation's to bf16 rounding,
    rotated Q and K too but for rotation-order flips of one E4M3 step (GQA, every length shape)."""
    from opengem.ops.reference import attention_fp8

    q, k, v, offsets = _batch(LENGTHS, heads=4, kv_heads=2, seed=7)
    _, pb = _problem(q, offsets, None, max(LENGTHS), True, 0, -1, 128**-0.5)
    got = kernels.straight_through_operands(q, k, v, pb)
    want = attention_fp8.straight_through_operands(q, k, v, offsets.long(), kernels.BLOCK)
    for g, w, name in zip(got, want, "qkv"):
        assert g.dtype == torch.bfloat16 and g.shape == w.shape
        close = (g.double() - w.double()).abs() <= 2**-8 * w.double().abs()
        assert bool(close.all()) if name == "v" else close.double().mean() > 0.99 and _rel(g.float(), w) < 1e-2


def _fp8_gradients(
    mask: str, seed: int, precision: str = "fp8", backward_precision: str = "bf16"
) -> dict[str, tuple[torch.Tensor, ...]]:
    """dQ, dK, dV of the FP8 (or MXFP8) op on bf16 inputs (GQA), by backend (the kernels', the reference's in
    fp32)."""
    q, k, v, offsets = _batch(LENGTHS, heads=4, kv_heads=2, seed=seed)
    dout = torch.randn_like(q)
    kwargs = _mask_kwargs(MASKS[mask], LENGTHS)
    grads = {}
    for backend in ("triton", "reference"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = jagged_attention(*leaves, offsets, max(LENGTHS), backend=backend, precision=precision,
                               backward_precision=backward_precision, **kwargs)  # fmt: skip
        grads[backend] = torch.autograd.grad(out, leaves, dout)
    return grads


@pytest.mark.parametrize("mask", ["causal", "all_options"])
def test_backward_is_the_straight_through_one(mask):
    """bf16 kernels against the reference's FP8 backward in fp32 on the same bf16 inputs (GQA): dV to bf16
    rounding, dQ and dK within what the forward's quantized P does to rowsum(dO * O) (CPU: <= 3e-2)."""
    grads = _fp8_gradients(mask, seed=3)
    (dq, dk, dv), (want_dq, want_dk, want_dv) = grads["triton"], grads["reference"]
    assert _rel(dv, want_dv) < 1e-2
    assert _rel(dq, want_dq) < 5e-2 and _rel(dk, want_dk) < 5e-2


def test_fp8_backward_beats_the_forward_only_one_on_outlier_channels():
    """Against the fp32 gradient on outlier-channel inputs: the straight-through backward errs a fraction of the
    forward-only one (bf16 Q, K against the FP8 forward's log-sum-exp; CPU: 0.32-0.51 against 0.14-0.16)."""
    from opengem.ops.triton import jagged_attention as jfa_kernels

    lengths = [1024, 300, 700]
    q, k, v, offsets = _batch(lengths, seed=5, outliers=True)
    dout = torch.randn_like(q)
    ref_leaves = [t.float().requires_grad_() for t in (q, k, v)]
    true = torch.autograd.grad(reference(*ref_leaves, offsets, 1024), ref_leaves, dout.float())
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    fp8 = torch.autograd.grad(jagged_attention(*leaves, offsets, 1024, precision="fp8"), leaves, dout)
    _, pb = _problem(q, offsets, None, 1024, True, 0, -1, 128**-0.5)
    out, lse = kernels.forward(q, k, v, pb)
    forward_only = jfa_kernels.backward(dout, q, k, v, out, lse, pb)
    for new, old, want in list(zip(fp8, forward_only, true))[:2]:
        assert _rel(new, want) < 0.6 * _rel(old, want)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fused_qkv_projection_quantizes_like_the_quantize_pass(head_dim):
    """The QKV projection with the quantization in its epilogue: qkv within bf16 GEMM rounding of F.linear, and
    its FP8 blocks those the quantize pass writes from that same qkv (V bit for bit; rotated Q, K up to the
    rotation MMA's summation order)."""
    from opengem.ops.triton.qkv_projection_fp8 import project_quantize_qkv

    gen = torch.Generator(device="cuda").manual_seed(4)
    heads, model_dim = 2, 512
    x = torch.randn(sum(LENGTHS), model_dim, generator=gen, device="cuda").bfloat16()
    weight = (torch.randn(3 * heads * head_dim, model_dim, generator=gen, device="cuda") / model_dim**0.5).bfloat16()
    bias = torch.randn(3 * heads * head_dim, generator=gen, device="cuda").bfloat16()
    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    _, pb = _problem(x, offsets, None, max(LENGTHS), True, 0, -1, 1.0)
    qkv, quantized = project_quantize_qkv(x, weight, bias, heads, pb)
    assert _rel(qkv, torch.nn.functional.linear(x, weight, bias).view_as(qkv)) < 1e-2
    again = kernels.quantize_qkv(*qkv.unbind(1), pb)
    for data, scale, want_data, want_scale, transposed in (
        (quantized[0], quantized[3], again[0], again[3], False),
        (quantized[1], quantized[4], again[1], again[4], False),
        (quantized[2], quantized[5], again[2], again[5], True),
    ):
        got = kernels.unblock(data, scale, quantized[6], offsets.long(), transposed)
        want = kernels.unblock(want_data, want_scale, again[6], offsets.long(), transposed)
        assert_quantized_like(*got, *want, exact=transposed)


def test_fused_qkv_attention_matches_the_unfused_fp8_path():
    """qkv_attention(precision="fp8", fuse_projection=True): the fused projection + FP8 attention, forward and backward, against the
    projection by F.linear then the FP8 op (the same numerics but for rounding flips: far below FP8's error)."""
    from opengem.ops.jagged_attention import jagged_attention_packed
    from opengem.ops.qkv_attention import qkv_attention

    gen = torch.Generator(device="cuda").manual_seed(5)
    heads, head_dim, model_dim = 4, 128, 512
    x = torch.randn(sum(LENGTHS), model_dim, generator=gen, device="cuda").bfloat16()
    weight = (torch.randn(3 * heads * head_dim, model_dim, generator=gen, device="cuda") / model_dim**0.5).bfloat16()
    bias = torch.randn(3 * heads * head_dim, generator=gen, device="cuda").bfloat16()
    dout = torch.randn(sum(LENGTHS), heads, head_dim, generator=gen, device="cuda").bfloat16()
    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    kwargs = {"causal": True, "window": 100, "contextual_len": 4}
    results = []
    for fused in (True, False):
        leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
        if fused:
            out = qkv_attention(*leaves, offsets, max(LENGTHS), num_heads=heads, precision="fp8",
                                fuse_projection=True, **kwargs)  # fmt: skip
        else:
            qkv = torch.nn.functional.linear(*leaves).view(-1, 3, heads, head_dim)
            out = jagged_attention_packed(qkv, offsets, max(LENGTHS), precision="fp8", **kwargs)
        results.append([out, *torch.autograd.grad(out, leaves, dout)])
    for got, want in zip(*results):
        assert got.dtype == torch.bfloat16 and _rel(got, want) < 1e-2


GDPA_OPTIONS = dict(pre_scale=128**-0.5, post_scale=1.0, norm="max_len")


@pytest.mark.parametrize("mask", ["full", "causal", "all_options"])
@pytest.mark.parametrize("activation", [dict(activation="fast_gelu"), dict(head_activations=["silu", "gelu_tanh"] * 2)])
def test_gdpa_fp8_kernel_matches_emulation(mask, activation):
    """FP8 GDPA: the kernel against its emulation (same fp8 bits of Q, K, V; P quantized per row alike), apart
    from fp32 rounding, the MMA's accumulation order and tanh.approx (silu, gelu_tanh) flipping a few E4M3
    roundings of P: predicted below 1e-2 (the FP8 JFA's: 5e-3), against fp8's own ~5e-2 from fp32."""
    from opengem.ops.gdpa import gdpa
    from opengem.ops.reference.gdpa import gdpa as gdpa_reference
    from opengem.ops.reference.gdpa_fp8 import gdpa_fp8

    q, k, v, offsets = _batch(LENGTHS, heads=4, kv_heads=2, seed=11)
    kwargs = _mask_kwargs(MASKS[mask], LENGTHS)
    top = max(LENGTHS)
    out = gdpa(q, k, v, offsets, offsets, top, top, precision="fp8", **GDPA_OPTIONS, **activation, **kwargs)
    names = activation.get("head_activations") or [activation["activation"]] * 4
    options = dict(pre_scale=GDPA_OPTIONS["pre_scale"], out_scale=1.0 / top, **kwargs)
    want = gdpa_fp8(q, k, v, offsets, block=kernels.BLOCK, head_activations=names, **options)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert _rel(out, want) < 1e-2
    fp32 = gdpa_reference(q.float(), k.float(), v.float(), offsets, offsets, head_activations=names, **options)
    bf16 = gdpa(q, k, v, offsets, offsets, top, top, **GDPA_OPTIONS, **activation, **kwargs)
    assert 0.005 < _rel(out, fp32) < 0.1 and _rel(bf16, fp32) < 1e-2


def test_gdpa_fp8_backward_is_the_straight_through_one():
    """GDPA's bf16 backward kernels on the dequantized rotated operands against the reference's FP8 backward in
    fp32 (GQA, masked): bf16 rounding of the operands and gradients apart, the same gradient."""
    from opengem.ops.gdpa import gdpa

    q, k, v, offsets = _batch(LENGTHS, heads=4, kv_heads=2, seed=12)
    dout = torch.randn_like(q)
    kwargs = dict(_mask_kwargs(MASKS["all_options"], LENGTHS), activation="silu", **GDPA_OPTIONS)
    grads = {}
    for backend in ("triton", "reference"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        top = max(LENGTHS)
        out = gdpa(*leaves, offsets, offsets, top, top, backend=backend, precision="fp8", **kwargs)
        grads[backend] = torch.autograd.grad(out, leaves, dout)
    for got, want in zip(grads["triton"], grads["reference"]):
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all() and _rel(got, want) < 2e-2


@pytest.mark.parametrize("kv_len", [128, 256, 77])
def test_gdpa_fp8_cross_attention(kv_len):
    """Workload (b)'s shape, small: jagged Q against K/V of ``kv_len`` per sample (77: a partial block), GQA.
    The kernel against its emulation (as the self-attention test), against fp32 within FP8's error, and the
    straight-through backward against the reference's."""
    from opengem.ops.gdpa import gdpa
    from opengem.ops.reference.gdpa import gdpa as gdpa_reference
    from opengem.ops.reference.gdpa_fp8 import gdpa_fp8

    q, _, _, q_offsets = _batch(LENGTHS, heads=4, kv_heads=2, seed=13)
    k_lengths = [kv_len, 0, 1, kv_len, kv_len, kv_len]
    _, k, v, k_offsets = _batch(k_lengths, heads=4, kv_heads=2, seed=14)
    top = max(LENGTHS)
    dout = torch.randn_like(q)
    outs, grads = {}, {}
    for backend in ("triton", "reference"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = gdpa(*leaves, q_offsets, k_offsets, top, kv_len, backend=backend, precision="fp8",
                   activation="fast_gelu", **GDPA_OPTIONS)  # fmt: skip
        grads[backend] = torch.autograd.grad(out, leaves, dout)
        outs[backend] = out.detach()
    options = dict(head_activations=["fast_gelu"] * 4, pre_scale=GDPA_OPTIONS["pre_scale"], out_scale=1.0 / kv_len)
    emulated = gdpa_fp8(q, k, v, q_offsets, k_offsets, block=kernels.BLOCK, **options)
    assert torch.isfinite(outs["triton"]).all() and _rel(outs["triton"], emulated) < 1e-2
    assert _rel(outs["reference"], emulated) < 1e-2  # the op's reference path is the emulation, in bf16
    fp32 = gdpa_reference(q.float(), k.float(), v.float(), q_offsets, k_offsets, **options)
    assert 0.005 < _rel(outs["triton"], fp32) < 0.1
    for got, want in zip(grads["triton"], grads["reference"]):
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all() and _rel(got, want) < 2e-2


@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_block_attention_fp8(activation):
    """FP8 BlockAttention (the blocks of 64 as sequences of their own through the FP8 JFA / GDPA, time-aware
    rotary before): the kernels against the emulation (the same composition on the reference path), within
    FP8's error of fp32, and gradients against the emulation's."""
    from opengem.ops.block_attention import Rotary, block_attention

    q, k, v, offsets = _batch(LENGTHS, heads=4, kv_heads=2, seed=17)
    gen = torch.Generator(device="cuda").manual_seed(18)
    rotary = Rotary(time_gaps=torch.rand(q.shape[0], generator=gen, device="cuda") * 1e4, time_scale=60.0)
    dout = torch.randn_like(q)
    outs, grads = {}, {}
    for backend in ("triton", "reference"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = block_attention(*leaves, offsets, max(LENGTHS), block_size=64, activation=activation, rotary=rotary,
                              backend=backend, precision="fp8")  # fmt: skip
        grads[backend] = torch.autograd.grad(out, leaves, dout)
        outs[backend] = out.detach()
    assert torch.isfinite(outs["triton"]).all() and _rel(outs["triton"], outs["reference"]) < 1e-2
    fp32 = block_attention(q.float(), k.float(), v.float(), offsets, max(LENGTHS), block_size=64,
                           activation=activation, rotary=rotary, backend="reference")  # fmt: skip
    assert 0.005 < _rel(outs["triton"], fp32) < 0.1
    for got, want in zip(grads["triton"], grads["reference"]):
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all() and _rel(got, want) < 5e-2


@pytest.mark.parametrize("mask", ["causal", "all_options"])
def test_backward_with_fp8_products_matches_its_emulation(mask):
    """``backward_precision="fp8"``: the kernels' E4M3 S and dP (dO quantized) against the emulation in fp32 on
    the same bf16 inputs (GQA): apart from bf16 dS, P and operands in the three 16-bit products and the MMAs'
    accumulation, the same gradient (the CPU interpreter in fp32: ~1e-4); dV within bf16 rounding."""
    grads = _fp8_gradients(mask, seed=19, backward_precision="fp8")
    for got, want in zip(grads["triton"], grads["reference"]):
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all() and _rel(got, want) < 2e-2


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_mxfp8_operand_pass_matches_the_emulation(head_dim):
    """MXFP8's Triton operand pass (``mx_values``) on bf16 inputs: V (no rotation) the emulation's bits; rotated Q
    and K too but for elements whose fp32 sums on the tensor cores round to the neighbouring E4M3 value (the
    emulation sums in fp64): expected a few in a million, under 1e-4 asserted."""
    from opengem.ops.reference.attention_mxfp8 import straight_through_operands
    from opengem.ops.triton.jagged_attention_mxfp8 import mx_values

    q, k, v, offsets = _batch(LENGTHS, heads=4, kv_heads=2, head_dim=head_dim, seed=23)
    got = mx_values(q, k, v, offsets)
    want = straight_through_operands(q, k, v, offsets.long())
    for g, w, name in zip(got, want, "qkv"):
        assert g.dtype == torch.bfloat16 and g.shape == w.shape and torch.isfinite(g).all()
        differs = (g.float() != w).double().mean().item()
        assert differs == 0.0 if name == "v" else differs < 1e-4, (name, differs)


@pytest.mark.parametrize("mask", ["causal", "full", "all_options"])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 128), (4, 1, 64)])
def test_mxfp8_kernel_matches_emulation(mask, heads, kv_heads, head_dim):
    """``precision="mxfp8"``: the bf16 kernel with P quantized to MX-E4M3 in its key loop (hardware E4M3
    conversion) against the emulation (P quantized once per row): the same MX operands, so they differ by fp32
    rounding (ex2.approx, MMA order) flipping a few P roundings, as FP8's kernel does (< 5e-3 there)."""
    from opengem.ops.reference.attention_mxfp8 import jagged_attention_mxfp8

    q, k, v, offsets = _batch(LENGTHS, heads, kv_heads, head_dim, seed=21)
    kwargs = _mask_kwargs(MASKS[mask], LENGTHS)
    out = jagged_attention(q, k, v, offsets, max(LENGTHS), precision="mxfp8", **kwargs)
    want = jagged_attention_mxfp8(q, k, v, offsets, **kwargs)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert _rel(out, want) < 5e-3
    fp32 = reference(q.float(), k.float(), v.float(), offsets, max(LENGTHS), **kwargs)
    assert 1e-2 < _rel(out, fp32) < 8e-2


@pytest.mark.parametrize("mask", ["causal", "all_options"])
def test_mxfp8_backward_is_the_straight_through_one(mask):
    """The bf16 backward kernels on the MX operands against the reference's straight-through gradient in fp32."""
    grads = _fp8_gradients(mask, seed=22, precision="mxfp8")
    (dq, dk, dv), (want_dq, want_dk, want_dv) = grads["triton"], grads["reference"]
    assert all(g.dtype == torch.bfloat16 and torch.isfinite(g).all() for g in (dq, dk, dv))
    assert _rel(dv, want_dv) < 1e-2
    assert _rel(dq, want_dq) < 5e-2 and _rel(dk, want_dk) < 5e-2


@pytest.mark.parametrize("kv_len", [None, 77, 256])
def test_gdpa_mxfp8_kernel_matches_emulation(kv_len):
    """MXFP8 GDPA, masked self-attention (``kv_len`` None) and cross-attention with short K/V (resident K/V at
    77 and 256 keys): the kernel (P quantized per row in blocks of 32 keys by the hardware conversion) against its
    emulation, within fp32 rounding flipping a few E4M3 roundings (< 1e-2, FP8 GDPA's bound)."""
    from opengem.ops.gdpa import gdpa
    from opengem.ops.reference.gdpa import gdpa as gdpa_reference
    from opengem.ops.reference.gdpa_mxfp8 import gdpa_mxfp8

    q, k, v, offsets = _batch(LENGTHS, heads=4, kv_heads=2, seed=23)
    k_offsets, kwargs = offsets, _mask_kwargs(MASKS["all_options"], LENGTHS)
    if kv_len is not None:
        k_lengths = [min(kv_len, n + 1) for n in LENGTHS]
        _, k, v, k_offsets = _batch(k_lengths, heads=4, kv_heads=2, seed=24)
        kwargs = {}
    top_q, top_k = max(LENGTHS), int((k_offsets[1:] - k_offsets[:-1]).max())
    out = gdpa(q, k, v, offsets, k_offsets, top_q, top_k, precision="mxfp8", activation="silu",
               pre_scale=GDPA_OPTIONS["pre_scale"], **kwargs)  # fmt: skip
    options = dict(head_activations=["silu"] * 4, pre_scale=GDPA_OPTIONS["pre_scale"], **kwargs)
    want = gdpa_mxfp8(q, k, v, offsets, k_offsets, **options)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert _rel(out, want) < 1e-2
    fp32 = gdpa_reference(q.float(), k.float(), v.float(), offsets, k_offsets, **options)
    assert 0.005 < _rel(out, fp32) < 0.1
