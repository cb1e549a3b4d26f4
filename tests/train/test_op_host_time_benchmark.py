"""benchmarks.diag.op_host_time on the CPU: each opengem custom-op call is timed and profiled, nested calls count
once, and the implementations are restored afterwards."""

import cProfile

import pytest
import torch
from torch._library import custom_ops

from benchmarks.diag.op_host_time import heaviest_functions, per_op, timed_ops
from opengem.ops import gdpa


def attention_step() -> None:
    lengths = torch.tensor([0, 3, 7])
    q = torch.randn(7, 2, 16, requires_grad=True)
    k, v = torch.randn(7, 2, 16), torch.randn(7, 2, 16)
    gdpa(q, k, v, lengths, lengths, 4, 4).sum().backward()


def test_every_call_is_timed_and_profiled_and_the_ops_restored():
    before = dict(custom_ops.OPDEFS["opengem::gdpa_fwd"]._backend_fns)
    drained = []
    profiler = cProfile.Profile()
    with timed_ops(lambda: drained.append(1), profiler) as times:
        for _ in range(2):
            attention_step()
    assert len(times["opengem::gdpa_fwd"]) == 2 and len(times["opengem::gdpa_bwd"]) == 2
    assert len(drained) == 4  # once before each outermost call
    rows = {row["op"]: row for row in per_op(times, steps=2)}
    assert rows["opengem::gdpa_bwd"]["calls_per_step"] == 1.0 and rows["opengem::gdpa_bwd"]["mean_us"] > 0
    assert rows["opengem::gdpa_fwd"]["ms_per_step"] == pytest.approx(1e3 * sum(times["opengem::gdpa_fwd"]) / 2)
    functions = heaviest_functions(profiler, steps=2)
    assert functions and any("gdpa" in row["function"] for row in functions)  # the reference ran inside the calls
    assert all(row["own_ms_per_step"] >= 0 for row in functions)
    assert custom_ops.OPDEFS["opengem::gdpa_fwd"]._backend_fns == before


def test_an_op_called_inside_another_is_part_of_the_outer_call():
    backward = custom_ops.OPDEFS["opengem::gdpa_bwd"]
    implementation = backward._backend_fns[None]

    def calls_the_forward(*args, **kwargs):
        lengths = torch.tensor([0, 2])
        x = torch.randn(2, 1, 16)
        gdpa(x, x, x, lengths, lengths, 2, 2)  # gdpa_fwd, inside this gdpa_bwd call
        return implementation(*args, **kwargs)

    backward._backend_fns[None] = calls_the_forward
    try:
        with timed_ops(lambda: None) as times:
            attention_step()
    finally:
        backward._backend_fns[None] = implementation
    assert {name: len(calls) for name, calls in times.items()} == {"opengem::gdpa_fwd": 1, "opengem::gdpa_bwd": 1}
