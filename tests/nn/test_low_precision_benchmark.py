"""The low-precision benchmark's MLP rows on CPU (tiny block, interpreter kernels, timings stubbed): it runs
once on the GPU, so its interleaved timing, the paired speedups and failure handling are checked here."""

import json
import os
import statistics

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from benchmarks import common, low_precision


@pytest.fixture
def cpu_bench(monkeypatch, tmp_path):
    monkeypatch.setattr(low_precision, "DEVICE", "cpu")
    monkeypatch.setattr(low_precision, "HIDDEN", 32)
    monkeypatch.setattr(low_precision, "INNER", 64)
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *args: None)
    return tmp_path


def scripted_rounds(monkeypatch, order: list[str], ms_of: dict[str, list[float]]) -> None:
    """The benchmark's do_bench rounds run each step once and return the next scripted time of its variant
    (the order of the calls is recorded); the CUDA-graph rounds pass through (no GPU: declined)."""
    real = low_precision.interleaved_ms

    def interleaved(fns, rounds, bench=None):
        if bench is not None:
            return real(fns, rounds, bench)
        name_of = {id(fn): name for name, fn in fns.items()}

        def scripted(fn) -> float:
            fn()
            order.append(name_of[id(fn)])
            return ms_of[name_of[id(fn)]].pop(0)

        return real(fns, rounds, scripted)

    monkeypatch.setattr(low_precision, "interleaved_ms", interleaved)


def test_mlp_rows_interleave_the_variants_and_pair_the_speedups(cpu_bench, monkeypatch):
    order: list[str] = []
    names = [low_precision.BF16_MLP, "LowPrecisionLinear fp8_rowwise", "LowPrecisionMLP fp8_rowwise (fused GELU)",
             "LowPrecisionMLP fp8_rowwise_fast (fused GELU)", "LowPrecisionMLP fp8_rowwise_fast (fused GELU, torch bias reductions)"]
    # the card's speed changes from round to round; each FP8 variant's gain within a round differs too
    bf16 = [10.0, 14.0, 11.0, 13.0, 12.0]
    gains = [2.0, 1.5, 2.0, 1.8, 1.6]
    rounds = {name: bf16 if name == low_precision.BF16_MLP else [b / g for b, g in zip(bf16, gains)]
              for name in names}
    scripted_rounds(monkeypatch, order, {n: list(t) for n, t in rounds.items()})
    results = low_precision.Results(quick=True)
    baseline = low_precision.mlp_rows(results, tokens=48, recipes=("fp8_rowwise",))
    assert baseline == rounds[low_precision.BF16_MLP]
    n = len(names)  # round r starts r variants later
    assert order == [names[(r + i) % n] for r in range(low_precision.MLP_ROUNDS) for i in range(n)]
    rows = {row["impl"]: row for row in results.rows}
    assert list(rows) == names
    for name in names[1:]:
        # the median of the per-round ratios (1.8), not the ratio of the medians (12 / 7.22 = 1.66)
        assert rows[name]["speedup_vs_bf16"] == pytest.approx(1.8)
        assert rows[name]["ms_rounds"] == rounds[name]
        assert rows[name]["rel_err"] < 0.15 and rows[name]["rel_err_dx"] < 0.15
        assert rows[name]["graph_error"] == "no CUDA graph timing"  # no GPU: declined, not a number
        assert "graph_ms" not in rows[name]
    saved = json.loads((cpu_bench / "low_precision.json").read_text())
    assert saved["bf16_round_spread"] == pytest.approx(14.0 / 10.0 - 1)
    assert saved["rows"][1]["ms"] == pytest.approx(statistics.median(rounds[names[1]]))


def test_a_variant_that_fails_is_recorded_and_the_others_still_time(cpu_bench, monkeypatch):
    timed = [low_precision.BF16_MLP, "LowPrecisionMLP fp8_rowwise (fused GELU)",
             "LowPrecisionMLP fp8_rowwise_fast (fused GELU)", "LowPrecisionMLP fp8_rowwise_fast (fused GELU, torch bias reductions)"]
    order: list[str] = []
    scripted_rounds(monkeypatch, order, {name: [1.0] * low_precision.MLP_ROUNDS for name in timed})
    results = low_precision.Results(quick=True)
    low_precision.mlp_rows(results, tokens=16, recipes=("no_such_recipe",))
    rows = {row["impl"]: row for row in results.rows}
    failed = rows["LowPrecisionLinear no_such_recipe"]
    assert "no_such_recipe" in failed["error"] and "ms" not in failed
    assert set(order) == set(timed)  # the failed variant is left out of the rounds
    assert rows["LowPrecisionMLP fp8_rowwise (fused GELU)"]["speedup_vs_bf16"] == pytest.approx(1.0)
