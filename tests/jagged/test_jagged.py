import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opengem.jagged import Jagged, KeyedJagged, offsets_from_lengths, uniform_offsets


@given(st.lists(st.integers(0, 7), min_size=0, max_size=6), st.integers(1, 3))
@settings(max_examples=40, deadline=None)
def test_padded_round_trip(lengths, width):
    lengths_t = torch.tensor(lengths, dtype=torch.int64)
    values = torch.randn(int(lengths_t.sum()), width)
    jagged = Jagged.from_lengths(values, lengths_t)
    assert jagged.max_len == (max(lengths) if lengths else 0)
    padded = jagged.to_padded(pad_value=-7.0)
    assert padded.shape == (len(lengths), jagged.max_len, width)
    for b, n in enumerate(lengths):
        assert torch.equal(padded[b, :n], jagged.split()[b])
        assert bool((padded[b, n:] == -7.0).all())
    back = Jagged.from_padded(padded, lengths_t)
    assert torch.equal(back.values, values)
    assert torch.equal(back.offsets, jagged.offsets)


def test_sample_ids_and_lengths():
    jagged = Jagged.from_lengths(torch.arange(6.0), torch.tensor([2, 0, 3, 1]))
    assert jagged.sample_ids().tolist() == [0, 0, 2, 2, 2, 3]
    assert jagged.lengths().tolist() == [2, 0, 3, 1]
    assert jagged.batch_size == 4 and jagged.num_values == 6


@pytest.mark.parametrize(
    "offsets, message",
    [
        (torch.tensor([1, 2, 3]), r"offsets\[0\] must be 0"),
        (torch.tensor([0, 3, 2]), r"non-decreasing: offsets\[2\] = 2 < offsets\[1\] = 3"),
        (torch.tensor([0, 1, 2]), r"offsets\[-1\] = 2 must equal the number of values, 3"),
        (torch.tensor([0.0, 3.0]), "int32 or int64"),
        (torch.tensor([[0, 3]]), r"shape \[B \+ 1\]"),
    ],
)
def test_bad_offsets_are_named(offsets, message):
    with pytest.raises(ValueError, match=message):
        Jagged.from_offsets(torch.zeros(3, 2), offsets)


def test_devices_must_match():
    values = torch.zeros(2, device="meta")
    with pytest.raises(ValueError, match="(on meta but offsets are on cpu|one device)"):
        Jagged.from_offsets(values, torch.tensor([0, 2]))


def test_from_padded_rejects_long_lengths():
    with pytest.raises(ValueError, match="exceeds the padded size"):
        Jagged.from_padded(torch.zeros(2, 3), torch.tensor([1, 4]))


def test_negative_lengths_rejected():
    with pytest.raises(ValueError, match="non-negative"):
        offsets_from_lengths(torch.tensor([2, -1]))


def test_float_lengths_and_negative_sizes_are_refused():
    # the fractions were truncated by the cumsum into int64 offsets ([0, 1, 3] for [1.5, 2.0])
    with pytest.raises(ValueError, match=r"lengths must be 1-D int32 or int64, got torch.float32 \(2,\)"):
        offsets_from_lengths(torch.tensor([1.5, 2.0]))
    with pytest.raises(ValueError, match="lengths must be int32 or int64, got torch.float32"):
        KeyedJagged(("a", "b"), torch.arange(5), torch.tensor([2.5, 0.5, 1.0, 1.0]))
    with pytest.raises(ValueError, match="batch and length must be >= 0, got 2 and -3"):
        uniform_offsets(2, -3, "cpu")
    assert uniform_offsets(2, 3, "cpu").tolist() == [0, 3, 6]


def test_int32_offsets_accepted():
    jagged = Jagged.from_offsets(torch.zeros(5), torch.tensor([0, 2, 5], dtype=torch.int32))
    assert jagged.max_len == 3


def _kjt() -> KeyedJagged:
    return KeyedJagged(
        ("a", "b", "c"),
        torch.tensor([1, 2, 3, 10, 11, 20, 21, 22]),
        torch.tensor([2, 1, 0, 2, 3, 0]),
    )


def test_keyed_access_matches_layout():
    kjt = _kjt()
    assert kjt.stride == 2
    assert kjt.lengths_per_key() == [3, 2, 3]
    assert kjt["a"].values.tolist() == [1, 2, 3] and kjt["a"].lengths().tolist() == [2, 1]
    assert kjt["b"].values.tolist() == [10, 11] and kjt["b"].lengths().tolist() == [0, 2]
    assert kjt["c"].values.tolist() == [20, 21, 22] and kjt["c"].lengths().tolist() == [3, 0]
    with pytest.raises(KeyError, match="no feature 'z'"):
        kjt["z"]


def test_keyed_split_concat_round_trip():
    kjt = _kjt()
    first, second = kjt.split([1, 2])
    assert first.keys == ("a",) and second.keys == ("b", "c")
    joined = KeyedJagged.concat([first, second])
    assert joined.keys == kjt.keys
    assert torch.equal(joined.values, kjt.values) and torch.equal(joined.lengths, kjt.lengths)
    with pytest.raises(ValueError, match="sum to 3"):
        kjt.split([1, 1])


def test_keyed_from_dict_and_weights():
    a = Jagged.from_lengths(torch.tensor([5, 6, 7]), torch.tensor([1, 2]))
    b = Jagged.from_lengths(torch.tensor([8]), torch.tensor([0, 1]))
    kjt = KeyedJagged.from_dict({"a": a, "b": b})
    assert kjt.values.tolist() == [5, 6, 7, 8] and kjt.lengths.tolist() == [1, 2, 0, 1]
    weighted = KeyedJagged(kjt.keys, kjt.values, kjt.lengths, torch.tensor([0.5, 1.0, 2.0, 3.0]))
    assert weighted.weights_of("b").values.tolist() == [3.0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(keys=("a", "a"), values=torch.tensor([1]), lengths=torch.tensor([1, 0])), "unique"),
        (dict(keys=("a", "b"), values=torch.tensor([1]), lengths=torch.tensor([1, 0, 0])), "not a multiple"),
        (dict(keys=("a",), values=torch.tensor([1, 2]), lengths=torch.tensor([1])), "sum to 1 but there are 2"),
        (dict(keys=("a",), values=torch.tensor([1]), lengths=torch.tensor([2, -1])), "non-negative"),
    ],
)
def test_keyed_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KeyedJagged(**kwargs)
