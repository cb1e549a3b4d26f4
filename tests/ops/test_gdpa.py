"""GDPA: activations, reference (closed-form backward vs autograd), Triton kernels in the interpreter, op wiring."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import numpy as np  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from opengem.ops.activations import ACTIVATIONS, FAST_GELU_RADIUS, activation_grad, activation_value  # noqa: E402
from opengem.ops.attention_flops import visible_pairs  # noqa: E402
from opengem.ops.gdpa import gdpa, gdpa_packed_kv, hstu_attention  # noqa: E402
from opengem.ops.reference import gdpa as reference  # noqa: E402
from opengem.ops.reference.masks import attention_mask  # noqa: E402
from opengem.ops.triton.activations import activation_value_and_grad  # noqa: E402
from opengem.ops.triton.gdpa import GdpaArgs, gdpa_backward, gdpa_forward, key_chunks  # noqa: E402




def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)


def _inputs(q_lengths, k_lengths, heads=2, kv_heads=1, head_dim=16, dtype=torch.float32, seeds=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q_rows = seeds if seeds is not None else sum(q_lengths)
    q = torch.randn(q_rows, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(sum(k_lengths), kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(sum(k_lengths), kv_heads, head_dim, generator=gen).to(dtype)
    return q, k, v


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12))


# ---------------------------------------------------------------- activations


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_activation_derivative_matches_autograd(name):
    x = torch.linspace(-6, 6, 2001, dtype=torch.float64)
    # stay off the kinks (0, +-3, +-1.88) where one-sided derivatives differ
    x = x[(x.abs() > 1e-3) & ((x.abs() - 3).abs() > 1e-3) & ((x.abs() - 1.88).abs() > 1e-3)].requires_grad_(True)
    (auto,) = torch.autograd.grad(activation_value(name, x).sum(), x)
    torch.testing.assert_close(activation_grad(name, x.detach()), auto, atol=1e-10, rtol=1e-8)


@triton.jit
def _activation_kernel(X, Y, DY, act, N: tl.constexpr):
    offs = tl.arange(0, N)
    y, dy = activation_value_and_grad(tl.load(X + offs), act)
    tl.store(Y + offs, y)
    tl.store(DY + offs, dy)


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_triton_activation_table_matches_reference(name):
    x = torch.linspace(-5, 5, 256)
    y, dy = torch.empty_like(x), torch.empty_like(x)
    _activation_kernel[(1,)](x, y, dy, ACTIVATIONS.index(name), N=256)
    torch.testing.assert_close(y, activation_value(name, x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dy, activation_grad(name, x), atol=1e-5, rtol=1e-5)


def test_sigmoid_from_the_one_instruction_tanh_stays_within_its_bound():
    """The compiled 16-bit kernels take silu's sigmoid as (1 + tanh(x / 2)) / 2 from ``tanh.approx.f32``
    (relative error <= 2^-10.987): the identity holds, and the worst error of the approximate tanh moves
    the sigmoid by at most 2.5e-4 (gelu_tanh's 0.5 (1 + tanh) alike). The instruction itself runs only on
    the GPU (its tests compare against the reference in bf16)."""
    x = torch.linspace(-40, 40, 80001, dtype=torch.float64)
    t = torch.tanh(x / 2)
    torch.testing.assert_close(0.5 + 0.5 * t, torch.sigmoid(x), rtol=0, atol=1e-15)
    for rel in (2**-10.987, -(2**-10.987)):
        assert float((0.5 + 0.5 * t * (1 + rel) - torch.sigmoid(x)).abs().max()) <= 2.5e-4


def test_fast_gelu_is_close_to_gelu_and_exact_relu_outside_radius():
    x = torch.linspace(-8, 8, 4001)
    assert (activation_value("fast_gelu", x) - activation_value("gelu", x)).abs().max() < 0.07
    outside = x.abs() >= 1.88
    torch.testing.assert_close(activation_value("fast_gelu", x)[outside], torch.relu(x)[outside])


def test_fast_gelu_as_smoothstep_of_one_saturating_fma():
    """The compiled 16-bit kernels compute fast_gelu from ``v = clamp(x / 3.76 + 1/2, 0, 1)`` (one FFMA.SAT):
    ``phi(s x) = s x v^2 (3 - 2 v)`` and ``phi'(x) = 4 v^2 (3 - 2 v) - 3 v``, the clamp included. The instruction
    runs only on the GPU (its tests compare against the reference in bf16); the algebra is checked here."""
    x = torch.linspace(-6, 6, 120001, dtype=torch.float64)
    v = torch.clamp(x * (0.5 / FAST_GELU_RADIUS) + 0.5, 0.0, 1.0)
    gate = v * v * (3 - 2 * v)
    torch.testing.assert_close(x * gate, activation_value("fast_gelu", x), rtol=0, atol=1e-12)
    torch.testing.assert_close(4 * gate - 3 * v, activation_grad("fast_gelu", x), rtol=0, atol=1e-12)
    scale = 0.37  # the forward folds the pre-scale into the constants: scale * s * gate(scale * s)
    s = x / scale
    v = torch.clamp(s * (scale * 0.5 / FAST_GELU_RADIUS) + 0.5, 0.0, 1.0)
    torch.testing.assert_close(s * (v * v * (3 * scale - 2 * scale * v)), activation_value("fast_gelu", x),
                               rtol=0, atol=1e-12)


# ---------------------------------------------------------------- reference

_MASKS = {
    "full": {},
    "causal": {"causal": True},
    "targets": {"causal": True, "num_targets": [2, 0, 4]},
    "context": {"causal": True, "contextual_len": 3},
    "window_causal": {"causal": True, "window": 3},
    "window_full": {"window": 2},
    "targets_no_causal": {"num_targets": [1, 1, 3]},
    "everything": {"causal": True, "num_targets": [2, 0, 4], "contextual_len": 2, "window": 4},
}
_SELF_LENGTHS = [17, 1, 23]


def _mask_kwargs(spec: dict) -> dict:
    kwargs = dict(spec)
    if "num_targets" in kwargs:
        kwargs["num_targets"] = torch.tensor(kwargs["num_targets"], dtype=torch.int32)
    return kwargs


@pytest.mark.parametrize("mask, broadcast", [("full", False), ("everything", False), ("full", True)])
def test_reference_backward_matches_autograd(mask, broadcast):
    lengths = _SELF_LENGTHS
    q, k, v = _inputs(lengths, lengths, heads=4, kv_heads=2, seeds=5 if broadcast else None)
    offsets = _offsets(lengths)
    kwargs = dict(head_activations=["silu", "gelu", "relu2", "hardswish"], pre_scale=0.4, out_scale=0.3,
                  broadcast_q=broadcast, **_mask_kwargs(_MASKS[mask]))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = reference.gdpa(*leaves, offsets, offsets, **kwargs)
    grad_out = torch.randn_like(out)
    auto = torch.autograd.grad(out, leaves, grad_out)
    closed = reference.gdpa_backward(grad_out, q, k, v, offsets, offsets, **kwargs)
    for got, want in zip(closed, auto):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_reference_masks_after_the_activation():
    # every score is 16 (non-zero), so a masked pair only vanishes if the mask applies after phi
    lengths = [6]
    q = torch.ones(6, 1, 16)
    k = torch.ones(6, 1, 16)
    v = torch.ones(6, 1, 16)
    offsets = _offsets(lengths)
    out = reference.gdpa(q, k, v, offsets, offsets, head_activations=["identity"], causal=True)
    # row i sees i + 1 keys, each weight q.k = 16
    expected = 16.0 * torch.arange(1, 7, dtype=torch.float32)
    torch.testing.assert_close(out[:, 0, 0], expected)


# ---------------------------------------------------------------- Triton (interpreter) vs reference


def _run_triton_and_reference(q, k, v, q_offsets, k_offsets, max_len_q, max_len_k, acts, *, broadcast=False,
                              pre_scale=0.35, out_scale=0.6, mask=None, tol=2e-5):
    mask = _mask_kwargs(mask or {})
    kwargs = dict(head_activations=acts, pre_scale=pre_scale, out_scale=out_scale, broadcast_q=broadcast, **mask)
    out_ref = reference.gdpa(q, k, v, q_offsets, k_offsets, **kwargs)
    grad_out = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)
    grads_ref = reference.gdpa_backward(grad_out, q, k, v, q_offsets, k_offsets, **kwargs)
    args = GdpaArgs(
        head_activations=tuple(ACTIVATIONS.index(a) for a in acts), pre_scale=pre_scale, out_scale=out_scale,
        causal=mask.get("causal", False), contextual_len=mask.get("contextual_len", 0), window=mask.get("window"),
        broadcast_q=broadcast, max_len_q=max_len_q, max_len_k=max_len_k,
    )
    targets = mask.get("num_targets")
    # poisoned outputs: every element must be overwritten
    out = torch.full_like(out_ref, math.nan)
    gdpa_forward(q, k, v, q_offsets, k_offsets, targets, args, out=out)
    grads = tuple(torch.full_like(t, math.nan) for t in (q, k, v))
    gdpa_backward(grad_out, q, k, v, q_offsets, k_offsets, targets, args, grads=grads)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    assert _rel(out, out_ref) < tol, _rel(out, out_ref)
    for name, got, want in zip("qkv", grads, grads_ref):
        assert _rel(got, want) < tol, (name, _rel(got, want))
    return out, grads


@pytest.mark.parametrize("loads", ["tma", "pointer"])
@pytest.mark.parametrize("mask", list(_MASKS))
@pytest.mark.parametrize("max_len_k", [23, 300])  # short-KV resident variant, then the key-tile loop
def test_triton_self_attention_every_mask(monkeypatch, mask, max_len_k, loads):
    from opengem.ops.triton import gdpa as triton_gdpa

    if loads == "pointer":
        monkeypatch.setattr(triton_gdpa, "TMA_PASSES", triton_gdpa._tma_passes("none"))
    lengths = _SELF_LENGTHS
    q, k, v = _inputs(lengths, lengths)
    offsets = _offsets(lengths)
    _run_triton_and_reference(q, k, v, offsets, offsets, max_len_k, max_len_k, ["fast_gelu"] * 2, mask=_MASKS[mask])


@pytest.mark.parametrize("mask", ["full", "everything"])
def test_keys_work_order_gives_the_same_bits(monkeypatch, mask):
    """``OPENGEM_GDPA_WORK_ORDER`` moves tiles between programs, not their math: output and gradients under ``keys``
    equal ``work``'s bit for bit (several tiles a sample, partial last tiles; no mask, then every option at once)."""
    from opengem.ops.triton.gdpa import _INTERPRET, _work_list

    lengths = [70, 5, 45]
    host = np.array(lengths, dtype=np.int64).tobytes()
    lists = [_work_list(host, host, _INTERPRET.block_m, 1, "full", 0, "cpu", order)[0].tolist()
             for order in ("work", "keys")]
    assert lists[0] != lists[1]  # the forward's 16-row tiles in the interpreter: the orders differ here
    q, k, v = _inputs(lengths, lengths)
    offsets = _offsets(lengths)
    results = []
    for order in ("work", "keys"):
        monkeypatch.setenv("OPENGEM_GDPA_WORK_ORDER", order)
        results.append(_run_triton_and_reference(q, k, v, offsets, offsets, 70, 300, ["silu", "gelu"],
                                                 mask=_MASKS[mask]))
    (out_work, grads_work), (out_keys, grads_keys) = results
    assert torch.equal(out_work, out_keys)
    assert all(torch.equal(a, b) for a, b in zip(grads_work, grads_keys))


@pytest.mark.parametrize("max_len_k", [5, 300])
def test_triton_cross_attention_with_kv_lengths_zero_and_one(max_len_k):
    q_lengths, k_lengths = [19, 7, 0, 33], [5, 0, 1, 3]
    q, k, v = _inputs(q_lengths, k_lengths, heads=2, kv_heads=2)
    out, _ = _run_triton_and_reference(q, k, v, _offsets(q_lengths), _offsets(k_lengths), 33, max_len_k,
                                       ["silu", "gelu_tanh"])
    assert (out[19:26] == 0).all()  # the sample with no keys outputs exact zeros


@pytest.mark.parametrize("max_len_k, k_lengths", [(20, [20, 0, 1, 13, 7]), (300, [20, 0, 1, 13, 7]),
                                                  (40, [40, 3, 0, 25])])  # the last: sample 0 spans two dQ chunks
def test_triton_broadcast_q_and_deterministic_dq(max_len_k, k_lengths):
    q, k, v = _inputs([], k_lengths, heads=2, kv_heads=1, seeds=18)
    k_offsets = _offsets(k_lengths)
    _, grads = _run_triton_and_reference(q, k, v, k_offsets, k_offsets, 18, max_len_k, ["relu2", "leaky_relu"],
                                         broadcast=True)
    _, again = _run_triton_and_reference(q, k, v, k_offsets, k_offsets, 18, max_len_k, ["relu2", "leaky_relu"],
                                         broadcast=True)
    assert torch.equal(grads[0], again[0])


@pytest.mark.parametrize("seeds", [18, 70])  # the short-query dK/dV kernel (<= 64 seeds), then the generic one
def test_triton_broadcast_q_dkdv_kernels(monkeypatch, seeds):
    from opengem.ops.triton import gdpa as triton_gdpa

    launched = []
    for name in ("gdpa_bwd_dkdv_kernel", "gdpa_bwd_dkdv_short_q_kernel"):
        kernel = getattr(triton_gdpa, name)
        monkeypatch.setattr(triton_gdpa, name, _Recorded(kernel, name, launched))
    k_lengths = [40, 0, 1, 25]
    q, k, v = _inputs([], k_lengths, heads=2, kv_heads=1, seeds=seeds)
    k_offsets = _offsets(k_lengths)
    _run_triton_and_reference(q, k, v, k_offsets, k_offsets, seeds, 40, ["silu", "gelu"], broadcast=True)
    assert launched == ["gdpa_bwd_dkdv_short_q_kernel" if seeds <= 64 else "gdpa_bwd_dkdv_kernel"]


@pytest.mark.parametrize(
    "case",
    ["self_resident_q", "self_key_loop_q", "cross_resident_q", "cross_kv", "pooling_short_q_kv",
     "pooling_short_q_gqa_kv", "pooling_kv"],
)
def test_backward_column_sums_are_the_gradients_summed_over_tokens(case):
    """``gdpa_backward_with_column_sums``: the same dq, dk, dv as ``gdpa_backward``, and the column sums of dq
    (``"q"``: a Q projection's bias gradient; resident K/V with several query tiles a program, and the key loop) or
    of dk and dv (``"kv"``: the short-query dK/dV over several key tiles a program for <= 64 broadcast seeds, one Q
    head a K/V head and GQA, and the generic one), from the programs' tiles; samples without keys or queries
    included."""
    from opengem.ops.triton.gdpa import gdpa_backward_with_column_sums

    acts, broadcast, which = ["silu", "gelu_tanh"], case.startswith("pooling"), case.rsplit("_", 1)[1]
    if case.startswith("self"):
        q_lengths = k_lengths = [40, 1, 0, 23]
        max_len_k, mask = (40 if case == "self_resident_q" else 300), {"causal": True, "window": 9}
    elif case.startswith("cross"):
        q_lengths, k_lengths, max_len_k, mask = [19, 7, 0, 33], [5, 0, 1, 3], 5, {}
    else:
        q_lengths, k_lengths, mask = [], [40, 0, 1, 25], {}
        max_len_k = 40
    seeds = (70 if case == "pooling_kv" else 18) if broadcast else None
    kv_heads = 1 if "gqa" in case else 2
    q, k, v = _inputs(q_lengths, k_lengths, heads=2, kv_heads=kv_heads, seeds=seeds, seed=3)
    k_offsets = _offsets(k_lengths)
    q_offsets = k_offsets if broadcast else _offsets(q_lengths)
    max_len_q = seeds if broadcast else max(q_lengths)
    mask = _mask_kwargs(mask)
    args = GdpaArgs(head_activations=tuple(ACTIVATIONS.index(a) for a in acts), pre_scale=0.35, out_scale=0.6,
                    causal=mask.get("causal", False), contextual_len=0, window=mask.get("window"),
                    broadcast_q=broadcast, max_len_q=max_len_q, max_len_k=max_len_k)  # fmt: skip
    rows = seeds * len(k_lengths) if broadcast else q.shape[0]
    grad_out = torch.randn(rows, 2, 16, generator=torch.Generator().manual_seed(4))
    want = gdpa_backward(grad_out, q, k, v, q_offsets, k_offsets, None, args)
    *got, sums = gdpa_backward_with_column_sums(grad_out, q, k, v, q_offsets, k_offsets, None, args, which)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    expected = want[0].sum(0) if which == "q" else torch.stack([want[1].sum(0), want[2].sum(0)])
    assert sums.dtype == torch.float32 and sums.shape == expected.shape
    torch.testing.assert_close(sums, expected, rtol=1e-5, atol=1e-5)


def test_backward_column_sums_refuse_what_they_cannot_give():
    from opengem.ops.triton.gdpa import gdpa_backward_with_column_sums

    q, k, v = _inputs([], [3], seeds=4)
    offsets = _offsets([3])
    args = GdpaArgs(head_activations=(0,), pre_scale=1.0, out_scale=1.0, causal=False, contextual_len=0, window=None,
                    broadcast_q=True, max_len_q=4, max_len_k=3)  # fmt: skip
    grad_out = torch.zeros(4, 2, 16)
    with pytest.raises(ValueError, match="broadcast queries are shared by every sample"):
        gdpa_backward_with_column_sums(grad_out, q, k, v, offsets, offsets, None, args, "q")
    with pytest.raises(ValueError, match="which must be 'q' or 'kv', got 'v'"):
        gdpa_backward_with_column_sums(grad_out, q, k, v, offsets, offsets, None, args, "v")


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_dkdv_splits_long_samples_into_query_chunks(monkeypatch, kv_heads):
    """A sample whose query rows exceed a dK/dV program's share (``query_chunk_rows``) is split into chunks whose fp32
    partial dK/dV are summed in chunk order by ``gdpa_bwd_dkdv_chunk_sum_kernel``: gradients as the reference's, the
    K/V column sums as the gradients' sums, and bitwise repeatable. Short K/V (one and two key tiles, one empty),
    GQA and one K/V head a Q head; the poisoned gradients prove every row is written."""
    from opengem.ops.triton import gdpa as triton_gdpa
    from opengem.ops.triton.gdpa import gdpa_backward_with_column_sums

    monkeypatch.setattr(triton_gdpa, "_num_sms", lambda device: 16)  # 128-row chunks at these lengths
    launched = []
    for name in ("gdpa_bwd_dkdv_kernel", "gdpa_bwd_dkdv_chunk_sum_kernel"):
        monkeypatch.setattr(triton_gdpa, name, _Recorded(getattr(triton_gdpa, name), name, launched))
    q_lengths, k_lengths = [300, 10, 0, 40, 200], [5, 3, 2, 0, 20]
    q, k, v = _inputs(q_lengths, k_lengths, heads=2, kv_heads=kv_heads, seed=5)
    q_offsets, k_offsets = _offsets(q_lengths), _offsets(k_lengths)
    _, grads = _run_triton_and_reference(q, k, v, q_offsets, k_offsets, 300, 20, ["silu", "fast_gelu"])
    assert launched[:2] == ["gdpa_bwd_dkdv_kernel", "gdpa_bwd_dkdv_chunk_sum_kernel"]
    _, again = _run_triton_and_reference(q, k, v, q_offsets, k_offsets, 300, 20, ["silu", "fast_gelu"])
    assert all(torch.equal(a, b) for a, b in zip(grads, again))
    monkeypatch.setenv("OPENGEM_GDPA_WORK_ORDER", "work")  # the other tile order: the same bits
    _, other_order = _run_triton_and_reference(q, k, v, q_offsets, k_offsets, 300, 20, ["silu", "fast_gelu"])
    assert all(torch.equal(a, b) for a, b in zip(grads, other_order))
    monkeypatch.delenv("OPENGEM_GDPA_WORK_ORDER")
    args = GdpaArgs(head_activations=(ACTIVATIONS.index("silu"), ACTIVATIONS.index("fast_gelu")), pre_scale=0.35,
                    out_scale=0.6, causal=False, contextual_len=0, window=None, broadcast_q=False, max_len_q=300,
                    max_len_k=20)  # fmt: skip
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    *got, sums = gdpa_backward_with_column_sums(grad_out, q, k, v, q_offsets, k_offsets, None, args, "kv")
    torch.testing.assert_close(sums, torch.stack([got[1].sum(0), got[2].sum(0)]), rtol=1e-5, atol=1e-5)


def test_query_chunked_work_covers_every_key_tile_and_query_row_once():
    from opengem.ops.triton.gdpa import _query_chunked_work, query_chunk_rows

    q_len = np.array([300, 10, 0, 40, 200], dtype=np.int64)
    k_len = np.array([5, 3, 2, 0, 20], dtype=np.int64)
    # work: (300 + 10 + 0 + 0 + 2 x 200) query rows x key tiles x 2 K/V heads = 1,420, over 2 programs on each of 16
    # SMs: 44 rows -> 3 tiles of 16, raised to 8 tiles; on one SM 710 rows -> 45 tiles
    assert query_chunk_rows(q_len.tobytes(), k_len.tobytes(), 16, 16, 2, 16) == 128
    assert query_chunk_rows(q_len.tobytes(), k_len.tobytes(), 16, 16, 2, 1) == 720
    assert _query_chunked_work(k_len.tobytes(), q_len.tobytes(), 0, 16, 720, "cpu", "keys") is None  # none so long
    chunks = _query_chunked_work(k_len.tobytes(), q_len.tobytes(), 7, 16, 128, "cpu", "work")
    items = list(zip(chunks.work_b.tolist(), chunks.work_t.tolist(), map(tuple, chunks.bounds.tolist())))
    big = np.iinfo(np.int32).max
    # sample 0: 3 chunks (slots 0-2); sample 4's two key tiles: 2 chunks each (slots 3-4, 5-6); the rest whole
    assert sorted(items) == [
        (0, 0, (0, 128, 0)), (0, 0, (128, 256, 1)), (0, 0, (256, 384, 2)), (1, 0, (0, big, -1)), (2, 0, (0, big, -1)),
        (4, 0, (0, 128, 3)), (4, 0, (128, 256, 4)), (4, 1, (0, 128, 5)), (4, 1, (128, 256, 6)),
    ]
    assert chunks.slots == 7 and chunks.bounds.dtype == torch.int32
    # groups: (first dK row, key rows, first slot, chunks), rows counted from the offsets' first entry (7)
    assert chunks.groups.tolist() == [[7, 5, 0, 3], [17, 16, 3, 2], [33, 4, 5, 2]]
    # longest first by key rows x query rows: sample 4's first key tile's full 128-row chunks lead
    assert items[0][:2] == (4, 0) and items[-1][0] == 2
    keys = _query_chunked_work(k_len.tobytes(), q_len.tobytes(), 7, 16, 128, "cpu", "keys")
    keyed = list(zip(keys.work_b.tolist(), keys.work_t.tolist(), map(tuple, keys.bounds.tolist())))
    assert sorted(keyed) == sorted(items) and keys.groups.tolist() == chunks.groups.tolist()
    # by query rows, then the sample's keys: the full 128-row chunks first, sample 4's (20 keys) before sample 0's
    # (5), so sample 4's 4-key last tile runs beside its full one (by rows x keys it came after sample 0's chunks),
    # then 72, 44, 10 and 0 query rows
    assert [item[:2] for item in keyed] == [(4, 0), (4, 1), (0, 0), (0, 0), (4, 0), (4, 1), (0, 0), (1, 0), (2, 0)]
    assert [item[:2] for item in items].index((4, 1)) == 4


class _Recorded:
    """A Triton kernel whose launches (``kernel[grid](...)``) are recorded by name."""

    def __init__(self, kernel, name: str, launched: list) -> None:
        self.kernel, self.name, self.launched = kernel, name, launched

    def __getitem__(self, grid):
        self.launched.append(self.name)
        return self.kernel[grid]


def test_broadcast_dq_key_chunks_cover_each_sample_overlapping_them():
    # offsets 5, 45, 48, 48, 73: chunks of 30 rows from 5 -> [5, 35), [35, 65), [65, 95)
    chunks = key_chunks(np.array([40, 3, 0, 25], dtype=np.int64).tobytes(), 5, 30, 3, "cpu")
    assert chunks.dtype == torch.int32 and chunks.view(3, 2).tolist() == [[0, 1], [0, 4], [3, 4]]
    # one chunk over every sample, an empty one between them included
    assert key_chunks(np.array([2, 0, 5], dtype=np.int64).tobytes(), 0, 16, 1, "cpu").tolist() == [0, 3]


def test_triton_gqa_per_head_activations_fp16_head_dim_32():
    lengths = [9, 31, 2]
    q, k, v = _inputs(lengths, lengths, heads=4, kv_heads=2, head_dim=32, dtype=torch.float16)
    offsets = _offsets(lengths)
    _run_triton_and_reference(q, k, v, offsets, offsets, 31, 31, ["identity", "hardswish", "relu", "gelu"],
                              mask=_MASKS["targets"] | {"num_targets": [1, 4, 0]}, tol=3e-3)


@settings(max_examples=10, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 24), min_size=1, max_size=3),
    causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(0, 6)),
    contextual_len=st.integers(0, 3),
    activation=st.sampled_from(ACTIVATIONS),
    kv_heads=st.sampled_from([1, 2]),
)
def test_triton_property_self_attention(lengths, causal, window, contextual_len, activation, kv_heads):
    if sum(lengths) == 0:
        lengths = [1]
    q, k, v = _inputs(lengths, lengths, heads=2, kv_heads=kv_heads, seed=len(lengths))
    offsets = _offsets(lengths)
    mask = {"causal": causal, "window": window, "contextual_len": contextual_len}
    _run_triton_and_reference(q, k, v, offsets, offsets, max(lengths), max(lengths), [activation] * 2, mask=mask)


