"""BlockAttention: Triton kernels (interpreter) and the custom op against the fp32 reference, on CPU."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from opengem.jagged import offsets_from_lengths  # noqa: E402
from opengem.ops.block_attention import Rotary, block_attention, block_attention_from_hidden, block_pairs  # noqa: E402
from opengem.ops.reference import block_attention as reference  # noqa: E402
from opengem.ops.reference.attention import jagged_attention  # noqa: E402
from opengem.ops.reference.rotary import apply_rotary, positions_in_sequence  # noqa: E402
import triton  # noqa: E402

from opengem.ops.triton.block_attention import _configs, _prune, block_schedule  # noqa: E402

TOL = dict(rtol=2e-4, atol=2e-4)


def _offsets(lengths: list[int]) -> torch.Tensor:
    return offsets_from_lengths(torch.tensor(lengths, dtype=torch.int32))


def _inputs(lengths, heads, kv_heads, head_dim, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    make = lambda h: torch.randn(total, h, head_dim, generator=g).to(dtype).requires_grad_(True)  # noqa: E731
    return make(heads), make(kv_heads), make(kv_heads), torch.randn(total, heads, head_dim, generator=g).to(dtype)


def _rotary(kind: str, total: int) -> Rotary | None:
    g = torch.Generator().manual_seed(7)
    if kind == "none":
        return None
    if kind == "sequence":
        return Rotary()
    if kind == "positions":
        return Rotary(positions=torch.randint(0, 5000, (total,), generator=g), base=500.0)
    # A strided view: the op must hand the kernel a contiguous copy.
    return Rotary(time_gaps=(torch.rand(total, 2, generator=g) * 1e5 - 10.0)[:, 1], time_scale=60.0)


def _block_relative(options: dict, offsets: torch.Tensor) -> dict:
    """The reference's options with given positions made relative to each block's first token, as the
    kernel rotates (the shift cancels: ``test_rotary_depends_only_on_positions_within_the_block``). Equal
    fp32 angles keep the comparison tight: absolute positions in the thousands round the angle by ~1e-4
    rad, which a ReLU's step in the gradient can turn into a visible difference."""
    rotary = options["rotary"]
    if rotary is None or rotary.positions is None:
        return options
    row = positions_in_sequence(offsets, rotary.positions.numel())
    first = torch.arange(row.numel()) - row % options["block_size"]
    return dict(options, rotary=Rotary(positions=rotary.positions - rotary.positions[first], base=rotary.base))


def _run(backend, q, k, v, grad, offsets, max_len, **options):
    out = block_attention(q, k, v, offsets, max_len, backend=backend, **options)
    return (out, *torch.autograd.grad(out, (q, k, v), grad))


def _compare(lengths, heads=2, kv_heads=1, head_dim=32, block_size=16, rotary="none", **options):
    q, k, v, grad = _inputs(lengths, heads, kv_heads, head_dim)
    offsets, max_len = _offsets(lengths), max(lengths, default=0)
    options = dict(block_size=block_size, rotary=_rotary(rotary, sum(lengths)), **options)
    expected = _run("reference", q, k, v, grad, offsets, max_len, **_block_relative(options, offsets))
    with _poison():
        actual = _run("triton", q, k, v, grad, offsets, max_len, **options)
    for name, a, e in zip(("out", "dq", "dk", "dv"), actual, expected):
        torch.testing.assert_close(a, e, **TOL, msg=lambda m, n=name: f"{n}: {m}")


class _poison:
    """Fill every torch.empty with NaN while active, so unwritten kernel outputs show up."""

    def __enter__(self):
        self._det = torch.are_deterministic_algorithms_enabled()
        self._fill = torch.utils.deterministic.fill_uninitialized_memory
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self._det)
        torch.utils.deterministic.fill_uninitialized_memory = self._fill


@pytest.mark.parametrize(
    "block_size, lengths",
    [(16, [0, 1, 17, 40, 0, 16]), (32, [33, 5, 0, 32]), (64, [40, 1, 0]), (128, [3, 37])],
)
def test_block_sizes_match_reference(block_size, lengths):
    _compare(lengths, block_size=block_size)


