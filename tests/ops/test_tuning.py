"""The interleaved autotuner: candidates timed in rotating rounds, ranked by their median over rounds.

Triton's timing is replaced by a script (``Autotuner._bench``, which the rounds call), so the ranking logic runs
through Triton's own ``run`` on the CPU: a launch tunes, caches the pick and runs the kernel with it.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.autotuner import Autotuner

from opengem.ops.triton.tuning import InterleavedAutotuner, autotune

CONFIGS = [triton.Config({"VALUE": value}) for value in (1, 2, 3)]


@autotune(configs=CONFIGS, key=["n"])
@triton.jit
def _write_value(out, n, VALUE: tl.constexpr):
    tl.store(out + tl.arange(0, 4), tl.full((4,), VALUE, tl.float32), mask=tl.arange(0, 4) < n)


def _scripted(monkeypatch, times: dict[int, list[float]]) -> list[int]:
    """Make each timing of the candidate with VALUE v return the next of ``times[v]``; returns the timed VALUEs
    in call order."""
    calls: list[int] = []
    left = {v: list(t) for v, t in times.items()}

    def fake_bench(self, *args, config, **meta):
        value = config.kwargs["VALUE"]
        calls.append(value)
        t = left[value].pop(0)
        return [t, t, t]

    monkeypatch.setattr(Autotuner, "_bench", fake_bench)
    return calls


def _launch(n: int) -> torch.Tensor:
    out = torch.zeros(4)
    _write_value[(1,)](out, n)
    return out


def test_a_dip_in_one_round_does_not_decide_the_pick(monkeypatch):
    # VALUE 2 is fastest in two rounds of three; one lucky window makes VALUE 3 look fastest in the first,
    # which is all Triton's one-window tuner would have seen.
    calls = _scripted(monkeypatch, {1: [2.0, 2.0, 2.0], 2: [1.5, 1.5, 1.5], 3: [1.0, 1.8, 1.9]})
    _write_value.cache.clear()
    out = _launch(4)
    assert _write_value.best_config.kwargs["VALUE"] == 2
    assert torch.equal(out, torch.full((4,), 2.0))  # the kernel ran with the pick
    assert calls == [1, 2, 3, 2, 3, 1, 3, 1, 2]  # each round starts one candidate later
    timings = {c.kwargs["VALUE"]: t[0] for c, t in _write_value.configs_timings.items()}
    assert timings == {1: 2.0, 2: 1.5, 3: 1.8}  # medians over the rounds


def test_a_cached_key_is_not_timed_again_and_a_new_key_is(monkeypatch):
    calls = _scripted(monkeypatch, {1: [1.0] * 6, 2: [2.0] * 6, 3: [3.0] * 6})
    _write_value.cache.clear()
    _launch(4)
    _launch(4)
    assert len(calls) == 9
    _launch(3)  # a new key: a fresh tuning of three rounds
    assert len(calls) == 18 and _write_value.best_config.kwargs["VALUE"] == 1


def test_a_candidate_that_fails_is_timed_once_and_never_picked(monkeypatch):
    calls = _scripted(monkeypatch, {1: [math.inf], 2: [2.0, 2.1, 1.9], 3: [2.5, 2.4, 2.6]})
    _write_value.cache.clear()
    _launch(4)
    assert calls.count(1) == 1
    assert _write_value.best_config.kwargs["VALUE"] == 2


def test_every_opengem_tuned_kernel_uses_the_interleaved_tuner():
    from opengem.ops.triton import embedding, gdpa_fp8, jagged_attention, jagged_attention_fp8, qkv_projection_fp8
    from opengem.ops.triton import jagged_attention_fp8_backward as fp8_backward

    kernels = [*jagged_attention.KERNELS.values(), jagged_attention_fp8._fwd_fp8_kernel, fp8_backward._dq_fp8_kernel,
               fp8_backward._dkdv_fp8_kernel, gdpa_fp8._gdpa_fp8_fwd_kernel, embedding._lookup_kernel,
               qkv_projection_fp8._project_quantize_kernel]
    assert all(isinstance(k, InterleavedAutotuner) for k in kernels)


@pytest.mark.parametrize("rounds", [1, 3])
def test_rounds_is_a_per_kernel_setting(monkeypatch, rounds):
    calls = _scripted(monkeypatch, {v: [float(v)] * 3 for v in (1, 2, 3)})
    _write_value.cache.clear()
    monkeypatch.setattr(_write_value, "rounds", rounds)
    _launch(4)
    assert len(calls) == 3 * rounds