# ---------------------------------------------------------------- public op


def test_op_dispatches_reference_on_cpu_and_triton_when_forced():
    lengths = [11, 0, 6]
    offsets = _offsets(lengths)
    q, k, v = _inputs(lengths, lengths)
    outs, grads = [], []
    for backend in ("auto", "triton"):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = gdpa(*leaves, offsets, offsets, 11, 11, activation="gelu", pre_scale=0.5, post_scale=2.0,
                   norm="max_len", causal=True, backend=backend)
        out.backward(torch.ones_like(out))
        outs.append(out)
        grads.append([t.grad for t in leaves])
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    expected = reference.gdpa(q, k, v, offsets, offsets, head_activations=["gelu"] * 2, pre_scale=0.5,
                              out_scale=2.0 / 11, causal=True)
    torch.testing.assert_close(outs[0], expected)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("case", ["broadcast", "self_masked"])
def test_packed_kv_equals_the_unbound_views(backend, case):
    """``gdpa_packed_kv`` on a [Tk, 2, H_kv, D] projection output: ``gdpa``'s output on its ``unbind(1)`` views,
    dq equal, and the one packed K/V gradient equal to dK and dV stacked (the kernels write it directly)."""
    lengths = [20, 0, 1, 13, 7]
    offsets = _offsets(lengths)
    gen = torch.Generator().manual_seed(4)
    kv = torch.randn(sum(lengths), 2, 1, 16, generator=gen)
    if case == "broadcast":
        q = torch.randn(6, 2, 16, generator=gen)
        args, kwargs = (None, offsets, 6, 20), {"broadcast_q": True, "activation": "silu", "pre_scale": 0.25}
    else:
        q = torch.randn(sum(lengths), 2, 16, generator=gen)
        args, kwargs = (offsets, offsets, 20, 20), {"causal": True, "window": 5, "activation": "gelu", "norm": "max_len"}
    grad = torch.randn(q.shape[0] * (len(lengths) if case == "broadcast" else 1), 2, 16, generator=gen)
    q_leaf, kv_leaf = q.clone().requires_grad_(), kv.clone().requires_grad_()
    out = gdpa_packed_kv(q_leaf, kv_leaf, *args, backend=backend, **kwargs)
    dq, dkv = torch.autograd.grad(out, (q_leaf, kv_leaf), grad)
    leaves = [t.clone().requires_grad_() for t in (q, *kv.unbind(1))]
    want = gdpa(*leaves, *args, backend=backend, **kwargs)
    want_dq, want_dk, want_dv = torch.autograd.grad(want, leaves, grad)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(dq, want_dq, rtol=0, atol=0)
    torch.testing.assert_close(dkv, torch.stack([want_dk, want_dv], 1), rtol=0, atol=0)
    with FlopCounterMode(display=False) as counter:
        gdpa_packed_kv(q_leaf, kv_leaf, *args, backend=backend, **kwargs).backward(grad)
    with FlopCounterMode(display=False) as unpacked:
        gdpa(*leaves, *args, backend=backend, **kwargs).backward(grad)
    assert counter.get_total_flops() == unpacked.get_total_flops() > 0


