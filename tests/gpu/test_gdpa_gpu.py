"""GDPA Triton kernels on the GPU in bf16 against the fp32 reference (skipped without CUDA).

Tuning is off here (each pass's first candidate: one compile per variant, keeps the run short);
``test_every_tuning_candidate`` checks every candidate configuration instead.
"""

import math
import os

os.environ.setdefault("OPENGEM_GDPA_TUNE", "0")

import pytest
import torch
import triton
import triton.language as tl

from opengem.ops.activations import ACTIVATIONS, activation_grad, activation_value
from opengem.ops.gdpa import gdpa, gdpa_packed_kv, hstu_attention
from opengem.ops.reference import gdpa as reference
from opengem.ops.triton import gdpa as triton_gdpa
from opengem.ops.triton import launcher as launcher_module
from opengem.ops.triton.activations import activation_value_and_grad, scaled_activation_value
from opengem.ops.triton.gdpa import GdpaArgs, gdpa_backward, gdpa_forward
from opengem.ops.triton.gdpa_kernels import gdpa_fwd_kernel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEVICE = "cuda"


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths], device=DEVICE).cumsum(0).to(torch.int32)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.detach().double(), ref.detach().double()
    if not torch.isfinite(out64).all():
        return math.inf
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-12))


def _check(q_lengths, k_lengths, *, heads=4, kv_heads=4, head_dim=128, activation="fast_gelu",
           head_activations=None, seeds=None, mask=None, pre_scale=None, norm="max_len", tol=2e-2, seed=0):
    """Run the public op (Triton) with autograd and compare output and grads with the fp32 reference."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q_rows = seeds if seeds is not None else sum(q_lengths)
    shape_q, shape_kv = (q_rows, heads, head_dim), (sum(k_lengths), kv_heads, head_dim)
    q = torch.randn(shape_q, generator=gen, device=DEVICE).bfloat16().requires_grad_(True)
    k = torch.randn(shape_kv, generator=gen, device=DEVICE).bfloat16().requires_grad_(True)
    v = torch.randn(shape_kv, generator=gen, device=DEVICE).bfloat16().requires_grad_(True)
    q_offsets = None if seeds is not None else _offsets(q_lengths)
    k_offsets = _offsets(k_lengths)
    max_len_q = seeds if seeds is not None else max(q_lengths)
    max_len_k = max(k_lengths)
    mask = dict(mask or {})
    pre_scale = 1.0 / math.sqrt(head_dim) if pre_scale is None else pre_scale
    out = gdpa(q, k, v, q_offsets, k_offsets, max_len_q, max_len_k, activation=activation,
               head_activations=head_activations, pre_scale=pre_scale, norm=norm, broadcast_q=seeds is not None,
               **mask)
    grad_out = torch.randn(out.shape, generator=gen, device=DEVICE).bfloat16()
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    names = head_activations or [activation] * heads
    ref_kwargs = dict(head_activations=names, pre_scale=pre_scale, out_scale=1.0 / max(max_len_k, 1),
                      broadcast_q=seeds is not None, **mask)
    qf, kf, vf = (t.detach().float() for t in (q, k, v))
    ref_q_offsets = k_offsets if q_offsets is None else q_offsets
    out_ref = reference.gdpa(qf, kf, vf, ref_q_offsets, k_offsets, **ref_kwargs)
    grads_ref = reference.gdpa_backward(grad_out.float(), qf, kf, vf, ref_q_offsets, k_offsets, **ref_kwargs)
    assert _rel(out, out_ref) < tol, _rel(out, out_ref)
    for name, got, want in zip("qkv", grads, grads_ref):
        assert _rel(got, want) < tol, (name, _rel(got, want))
    return q, k, v, grads


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("lengths", [[200, 1, 0, 256, 77], [700, 129, 0, 1, 513]])  # short-KV, key-tile loop
def test_self_attention_full(head_dim, lengths):
    _check(lengths, lengths, head_dim=head_dim)


@pytest.mark.parametrize("pre_scale", [1.0, None])
def test_self_attention_with_the_longest_sample_last(pre_scale):
    """Session 66 (found by tests/gpu/test_offsets_layout_gpu.py): NaN and ~1e34 rows in the last sample's output
    on an H100 for these lengths at pre_scale 1 (resident K/V: the longest sample, 255 rows, ends the tensor, so
    its 256-row key tile reaches past the end). The other self-attention cases put a shorter sample last."""
    lengths = [130, 7, 0, 64, 255]
    _check(lengths, lengths, heads=2, activation="silu", pre_scale=pre_scale)


@pytest.mark.parametrize(
    "mask",
    [
        {"causal": True},
        {"causal": True, "num_targets": [5, 0, 0, 64]},
        {"window": 33},
        {"causal": True, "num_targets": [3, 1, 0, 17], "contextual_len": 4, "window": 100},
    ],
)
@pytest.mark.parametrize("lengths", [[200, 1, 0, 256], [700, 129, 0, 513]])
def test_self_attention_masks(mask, lengths):
    mask = dict(mask)
    if "num_targets" in mask:
        mask["num_targets"] = torch.tensor(mask["num_targets"], device=DEVICE)
    _check(lengths, lengths, activation="silu", mask=mask)


@pytest.mark.parametrize("kv_len", [128, 256, 300])
def test_cross_attention_short_kv_with_empty_and_single_keys(kv_len):
    q_lengths = [2048, 1000, 1, 0, 333]
    k_lengths = [kv_len, 0, 1, kv_len, kv_len // 2]
    _check(q_lengths, k_lengths, activation="gelu")


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_gqa_and_per_head_activations(kv_heads):
    lengths = [300, 17, 0, 64]
    _check(lengths, lengths, kv_heads=kv_heads, head_activations=["silu", "relu2", "gelu_tanh", "hardswish"],
           mask={"causal": True})


@pytest.mark.parametrize("seeds", [32, 128])
def test_broadcast_q_pooling_and_bitwise_deterministic_dq(seeds):
    k_lengths = [4096, 0, 1, 1500, 3000, 17] * 4
    q, k, v, grads = _check(None, k_lengths, seeds=seeds, activation="fast_gelu", kv_heads=2)
    out = gdpa(q, k, v, None, _offsets(k_lengths), seeds, 4096, activation="fast_gelu", broadcast_q=True,
               pre_scale=1.0 / math.sqrt(128), norm="max_len")
    grad_out = torch.randn(out.shape, generator=torch.Generator(device=DEVICE).manual_seed(3), device=DEVICE).bfloat16()
    first = torch.autograd.grad(out, (q,), grad_out, retain_graph=True)[0]
    second = torch.autograd.grad(out, (q,), grad_out)[0]
    assert torch.equal(first, second)


@triton.jit
def _fast_activation_kernel(X, Y, DY, SCALED, act, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(X + offs)
    y, dy = activation_value_and_grad(x, act, True)
    tl.store(Y + offs, y)
    tl.store(DY + offs, dy)
    tl.store(SCALED + offs, scaled_activation_value(x * 4.0, 0.25, act, True))


def test_fast_gelu_smoothstep_on_the_gpu_matches_the_cubic():
    """The compiled kernels' fast_gelu (one saturating FMA, smoothstep gate; pre-scale folded into the forward's
    constants) equals the reference's cubic in fp32, its derivative too, and keeps NaN and infinities as it."""
    x = torch.cat([torch.linspace(-6, 6, 4093), torch.tensor([float("nan"), float("inf"), -float("inf")])]).to(DEVICE)
    y, dy, scaled = (torch.empty_like(x) for _ in range(3))
    _fast_activation_kernel[(1,)](x, y, dy, scaled, ACTIVATIONS.index("fast_gelu"), N=4096)
    want = activation_value("fast_gelu", x)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(scaled, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(dy[:-3], activation_grad("fast_gelu", x[:-3]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("first", [0, 3, 6])
def test_every_activation_forward_and_backward(first):
    # per-head activations: the runtime-selected branch covers the whole table in 3 compiled variants
    names = [ACTIVATIONS[(first + i) % len(ACTIVATIONS)] for i in range(3)]
    lengths = [130, 5, 64, 700]
    _check(lengths, lengths, head_activations=names, heads=3, kv_heads=1, mask={"causal": True}, pre_scale=0.05)


@pytest.mark.parametrize("loads", ["fwd,dkdv,dq", "none"])  # TMA descriptors (tuning off runs them first), pointers
@pytest.mark.parametrize("max_len, forward, head_dim", [(256, "_FWD_RESIDENT", 128), (256, "_FWD", 128),
                                                        (700, "_FWD", 128), (256, "_FWD", 64)])
def test_every_tuning_candidate(monkeypatch, max_len, forward, head_dim, loads):
    """Each candidate alone (short K/V times the resident-K/V and the key-loop forwards side by side), on
    each load path, at D 128 and 64 (masked tiles with BLOCK_N = D went wrong through TMA: ``tma_tile_safe``)."""
    lengths = [max_len, 1, 0, 129, max_len // 3]
    targets = torch.tensor([7, 0, 0, 64, 3], device=DEVICE)
    for index in range(len(getattr(triton_gdpa, forward))):
        monkeypatch.setattr(triton_gdpa, "TMA_PASSES", triton_gdpa._tma_passes(loads))
        for name in (forward, "_DKDV", "_DQ"):
            candidates = getattr(triton_gdpa, name)
            monkeypatch.setattr(triton_gdpa, name, (candidates[index % len(candidates)],))
        other = {"_FWD": "_FWD_RESIDENT", "_FWD_RESIDENT": "_FWD"}[forward]
        monkeypatch.setattr(triton_gdpa, other, ())
        _check(lengths, lengths, activation="silu", mask={"causal": True, "num_targets": targets}, seed=index,
               head_dim=head_dim)
        _check(lengths, lengths, activation="fast_gelu", seed=index, head_dim=head_dim)
        monkeypatch.undo()


@pytest.mark.parametrize("loads", ["fwd,dkdv,dq", "none"])
@pytest.mark.parametrize("index", range(len(triton_gdpa._DQ_RESIDENT)))
def test_every_resident_kv_dq_candidate(monkeypatch, index, loads):
    """Each resident-K/V dQ candidate alone on each load path, on short-K/V cross-attention (GEM's PFFN shape: long
    jagged Q, 32 keys a sample, a sample without keys) and masked self-attention over K/V of up to 64."""
    monkeypatch.setattr(triton_gdpa, "TMA_PASSES", triton_gdpa._tma_passes(loads))
    monkeypatch.setattr(triton_gdpa, "_DQ_RESIDENT", (triton_gdpa._DQ_RESIDENT[index],))
    monkeypatch.setattr(triton_gdpa, "_DQ", ())  # no key-loop fallback: the resident candidate must run
    _check([700, 1, 50, 129, 2100], [32, 32, 0, 32, 32], activation="silu", pre_scale=0.09, seed=index)
    lengths = [64, 1, 0, 57, 40]  # key tiles of 64: masked TMA tiles are right where BLOCK_N != D
    targets = torch.tensor([7, 0, 0, 30, 3], device=DEVICE)
    _check(lengths, lengths, activation="fast_gelu", mask={"causal": True, "num_targets": targets}, seed=index)


@pytest.mark.parametrize("index", range(len(triton_gdpa._DKDV_SHORT_Q)))
def test_every_short_query_dkdv_candidate(monkeypatch, index):
    """Each broadcast-Q dK/dV candidate for short query sides alone (seed pooling: 16 and 64 seeds over jagged K/V,
    an empty sample and one longer than a program's key tiles), GQA and per-head activations."""
    monkeypatch.setattr(triton_gdpa, "_DKDV_SHORT_Q", (triton_gdpa._DKDV_SHORT_Q[index],))
    monkeypatch.setattr(triton_gdpa, "_DKDV", ())  # no fallback: the short-query candidate must run
    k_lengths = [4096, 0, 1, 700, 129]
    _check([], k_lengths, seeds=16, activation="silu", seed=index)
    _check([], k_lengths, seeds=64, heads=4, kv_heads=2, head_activations=["silu", "fast_gelu", "gelu", "relu2"],
           seed=index)


@pytest.mark.parametrize("seeds", [None, 16])
def test_packed_kv_gradient_equals_the_stacked_one(seeds):
    """Seed pooling and self-attention over one [Tk, 2, H, D] K/V projection: the kernels write dK and dV into one
    packed gradient (strided stores), bitwise the gradients of the unbound views stacked."""
    lengths = [700, 129, 0, 1, 513]
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    q = torch.randn(seeds or sum(lengths), 2, 128, generator=gen, device=DEVICE).bfloat16()
    kv = torch.randn(sum(lengths), 2, 2, 128, generator=gen, device=DEVICE).bfloat16()
    offsets = _offsets(lengths)
    args = (None, offsets, seeds, 700) if seeds else (offsets, offsets, 700, 700)
    kwargs = {"broadcast_q": True} if seeds else {"causal": True, "window": 100}
    q_leaf, kv_leaf = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out = gdpa_packed_kv(q_leaf, kv_leaf, *args, activation="silu", **kwargs)
    grad_out = torch.randn(out.shape, generator=gen, device=DEVICE).bfloat16()
    dq, dkv = torch.autograd.grad(out, (q_leaf, kv_leaf), grad_out)
    leaves = [t.clone().requires_grad_() for t in (q, *kv.unbind(1))]
    want = gdpa(*leaves, *args, activation="silu", **kwargs)
    want_dq, want_dk, want_dv = torch.autograd.grad(want, leaves, grad_out)
    assert torch.equal(out, want) and torch.equal(dq, want_dq)
    assert torch.equal(dkv, torch.stack([want_dk, want_dv], 1))


def test_hstu_attention_matches_reference():
    lengths = [1000, 100, 0, 2048]
    offsets = _offsets(lengths)
    targets = torch.tensor([64, 10, 0, 64], device=DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), 4, 128, generator=gen, device=DEVICE).bfloat16() for _ in range(3))
    out = hstu_attention(q, k, v, offsets, 2048, alpha=0.1, num_targets=targets, contextual_len=3)
    ref = reference.gdpa(q.float(), k.float(), v.float(), offsets, offsets, head_activations=["silu"] * 4,
                         pre_scale=0.1, out_scale=1 / 2048, causal=True, num_targets=targets, contextual_len=3)
    assert _rel(out, ref) < 2e-2


def test_kernels_overwrite_poisoned_outputs():
    q_lengths, k_lengths = [300, 0, 65], [256, 3, 0]
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(sum(q_lengths), 4, 128, generator=gen, device=DEVICE).bfloat16()
    k, v = (torch.randn(sum(k_lengths), 4, 128, generator=gen, device=DEVICE).bfloat16() for _ in range(2))
    q_offsets, k_offsets = _offsets(q_lengths), _offsets(k_lengths)
    for max_len_k in (256, 1000):
        args = GdpaArgs((3,) * 4, 0.1, 0.01, False, 0, None, False, 300, max_len_k)
        out = torch.full_like(q, math.nan)
        gdpa_forward(q, k, v, q_offsets, k_offsets, None, args, out=out)
        grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))
        gdpa_backward(torch.randn_like(q), q, k, v, q_offsets, k_offsets, None, args, grads=grads)
        assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
        assert (out[300:365] == 0).all()  # the last sample has no keys: exact zeros