@pytest.mark.parametrize("rotary", ["sequence", "positions", "time"])
def test_rotary_matches_reference(rotary):
    _compare([21, 0, 38], block_size=16, rotary=rotary)


@pytest.mark.parametrize("share_back, late_v", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("rotary", ["none", "positions"])
def test_every_backward_code_path_matches_reference(monkeypatch, rotary, share_back, late_v):
    """The interpreter's one config takes the newest path (SHARE_BACK, LATE_V); the GPU's autotuner may
    pick any of the others, so each runs here too (GROUP 1, where both flags change the code)."""
    from opengem.ops.triton import block_attention as kernels

    config = triton.Config({"SHARE_BACK": share_back, "LATE_V": late_v}, num_warps=4)
    monkeypatch.setattr(kernels._block_attention_bwd, "configs", [config])
    kernels._block_attention_bwd.cache.clear()
    _compare([21, 0, 38], heads=2, kv_heads=2, block_size=16, rotary=rotary)
    kernels._block_attention_bwd.cache.clear()


@pytest.mark.parametrize("rotary", ["none", "sequence", "time"])
def test_rotary_with_gqa_covers_every_head(rotary):
    """Four q heads over two kv heads (GQA groups of 2): every head's output and gradients are written,
    with and without rotary (with it, one backward program covers both kv heads of a block)."""
    _compare([21, 0, 38], heads=4, kv_heads=2, block_size=16, rotary=rotary)


@pytest.mark.parametrize("activation", reference.ACTIVATIONS)
def test_every_activation_matches_reference(activation):
    _compare([19, 30], heads=1, kv_heads=1, block_size=16, activation=activation, scale=0.3)


def test_rotary_depends_only_on_positions_within_the_block():
    """The kernel rotates by the row in the block for in-sequence positions (the block's start cancels in
    every score and gradient): it must equal given positions shifted by any constant."""
    lengths = [37, 0, 21]
    q, k, v, grad = _inputs(lengths, 2, 1, 32, seed=4)
    offsets = _offsets(lengths)
    positions = positions_in_sequence(offsets, sum(lengths))
    expected = _run("reference", q, k, v, grad, offsets, 37, block_size=16, rotary=Rotary(positions=positions))
    for rotary in (Rotary(), Rotary(positions=positions + 700), Rotary(positions=positions.float() - 50.5)):
        actual = _run("triton", q, k, v, grad, offsets, 37, block_size=16, rotary=rotary)
        for name, a, e in zip(("out", "dq", "dk", "dv"), actual, expected):
            torch.testing.assert_close(a, e, **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("rotary", [Rotary(base=0.05), Rotary(time_gaps=torch.rand(40, generator=torch.Generator().manual_seed(1)) * 1e4, base=0.05)])
def test_rotary_base_below_one_reduces_large_angles(rotary):
    """inv_freq up to ~17: angles of hundreds of rad, which the kernel range-reduces before sin/cos."""
    q, k, v, grad = _inputs([40], 2, 2, 32, seed=9)
    expected = _run("reference", q, k, v, grad, _offsets([40]), 40, block_size=32, rotary=rotary)
    actual = _run("triton", q, k, v, grad, _offsets([40]), 40, block_size=32, rotary=rotary)
    for name, a, e in zip(("out", "dq", "dk", "dv"), actual, expected):
        torch.testing.assert_close(a, e, **TOL, msg=lambda m, n=name: f"{n}: {m}")


def test_head_dim_64_fp16_gqa_group_of_two():
    q, k, v, grad = _inputs([20, 33], 4, 2, 64, dtype=torch.float16)
    offsets = _offsets([20, 33])
    expected = _run("reference", q, k, v, grad, offsets, 33, block_size=16, rotary=Rotary())
    actual = _run("triton", q, k, v, grad, offsets, 33, block_size=16, rotary=Rotary())
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=2e-2, atol=2e-2)


def test_only_zero_length_sequences():
    q, k, v, grad = _inputs([0, 0], 2, 2, 32)
    for backend in ("reference", "triton"):
        out, dq, dk, dv = _run(backend, q, k, v, grad, _offsets([0, 0]), 0)
        assert out.shape == (0, 2, 32) and dq.shape == dk.shape == dv.shape == (0, 2, 32)


@settings(max_examples=12, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=3),
    block_size=st.sampled_from([16, 32]),
    group=st.sampled_from([1, 2]),
    rotary=st.sampled_from(["none", "sequence", "positions", "time"]),
    activation=st.sampled_from(["softmax", "silu", "relu"]),
)
def test_property_matches_reference(lengths, block_size, group, rotary, activation):
    _compare(lengths, heads=2, kv_heads=2 // group, block_size=block_size, rotary=rotary, activation=activation)


def test_reference_equals_jagged_attention_on_blocks():
    """Block attention = non-causal jagged attention over the sequence of blocks (independent check)."""
    lengths, block_size = [37, 0, 5, 16], 16
    q, k, v, _ = _inputs(lengths, 2, 1, 32)
    blocks = [min(block_size, n - s) for n in lengths for s in range(0, n, block_size)]
    expected = jagged_attention(q, k, v, _offsets(blocks), block_size, causal=False)
    actual = reference.block_attention(q, k, v, _offsets(lengths), block_size=block_size)
    torch.testing.assert_close(actual, expected)


def test_rotary_scores_depend_only_on_relative_position():
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 1, 32, generator=g), torch.randn(1, 1, 32, generator=g)
    score = lambda m, n: float(  # noqa: E731
        (apply_rotary(q, torch.tensor([m]), 1e4) * apply_rotary(k, torch.tensor([n]), 1e4)).sum()
    )
    assert math.isclose(score(3.0, 10.0), score(103.0, 110.0), rel_tol=1e-4)
    assert not math.isclose(score(3.0, 10.0), score(3.0, 11.0), rel_tol=1e-4)
    assert torch.allclose(apply_rotary(q, torch.tensor([5.0]), 1e4).norm(), q.norm())