def test_packed_kv_compiles_and_rejects_bad_shapes():
    lengths = [7, 3]
    offsets = _offsets(lengths)
    q = torch.randn(10, 2, 16, requires_grad=True)
    kv = torch.randn(10, 2, 1, 16, requires_grad=True)

    def f(q, kv):
        return gdpa_packed_kv(q, kv, offsets, offsets, 7, 7, activation="relu2", causal=True, norm=4.0)

    out = torch.compile(f, backend="aot_eager", fullgraph=True)(q, kv)
    dq, dkv = torch.autograd.grad(out.sum(), (q, kv))
    want_dq, want_dkv = torch.autograd.grad(f(q, kv).sum(), (q, kv))
    torch.testing.assert_close(out, f(q, kv))
    torch.testing.assert_close((dq, dkv), (want_dq, want_dkv))
    with pytest.raises(ValueError, match=_escape("kv must have shape [Tk, 2, H_kv, D], got [10, 3, 1, 16]")):
        gdpa_packed_kv(q, torch.randn(10, 3, 1, 16), offsets, offsets, 7, 7)
    with pytest.raises(ValueError, match="q_offsets is required unless broadcast_q=True"):
        gdpa_packed_kv(q, kv, None, offsets, 7, 7)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("layer", ["pffn_q", "pooling_kv"])
