"""The benchmarks' interleaved timing (benchmarks.common): the order of the rounds and the paired speedup."""

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
