"""`benchmarks.diag.inductor_kernel_bytes`: the bytes counted per launch and the per-kernel rows (no GPU needed)."""

from types import SimpleNamespace

import pytest
import torch

from benchmarks.diag.inductor_kernel_bytes import Launches, argument_bytes, per_kernel


class _Event:
    def __init__(self, at_ms: float) -> None:
        self.at_ms = at_ms

    def elapsed_time(self, end: "_Event") -> float:
        return end.at_ms - self.at_ms


def test_argument_bytes_counts_tensors_and_in_out_buffers_twice():
    tuner = SimpleNamespace(fn=SimpleNamespace(arg_names=["in_out_ptr0", "in_ptr0", "out_ptr0", "xnumel"]))
    args = (torch.empty(10, dtype=torch.float32), torch.empty(4, 8, dtype=torch.bfloat16),
            torch.empty(3, dtype=torch.int64), 10)
    assert argument_bytes(tuner, args) == 2 * 40 + 64 + 24


def test_per_kernel_rows_sum_launches_per_step_against_the_copy_rate():
    launches = Launches(records=[
        ("ln_bwd", 4_000_000, _Event(0.0), _Event(2.0)),
        ("gelu", 1_000_000, _Event(2.0), _Event(2.5)),
        ("ln_bwd", 4_000_000, _Event(3.0), _Event(5.0)),
        ("gelu", 1_000_000, _Event(5.0), _Event(5.5)),
    ])  # fmt: skip
    first, second = per_kernel(launches, steps=2, copy_gbps=4.0)
    assert first["kernel"] == "ln_bwd" and first["calls_per_step"] == 1 and first["ms_per_step"] == 2.0
    assert first["gb_per_step"] == pytest.approx(0.004) and first["gbps"] == pytest.approx(2.0)
    assert first["copy_share"] == pytest.approx(0.5) and first["ms_at_copy_rate"] == pytest.approx(1.0)
    assert second["kernel"] == "gelu" and second["gbps"] == pytest.approx(2.0)