def test_projection_bias_gradient_comes_from_the_backward(monkeypatch, backend, layer):
    """``projection_bias``: the projection adds the bias without a gradient of its own and the op returns it, dq's
    (GEM's PFFN queries) or dkv's (seed pooling's keys and values) column sums, from the Triton backward's programs
    (``gdpa_backward_with_column_sums`` runs) or from the gradients on the reference path. x's and W's gradients are
    the unfused path's bit for bit, the bias's to fp32 summation order; also under ``torch.compile(fullgraph=True)``,
    and no bias gradient is made when the bias needs none."""
    import sys

    op_module = sys.modules["opengem.ops.gdpa"]  # (the package's ``gdpa`` attribute is the function)
    calls = []
    original = op_module.gdpa_backward_with_column_sums
    monkeypatch.setattr(op_module, "gdpa_backward_with_column_sums",
                        lambda *a, **k: (calls.append(a[-1]), original(*a, **k))[1])  # fmt: skip
    gen = torch.Generator().manual_seed(11)
    heads, head_dim, width = 2, 16, 24
    q_lengths, k_lengths = [19, 7, 0, 33], [5, 0, 1, 3]
    q_offsets, k_offsets = _offsets(q_lengths), _offsets(k_lengths)
    if layer == "pffn_q":
        x = torch.randn(sum(q_lengths), width, generator=gen)
        weight = torch.randn(heads * head_dim, width, generator=gen) / width**0.5
        k, v = (torch.randn(sum(k_lengths), heads, head_dim, generator=gen) for _ in range(2))
        rows = sum(q_lengths)
    else:
        x = torch.randn(sum(k_lengths), width, generator=gen)
        weight = torch.randn(2 * heads * head_dim, width, generator=gen) / width**0.5
        seeds = torch.randn(4, heads, head_dim, generator=gen)
        rows = 4 * len(k_lengths)
    bias = torch.randn(weight.shape[0], generator=gen)
    dout = torch.randn(rows, heads, head_dim, generator=gen)
    options = dict(activation="silu", pre_scale=0.3, backend=backend)

    def attend(x, w, b, fused):
        projected = torch.nn.functional.linear(x, w, b.detach() if fused else b)
        extra = {"projection_bias": b} if fused else {}
        if layer == "pffn_q":
            return gdpa(projected.view(-1, heads, head_dim), k, v, q_offsets, k_offsets, 33, 5, **options, **extra)
        return gdpa_packed_kv(seeds, projected.view(-1, 2, heads, head_dim), None, k_offsets, 4, 5, broadcast_q=True,
                              **options, **extra)  # fmt: skip

    def grads(fn, needs_bias=True):
        leaves = [x.clone().requires_grad_(), weight.clone().requires_grad_(), bias.clone().requires_grad_(needs_bias)]
        out = fn(*leaves)
        return out.detach(), torch.autograd.grad(out, leaves[:3] if needs_bias else leaves[:2], dout)

    want_out, (want_dx, want_dw, want_db) = grads(lambda x, w, b: attend(x, w, b, False))
    fused = lambda x, w, b: attend(x, w, b, True)  # noqa: E731
    for fn in (fused, torch.compile(fused, fullgraph=True, backend="aot_eager")):
        out, (dx, dw, db) = grads(fn)
        torch.testing.assert_close(out, want_out, rtol=0, atol=0)
        torch.testing.assert_close(dx, want_dx, rtol=0, atol=0)
        torch.testing.assert_close(dw, want_dw, rtol=0, atol=0)
        torch.testing.assert_close(db, want_db, rtol=1e-5, atol=1e-5)
    which = "q" if layer == "pffn_q" else "kv"
    assert calls == ([which, which] if backend == "triton" else [])
    _, (dx, _) = grads(fused, needs_bias=False)
    torch.testing.assert_close(dx, want_dx, rtol=0, atol=0)
    assert len(calls) == (2 if backend == "triton" else 0)


