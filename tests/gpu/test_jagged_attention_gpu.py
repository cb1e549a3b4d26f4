"""Jagged Flash Attention on the GPU in bf16 / fp16 against the fp32 reference (from the same inputs)."""

import pytest
import torch

from opengem.ops.jagged_attention import jagged_attention, jagged_attention_packed
from opengem.ops.reference.attention import jagged_attention as reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MASKS = {
    "causal": dict(causal=True),
    "full": dict(causal=False),
    "causal_window": dict(causal=True, window=64),
    "full_window": dict(causal=False, window=37),
    "targets_context": dict(causal=True, contextual_len=10, targets=True),
    "all_options": dict(causal=True, window=50, contextual_len=7, targets=True),
}


@pytest.fixture(autouse=True)
def untuned(monkeypatch):
    """The default config per kernel keeps compile time of this matrix short (the benchmark tunes)."""
    monkeypatch.setenv("OPENGEM_JFA_AUTOTUNE", "0")


def _batch(lengths: list[int], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    q, k, v, dout = (
        torch.randn(total, h, head_dim, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
        for h in (heads, kv_heads, kv_heads, heads)
    )
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return q, k, v, dout, offsets


def _mask_kwargs(spec: dict, lengths: list[int]) -> dict:
    kwargs = {key: value for key, value in spec.items() if key != "targets"}
    if spec.get("targets"):
        kwargs["num_targets"] = torch.tensor([min(n, 1 + n // 8) for n in lengths], device="cuda")
    return kwargs


def _forward_backward(q, k, v, dout, offsets, max_len, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = jagged_attention(*leaves, offsets, max_len, **kwargs)
    grads = torch.autograd.grad(out, leaves, dout)
    return [out.detach(), *grads]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    assert torch.isfinite(got).all()
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


def _check(lengths, heads, kv_heads, head_dim, dtype, tol, **kwargs):
    q, k, v, dout, offsets = _batch(lengths, heads, kv_heads, head_dim, dtype)
    max_len = max(lengths)
    got = _forward_backward(q, k, v, dout, offsets, max_len, **kwargs)
    # the reference path on the same low-precision inputs (fp32 math, rounded outputs) as a yardstick
    rounded = _forward_backward(q, k, v, dout, offsets, max_len, backend="reference", **kwargs)
    # the specification in fp32 from the very same low-precision inputs
    want = _forward_backward(q.float(), k.float(), v.float(), dout.float(), offsets, max_len, backend="reference", **kwargs)
    for name, g, r, w in zip(("out", "dq", "dk", "dv"), got, rounded, want):
        assert g.dtype == dtype
        assert _rel(g, w) < tol, (name, _rel(g, w), _rel(r, w))
        assert _rel(r, w) < tol, (name, _rel(r, w))


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_bf16_matches_reference(mask, head_dim):
    lengths = [300, 0, 1, 129, 64, 17, 511]
    _check(lengths, 4, 2, head_dim, torch.bfloat16, 1e-2, **_mask_kwargs(MASKS[mask], lengths))


def test_fp16_and_fp32_mqa():
    lengths = [200, 3, 77]
    _check(lengths, 4, 1, 128, torch.float16, 5e-3, causal=True)
    _check(lengths, 4, 1, 64, torch.float32, 1e-5, causal=True, window=20)


def test_long_sequences_sub_batch():
    lengths = [4100, 2, 1500]  # tiles at many diagonal / off-diagonal positions
    _check(lengths, 2, 2, 128, torch.bfloat16, 1.5e-2, causal=True)  # long rows sum more bf16 roundings


@pytest.mark.parametrize("mask", ["causal", "all_options"])
def test_packed_qkv_gradient_equals_the_stacked_one(mask):
    """The kernels write dq, dk, dv into one [T, 3, H, D] gradient (strided stores): bitwise the three
    separate gradients of the same views, stacked."""
    lengths = [300, 0, 1, 129, 511]
    gen = torch.Generator(device="cuda").manual_seed(2)
    qkv = torch.randn(sum(lengths), 3, 2, 128, generator=gen, device="cuda").to(torch.bfloat16)
    dout = torch.randn(sum(lengths), 2, 128, generator=gen, device="cuda").to(torch.bfloat16)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    kwargs = _mask_kwargs(MASKS[mask], lengths)
    leaf = qkv.clone().requires_grad_()
    out = jagged_attention_packed(leaf, offsets, 511, **kwargs)
    (dqkv,) = torch.autograd.grad(out, leaf, dout)
    want = _forward_backward(*qkv.unbind(1), dout, offsets, 511, **kwargs)
    assert torch.equal(out, want[0])
    assert torch.equal(dqkv, torch.stack(want[1:], 1))


def test_backward_is_deterministic():
    q, k, v, dout, offsets = _batch([700, 33, 1200], 4, 2, 128, torch.bfloat16, seed=5)
    first = _forward_backward(q, k, v, dout, offsets, 1200, causal=True)
    second = _forward_backward(q, k, v, dout, offsets, 1200, causal=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_new_lengths_in_the_same_bucket_reuse_the_tuned_config(monkeypatch):
    from opengem.ops.triton import jagged_attention as kernels

    monkeypatch.delenv("OPENGEM_JFA_AUTOTUNE")
    q, k, v, dout, offsets = _batch([300, 200], 4, 4, 128, torch.bfloat16)
    jagged_attention(q, k, v, offsets, 300)
    tuned = len(kernels._fwd_kernel.cache)
    q, k, v, dout, offsets = _batch([290, 10, 150], 4, 4, 128, torch.bfloat16, seed=1)
    out = jagged_attention(q, k, v, offsets, 290)
    assert len(kernels._fwd_kernel.cache) == tuned
    want = reference(q.float(), k.float(), v.float(), offsets, 290)
    assert _rel(out, want) < 1e-2


def _power_law_lengths(total: int = 150_000, low: int = 100, high: int = 16384, seed: int = 0) -> list[int]:
    """The benchmark's shape class: heavy-tailed lengths (pdf ~ x^-1.5) up to ``total`` tokens, one sample
    of exactly ``high`` among them, and a long last sample whose final tile runs past the end of the batch."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [high]
    while sum(lengths) < total - 5000:
        u = float(torch.rand((), generator=gen))
        lengths.append(int(min(high, max(low, (low**-0.5 + u * (high**-0.5 - low**-0.5)) ** -2))))
    lengths.insert(len(lengths) // 2, lengths.pop(0))  # the 16384 one in the middle of the batch
    return [*lengths, 4999]


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Buffers the kernels allocate start as NaN: a row they forget to write fails the finiteness check."""
    empty_like, empty = torch.empty_like, torch.empty

    def nan_like(*args, **kwargs):
        out = empty_like(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    def nan_empty(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty_like", nan_like)
    monkeypatch.setattr(torch, "empty", nan_empty)


def _check_samples(lengths, samples, tol, **kwargs):
    """Whole-batch run (every output finite), then the listed samples against the fp32 reference on each
    sample alone (a sample's outputs depend on it only), which keeps the reference small."""
    q, k, v, dout, offsets = _batch(lengths, 4, 4, 128, torch.bfloat16, seed=3)
    got = _forward_backward(q, k, v, dout, offsets, max(lengths), **kwargs)
    for name, g in zip(("out", "dq", "dk", "dv"), got):
        assert torch.isfinite(g).all(), name
    bounds = offsets.tolist()
    for b in samples:
        rows = slice(bounds[b], bounds[b + 1])
        one = torch.tensor([0, lengths[b]], dtype=torch.int32, device="cuda")
        sample = (t[rows].float() for t in (q, k, v, dout))
        want = _forward_backward(*sample, one, lengths[b], backend="reference", **kwargs)
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            assert _rel(g[rows], w) < tol, (b, lengths[b], name, _rel(g[rows], w))


@pytest.mark.parametrize("window", [None, 256])
def test_benchmark_shape_class_long_power_law_batch(poisoned_outputs, window):
    """benchmarks/jfa.py workloads (a) and (d): ~150k tokens, a 16384-long sample, H = 4, D = 128, bf16."""
    lengths = _power_law_lengths()
    assert 140_000 < sum(lengths) < 160_000 and 16384 in lengths
    samples = [0, lengths.index(16384), len(lengths) - 1]
    _check_samples(lengths, samples, 2e-2, causal=True, window=window)


@pytest.mark.parametrize(
    "configs",
    [
        # (BLOCK_M, BLOCK_N, num_warps, num_stages) of fwd, dkdv, dq: the curated non-default tile shapes
        ((64, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 3)),  # 64-row schedules in every kernel
        ((128, 128, 8, 3), (64, 128, 4, 3), (128, 128, 8, 2)),
        ((64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 1)),  # the short-sequence backward tiles
        ((64, 64, 4, 3), (64, 64, 4, 1), (64, 64, 4, 2)),
        ((64, 32, 4, 3), (64, 64, 4, 3), (64, 64, 4, 3)),  # the forward's 32-key tiles: two per 64-row causal diagonal
        ((64, 32, 4, 4), (64, 64, 4, 3), (64, 64, 4, 3)),
        # narrower inner tiles for the backward (GDPA's picks; candidates of benchmarks.diag.jfa_configs): 32 query
        # rows per dK/dV step (four per 128-key causal diagonal), 32 keys per dQ step
        ((64, 64, 4, 3), (32, 128, 8, 2), (64, 32, 4, 3)),
        ((64, 64, 4, 3), (32, 64, 4, 3), (128, 32, 8, 3)),
    ],
)
def test_curated_tile_shapes_the_autotuner_may_pick(poisoned_outputs, monkeypatch, configs):
    from opengem.ops.triton import jagged_attention as kernels

    for (name, kernel), tiles in zip(kernels.KERNELS.items(), configs):
        monkeypatch.setattr(kernel, "configs", [kernels.tile_config(name, *tiles)])
    lengths = [4100, 2, 1500, 129, 64, 63, 3001]
    _check_samples(lengths, range(len(lengths)), 1.5e-2, causal=True)


@pytest.mark.parametrize("tiles", [((128, 64, 8, 3), (64, 128, 8, 3)), ((64, 64, 4, 3), (64, 64, 4, 2))])
@pytest.mark.parametrize("mask", ["full_window", "all_options"])
def test_backward_column_sums_on_both_schedule_tiles(poisoned_outputs, monkeypatch, tiles, mask):
    """``backward_with_column_sums`` (a QKV bias's gradient from the kernels' fp32 tiles, the TMA path): the same
    dq, dk, dv as ``backward`` and their column sums, on 128-row dQ / 128-key dK/dV tiles (each zeroing the second
    64-row row of the sums buffer it covers) and on 64-row ones; the buffer starts as NaN. Twice: bitwise equal."""
    from opengem.ops.triton import jagged_attention as kernels

    (dq_tile, dkdv_tile) = tiles
    monkeypatch.setattr(kernels._dq_kernel, "configs", [kernels.tile_config("dq", *dq_tile)])
    monkeypatch.setattr(kernels._dkdv_kernel, "configs", [kernels.tile_config("dkdv", *dkdv_tile)])
    lengths = [300, 0, 1, 129, 511, 64, 65]
    q, k, v, dout, offsets = _batch(lengths, 4, 4, 128, torch.bfloat16, seed=7)
    kwargs = _mask_kwargs(MASKS[mask], lengths)
    opts = kernels.MaskOptions(kwargs["causal"], kwargs.get("contextual_len", 0), kwargs.get("window"))
    pb = kernels.problem(offsets, kwargs.get("num_targets"), opts, 511, 128**-0.5, q.device)
    out, lse = kernels.forward(q, k, v, pb)
    got = kernels.backward_with_column_sums(dout, q, k, v, out, lse, pb)
    again = kernels.backward_with_column_sums(dout, q, k, v, out, lse, pb)
    want = kernels.backward(dout, q, k, v, out, lse, pb)
    for g, a, w in zip(got[:3], again[:3], want):
        assert torch.equal(g, w) and torch.equal(a, w)
    assert torch.equal(got[3], again[3])
    summed = torch.stack([g.float().sum(0) for g in want])  # the bf16-rounded gradients, summed in fp32
    assert got[3].shape == (3, 4, 128) and _rel(got[3], summed) < 1e-2


def test_qkv_attention_bias_gradient_from_the_kernels():
    """``qkv_attention`` in bf16: the bias's gradient from JFA's backward kernels (the projection adds it without
    one) against autograd's column sum on the unfused path; x's and W's gradients bitwise the unfused path's."""
    from opengem.ops.qkv_attention import qkv_attention

    lengths, heads, dim = [300, 0, 1, 129, 511], 4, 512
    gen = torch.Generator(device="cuda").manual_seed(9)
    x = torch.randn(sum(lengths), dim, generator=gen, device="cuda").to(torch.bfloat16)
    weight = (torch.randn(3 * dim, dim, generator=gen, device="cuda") / dim**0.5).to(torch.bfloat16)
    bias = torch.randn(3 * dim, generator=gen, device="cuda").to(torch.bfloat16)
    dout = torch.randn(sum(lengths), heads, dim // heads, generator=gen, device="cuda").to(torch.bfloat16)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")

    def grads(fused: bool):
        leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
        if fused:
            out = qkv_attention(*leaves, offsets, 511, num_heads=heads, causal=False, window=64, contextual_len=8)
        else:
            qkv = torch.nn.functional.linear(*leaves).view(-1, 3, heads, dim // heads)
            out = jagged_attention_packed(qkv, offsets, 511, causal=False, window=64, contextual_len=8)
        return out, torch.autograd.grad(out, leaves, dout)

    (out, (dx, dw, db)), (want_out, (want_dx, want_dw, want_db)) = grads(True), grads(False)
    assert torch.equal(out, want_out) and torch.equal(dx, want_dx) and torch.equal(dw, want_dw)
    assert db.dtype == torch.bfloat16 and _rel(db, want_db) < 1e-2