def test_block_schedule_columns():
    schedule = block_schedule(_offsets([0, 40, 16, 3]), 16)
    assert schedule.tolist() == [[0, 16, 32, 40, 56], [16, 16, 8, 16, 3]]
    offsets = _offsets([5, 5])
    assert block_schedule(offsets, 16) is block_schedule(offsets, 16)


def test_flop_counter_counts_pairs_in_blocks():
    lengths = [37, 5]
    q, k, v, grad = _inputs(lengths, 2, 2, 32)
    offsets = _offsets(lengths)
    assert block_pairs(offsets, 16) == 16 * 16 * 2 + 5 * 5 + 5 * 5
    with FlopCounterMode(display=False) as counter:
        out = block_attention(q, k, v, offsets, 37, block_size=16)
        out.backward(grad)
    forward = 4 * 2 * 32 * block_pairs(offsets, 16)
    assert counter.get_total_flops() == forward + 2.5 * forward


def test_compile_fullgraph_reference_path():
    lengths = [20, 7]
    q, k, v, grad = _inputs(lengths, 2, 1, 32)
    offsets = _offsets(lengths)

    def step(q, k, v):
        return block_attention(q, k, v, offsets, 20, block_size=16, activation="silu", rotary=Rotary()) * 2.0

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out = compiled(q, k, v)
    expected = step(q, k, v)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(torch.autograd.grad(out, q, grad)[0], torch.autograd.grad(expected, q, grad)[0])