def test_compiles_fullgraph_on_cuda():
    lengths = [100, 7]
    offsets = _offsets(lengths)
    q, k, v = (torch.randn(107, 4, 64, device=DEVICE).bfloat16().requires_grad_(True) for _ in range(3))

    def f(q, k, v):
        return gdpa(q, k, v, offsets, offsets, 100, 100, activation="silu", causal=True)

    out = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
    out.float().sum().backward()
    assert _rel(out, f(q, k, v)) == 0.0


@pytest.mark.parametrize("tuned", [False, True])
@pytest.mark.parametrize("layer", ["pffn_q", "self_q", "pooling_kv", "cross_kv"])
def test_projection_bias_gradient_from_the_backward_kernels(monkeypatch, layer, tuned):
    """``projection_bias`` in bf16: the bias gradient from the dQ (GEM's PFFN: resident K/V; masked self-attention:
    the key loop) or dK/dV programs (seed pooling: the short-query kernel; cross-attention: the generic one, its long
    samples in query chunks) against autograd's column sum on the unfused path, x's and W's gradients bitwise the
    unfused path's on the same tile; with tuning on, every candidate of the column-sum variants is timed and the pick
    runs. (The column-sum variants tune apart, so tuned picks may differ from the unfused path's, and another tile sums
    in another order: those gradients are compared to a tolerance.)"""
    if tuned:
        monkeypatch.setenv("OPENGEM_GDPA_TUNE", "1")
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    heads, head_dim, width = 4, 128, 512
    q_lengths, k_lengths = {"pffn_q": ([700, 1, 0, 129, 2100], [32, 32, 0, 32, 32]),
                            "self_q": ([300, 1, 0, 511], [300, 1, 0, 511]),
                            "pooling_kv": ([], [4096, 0, 1, 700, 129]),
                            "cross_kv": ([700, 1, 0, 129, 2100], [200, 3, 0, 1, 256])}[layer]  # fmt: skip
    projected_rows = sum(q_lengths) if layer.endswith("q") else sum(k_lengths)
    out_width = heads * head_dim * (1 if layer.endswith("q") else 2)
    x = torch.randn(projected_rows, width, generator=gen, device=DEVICE).bfloat16()
    weight = (torch.randn(out_width, width, generator=gen, device=DEVICE) / width**0.5).bfloat16()
    bias = torch.randn(out_width, generator=gen, device=DEVICE).bfloat16()
    # the other side: keys and values for a projected q; the seeds, or the jagged queries, for a projected kv
    other_rows = {"pffn_q": sum(k_lengths), "self_q": sum(k_lengths), "pooling_kv": 16, "cross_kv": sum(q_lengths)}
    other = torch.randn(other_rows[layer], heads, head_dim, generator=gen, device=DEVICE).bfloat16()
    q_offsets, k_offsets = (_offsets(q_lengths) if q_lengths else None), _offsets(k_lengths)
    mask = {"causal": True, "window": 64} if layer == "self_q" else {}
    options = dict(activation="silu", pre_scale=0.09, **mask)

    def attend(x, w, b, fused):
        projected = torch.nn.functional.linear(x, w, b.detach() if fused else b)
        extra = {"projection_bias": b} if fused else {}
        if layer.endswith("q"):
            return gdpa(projected.view(-1, heads, head_dim), other, other, q_offsets, k_offsets, max(q_lengths),
                        max(k_lengths), **options, **extra)  # fmt: skip
        kv = projected.view(-1, 2, heads, head_dim)
        if layer == "pooling_kv":
            return gdpa_packed_kv(other, kv, None, k_offsets, 16, max(k_lengths), broadcast_q=True, **options, **extra)
        return gdpa_packed_kv(other, kv, q_offsets, k_offsets, max(q_lengths), max(k_lengths), **options, **extra)

    grad_out = None

    def grads(fused):
        nonlocal grad_out
        leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
        out = attend(*leaves, fused)
        if grad_out is None:
            grad_out = torch.randn(out.shape, generator=gen, device=DEVICE).bfloat16()
        return out, torch.autograd.grad(out, leaves, grad_out)

    (out, (dx, dw, db)), (want_out, (want_dx, want_dw, want_db)) = grads(True), grads(False)
    assert torch.equal(out, want_out)
    picks = {(entry["pass"], entry["pick"]) for entry in triton_gdpa.tuning_report()}
    if tuned:
        assert _rel(dx, want_dx) < 1e-2 and _rel(dw, want_dw) < 1e-2, (_rel(dx, want_dx), _rel(dw, want_dw), picks)
    else:
        assert torch.equal(dx, want_dx) and torch.equal(dw, want_dw)
    assert db.dtype == torch.bfloat16 and _rel(db, want_db) < 1e-2


