"""Jagged Flash Attention: Triton kernels (interpreter) and the CPU path against the fp32 reference."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math
import re

import pytest
import torch
import triton
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from opengem.ops.jagged_attention import attention_pairs, jagged_attention, jagged_attention_packed
from opengem.ops.reference.attention import jagged_attention as reference
from opengem.ops.reference.masks import attention_mask
from opengem.ops.triton import jagged_attention as kernels
from opengem.ops.triton.ragged_tiles import ragged_descriptor, tma_ok

MASKS = {
    "causal": dict(causal=True),
    "full": dict(causal=False),
    "causal_window": dict(causal=True, window=5),
    "full_window": dict(causal=False, window=3),
    "targets_context": dict(causal=True, contextual_len=5, targets=[4, 0, 1, 20, 3]),
    "all_options": dict(causal=True, window=4, contextual_len=3, targets=[6, 0, 0, 2, 16]),
    "full_all_options": dict(causal=False, window=20, contextual_len=18, targets=[6, 0, 0, 2, 16]),
}
LENGTHS = [37, 0, 1, 20, 16]  # several tiles of 16, empty, single token, partial tiles


def _offsets(lengths: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=dtype)


def _inputs(lengths, heads=2, kv_heads=1, head_dim=16, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, head_dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
    dout = torch.randn(total, heads, head_dim, generator=gen).to(dtype)
    return q, k, v, dout


def _mask_kwargs(spec: dict) -> dict:
    kwargs = {k: v for k, v in spec.items() if k != "targets"}
    if "targets" in spec:
        kwargs["num_targets"] = torch.tensor(spec["targets"])
    return kwargs


@pytest.fixture
def poisoned(monkeypatch):
    """Every float buffer the kernels allocate starts as NaN, so a row they forget to write shows up."""
    empty_like, empty = torch.empty_like, torch.empty

    def nan_like(*args, **kwargs):
        out = empty_like(*args, **kwargs)
        return out.fill_(math.nan) if out.is_floating_point() else out

    def nan_empty(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(math.nan) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty_like", nan_like)
    monkeypatch.setattr(torch, "empty", nan_empty)


def _run(q, k, v, dout, offsets, max_len, backend, **kwargs):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = jagged_attention(*leaves, offsets, max_len, backend=backend, **kwargs)
    grads = torch.autograd.grad(out, leaves, dout)
    return out.detach(), grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _check_against_reference(lengths, q, k, v, dout, tol, offsets_dtype=torch.int32, **kwargs):
    offsets = _offsets(lengths, offsets_dtype)
    max_len = max(lengths, default=0)
    out, grads = _run(q, k, v, dout, offsets, max_len, "triton", **kwargs)
    # the specification, in fp32 from the same (possibly fp16) inputs
    ref_out, ref_grads = _run(q.float(), k.float(), v.float(), dout.float(), offsets, max_len, "reference", **kwargs)
    assert out.dtype == q.dtype and out.shape == q.shape
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads)):
        assert torch.isfinite(got).all(), name
        if want.numel() and want.abs().max() > 1e-3:
            assert _rel(got, want) < tol, name
        elif want.numel():  # e.g. dq of single-token samples: zero up to rounding
            assert (got.double() - want.double()).abs().max() < 1e-3, name


@pytest.mark.parametrize("mask", list(MASKS))
def test_triton_matches_reference_fp32_gqa(poisoned, mask):
    q, k, v, dout = _inputs(LENGTHS, heads=2, kv_heads=1)
    _check_against_reference(LENGTHS, q, k, v, dout, 1e-5, **_mask_kwargs(MASKS[mask]))


@pytest.mark.parametrize("mask", ["causal", "full_window", "all_options"])
def test_pointer_loads_match_reference(poisoned, monkeypatch, mask):
    """The masked pointer loads every pass falls back to where TMA cannot run (the other tests take TMA)."""
    monkeypatch.setattr(kernels, "TMA_PASSES", kernels._tma_passes("none"))
    q, k, v, dout = _inputs(LENGTHS, heads=2, kv_heads=1)
    _check_against_reference(LENGTHS, q, k, v, dout, 1e-5, **_mask_kwargs(MASKS[mask]))


def test_tma_only_where_the_tensors_allow_it():
    """A base off 16 bytes (a view one element in) or strides that are not multiples of 16 bytes take the
    pointer loads, with the same result; the setting names passes or ``none``."""
    q, k, v, dout = _inputs(LENGTHS, heads=2, kv_heads=1)
    assert tma_ok(q) and kernels._descriptors("fwd", q, k)[1]
    shifted = torch.randn(q.numel() + 1)[1:].view_as(q).copy_(q)
    assert not tma_ok(shifted) and not kernels._descriptors("fwd", shifted, k)[1]
    odd_stride = torch.randn(q.shape[0], 3, q.shape[2])[:, :2]  # row stride 3 x 16 x 4 B: still aligned
    assert tma_ok(odd_stride)
    narrow = torch.randn(q.shape[0], 2, 3)  # 12-byte rows
    assert not tma_ok(narrow)
    broadcast = torch.randn(1, 2, q.shape[2]).expand_as(q)  # e.g. the gradient of out.sum()
    assert not tma_ok(broadcast)
    _check_against_reference(LENGTHS, q, k, v, broadcast, 1e-5, causal=True)
    _check_against_reference(LENGTHS, shifted, k, v, dout, 1e-5, causal=True)
    assert kernels._tma_passes("none") == frozenset() and kernels._tma_passes("dq, fwd") == {"dq", "fwd"}
    with pytest.raises(ValueError, match="OPENGEM_JFA_TMA"):
        kernels._tma_passes("fwd,bwd")


@pytest.mark.parametrize("block_rows", [16, 64])
def test_ragged_descriptor_matches_tritons_helper(block_rows):
    """The descriptor built without Triton's checks (host time) has exactly the fields of Triton's own
    ``create_ragged_descriptor``, for a packed-QKV view too: a Triton upgrade that changes the layout fails here."""
    from triton.tools.ragged_tma import create_ragged_descriptor

    packed = torch.randn(40, 3 * 2, 32)
    for t in (packed[:, :2], packed[:, 4:], torch.randn(7, 1, 64)):
        ours, theirs = ragged_descriptor(t, block_rows), create_ragged_descriptor(t, [block_rows, 1, t.shape[2]])
        assert ours.base is t and type(ours) is type(theirs)
        assert (ours.shape, ours.strides, ours.block_shape, ours.padding) == (
            list(theirs.shape), list(theirs.strides), list(theirs.block_shape), theirs.padding)


@pytest.mark.parametrize("mask", ["causal", "all_options"])
def test_triton_matches_reference_fp16(poisoned, mask):
    q, k, v, dout = _inputs(LENGTHS, heads=2, kv_heads=2, dtype=torch.float16, seed=1)
    _check_against_reference(LENGTHS, q, k, v, dout, 1e-2, **_mask_kwargs(MASKS[mask]))


@pytest.mark.parametrize(
    "lengths, kwargs",
    [
        ([1], dict(causal=True)),  # B = 1, a single token
        ([0, 0, 7, 0], dict(causal=False)),  # zero-length samples around one sample
        ([33], dict(causal=True, num_targets=torch.tensor([33]))),  # a sample made only of targets
        ([18, 5], dict(causal=True, num_targets=torch.tensor([18, 5]), window=2)),  # only targets, windowed
        ([21, 9], dict(causal=True, window=100)),  # window longer than the sequence
        ([17, 30], dict(causal=False, window=100, contextual_len=40)),  # context longer than the sequence
        ([25, 3], dict(causal=True, contextual_len=20, num_targets=torch.tensor([10, 3]))),  # context reaches targets
    ],
)
def test_edge_cases(poisoned, lengths, kwargs):
    q, k, v, dout = _inputs(lengths, heads=2, kv_heads=2, seed=2)
    _check_against_reference(lengths, q, k, v, dout, 1e-5, **kwargs)


def test_int64_offsets_head_dim_32_mqa(poisoned):
    lengths = [19, 40, 2]
    q, k, v, dout = _inputs(lengths, heads=2, kv_heads=1, head_dim=32, seed=3)
    _check_against_reference(lengths, q, k, v, dout, 1e-5, offsets_dtype=torch.int64, causal=True, window=9)


def test_scale_and_normalize_by_max_len(poisoned):
    lengths = [12, 30]
    q, k, v, dout = _inputs(lengths, seed=4)
    _check_against_reference(lengths, q, k, v, dout, 1e-5, scale=0.7, normalize_by_max_len=True)
    # the forward takes its row maximum on the raw logits, the minimum for a negative scale: logits of
    # hundreds (base 2) overflow exp2 if the wrong one is taken
    _check_against_reference(lengths, q, k, v, dout, 1e-5, scale=-20.0, causal=False)


def test_empty_batch():
    q, k, v, _ = _inputs([0, 0])
    out = jagged_attention(q, k, v, _offsets([0, 0]), 0, backend="triton")
    assert out.shape == (0, 2, 16)


@settings(max_examples=12, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=4),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 2]),
    causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(0, 24)),
    contextual_len=st.integers(0, 6),
    target_fraction=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_property_random_shapes(lengths, kv_heads, group, causal, window, contextual_len, target_fraction, seed):
    q, k, v, dout = _inputs(lengths, heads=kv_heads * group, kv_heads=kv_heads, seed=seed)
    targets = torch.tensor([int(n * target_fraction) for n in lengths])
    _check_against_reference(
        lengths, q, k, v, dout, 1e-5, causal=causal, window=window, contextual_len=contextual_len, num_targets=targets
    )


@pytest.mark.parametrize("mask", ["causal", "full_window", "all_options"])
def test_reference_gradcheck_fp64(mask):
    lengths = [6, 0, 1, 5, 4] if mask != "causal" else [6, 3]
    spec = dict(MASKS[mask])
    if "targets" in spec:
        spec["targets"] = [min(t, n) for t, n in zip(spec["targets"], lengths)]
    kwargs = _mask_kwargs(spec)
    offsets = _offsets(lengths)
    q, k, v, _ = _inputs(lengths, heads=2, kv_heads=1, head_dim=4, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def fp64_reference(q, k, v):
        return reference(q, k, v, offsets, max(lengths), **kwargs)

    assert fp64_reference(*leaves).dtype == torch.float64  # fp64 in, fp64 math (no fp32 round trip)
    assert torch.autograd.gradcheck(fp64_reference, leaves, eps=1e-6, atol=1e-6, fast_mode=True)


@pytest.mark.parametrize("mask", list(MASKS))
def test_attention_pairs_counts_the_mask(mask):
    spec = MASKS[mask]
    kwargs = _mask_kwargs(spec)
    targets = spec.get("targets", [0] * len(LENGTHS))
    want = sum(
        int(attention_mask(n, causal=spec["causal"], num_targets=t, contextual_len=spec.get("contextual_len", 0),
                           window=spec.get("window")).sum())
        for n, t in zip(LENGTHS, targets)
    )  # fmt: skip
    assert attention_pairs(_offsets(LENGTHS), **kwargs) == want


def test_flop_counter_counts_useful_pairs():
    lengths = [9, 0, 14]
    offsets = _offsets(lengths)
    q, k, v, dout = _inputs(lengths, heads=2, kv_heads=2)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    pairs = attention_pairs(offsets, causal=True, window=3)
    with FlopCounterMode(display=False) as counter:
        out = jagged_attention(*leaves, offsets, 14, window=3)
        out.backward(dout)
    assert counter.get_total_flops() == 4 * 2 * 16 * pairs * (1 + 2.5)


def test_cpu_default_path_is_the_reference_with_autograd():
    lengths = [5, 11]
    offsets = _offsets(lengths)
    q, k, v, dout = _inputs(lengths)
    out, grads = _run(q, k, v, dout, offsets, 11, None, causal=True)
    torch.testing.assert_close(out, reference(q, k, v, offsets, 11))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_grads = torch.autograd.grad(reference(*leaves, offsets, 11), leaves, dout)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want)


def test_torch_compile_fullgraph_cpu():
    class Attend(torch.nn.Module):
        def forward(self, q, k, v, offsets):
            return jagged_attention(q, k, v, offsets, 11, causal=True, window=4) * 2.0

    lengths = [5, 11]
    offsets = _offsets(lengths)
    q, k, v, dout = _inputs(lengths)
    compiled = torch.compile(Attend(), fullgraph=True, backend="aot_eager")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = compiled(*leaves, offsets)
    grads = torch.autograd.grad(out, leaves, dout)
    want_out, want_grads = _run(q, k, v, dout * 2.0, offsets, 11, "reference", causal=True, window=4)
    torch.testing.assert_close(out, want_out * 2.0)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want)


def test_schedule_covers_every_tile_once_longest_first():
    lengths = [37, 0, 1, 20, 16]
    opts = kernels.MaskOptions(causal=True, contextual_len=0, window=None)
    sched = kernels.schedule(_offsets(lengths), None, opts, torch.device("cpu"))
    for items in (sched.query_tiles[16], sched.key_tiles[16]):
        assert sorted(map(tuple, items.tolist())) == [(0, 0), (0, 16), (0, 32), (2, 0), (3, 0), (3, 16), (4, 0)]
    # the causal query tile with the most keys to visit (last tile of the longest sample) runs first
    assert tuple(sched.query_tiles[16][0].tolist()) == (0, 32)
    assert tuple(sched.key_tiles[16][0].tolist()) == (0, 0)
    assert kernels.schedule(_offsets(lengths), None, opts, torch.device("cpu")) is sched


def test_schedule_order_is_a_stable_longest_first_sort():
    """Work items longest first; equal work keeps the tiles' sample order (deterministic launches)."""
    g = torch.Generator().manual_seed(1)
    for n in (0, 1, 7, 5000):
        work = torch.randint(0, 50, (n,), generator=g)  # many ties
        sample, row = torch.arange(n), torch.randint(0, 1000, (n,), generator=g)
        order = torch.argsort(work, descending=True, stable=True)
        expected = torch.stack([sample[order], row[order]], 1).to(torch.int32)
        assert torch.equal(kernels._order(sample, row, work, torch.device("cpu")), expected), n


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(head_dim=24), "head_dim must be one of"),
        (dict(offsets=torch.tensor([0, 5, 4, 16], dtype=torch.int32)), "non-decreasing"),
        (dict(max_len=5), "max_len = 5 is shorter"),  # named max_len_q, an argument jagged_attention has not
        # named q_offsets, an argument jagged_attention has not
        (dict(offsets=torch.tensor([0, 5, 5, 15], dtype=torch.int32)), r"^offsets\[-1\] = 15 must equal"),
        (dict(window=-1), "window must be None or a non-negative int"),
        (dict(contextual_len=-2), "contextual_len must be a non-negative int"),
        (dict(num_targets=torch.tensor([1, 2])), r"num_targets must have shape \[3\]"),
        (dict(num_targets=torch.tensor([1, 9, 0])), r"num_targets\[1\] = 9 must be in \[0, length 0\]"),
        (dict(kv_heads=4), "must divide q heads"),
        (dict(backend="cuda"), "backend must be one of"),
        (dict(v_dtype=torch.float16), "share one dtype"),
    ],
)
def test_bad_inputs_raise(change, message):
    lengths = [5, 0, 11]
    head_dim = change.get("head_dim", 16)
    q, k, v, _ = _inputs(lengths, heads=6, kv_heads=change.get("kv_heads", 2), head_dim=head_dim)
    if "v_dtype" in change:
        v = v.to(change["v_dtype"])
    kwargs = {key: change[key] for key in ("window", "contextual_len", "num_targets") if key in change}
    with pytest.raises(ValueError, match=message):
        jagged_attention(
            q, k, v, change.get("offsets", _offsets(lengths)), change.get("max_len", 11),
            backend=change.get("backend", "triton"), **kwargs,
        )  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(causal=0), "causal must be a bool, got 0"),  # had run non-causal
        (dict(causal="no"), "causal must be a bool, got 'no'"),  # had failed in torch's op schema
        (dict(normalize_by_max_len="yes"), "normalize_by_max_len must be a bool, got 'yes'"),
        (dict(scale="2"), "scale must be a number, got '2'"),  # float() had converted it
        (dict(scale=True), "scale must be a number, got True"),
        (dict(scale=float("nan")), "scale must be finite, got nan"),  # NaN output
        (dict(scale=float("inf")), "scale must be finite, got inf"),
        (dict(contextual_len=True), "contextual_len must be a non-negative int, got True"),  # had been taken as 1
        (dict(window=True), "window must be None or a non-negative int, got True"),
        (dict(max_len=True), "max_len must be a non-negative host int, got True"),
    ],
)
@pytest.mark.parametrize("packed", [False, True])
def test_bad_scalar_options_raise_naming_the_argument(kwargs, message, packed):
    lengths = [2, 4]
    q, k, v, _ = _inputs(lengths, heads=2, kv_heads=2)
    kwargs = dict(kwargs)
    max_len = kwargs.pop("max_len", 4)
    fn = "jagged_attention_packed" if packed else "jagged_attention"
    prefix = f"{fn}: " if any(name in kwargs for name in ("causal", "normalize_by_max_len", "scale")) else ""
    with pytest.raises(ValueError, match=re.escape(prefix + message)):
        if packed:
            jagged_attention_packed(torch.stack([q, k, v], 1), _offsets(lengths), max_len, **kwargs)
        else:
            jagged_attention(q, k, v, _offsets(lengths), max_len, **kwargs)