def test_from_hidden_matches_separate_ops():
    lengths, heads, head_dim, d_model = [23, 9], 2, 32, 24
    g = torch.Generator().manual_seed(5)
    x = torch.randn(sum(lengths), d_model, generator=g, requires_grad=True)
    w = (torch.randn(3 * heads * head_dim, d_model, generator=g) / d_model**0.5).requires_grad_(True)
    offsets = _offsets(lengths)
    rotary = _rotary("time", sum(lengths))
    fused = block_attention_from_hidden(x, w, offsets, 23, heads, block_size=16, rotary=rotary, backend="triton")
    q, k, v = (x @ w.T).view(-1, 3, heads, head_dim).unbind(1)
    separate = block_attention(q, k, v, offsets, 23, block_size=16, rotary=rotary, backend="reference")
    torch.testing.assert_close(fused, separate.reshape(fused.shape), **TOL)
    grad = torch.randn(fused.shape, generator=g)
    for a, e in zip(torch.autograd.grad(fused, (x, w), grad), torch.autograd.grad(separate.reshape(fused.shape), (x, w), grad)):
        torch.testing.assert_close(a, e, **TOL)


def _bad(**overrides):
    q, k, v, _ = _inputs([4, 6], 2, 1, 32)
    args = dict(q=q, k=k, v=v, offsets=_offsets([4, 6]), max_len=6)
    args.update(overrides)
    return lambda: block_attention(**args)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(block_size=48), "block_size must be one of"),
        (dict(activation="tanh"), "activation must be one of"),
        (dict(backend="cuda"), "backend must be one of"),
        (dict(max_len=5), "max_len"),
        (dict(k=torch.randn(9, 1, 32), v=torch.randn(9, 1, 32)), r"k and v must have as many rows as q \(10\), got 9"),
        (dict(offsets=_offsets([4, 5])), r"^offsets\[-1\] = 9 must equal the number of values, 10"),  # said q_offsets
        (dict(max_len=5), "max_len = 5 is shorter"),  # had said max_len_q
        (dict(scale="2"), "block_attention: scale must be a number, got '2'"),  # float() had converted it
        (dict(scale=True), "block_attention: scale must be a number, got True"),
        (dict(scale=float("nan")), "block_attention: scale must be finite, got nan"),  # NaN output
        (dict(rotary=Rotary(base="x")), "block_attention: rotary.base must be a positive finite number, got 'x'"),
        (dict(rotary=Rotary(base=float("inf"))), "block_attention: rotary.base must be a positive finite number"),
        (dict(rotary=Rotary(positions=torch.ones(10, dtype=torch.bool))),  # True had been taken as position 1
         "rotary.positions must be an int or float tensor, got torch.bool"),
        (dict(q=torch.randn(10, 2, 48), k=torch.randn(10, 1, 48), v=torch.randn(10, 1, 48), backend="triton"), "head_dim must be one of"),
        (dict(q=torch.randn(10, 2, 256), k=torch.randn(10, 1, 256), v=torch.randn(10, 1, 256), block_size=128, backend="triton"), r"block_size \* head_dim must be <= 16384"),
        (dict(rotary=Rotary(positions=torch.arange(9))), r"rotary.positions must have shape \[T\] = \[10\]"),
        (dict(rotary=Rotary(time_gaps=torch.arange(10))), "rotary.time_gaps must be floating point"),
        (dict(rotary=Rotary(positions=torch.arange(10), time_gaps=torch.rand(10))), "not both"),
        (dict(rotary=Rotary(time_scale=0.0)), "rotary.time_scale must be a positive finite number, got 0.0"),
        (dict(rotary="rope"), "block_attention: rotary must be None or a Rotary"),
    ],
)
def test_bad_inputs_raise(overrides, message):
    with pytest.raises(ValueError, match=message):
        _bad(**overrides)()


