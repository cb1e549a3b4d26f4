"""The benchmarks' shared plumbing (benchmarks.common): the interleaved rounds, the paired speedup, the size lists."""

import pytest

from benchmarks.common import interleaved_ms, paired_speedup


def test_interleaved_rounds_rotate_the_order_and_keep_each_entry_in_round_order():
    order: list[str] = []
    clock = iter(range(100))

    def bench(fn) -> float:
        order.append(fn())
        return float(next(clock))  # a drifting card: every later call is slower

    times = interleaved_ms({name: (lambda n=name: n) for name in "abc"}, rounds=4, bench=bench)
    assert order == list("abc" "bca" "cab" "abc")
    assert times == {"a": [0.0, 5.0, 7.0, 9.0], "b": [1.0, 3.0, 8.0, 10.0], "c": [2.0, 4.0, 6.0, 11.0]}
    # the drift spreads over the entries: timed in sequence, c would have taken all the late slots
    assert max(sum(t) for t in times.values()) - min(sum(t) for t in times.values()) <= 2


def test_paired_speedup_is_the_median_of_per_round_ratios():
    assert paired_speedup([6.0, 5.0, 9.0], [3.0, 5.0, 3.0]) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="equally many rounds"):
        paired_speedup([1.0, 2.0], [1.0])
    assert interleaved_ms({}, rounds=3, bench=lambda fn: 1.0) == {}  # every variant failed before timing
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        interleaved_ms({"a": lambda: None}, rounds=0, bench=lambda fn: 1.0)


def test_int_tuples_parses_sizes_and_refuses_a_malformed_entry_by_name():
    import argparse

    from benchmarks.common import int_tuples

    assert int_tuples("64x32x4x4,128x32x8x3", 4, "64x32x4x4") == [(64, 32, 4, 4), (128, 32, 8, 3)]
    assert int_tuples("16384x1024,", 2, "16384x1024") == [(16384, 1024)]
    for bad in ("64x32x4", "64x0x4x4", "64x-1x4x4", "64xax4x4"):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad)):
            int_tuples(f"64x32x4x4,{bad}", 4, "64x32x4x4")