def test_self_attention_row_mismatch_names_k_and_v_not_k_offsets():
    q, k, v, _ = _inputs([2, 4], heads=2, kv_heads=2)
    with pytest.raises(ValueError, match=re.escape("k and v must have as many rows as q (6), got 5")):
        jagged_attention(q, k[:5], v[:5], _offsets([2, 4]), 4)


def test_tile_config_refuses_a_tile_the_schedule_has_no_size_for(monkeypatch):
    """The host lists each kernel's tiles in the schedule's sizes only: forcing another size must fail at once, naming
    the kernel and the block, not with a KeyError from the launch grid (the forward's 32-row tile, session 37)."""
    monkeypatch.setattr(kernels, "_TILES", (64, 128))
    for name, (block_m, block_n), label in (("fwd", (32, 64), "BLOCK_M = 32"), ("dq", (32, 128), "BLOCK_M = 32"),
                                            ("dkdv", (64, 32), "BLOCK_N = 32")):
        with pytest.raises(ValueError, match=f"JFA {name} tile {block_m}x{block_n}: {label} is not a scheduled"):
            kernels.tile_config(name, block_m, block_n, 4, 3)
    # the unscheduled block may take any size: dK/dV's query tile, the others' key tile
    assert kernels.tile_config("dkdv", 32, 64, 4, 3).kwargs == {"BLOCK_M": 32, "BLOCK_N": 64}
    assert kernels.tile_config("fwd", 64, 32, 4, 3).kwargs == {"BLOCK_M": 64, "BLOCK_N": 32}