def test_from_hidden_bad_weight():
    with pytest.raises(ValueError, match="w_qkv must have shape"):
        block_attention_from_hidden(torch.randn(5, 8), torch.randn(10, 8), _offsets([5]), 5, 2)
    x, w = torch.randn(5, 8), torch.randn(12, 8)
    with pytest.raises(ValueError, match="heads must be an int >= 1, got 0"):  # was a ZeroDivisionError
        block_attention_from_hidden(x, w, _offsets([5]), 5, 0)
    with pytest.raises(ValueError, match="block_attention_from_hidden: heads must be an int >= 1, got True"):
        block_attention_from_hidden(x, w, _offsets([5]), 5, True)  # had run with 1 head
    with pytest.raises(ValueError, match="block_attention_from_hidden: scale must be a number, got '2'"):
        block_attention_from_hidden(x, w, _offsets([5]), 5, 2, scale="2")
    with pytest.raises(ValueError, match="block_attention_from_hidden: rotary.base must be a positive finite number"):
        block_attention_from_hidden(x, w, _offsets([5]), 5, 2, rotary=Rotary(base="x"))
    with pytest.raises(ValueError, match=r"x must have shape \[T, d_model\], got \(40,\)"):
        block_attention_from_hidden(x.flatten(), w, _offsets([5]), 5, 2)
    with pytest.raises(ValueError, match=r"bias must have shape \[12\] \(w_qkv's rows, 3 \* heads \* head_dim\), "
                                         r"got \[5\]"):
        block_attention_from_hidden(x, w, _offsets([5]), 5, 2, bias=torch.zeros(5))


@pytest.mark.parametrize("activation", reference.ACTIVATIONS)
def test_reference_backward_matches_autograd(activation):
    """The hand-written reference backward (used by the CPU custom op) against autograd of the reference."""
    lengths = [19, 0, 6]
    q, k, v, grad = _inputs(lengths, 2, 1, 32, seed=11)
    offsets = _offsets(lengths)
    phase = torch.rand(sum(lengths), generator=torch.Generator().manual_seed(2)) * 50
    options = dict(block_size=16, scale=0.4, activation=activation, rotary_phase=phase)
    out = reference.block_attention(q, k, v, offsets, **options)
    expected = torch.autograd.grad(out, (q, k, v), grad)
    actual = reference.block_attention_backward(grad, q, k, v, offsets, **options)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, **TOL)


def test_autotune_offers_16_warps_only_for_128_row_tiles():
    configs = [triton.Config({}, num_warps=w) for w in (4, 8, 16)]
    warps = lambda **meta: [c.num_warps for c in _prune(configs, {}, **meta)]  # noqa: E731
    assert warps(BLOCK=128, HALF=64) == [4, 8, 16]
    assert warps(BLOCK=64, HALF=128) == [4, 8]


def test_only_the_backward_tries_three_programs_per_sm(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the GPU's config list
    shape = lambda configs: [(c.num_warps, c.maxnreg) for c in configs]  # noqa: E731
    assert shape(_configs(backward=False)) == [(4, None), (8, None), (16, None)]
    backward = _configs(backward=True)
    repeats = {4: 4, 8: 2, 16: 2}  # SHARE_BACK x LATE_V at 4 warps, SHARE_BACK at 8 and 16
    shapes = ((4, None), (8, None), (16, None), (4, 168))
    assert shape(backward) == [(w, cap) for w, cap in shapes for _ in range(repeats[w])]
    flags = [(c.kwargs["SHARE_BACK"], c.kwargs["LATE_V"]) for c in backward if c.num_warps == 4]
    assert flags == [(False, False), (False, True), (True, False), (True, True)] * 2


def test_the_shared_inverse_rotation_is_tried_only_where_it_changes_the_code(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    backward = _configs(backward=True)
    kept = lambda **meta: [  # noqa: E731
        (c.num_warps, c.kwargs["SHARE_BACK"], c.kwargs["LATE_V"]) for c in _prune(backward, {}, BLOCK=64, HALF=64, **meta)
    ]
    every_4 = [(4, False, False), (4, False, True), (4, True, False), (4, True, True)]
    assert kept(GROUP=1, ROT=1) == [*every_4, (8, False, False), (8, True, False), *every_4]
    assert kept(GROUP=1, ROT=0) == [(4, False, False), (4, False, True), (8, False, False), (4, False, False), (4, False, True)]
    assert kept(GROUP=2, ROT=3) == [(4, False, False), (8, False, False), (4, False, False)]  # v serves the group
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # one config there, with the newest code path
    backward = _configs(backward=True)
    assert kept(GROUP=1, ROT=2) == kept(GROUP=2, ROT=0) == [(4, True, True)]