@pytest.mark.parametrize("index", range(len(triton_gdpa._DKDV)))
def test_dkdv_query_chunks_with_every_candidate(monkeypatch, index):
    """A power-law PFFN-like batch (one sample of 20,000 queries among a hundred of 97; 32 keys a sample) makes the
    dK/dV pass split the long sample's query rows into chunks on the device's own SM count (``query_chunk_rows``):
    each dK/dV candidate alone, gradients against the fp32 reference, bitwise repeatable, and the K/V column sums (a
    projection bias's gradient) equal to the gradients' sums."""
    config = triton_gdpa._DKDV[index]
    monkeypatch.setattr(triton_gdpa, "_DKDV", (config,))
    q_lengths, k_lengths = [20000, 0, 1] + [97] * 100, [32, 32, 0] + [32] * 100
    chunk_rows = triton_gdpa.query_chunk_rows(
        torch.tensor(q_lengths).numpy().tobytes(), torch.tensor(k_lengths).numpy().tobytes(), config.block_m,
        config.block_n, 4, triton_gdpa._num_sms(torch.device(DEVICE)))
    assert chunk_rows < 20000  # the long sample is split
    launched = []
    kernel = triton_gdpa.gdpa_bwd_dkdv_chunk_sum_kernel

    class Recorded:
        def __getitem__(self, grid):
            launched.append(grid)
            return kernel[grid]

    monkeypatch.setattr(triton_gdpa, "gdpa_bwd_dkdv_chunk_sum_kernel", Recorded())
    _, _, _, grads = _check(q_lengths, k_lengths, activation="silu", pre_scale=0.09, seed=index)
    assert launched
    _, _, _, again = _check(q_lengths, k_lengths, activation="silu", pre_scale=0.09, seed=index)
    assert all(torch.equal(a, b) for a, b in zip(grads, again))
    gen = torch.Generator(device=DEVICE).manual_seed(index)
    q, k, v = (torch.randn(rows, 4, 128, generator=gen, device=DEVICE).bfloat16()
               for rows in (sum(q_lengths), sum(k_lengths), sum(k_lengths)))
    args = GdpaArgs(head_activations=(ACTIVATIONS.index("silu"),) * 4, pre_scale=0.09, out_scale=1 / 32, causal=False,
                    contextual_len=0, window=None, broadcast_q=False, max_len_q=20000, max_len_k=32)  # fmt: skip
    grad_out = torch.randn(q.shape, generator=gen, device=DEVICE).bfloat16()
    _, dk, dv, sums = triton_gdpa.gdpa_backward_with_column_sums(
        grad_out, q, k, v, _offsets(q_lengths), _offsets(k_lengths), None, args, "kv")
    want = torch.stack([dk.float().sum(0), dv.float().sum(0)])
    assert _rel(sums, want) < 1e-2, _rel(sums, want)


def test_repeat_launches_skip_triton_with_the_same_bits(monkeypatch):
    """The cached launcher (:mod:`opengem.ops.triton.launcher`): a repeat call skips Triton's launch path and gives
    the bits Triton's own path gives."""
    gen = torch.Generator().manual_seed(0)
    lengths = [300, 17, 0, 129]
    offsets = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32).to(DEVICE)
    q, k, v = (torch.randn(sum(lengths), 2, 64, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(3))

    def run() -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = gdpa(*leaves, offsets, offsets, 300, 300, activation="fast_gelu", backend="triton")
        out.backward(torch.ones_like(out))
        return [out.detach(), *(t.grad for t in leaves)]

    cached = run()  # compiles and tunes through Triton
    forward = launcher_module.launcher(gdpa_fwd_kernel)
    before = forward.through_triton
    assert torch.equal(torch.stack(run()), torch.stack(cached)) and forward.through_triton == before
    monkeypatch.setattr(launcher_module, "CACHED", False)
    assert torch.equal(torch.stack(run()), torch.stack(cached))  # Triton's own path, the same bits