def test_fp32_head_dim_128_gets_the_small_tile_configs(monkeypatch):
    """On an H200 the default dK/dV config needed 296 KB of shared memory for fp32 at D = 128 (limit
    227 KB); fp32 rows are as wide as bf16 rows of D = 256, so they get the same pruned configs."""
    monkeypatch.setattr(kernels, "_INTERPRET", False)
    configs = [triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=8, num_stages=3)]
    fp32 = kernels._prune(configs, {"Q": torch.empty(1, 1, 128), "HEAD_DIM": 128})
    bf16 = kernels._prune(configs, {"Q": torch.empty(1, 1, 128, dtype=torch.bfloat16), "HEAD_DIM": 128})
    assert [c.num_stages for c in fp32] and all(c.num_stages <= 2 for c in fp32)
    assert all(c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 128 for c in fp32)
    assert bf16 == configs


def test_tuning_bucket_is_one_past_4096():
    """Lengths past 4096 share one autotuning key: a batch whose longest history swings between 8k and 16k
    does not re-time every candidate configuration (seconds of host time) each time it crosses 2^k; a
    batch of lengths up to 4096 keeps its own key (it tunes to other tiles than a long-tailed one)."""
    from opengem.ops.triton.jagged_attention import TUNING_BUCKET_CAP, tuning_bucket

    assert [tuning_bucket(n) for n in (0, 1, 17, 1000, 4096)] == [16, 16, 32, 1024, 4096]
    assert tuning_bucket(4097) == tuning_bucket(9000) == tuning_bucket(16384) == TUNING_BUCKET_CAP == 8192


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("mask", ["causal", "full_window", "all_options"])
def test_packed_qkv_equals_the_unbound_views(poisoned, backend, mask):
    """``jagged_attention_packed`` on a [T, 3, H, D] projection output: the output of ``jagged_attention`` on its
    ``unbind(1)`` views, and its one packed gradient equal to the three stacked (the kernels write it directly)."""
    kwargs = _mask_kwargs(MASKS[mask])
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(sum(LENGTHS), 3, 2, 16, generator=gen)
    dout = torch.randn(sum(LENGTHS), 2, 16, generator=gen)
    offsets, max_len = _offsets(LENGTHS), max(LENGTHS)
    packed = qkv.clone().requires_grad_()
    out = jagged_attention_packed(packed, offsets, max_len, backend=backend, **kwargs)
    (dqkv,) = torch.autograd.grad(out, packed, dout)
    want_out, want_grads = _run(*qkv.unbind(1), dout, offsets, max_len, backend, **kwargs)
    assert out.is_contiguous() and dqkv.shape == qkv.shape
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(dqkv, torch.stack(want_grads, 1), rtol=0, atol=0)


