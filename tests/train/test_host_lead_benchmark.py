"""benchmarks.diag.host_lead on the CPU: marks in call order (forward, end, backward through the output's gradient
hook), the lead arithmetic on made-up clocks, the collector's time, the forward's cProfile only while recording."""

import cProfile
import gc

import pytest
import torch
from torch import nn

from benchmarks.diag.host_lead import Marked, Marks, Profiled, collector_time, leads, step_spans, top_functions


class NamesOnly(Marks):
    def mark(self, name: str) -> None:
        if self.recording:
            self.taken.append((name, 0.0, None))


def test_marked_modules_mark_forward_end_and_backward_in_order():
    marks = NamesOnly(recording=True)
    first, second = Marked(nn.Linear(3, 3), "a", marks), Marked(nn.Linear(3, 3), "b", marks)
    y = second(first(torch.randn(2, 3)))
    y.sum().backward()
    assert [name for name, _, _ in marks.taken] == [
        "a forward", "a forward end", "b forward", "b forward end", "b backward", "a backward"]
    marks.recording = False
    with torch.no_grad():  # nothing needs a gradient: no hook, no backward mark
        first(torch.randn(2, 3))
    assert len(marks.taken) == 6


class Event:
    def __init__(self, gpu_ms: float) -> None:
        self.gpu_ms = gpu_ms


class Reference:
    def elapsed_time(self, event: Event) -> float:
        return event.gpu_ms


def test_lead_is_how_long_after_the_host_the_gpu_reached_each_mark():
    # two steps of marks (x, y): host seconds, GPU ms after the reference; the first step is not reported
    marks = Marks(taken=[("x", 0.000, Event(0.0)), ("y", 0.001, Event(5.0)),
                         ("x", 0.002, Event(9.0)), ("y", 0.010, Event(10.5))])  # fmt: skip
    rows = leads(marks, steps=2, reference=Reference(), host_zero=0.0)
    assert [r["mark"] for r in rows] == ["x", "y"]
    assert rows[0]["lead_ms"] == pytest.approx(7.0) and rows[1]["lead_ms"] == pytest.approx(0.5)
    assert rows[0]["host_ms_since_previous"] == pytest.approx(1.0) and rows[0]["gpu_ms_since_previous"] == 4.0
    assert rows[1]["host_ms_since_previous"] == pytest.approx(8.0) and rows[1]["gpu_ms_since_previous"] == 1.5
    assert rows[1]["lead_ms_each_step"] == [pytest.approx(0.5)] and rows[1]["min_lead_ms"] == pytest.approx(0.5)
    assert step_spans(marks, 2, Reference()) == [{"host_ms": pytest.approx(2.0), "gpu_ms": 9.0}]
    with pytest.raises(ValueError, match="3 marks over 2 steps"):
        leads(Marks(taken=marks.taken[:3]), steps=2, reference=Reference(), host_zero=0.0)


def test_collector_time_counts_each_collection_inside_the_block():
    totals: list[float] = []
    with collector_time(totals):
        gc.collect()
        gc.collect()
    gc.collect()  # outside: not counted
    assert len(totals) == 2 and all(t >= 0 for t in totals)


def test_profiled_module_runs_under_the_profiler_only_while_recording():
    marks, profiler = NamesOnly(recording=False), cProfile.Profile()

    class Inner(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return forward_body_of_the_inner_module(x)

    profiled = Profiled(Inner(), marks, profiler)
    profiled(torch.randn(2))  # not recording: nothing profiled
    assert top_functions(profiler) == "nothing ran under the profiler"
    marks.recording = True
    profiled(torch.randn(2))
    table = top_functions(profiler)
    assert "forward_body_of_the_inner_module" in table and "Ordered by: internal time" in table


def forward_body_of_the_inner_module(x: torch.Tensor) -> torch.Tensor:
    return x * 2
