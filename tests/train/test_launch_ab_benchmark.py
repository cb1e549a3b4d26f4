"""benchmarks.diag.launch_ab on the CPU: ABBA rounds, the per-path timing loop and its summary."""

import pytest

from benchmarks.diag.launch_ab import round_orders, summary, time_rounds


def test_round_orders_flip_every_round_and_need_an_even_count():
    assert round_orders(4) == [("triton", "cached"), ("cached", "triton")] * 2
    for bad in (0, 3):
        with pytest.raises(ValueError, match="rounds must be an even number"):
            round_orders(bad)


def test_time_rounds_sets_each_path_before_its_steps_and_summary_compares_them():
    events = []
    step_ms = time_rounds(lambda: events.append("steps"), lambda path: events.append(path), 2, 4,
                          lambda: events.append("sync"))
    first, second = ["triton", "sync", "steps", "sync"], ["cached", "sync", "steps", "sync"]
    assert events == first + second + second + first
    assert [len(step_ms[p]) for p in ("triton", "cached")] == [2, 2] and min(step_ms["cached"]) >= 0
    result = summary({"triton": [10.0, 12.0, 11.0], "cached": [9.0, 9.9, 12.0]})
    assert result["median_ms"] == {"triton": 11.0, "cached": 9.9}
    assert result["cached_over_triton_median"] == pytest.approx(0.9)
    assert result["cached_over_triton_mean"] == pytest.approx(10.3 / 11.0)