@pytest.mark.parametrize("tiles", ["tuned", "small"])
@pytest.mark.parametrize("mask", ["full", "causal_window", "full_all_options"])
def test_backward_column_sums_are_the_gradients_summed_over_tokens(poisoned, monkeypatch, tiles, mask):
    """``backward_with_column_sums``: the same dq, dk, dv as ``backward``, and their sums over the tokens (a QKV
    bias's gradient) from the kernels' tiles. The interpreter's tuned tiles span two 16-row schedule tiles (the
    second's row of the sums buffer gets zeros); "small" forces 16-row tiles. The buffer starts as NaN: a row no
    program writes would show."""
    if tiles == "small":
        for name, kernel in (("dq", kernels._dq_kernel), ("dkdv", kernels._dkdv_kernel)):
            monkeypatch.setattr(kernel, "configs", [kernels.tile_config(name, 16, 16, 1, 1)])
    kwargs = _mask_kwargs(MASKS[mask])
    q, k, v, dout = _inputs(LENGTHS, heads=2, kv_heads=2, seed=4)
    offsets = _offsets(LENGTHS)
    opts = kernels.MaskOptions(kwargs.get("causal", True), kwargs.get("contextual_len", 0), kwargs.get("window"))
    pb = kernels.problem(offsets, kwargs.get("num_targets"), opts, max(LENGTHS), 0.25, q.device)
    out, lse = kernels.forward(q, k, v, pb)
    dq, dk, dv, sums = kernels.backward_with_column_sums(dout, q, k, v, out, lse, pb)
    want = kernels.backward(dout, q, k, v, out, lse, pb)
    for got, expected in zip((dq, dk, dv), want):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert sums.shape == (3, 2, 16) and sums.dtype == torch.float32
    torch.testing.assert_close(sums, torch.stack([g.sum(0) for g in want]), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="column sums need as many k / v heads as q heads, got 2 and 1"):
        kernels.backward_with_column_sums(dout, q, k[:, :1], v[:, :1], out, lse, pb)


