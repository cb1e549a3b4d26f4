import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opengem.jagged import Jagged, KeyedJagged, offsets_from_lengths, uniform_offsets, validate_offsets


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


@pytest.mark.parametrize(
    "keys, message",
    [
        ("ab", r"keys must be a list or tuple of str, got str 'ab'"),  # had become keys 'a' and 'b'
        ({"a", "b"}, "keys must be a list or tuple of str, got set"),  # no order to lay features out in
        (("a", 1), r"keys\[1\] must be a str, got int 1"),
    ],
)
def test_keyed_keys_must_be_a_list_of_str(keys, message):
    with pytest.raises(ValueError, match=message):
        KeyedJagged(keys, torch.arange(5), torch.tensor([1, 1, 2, 1]))


def test_keyed_list_keys_are_stored_as_a_tuple():
    assert KeyedJagged(["a", "b"], torch.arange(5), torch.tensor([1, 1, 2, 1])).keys == ("a", "b")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(values=[1, 2]), "values must be a torch.Tensor, got list"),
        (dict(lengths=[2]), "lengths must be a torch.Tensor, got list"),
        (dict(weights=[1.0, 1.0]), "weights must be a torch.Tensor, got list"),
        (dict(weights=torch.ones(2, dtype=torch.int64)), "weights must be a floating-point tensor, got torch.int64"),
        (dict(weights=torch.ones(2, device="meta")), "values are on cpu but weights are on meta"),
    ],
)
def test_keyed_tensors_are_checked_by_name(kwargs, message):
    args = dict(keys=("a",), values=torch.tensor([1, 2]), lengths=torch.tensor([2])) | kwargs
    with pytest.raises(ValueError, match=message):
        KeyedJagged(**args)


def test_keyed_split_concat_and_from_dict_refuse_bad_parts():
    kjt = _kjt()
    with pytest.raises(ValueError, match=r"segments must be a sequence of ints, got \[True, True, True\]"):
        kjt.split([True, True, True])  # had split one key each
    with pytest.raises(ValueError, match=r"cannot concat KeyedJagged sharing feature keys \['a', 'b', 'c'\]"):
        KeyedJagged.concat([kjt, kjt])  # _trusted had kept both copies of every key
    with pytest.raises(ValueError, match=r"parts\[1\] must be a KeyedJagged, got dict"):
        KeyedJagged.concat([kjt, {}])
    meta = KeyedJagged(("z",), torch.zeros(0, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)).to("meta")
    with pytest.raises(ValueError, match=r"parts\[1\] is on meta but parts\[0\] is on cpu"):
        KeyedJagged.concat([kjt, meta])
    with pytest.raises(ValueError, match=r"features\['a'\] must hold 1-D ids, got values of shape \(3, 2\)"):
        KeyedJagged.from_dict({"a": Jagged.from_lengths(torch.zeros(3, 2), torch.tensor([3]))})
    with pytest.raises(ValueError, match=r"features\['a'\] must be a Jagged, got Tensor"):
        KeyedJagged.from_dict({"a": torch.zeros(3)})


def test_jagged_constructors_name_their_arguments():
    with pytest.raises(ValueError, match="lengths sum to 2 but values have 3 rows"):  # had named "offsets[-1]"
        Jagged.from_lengths(torch.zeros(3), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="lengths must be a torch.Tensor, got list"):
        Jagged.from_lengths(torch.zeros(3), [3])
    with pytest.raises(ValueError, match="padded must be a torch.Tensor, got list"):
        Jagged.from_padded([[0.0, 0.0]], torch.tensor([1]))
    with pytest.raises(ValueError, match="lengths must be a torch.Tensor, got list"):
        Jagged.from_padded(torch.zeros(2, 3), [1, 2])
    with pytest.raises(ValueError, match="num_values must be an int, got True"):  # True had matched [0, 1]
        validate_offsets(torch.tensor([0, 1]), True)


def test_with_values_and_padding_sizes_are_checked():
    jagged = Jagged.from_lengths(torch.zeros(5, 2), torch.tensor([2, 3]))
    with pytest.raises(ValueError, match="new values are on meta but the offsets are on cpu"):
        jagged.with_values(torch.zeros(5, device="meta"))
    with pytest.raises(ValueError, match="values must be a tensor with at least one dimension"):
        jagged.with_values(torch.tensor(1.0))
    with pytest.raises(ValueError, match="max_len 1 is shorter than the longest sequence, 3"):
        jagged.padding_mask(1)  # had returned a mask that drops the tail of the second sequence
    with pytest.raises(ValueError, match="max_len must be an int or None, got True"):
        jagged.to_padded(max_len=True)
    assert jagged.padding_mask(4).shape == (2, 4)


def test_offsets_helpers_refuse_bool_float_and_overflowing_sizes():
    with pytest.raises(ValueError, match="dtype must be torch.int32 or torch.int64, got torch.float32"):
        offsets_from_lengths(torch.tensor([1, 2]), torch.float32)  # had made float offsets
    with pytest.raises(ValueError, match="lengths sum to 2147483652, more than int32 offsets hold"):
        offsets_from_lengths(torch.tensor([2**31 - 1, 5]), torch.int32)  # had wrapped negative
    with pytest.raises(ValueError, match="batch and length must be ints, got True and 3"):
        uniform_offsets(True, 3, "cpu")
    with pytest.raises(ValueError, match="batch and length must be ints, got 2 and 1.5"):
        uniform_offsets(2, 1.5, "cpu")
    with pytest.raises(ValueError, match="dtype must be torch.int32 or torch.int64, got torch.float32"):
        uniform_offsets(2, 3, "cpu", torch.float32)
    with pytest.raises(ValueError, match=r"batch \* length = 3221225472 overflows int32 offsets"):
        uniform_offsets(3, 2**30, "cpu", torch.int32)


@pytest.mark.parametrize("block_size", [0, -2, True, 2.0])
def test_block_offsets_refuses_bad_block_sizes(block_size):
    from opengem.jagged.blocks import block_offsets

    with pytest.raises(ValueError, match="block_size must be an int >= 1"):  # -2 had given one block, True 1
        block_offsets(torch.tensor([0, 3, 5]), block_size)
    with pytest.raises(ValueError, match="offsets must be an int32 or int64 tensor, got torch.float32"):
        block_offsets(torch.tensor([0.0, 3.0, 5.0]), 2)