def test_projection_bias_is_checked():
    q, k, v = _inputs([5], [3], heads=2, kv_heads=2)
    offsets_q, offsets_k = _offsets([5]), _offsets([3])
    shape_error = _escape("projection_bias must have shape [32] (q's heads * head_dim), got [31]")
    with pytest.raises(ValueError, match=shape_error):
        gdpa(q, k, v, offsets_q, offsets_k, 5, 3, projection_bias=torch.zeros(31))
    with pytest.raises(ValueError, match="projection_bias must be a floating tensor on cpu, got torch.int64"):
        gdpa(q, k, v, offsets_q, offsets_k, 5, 3, projection_bias=torch.zeros(32, dtype=torch.long))
    with pytest.raises(ValueError, match="broadcast_q's q has none here"):
        gdpa(q[:4, :, :], k, v, None, offsets_k, 4, 3, broadcast_q=True, projection_bias=torch.zeros(32))
    kv = torch.stack([k, v], 1)
    with pytest.raises(ValueError, match=_escape("must have shape [64] (2 * kv heads * head_dim), got [32]")):
        gdpa_packed_kv(q, kv, offsets_q, offsets_k, 5, 3, projection_bias=torch.zeros(32))


def test_hstu_attention_is_silu_over_max_len_with_the_mask():
    lengths = [8, 5]
    offsets = _offsets(lengths)
    q, k, v = _inputs(lengths, lengths, heads=1, kv_heads=1)
    targets = torch.tensor([2, 1])
    out = hstu_attention(q, k, v, offsets, 10, alpha=0.3, num_targets=targets, contextual_len=1, window=3)
    # direct formula for sample 0
    mask = attention_mask(8, causal=True, num_targets=2, contextual_len=1, window=3)
    scores = torch.nn.functional.silu(0.3 * q[:8, 0] @ k[:8, 0].T) / 10
    torch.testing.assert_close(out[:8, 0], (scores * mask) @ v[:8, 0])
    with pytest.raises(ValueError, match="contextual_len must be a non-negative int, got -1"):
        hstu_attention(q, k, v, offsets, 10, alpha=0.3, causal=False, contextual_len=-1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        # errors name hstu_attention's own arguments: they had said pre_scale, max_len_q and q_offsets
        ({"alpha": "1"}, "hstu_attention: alpha must be a number, got '1'"),
        ({"alpha": float("nan")}, "hstu_attention: alpha must be finite, got nan"),  # NaN output
        ({"alpha": float("inf")}, "hstu_attention: alpha must be finite, got inf"),
        ({"causal": 0}, "hstu_attention: causal must be a bool, got 0"),
        ({"norm": float("inf")}, "hstu_attention: norm must be None, 'max_len' or a positive finite number, got inf"),
        ({"max_len": 7}, "max_len = 7 is shorter than the longest sequence (8)"),
        ({"offsets": torch.tensor([0, 8, 12])}, "offsets[-1] = 12 must equal the number of values, 13"),
    ],
)
def test_hstu_attention_errors_name_its_own_arguments(kwargs, message):
    lengths = [8, 5]
    q, k, v = _inputs(lengths, lengths, heads=1, kv_heads=1)
    args = {"offsets": _offsets(lengths), "max_len": 10, "alpha": 0.3} | kwargs
    with pytest.raises(ValueError, match="^" + _escape(message)):
        hstu_attention(q, k, v, args.pop("offsets"), args.pop("max_len"), **args)


def test_op_compiles_fullgraph_on_cpu():
    lengths = [7, 3]
    offsets = _offsets(lengths)
    q, k, v = (t.requires_grad_(True) for t in _inputs(lengths, lengths))

    def f(q, k, v):
        return gdpa(q, k, v, offsets, offsets, 7, 7, activation="relu2", causal=True, norm=4.0)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v)
    out.sum().backward()
    torch.testing.assert_close(out, f(q, k, v))
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_flop_counter_counts_useful_pairs():
    lengths = [9, 4, 0]
    offsets = _offsets(lengths)
    targets = torch.tensor([3, 1, 0])
    q, k, v = (t.requires_grad_(True) for t in _inputs(lengths, lengths, heads=2, kv_heads=1))
    with FlopCounterMode(display=False) as counter:
        out = gdpa(q, k, v, offsets, offsets, 9, 9, causal=True, num_targets=targets, window=2)
        out.sum().backward()
    pairs = sum(int(attention_mask(n, causal=True, num_targets=t, window=2).sum()) for n, t in zip(lengths, [3, 1, 0]))
    assert counter.get_total_flops() == 4 * 2 * 16 * pairs * 7 // 2


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 30), min_size=1, max_size=4),
    causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(0, 8)),
    contextual_len=st.integers(0, 5),
    data=st.data(),
)
def test_visible_pairs_matches_the_mask(lengths, causal, window, contextual_len, data):
    targets = [data.draw(st.integers(0, n)) for n in lengths]
    expected = sum(
        int(attention_mask(n, causal=causal, num_targets=t, contextual_len=contextual_len, window=window).sum())
        for n, t in zip(lengths, targets)
    )
    got = visible_pairs(torch.tensor(lengths), torch.tensor(lengths), masked=True, causal=causal,
                        num_targets=torch.tensor(targets), contextual_len=contextual_len, window=window)
    assert got == expected


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"activation": "swish"}, "unknown activation 'swish'"),
        ({"head_activations": ["silu"]}, "one activation per head"),
        ({"head_activations": ["silu", "tanh"]}, "head_activations: unknown activation 'tanh'"),
        ({"norm": "sum"}, "gdpa: norm must be None, 'max_len' or a positive finite number, got 'sum'"),
        ({"norm": float("inf")}, "gdpa: norm must be None, 'max_len' or a positive finite number, got inf"),  # zeros
        ({"norm": True}, "gdpa: norm must be None, 'max_len' or a positive finite number, got True"),
        ({"norm": 0.0}, "norm must be None"),
        ({"backend": "cuda"}, "backend must be one of"),
        ({"causal": True, "cross": True}, "q_offsets must equal k_offsets"),
        ({"broadcast_q": True}, "q_offsets must be None with broadcast_q"),
        ({"broadcast_q": True, "q_offsets": None, "max_len_q": 3}, "max_len_q must equal q.shape[0]"),
        ({"broadcast_q": True, "q_offsets": None, "max_len_q": 10, "window": 2}, "apply to self-attention"),
        ({"q_offsets": None}, "q_offsets is required"),
        ({"num_targets": torch.tensor([5, 0])}, "num_targets[0] = 5"),
        ({"max_len_k": 2}, "max_len_k = 2 is shorter"),
        ({"backend": "triton", "head_dim": 24}, "head_dim in"),
        # no other mask option set: a negative contextual_len left the op unmasked and went unchecked
        ({"contextual_len": -1}, "contextual_len must be a non-negative int, got -1"),
        ({"contextual_len": -1, "cross": True}, "contextual_len must be a non-negative int, got -1"),
        ({"window": -3}, "window must be None or a non-negative int, got -3"),
        ({"q_offsets": [0, 4, 10]}, "q_offsets must be a torch.Tensor, got list"),  # was an AttributeError
        ({"num_targets": [1, 1]}, "num_targets must be a torch.Tensor or None, got list"),
        ({"causal": "yes"}, "gdpa: causal must be a bool, got 'yes'"),  # reached torch's schema error
        ({"causal": 1}, "gdpa: causal must be a bool, got 1"),
        ({"broadcast_q": 0}, "gdpa: broadcast_q must be a bool, got 0"),
        ({"pre_scale": "2"}, "gdpa: pre_scale must be a number, got '2'"),  # was converted silently
        ({"post_scale": None}, "gdpa: post_scale must be a number, got None"),
        ({"pre_scale": float("nan")}, "gdpa: pre_scale must be finite, got nan"),  # NaN output
        ({"post_scale": float("inf")}, "gdpa: post_scale must be finite, got inf"),  # inf output
        ({"post_scale": False}, "gdpa: post_scale must be a number, got False"),
        ({"contextual_len": True}, "contextual_len must be a non-negative int, got True"),  # had been taken as 1
        ({"window": True}, "window must be None or a non-negative int, got True"),
        ({"head_dim": 0}, "head_dim must be >= 1, got 0"),  # returned an empty [T, H, 0]
    ],
)
def test_bad_inputs_raise_clear_errors(kwargs, message):
    kwargs = dict(kwargs)
    head_dim = kwargs.pop("head_dim", 16)
    lengths = [4, 6]
    offsets = _offsets(lengths)
    q, k, v = _inputs(lengths, lengths, head_dim=head_dim)
    q_offsets = kwargs.pop("q_offsets", offsets)
    if kwargs.pop("cross", False):
        q_offsets = _offsets([6, 4])
    max_len_q = kwargs.pop("max_len_q", 6)
    max_len_k = kwargs.pop("max_len_k", 6)
    with pytest.raises(ValueError, match=_escape(message)):
        gdpa(q, k, v, q_offsets, offsets, max_len_q, max_len_k, **kwargs)