def test_packed_qkv_flops_compile_and_bad_shapes():
    lengths = [9, 0, 14]
    offsets = _offsets(lengths)
    qkv = torch.randn(sum(lengths), 3, 2, 16, requires_grad=True)
    dout = torch.randn(sum(lengths), 2, 16)
    pairs = attention_pairs(offsets, causal=True, window=3)
    with FlopCounterMode(display=False) as counter:
        jagged_attention_packed(qkv, offsets, 14, window=3).backward(dout)
    assert counter.get_total_flops() == 4 * 2 * 16 * pairs * (1 + 2.5)

    compiled = torch.compile(lambda x: jagged_attention_packed(x, offsets, 14, window=3) * 2.0, fullgraph=True,
                             backend="aot_eager")  # fmt: skip
    leaf = qkv.detach().clone().requires_grad_()
    out = compiled(leaf)
    (grad,) = torch.autograd.grad(out, leaf, dout)
    want_out, want_grads = _run(*qkv.detach().unbind(1), dout * 2.0, offsets, 14, "reference", window=3)
    torch.testing.assert_close(out, want_out * 2.0)
    torch.testing.assert_close(grad, torch.stack(want_grads, 1))

    with pytest.raises(ValueError, match=r"qkv must have shape \[T, 3, H, D\], got \[23, 2, 2, 16\]"):
        jagged_attention_packed(qkv[:, :2], offsets, 14)
    with pytest.raises(ValueError, match="max_len = 5 is shorter"):
        jagged_attention_packed(qkv, offsets, 5)
    wrong_size = re.escape("projection_bias must have shape [96] (3 * heads * head_dim), got [95]")
    with pytest.raises(ValueError, match=wrong_size):
        jagged_attention_packed(qkv, offsets, 14, projection_bias=torch.zeros(95))
    with pytest.raises(ValueError, match="projection_bias must be a floating tensor on cpu, got torch.int64"):
        jagged_attention_packed(qkv, offsets, 14, projection_bias=torch.zeros(96, dtype=torch.int64))
