"""The power-window diag's arithmetic (`window_medians`) on hand-made timelines; its GPU part runs in chain s52b."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from benchmarks.diag.gdpa_power_window import window_medians


def test_first_window_slices_and_sustained_half_are_read_by_start_time():
    # 10 ms calls back to back for 1 s: 1.0 ms each in the first 300 ms (rested), then 1.5 ms (capped)
    starts = [float(i * 10) for i in range(100)]
    durations = [1.0 if s < 300 else 1.5 for s in starts]
    stats = window_medians(starts, durations, slice_ms=250.0)
    assert stats["first_window_ms"] == 1.0  # calls starting in the first 125 ms
    assert stats["sustained_ms"] == 1.5  # calls starting in the second half (>= 495.75 ms)
    assert stats["sustained_mean_ms"] == 1.5
    assert stats["calls"] == 100 and stats["window_ms"] == pytest.approx(991.5)
    assert [s[0] for s in stats["slices"]] == [0.0, 250.0, 500.0, 750.0]
    assert [s[2] for s in stats["slices"]] == [25, 25, 25, 25]
    assert stats["slices"][0][1] == 1.0
    assert stats["slices"][1][1] == 1.5  # 250-300 ms rested (5 calls), 300-500 capped (20): the median is capped


def test_a_window_shorter_than_the_benchmark_window_has_no_sustained_gap():
    stats = window_medians([0.0, 40.0, 80.0], [30.0, 30.0, 30.0], slice_ms=50.0)
    assert stats["first_window_ms"] == 30.0 and stats["sustained_ms"] == 30.0  # second half: the call at 80 ms


def test_the_sustained_mean_counts_the_dips_the_median_skips():
    starts = [float(i) for i in range(40)]
    durations = [2.0 if i % 4 == 1 else 1.0 for i in range(40)]  # every fourth call dipped; the second half: 20-39
    stats = window_medians(starts, durations, slice_ms=10.0)
    assert stats["sustained_ms"] == 1.0 and stats["sustained_mean_ms"] == pytest.approx(1.25)


@pytest.mark.parametrize("starts, durations, slice_ms, message", [
    ([], [], 10.0, "at least one call"),
    ([0.0, 1.0], [1.0], 10.0, "2 starts and 1 durations"),
    ([0.0], [1.0], 0.0, "slice_ms must be > 0"),
])
def test_bad_timelines_are_refused(starts, durations, slice_ms, message):
    with pytest.raises(ValueError, match=message):
        window_medians(starts, durations, slice_ms)


class _HostEvent:
    """A CUDA event stand-in on the host clock (the diag's control flow on the CPU)."""

    def __init__(self, enable_timing: bool = True) -> None:
        self.t = 0.0

    def record(self) -> None:
        import time

        self.t = time.perf_counter()

    def elapsed_time(self, other: "_HostEvent") -> float:
        return (other.t - self.t) * 1e3


def test_measure_reports_each_window_and_the_ratios(monkeypatch):
    import torch

    from benchmarks import gdpa as bench
    from benchmarks.diag import gdpa_power_window as diag

    monkeypatch.setattr(diag.torch.cuda, "Event", _HostEvent)
    monkeypatch.setattr(diag.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(diag, "_tensors", lambda w, device: bench._tensors(w, "cpu"))
    lengths = torch.tensor([5, 9, 3])
    row = diag.measure(bench.Workload("a tiny", lengths, lengths, "fast_gelu"), seconds=0.05, rest=0.0,
                       slice_ms=10.0)
    assert {"gdpa_alone", "jfa_alone", "interleaved"} <= set(row)
    assert set(row["gdpa_alone"]) == {"wall_start", "gdpa"} and set(row["jfa_alone"]) == {"wall_start", "jfa"}
    interleaved = row["interleaved"]
    assert interleaved["gdpa"]["calls"] == interleaved["jfa"]["calls"] >= 1  # call by call, in turn
    for key in ("x_fwd_jfa_alone_sustained", "x_fwd_jfa_alone_sustained_mean"):
        assert row[key] > 0
    assert interleaved["x_fwd_jfa_sustained"] > 0 and row["gdpa_alone"]["gdpa"]["sustained_tflops"] > 0
    assert "forward x JFA, each alone" in diag._summary(row)
    cross = diag.measure(bench.Workload("b tiny", lengths, torch.tensor([4, 4, 4]), "fast_gelu"), seconds=0.02,
                         rest=0.0, slice_ms=10.0)
    assert set(cross) == {"workload", "fwd_flops", "gdpa_alone"}  # no JFA peer for cross-attention