def _escape(message: str) -> str:
    import re

    return re.escape(message)


def test_work_list_covers_every_tile_once_longest_first():
    from opengem.ops.triton.gdpa import _work_list

    rows = torch.tensor([100, 0, 33, 64, 1], dtype=torch.int64).numpy()
    cols = torch.tensor([10, 5, 300, 64, 0], dtype=torch.int64).numpy()
    work_b, work_t = _work_list(rows.tobytes(), cols.tobytes(), 16, 2, "full", 0, "cpu", "work")
    items = sorted(zip(work_b.tolist(), work_t.tolist()))
    # 2 tiles of 16 rows per item: 100 rows -> 4 items (tiles 0, 2, 4, 6), 33 -> 2, 64 -> 2, 1 -> 1
    assert items == [(0, 0), (0, 2), (0, 4), (0, 6), (2, 0), (2, 2), (3, 0), (3, 2), (4, 0)]
    assert work_b.dtype == torch.int32 and work_t.dtype == torch.int32
    # longest first by rows x keys: the full 32-row item over 300 keys leads, empty-key work comes last
    assert (work_b[0].item(), work_t[0].item()) == (2, 0)
    assert work_b[-1].item() == 4


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(st.integers(0, 300), min_size=1, max_size=6),
    block=st.sampled_from([16, 64]),
    tiles=st.sampled_from([1, 2]),
    kind=st.sampled_from(["full", "causal_q", "causal_k"]),
    window=st.sampled_from([0, 40]),
    data=st.data(),
)
def test_work_orders_list_every_tile_once_and_keys_keeps_samples_together(rows, block, tiles, kind, window, data):
    """Both orders list each (sample, first tile) item once, heaviest first by their own weight; in ``keys`` order an
    unmasked sample's items are one run (its partial last tile beside its full ones)."""
    from opengem.ops.triton.gdpa import WORK_ORDERS, _work_order

    cols = [data.draw(st.one_of(st.just(32), st.integers(0, 300))) for _ in rows]  # often alike, as PFFN's keys
    row_lengths, col_lengths = np.array(rows, dtype=np.int64), np.array(cols, dtype=np.int64)
    step = block * tiles
    expected = sorted((b, i * tiles) for b, n in enumerate(rows) for i in range(-(-n // step)))
    for order in WORK_ORDERS:
        sample, first = _work_order(row_lengths, col_lengths, block, tiles, kind, window, order)
        assert sorted(zip(sample.tolist(), first.tolist())) == expected
        if order == "keys" and kind == "full" and window == 0:
            runs = [b for i, b in enumerate(sample.tolist()) if i == 0 or sample[i - 1] != b]
            assert len(runs) == len(set(runs))  # no sample's items split by another's
            weights = [(max(cols[b], 1), rows[b]) for b in runs]  # keys first, then the sample's rows
            assert weights == sorted(weights, reverse=True)


@settings(max_examples=25, deadline=None)
@given(q_lengths=st.lists(st.integers(0, 400), min_size=1, max_size=5), data=st.data())
def test_query_chunked_orders_list_the_same_items(q_lengths, data):
    """The query-chunked dK/dV list holds the same items (and chunk groups) in both orders: only their order moves."""
    from opengem.ops.triton.gdpa import _query_chunked_work

    k_lengths = [data.draw(st.integers(0, 40)) for _ in q_lengths]
    q_bytes, k_bytes = np.array(q_lengths, dtype=np.int64).tobytes(), np.array(k_lengths, dtype=np.int64).tobytes()
    lists = [_query_chunked_work(k_bytes, q_bytes, 3, 16, 64, "cpu", order) for order in ("work", "keys")]
    if lists[0] is None:
        assert lists[1] is None and all(q <= 64 for q, k in zip(q_lengths, k_lengths) if k)  # no sample to split
        return
    items = [sorted(zip(c.work_b.tolist(), c.work_t.tolist(), map(tuple, c.bounds.tolist()))) for c in lists]
    assert items[0] == items[1]
    assert lists[0].groups.tolist() == lists[1].groups.tolist() and lists[0].slots == lists[1].slots


def test_work_list_keys_order_keeps_a_samples_tiles_adjacent(monkeypatch):
    """``OPENGEM_GDPA_WORK_ORDER=keys`` (the default): samples by keys, then by their rows, longest first, each
    sample's tiles (its partial last one included) in a row, so they share its K/V in L2; ``work`` puts the partial
    tile after fuller work."""
    from opengem.ops.triton import gdpa as triton_gdpa

    rows = np.array([40, 100, 70], dtype=np.int64)
    cols = np.array([40, 100, 70], dtype=np.int64)
    monkeypatch.delenv("OPENGEM_GDPA_WORK_ORDER", raising=False)
    order = triton_gdpa.work_order_setting()
    assert order == "keys"
    work_b, work_t = triton_gdpa._work_list(rows.tobytes(), cols.tobytes(), 32, 1, "full", 0, "cpu", order)
    assert list(zip(work_b.tolist(), work_t.tolist())) == [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (2, 1), (2, 2),
                                                           (0, 0), (0, 1)]
    work_b, work_t = triton_gdpa._work_list(rows.tobytes(), cols.tobytes(), 32, 1, "full", 0, "cpu", "work")
    # by rows x keys: sample 1's 4-row last tile (400) runs after sample 0's tiles (32 x 40 = 1280, 8 x 40 = 320)
    assert list(zip(work_b.tolist(), work_t.tolist()))[-2:] == [(1, 3), (0, 1)]
    table = triton_gdpa.gluon_work_items(rows.tobytes(), cols.tobytes(), 0, 0, 32, "cpu", order)
    assert table[:, 0].tolist() == [40, 72, 104, 136, 140, 172, 204, 0, 32]  # first query rows
    # keys alike for every sample (PFFN's 32 summary keys): longest sample first, not sample order, and each
    # sample's partial last tile right after its full ones
    rows_pffn = np.array([40, 200, 10, 130], dtype=np.int64)
    cols_pffn = np.full(4, 32, dtype=np.int64)
    work_b, work_t = triton_gdpa._work_list(rows_pffn.tobytes(), cols_pffn.tobytes(), 64, 1, "full", 0, "cpu", order)
    assert list(zip(work_b.tolist(), work_t.tolist())) == [(1, 0), (1, 1), (1, 2), (1, 3), (3, 0), (3, 1), (3, 2),
                                                           (0, 0), (2, 0)]
    monkeypatch.setenv("OPENGEM_GDPA_WORK_ORDER", "widest")
    with pytest.raises(ValueError, match=r"OPENGEM_GDPA_WORK_ORDER must be one of \('work', 'keys'\), got 'widest'"):
        triton_gdpa.work_order_setting()
    with pytest.raises(ValueError, match="work order must be one of"):
        triton_gdpa._work_order(rows, cols, 32, 1, "full", 0, "widest")


@pytest.mark.parametrize("broadcast", [True, False])
def test_triton_takes_strided_kv_views(broadcast):
    """K and V as the two halves of one [T, 2, H, D] projection (token stride 2 H D): the seed pooling passes
    them uncopied. Output and gradients equal those of contiguous copies."""
    lengths = [20, 0, 7, 13]
    offsets = _offsets(lengths)
    gen = torch.Generator().manual_seed(4)
    kv = torch.randn(sum(lengths), 2, 2, 16, generator=gen)
    seeds = 6 if broadcast else sum(lengths)
    q = torch.randn(seeds, 2, 16, generator=gen)
    grad_out = torch.randn(len(lengths) * seeds if broadcast else seeds, 2, 16, generator=gen)

    def run(split):
        q_leaf, kv_leaf = q.clone().requires_grad_(), kv.clone().requires_grad_()
        k, v = split(kv_leaf)
        out = gdpa(q_leaf, k, v, None if broadcast else offsets, offsets, seeds if broadcast else max(lengths),
                   max(lengths), activation="silu", pre_scale=0.25, broadcast_q=broadcast, backend="triton")
        out.backward(grad_out)
        return out.detach(), q_leaf.grad, kv_leaf.grad

    strided_views = lambda t: t.unbind(1)  # noqa: E731
    assert not strided_views(kv)[0].is_contiguous()
    for got, want in zip(run(strided_views), run(lambda t: tuple(x.contiguous() for x in t.unbind(1)))):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_tma_loads_only_where_the_tensors_and_the_setting_allow():
    """Every jagged pass tunes each candidate over both load paths where TMA descriptors can describe the
    tensors; an unaligned base, a broadcast gradient or ``OPENGEM_GDPA_TMA=none`` leaves pointer loads only,
    and both paths give the reference's result (the every-mask test runs each)."""
    from opengem.ops.triton import gdpa as triton_gdpa

    lengths = [20, 0, 7]
    q, k, v = _inputs(lengths, lengths)
    assert triton_gdpa._tma_possible("fwd", q, k, v) and triton_gdpa._tma_possible("dq", q, k, v, q)
    shifted = torch.randn(q.numel() + 1)[1:].view_as(q).copy_(q)
    assert not triton_gdpa._tma_possible("fwd", shifted, k, v)
    assert not triton_gdpa._tma_possible("dkdv", q, torch.randn(1, 2, 16).expand_as(q))  # e.g. out.sum()'s
    both = triton_gdpa._load_paths(triton_gdpa._FWD, True)
    assert [c.pointer_loads for c in both] == [False] * len(triton_gdpa._FWD) + [True] * len(triton_gdpa._FWD)
    assert {c.pointer_loads for c in triton_gdpa._load_paths(triton_gdpa._FWD, False)} == {True}
    # masked tiles with BLOCK_N = D compute wrong results through TMA on the GPU: pointer loads only
    wide, narrow = triton_gdpa.Config(128, 128, 8, 2), triton_gdpa.Config(128, 64, 8, 3)
    masked = triton_gdpa._load_paths((wide, narrow), True, head_dim=128, masked=True)
    assert [(c.block_n, c.pointer_loads) for c in masked] == [(64, False), (128, True), (64, True)]
    assert len(triton_gdpa._load_paths((wide,), True, head_dim=128, masked=False)) == 2
    assert [c.block_n for c in triton_gdpa._load_paths((wide, narrow), True, 64, True) if not c.pointer_loads] == [128]
    resident = triton_gdpa.Config(64, 0, 4, 3, 4)  # its key tile: the sample's K/V, padded to kv_block rows
    assert len(triton_gdpa._load_paths((resident,), True, head_dim=128, masked=True, kv_block=128)) == 1
    assert len(triton_gdpa._load_paths((resident,), True, head_dim=128, masked=True, kv_block=256)) == 2
    assert triton_gdpa._tma_passes("none") == frozenset() and triton_gdpa._tma_passes("dq, fwd") == {"dq", "fwd"}
    with pytest.raises(ValueError, match="OPENGEM_GDPA_TMA"):
        triton_gdpa._tma_passes("fwd,bwd")


def test_tuning_times_every_candidate_and_reports_them(monkeypatch):
    """The tuner picks the fastest candidate that runs, skips one that fails, and reports each one's time
    (the benchmark JSON's evidence for pruning candidates and load paths)."""
    from opengem.ops.triton import gdpa as triton_gdpa

    monkeypatch.setattr(triton_gdpa, "interpreting", lambda: False)
    monkeypatch.setattr(triton_gdpa, "_TUNED", {})
    monkeypatch.setattr(triton_gdpa, "_TIMINGS", {})
    monkeypatch.setattr(triton_gdpa, "_CONFIRMED", {})
    monkeypatch.delenv("OPENGEM_GDPA_TUNE", raising=False)
    times = iter([3.0, 1.0, 2.0])

    def fake_bench(fn, warmup, rep):
        fn()
        return next(times)

    monkeypatch.setattr(triton.testing, "do_bench", fake_bench)
    tiles = (triton_gdpa.Config(128, 64, 8, 3), triton_gdpa.Config(128, 128, 8, 2))
    candidates = triton_gdpa._load_paths(tiles, True)  # 2 tiles x 2 load paths
    failing = candidates[3]

    def launch(config):
        if config == failing:
            raise RuntimeError("out of shared memory")

    key = ("fwd", (("MASKED", False),), False, 2048, 256)
    assert triton_gdpa._tuned(key, candidates, launch) == candidates[1]
    assert triton_gdpa._tuned(key, candidates, launch) == candidates[1]  # timed once: the iterator is spent
    (report,) = triton_gdpa.tuning_report()
    assert report["pass"] == "fwd" and report["bucket_q"] == 2048 and report["masked"] is False
    assert report["pick"] == "m128_n128_w8_s2_t1_tma"
    assert report["candidates"] == {"m128_n64_w8_s3_t1_tma": 3.0, "m128_n128_w8_s2_t1_tma": 1.0,
                                    "m128_n64_w8_s3_t1_ptr": 2.0, "m128_n128_w8_s2_t1_ptr": None}
    assert report["confirmed"] == {}  # a clear winner (the next is 2x slower): no second look


def test_tuning_times_the_close_finalists_again_and_picks_their_fastest(monkeypatch):
    """As JFA's ConfirmingAutotuner: the candidates within 10% of the first look's best (up to 3) are timed again in
    the long window, whose fastest is the pick; a candidate further off is not timed again."""
    from opengem.ops.triton import gdpa as triton_gdpa
    from opengem.ops.triton.tuning import ConfirmingAutotuner

    monkeypatch.setattr(triton_gdpa, "interpreting", lambda: False)
    monkeypatch.setattr(triton_gdpa, "_TUNED", {})
    monkeypatch.setattr(triton_gdpa, "_TIMINGS", {})
    monkeypatch.setattr(triton_gdpa, "_CONFIRMED", {})
    monkeypatch.delenv("OPENGEM_GDPA_TUNE", raising=False)
    candidates = triton_gdpa._load_paths((triton_gdpa.Config(64, 32, 4, 4), triton_gdpa.Config(64, 64, 4, 3)), True)
    first = dict(zip(candidates, [1.00, 1.03, 1.20, 1.05]))
    second = dict(zip(candidates, [1.10, 1.02, None, 1.30]))
    calls: list[tuple[int, int]] = []
    launched: list[triton_gdpa.Config] = []

    def fake_bench(fn, warmup, rep):
        fn()
        calls.append((candidates.index(launched[-1]), warmup))
        return (second if (warmup, rep) == ConfirmingAutotuner.confirm_window_ms else first)[launched[-1]]

    monkeypatch.setattr(triton.testing, "do_bench", fake_bench)
    key = ("fwd", (("MASKED", False),), False, 1024, 1024)
    assert triton_gdpa._tuned(key, candidates, launched.append) == candidates[1]
    assert calls == [(0, 5), (1, 5), (2, 5), (3, 5), (0, 100), (1, 100), (3, 100)]
    (report,) = triton_gdpa.tuning_report()
    assert report["pick"] == triton_gdpa._label(candidates[1])
    assert report["confirmed"] == {triton_gdpa._label(candidates[i]): second[candidates[i]] for i in (0, 1, 3)}
    monkeypatch.setattr(ConfirmingAutotuner, "finalists", 1)  # one finalist: the one window decides
    assert triton_gdpa._tuned(key[:-1] + (2048,), candidates, launched.append) == candidates[0]
    assert len(calls) == 11


def test_tuning_key_splits_full_and_ragged_batches():
    """One max_len bucket, two fills: a batch at sparsity 1.0 and one at 0.5 are tuned apart (their best tiles
    differ), while batches of similar fill share a key."""
    from opengem.ops.triton import gdpa as triton_gdpa

    assert triton_gdpa.fill_bucket(3048, 3, 1024) == "full"
    assert triton_gdpa.fill_bucket(1824, 3, 1024) == "ragged"
    assert triton_gdpa.fill_bucket(0, 0, 0) == "ragged"
    args = GdpaArgs((7,), 1.0, 1.0, False, 0, None, False, 1024, 1024)
    q = torch.zeros(4, 2, 16)
    common = {"constexprs": {"MASKED": False}}

    def key(lengths: list[int], offset: int = 0, run_args: GdpaArgs = args) -> tuple:
        # offsets need not start at 0 (a slice of a larger batch): the fill counts tokens between the ends
        offsets = offset + torch.tensor(np.concatenate([[0], np.cumsum(lengths)]))
        return triton_gdpa._tune_key("fwd", q, q, run_args, common, triton_gdpa._batch_lengths(offsets, offsets, run_args))

    assert key([1024, 1000]) == key([990, 1024], offset=77) != key([1024, 200])
    # broadcast-Q: every sample holds max_len_q queries, so its query side is always full
    pooled = GdpaArgs((7,), 1.0, 1.0, False, 0, None, True, 32, 1024)
    assert key([1024, 200], run_args=pooled)[-2:] == ("full", "ragged")


def test_fast_activations_only_in_compiled_16_bit_kernels(monkeypatch):
    """The one-instruction tanh is chosen for bf16 / fp16 kernels on the GPU, never for fp32 inputs, the
    interpreter (no inline PTX) or with ``OPENGEM_GDPA_FAST_ACT=0``."""
    from opengem.ops.triton import gdpa as triton_gdpa

    args = GdpaArgs((7, 7), 1.0, 1.0, False, 0, None, False, 8, 8)

    def fast(dtype):
        return triton_gdpa._common(torch.zeros(1, 2, 16, dtype=dtype), args, None, None)["constexprs"]["FAST_ACT"]

    assert not fast(torch.bfloat16)  # the interpreter
    monkeypatch.setattr(triton_gdpa, "interpreting", lambda: False)
    assert fast(torch.bfloat16) and fast(torch.float16) and not fast(torch.float32)
    monkeypatch.setenv("OPENGEM_GDPA_FAST_ACT", "0")
    assert not fast(torch.bfloat16)


def test_interpreter_runs_the_tma_path(monkeypatch):
    """The interpreter tests take the descriptor path (the GPU's default), not only the pointer loads."""
    from opengem.ops.triton import gdpa as triton_gdpa

    used = []
    real = triton_gdpa._tile_descriptors
    monkeypatch.setattr(triton_gdpa, "_tile_descriptors", lambda *a: used.append(real(*a)[1]) or real(*a))
    lengths = [20, 0, 7]
    q, k, v = _inputs(lengths, lengths)
    offsets = _offsets(lengths)
    _run_triton_and_reference(q, k, v, offsets, offsets, 20, 20, ["silu"] * 2)
    assert used == [True, True, True]  # forward, dK/dV, dQ


@pytest.mark.parametrize("max_len_k, resident", [(256, True), (300, False)])
def test_short_kv_forward_times_the_key_loop_beside_resident_kv(monkeypatch, max_len_k, resident):
    """Resident K/V (candidates with block_n 0) holds one program per SM at K/V 256, D 128: the GPU's
    tuner also times the key loop's candidates for short K/V, and only those past 256."""
    from opengem.ops.triton import gdpa as triton_gdpa

    offered = []

    def record(key, candidates, launch):
        offered.append(candidates)
        return triton_gdpa._INTERPRET_RESIDENT if resident else triton_gdpa._INTERPRET  # runnable here

    monkeypatch.setattr(triton_gdpa, "interpreting", lambda: False)
    monkeypatch.setattr(triton_gdpa, "_tuned", record)
    q = torch.randn(40, 2, 16)
    k, v = torch.randn(2, max_len_k, 2, 16).unbind(0)
    offsets_q, offsets_k = torch.tensor([0, 40], dtype=torch.int32), torch.tensor([0, max_len_k], dtype=torch.int32)
    args = GdpaArgs((0, 0), 1.0, 1.0, False, 0, None, False, 40, max_len_k)
    out = gdpa_forward(q, k, v, offsets_q, offsets_k, None, args)
    assert torch.isfinite(out).all()
    kinds = {config.block_n == 0 for config in offered[0]}
    assert kinds == ({True, False} if resident else {False})


def test_gluon_forward_takes_only_what_it_was_written_for(monkeypatch):
    """The persistent Gluon forward (sm_90, triton 3.6) is a tuner candidate only for unmasked, non-broadcast, one-
    activation bf16 calls at D 128 with heads packed along rows and keys for every sample with queries; the GPU tests
    (``tests/gpu/test_gdpa_gluon_gpu.py``) run it."""
    from opengem.ops import gluon
    from opengem.ops.gluon import gdpa_forward as gluon_gdpa
    from opengem.ops.triton import gdpa as triton_gdpa

    lengths = np.array([300, 0, 7])
    q, k, v = _inputs(lengths.tolist(), lengths.tolist(), heads=4, kv_heads=2, head_dim=128, dtype=torch.bfloat16)
    plain = dict(masked=False, broadcast_q=False, uniform_activation=True, p_mx=False, q_lengths=lengths,
                 k_lengths=lengths)

    def reason(**changes):
        kwargs = plain | changes
        tensors = [kwargs.pop(name, default) for name, default in (("q", q), ("k", k), ("v", v), ("out", q))]
        return gluon_gdpa.unsupported(*tensors, **kwargs)

    assert reason() is None
    assert "masks" in reason(masked=True) and "broadcast-Q" in reason(broadcast_q=True) and "MX" in reason(p_mx=True)
    assert "per-head" in reason(uniform_activation=False)
    assert "bf16" in reason(q=q.half()) and "head_dim 128" in reason(v=v[..., :64].contiguous())
    packed = torch.zeros(q.shape[0], 3, 4, 128, dtype=torch.bfloat16)
    assert reason(q=packed[:, 0], out=packed[:, 2]) is None  # a packed QKV projection's views: row stride 3 H D
    assert "packed" in reason(q=q.transpose(0, 1).contiguous().transpose(0, 1))
    assert "no keys" in reason(k_lengths=np.array([300, 0, 0]))
    assert reason(q_lengths=np.array([300, 0, 0]), k_lengths=np.array([300, 5, 0])) is None  # no queries there
    # the op's tile for it is the kernel's
    tile = triton_gdpa._GLUON_FWD
    assert (tile.block_m, tile.block_n, tile.num_stages) == (gluon_gdpa.BLOCK_M, gluon_gdpa.BLOCK_N, gluon_gdpa.STAGES)
    assert triton_gdpa._label(tile) == "gluon_persistent_m128_n64_s3"
    assert gluon_gdpa.LAUNCH_REGISTERS == 168  # 12 warps, one program an SM
    # on this machine: no sm_90 GPU, so the Triton forward (the interpreter) runs
    assert not gluon.available(q.device)
    monkeypatch.delenv("OPENGEM_GDPA_GLUON", raising=False)
    assert triton_gdpa.gluon_forward_setting() == "off"  # opt-in until the GPU reruns it
    monkeypatch.setenv("OPENGEM_GDPA_GLUON", "sometimes")
    expected = r"OPENGEM_GDPA_GLUON must be one of \('auto', 'off', 'only'\), got 'sometimes'"
    with pytest.raises(ValueError, match=expected):
        triton_gdpa.gluon_forward_setting()


def test_gluon_work_items_list_every_query_tile_once_longest_first():
    """The Gluon forward's table: a row per 128-row query tile of every sample with queries, in the Triton forward's
    work order, each with its first query row, the rows left in its sample, its sample's first key row and keys
    (offsets that start past 0 included)."""
    from opengem.ops.triton import gdpa as triton_gdpa

    q_len, k_len = np.array([300, 0, 128, 5, 129]), np.array([10, 4, 0, 256, 1])
    q_start, k_start = 7 + np.cumsum(q_len) - q_len, 3 + np.cumsum(k_len) - k_len
    want = {(int(q_start[b] + t * 128), int(q_len[b] - t * 128), int(k_start[b]), int(k_len[b]))
            for b in range(5) for t in range(-(-int(q_len[b]) // 128))}
    firsts = []
    for order in triton_gdpa.WORK_ORDERS:
        table = triton_gdpa.gluon_work_items(q_len.tobytes(), k_len.tobytes(), 7, 3, 128, "cpu", order)
        assert table.dtype == torch.int32 and table.shape == (3 + 1 + 1 + 2, 4)
        rows = [tuple(r) for r in table.tolist()]
        assert sorted(rows) == sorted(want)
        work_b, work_t = triton_gdpa._work_list(q_len.tobytes(), k_len.tobytes(), 128, 1, "full", 0, "cpu", order)
        firsts.append([r[0] for r in rows])
        assert firsts[-1] == [int(q_start[b] + t * 128) for b, t in zip(work_b.tolist(), work_t.tolist())]
    assert firsts[0] != firsts[1]  # the two orders differ on these lengths, so both were checked
