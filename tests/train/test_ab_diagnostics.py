"""benchmarks.diag on the CPU: the shared learner's settings; launch_ab's and loader_ab's ABBA rounds and summaries."""

import pytest

from benchmarks.diag.compiled_learner import abba, timed
from benchmarks.diag.launch_ab import summary, time_rounds
from benchmarks.diag.loader_ab import mode_summary, time_round


def test_abba_flips_the_order_every_round_and_needs_an_even_count():
    assert abba(4, ("a", "b")) == [("a", "b"), ("b", "a")] * 2
    for bad in (0, 3):
        with pytest.raises(ValueError, match="rounds must be an even number"):
            abba(bad, ("a", "b"))


def test_timed_runs_between_two_syncs_and_returns_the_result():
    events = []
    seconds, result = timed(lambda: events.append("run") or 7, lambda: events.append("sync"))
    assert events == ["sync", "run", "sync"] and result == 7 and seconds >= 0


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


def test_loader_ab_times_a_round_and_summarizes_each_mode_by_its_median():
    calls = []
    seconds, flops = time_round(lambda: calls.append("steps") or [1e12, 2e12], lambda: calls.append("sync"))
    assert calls == ["sync", "steps", "sync"] and flops == 3e12 and seconds >= 0
    rows = [{"mode": mode, "step_ms": ms, "tflops": tflops} for mode, ms, tflops in
            [("staged", 140.0, 270.0), ("stream", 160.0, 240.0), ("stream", 150.0, 250.0), ("staged", 142.0, 268.0),
             ("stream", 170.0, 230.0)]]
    result = mode_summary(rows, 1000.0)
    assert result["staged"] == {"step_ms": 141.0, "tflops": 269.0, "mfu": 0.269}
    assert result["stream"] == {"step_ms": 160.0, "tflops": 240.0, "mfu": 0.24}


def test_compiled_learner_takes_the_settings_of_set_and_compiles_with_them(monkeypatch):
    """The diagnostics' ``--set`` (here the C++ wrapper and a memory budget) reaches the config and the regions'
    compile; without it the config is bench train's."""
    from benchmarks.diag import compiled_learner as module
    from opengem.train import trainer

    asked = []
    monkeypatch.setattr(trainer, "compile_regions", lambda model, mode, cpp_wrapper, memory_budget: asked.append(
        (mode, cpp_wrapper, memory_budget)))
    settings = ["compile_cpp_wrapper=true", "activation_memory_budget=0.5"]
    options, config, _, _ = module.compiled_learner("gem-tiny", 8, settings)
    assert options.overrides == ("gem.sequence_dtype=compute", *settings)
    assert config.compile_cpp_wrapper and asked == [("default", True, 0.5)]
    _, config, _, _ = module.compiled_learner("gem-tiny", 8)
    assert not config.compile_cpp_wrapper and asked[1] == ("default", False, 1.0)
