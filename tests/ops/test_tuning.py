"""The confirming autotuner: every candidate timed once in a short window, then the close finalists timed again in a
long one, whose fastest is the pick.

Triton's timing is replaced by a script (``Autotuner._bench``, which both looks call), so the selection runs through
Triton's own ``run`` on the CPU: a launch tunes, caches the pick and runs the kernel with it.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.autotuner import Autotuner

from opengem.ops.triton.tuning import ConfirmingAutotuner, autotune, tuning_bench

CONFIGS = [triton.Config({"VALUE": value}) for value in (1, 2, 3, 4)]


@autotune(configs=CONFIGS, key=["n"])
@triton.jit
def _write_value(out, n, VALUE: tl.constexpr):
    tl.store(out + tl.arange(0, 4), tl.full((4,), VALUE, tl.float32), mask=tl.arange(0, 4) < n)


def _scripted(monkeypatch, first: dict[int, float], second: dict[int, float]) -> list[tuple[int, tuple]]:
    """Time the candidate with VALUE v as ``first[v]`` under the first look's window and ``second[v]`` under any
    other; returns (VALUE, window) per timing, in call order."""
    calls: list[tuple[int, tuple]] = []

    def fake_bench(self, *args, config, **meta):
        value = config.kwargs["VALUE"]
        window = self.do_bench.window_ms
        calls.append((value, window))
        t = first[value] if window == tuning_bench.window_ms else second[value]
        return [t, t * 0.9, t * 1.1]

    monkeypatch.setattr(Autotuner, "_bench", fake_bench)
    return calls


def _launch(n: int) -> torch.Tensor:
    out = torch.zeros(4)
    _write_value[(1,)](out, n)
    return out


def test_the_second_look_decides_among_the_close_finalists(monkeypatch):
    # VALUE 1 wins the short window by 3%, VALUE 2 is 8% faster in the long one; 3 is 20% off and not looked at again
    calls = _scripted(monkeypatch, first={1: 1.00, 2: 1.03, 3: 1.20, 4: 1.05}, second={1: 1.10, 2: 1.02, 4: 1.30})
    _write_value.cache.clear()
    out = _launch(4)
    assert _write_value.best_config.kwargs["VALUE"] == 2
    assert torch.equal(out, torch.full((4,), 2.0))  # the kernel ran with the pick
    long_window = ConfirmingAutotuner.confirm_window_ms
    assert calls == [(1, (10, 40)), (2, (10, 40)), (3, (10, 40)), (4, (10, 40)),
                     (1, long_window), (2, long_window), (4, long_window)]
    timings = {c.kwargs["VALUE"]: t[0] for c, t in _write_value.configs_timings.items()}
    # the finalists' second look, scaled so that the pick sits at the first look's best; the rest as first timed
    assert timings == pytest.approx({1: 1.10 / 1.02, 2: 1.0, 3: 1.20, 4: 1.30 / 1.02})
    assert {c.kwargs["VALUE"]: t[0] for c, t in _write_value.confirmed_timings.items()} == {1: 1.10, 2: 1.02, 4: 1.30}


def test_a_clear_winner_is_not_looked_at_again(monkeypatch):
    calls = _scripted(monkeypatch, first={1: 2.0, 2: 1.0, 3: 1.5, 4: 3.0}, second={})
    _write_value.cache.clear()
    _launch(4)
    assert _write_value.best_config.kwargs["VALUE"] == 2
    assert len(calls) == 4 and _write_value.confirmed_timings == {}


def test_finalists_are_capped_and_a_cached_key_is_not_timed_again(monkeypatch):
    calls = _scripted(monkeypatch, first={1: 1.00, 2: 1.01, 3: 1.02, 4: 1.03}, second={1: 1.0, 2: 1.0, 3: 0.9, 4: 0.5})
    _write_value.cache.clear()
    _launch(4)
    _launch(4)
    assert [v for v, window in calls if window != (10, 40)] == [1, 2, 3]  # the 4th closest is past the cap of 3
    assert _write_value.best_config.kwargs["VALUE"] == 3
    _launch(3)  # a new key: a fresh tuning
    assert len(calls) == 14


def test_a_candidate_that_fails_is_never_a_finalist(monkeypatch):
    calls = _scripted(monkeypatch, first={1: math.inf, 2: 2.0, 3: 2.1, 4: 9.0}, second={2: 2.5, 3: 2.2})
    _write_value.cache.clear()
    _launch(4)
    assert [v for v, window in calls if window != (10, 40)] == [2, 3]
    assert _write_value.best_config.kwargs["VALUE"] == 3


def test_one_finalist_is_tritons_one_window_tuner(monkeypatch):
    calls = _scripted(monkeypatch, first={1: 1.00, 2: 1.01, 3: 1.02, 4: 1.03}, second={1: 2.0, 2: 1.0, 3: 1.0, 4: 1.0})
    monkeypatch.setattr(_write_value, "finalists", 1)
    _write_value.cache.clear()
    _launch(4)
    assert len(calls) == 4 and _write_value.best_config.kwargs["VALUE"] == 1


def test_every_opengem_tuned_kernel_confirms_its_pick():
    from opengem.ops.triton import embedding, gdpa_fp8, jagged_attention, jagged_attention_fp8, qkv_projection_fp8
    from opengem.ops.triton import jagged_attention_fp8_backward as fp8_backward

    kernels = [*jagged_attention.KERNELS.values(), jagged_attention_fp8._fwd_fp8_kernel, fp8_backward._dq_fp8_kernel,
               fp8_backward._dkdv_fp8_kernel, gdpa_fp8._gdpa_fp8_fwd_kernel, embedding._lookup_kernel,
               qkv_projection_fp8._project_quantize_kernel]
    assert all(isinstance(k, ConfirmingAutotuner) and k.do_bench is tuning_bench for k in kernels)
