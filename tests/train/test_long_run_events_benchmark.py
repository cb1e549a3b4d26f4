"""`benchmarks.diag.long_run_events`: the per-block summary of a long run's stalls, and a short CPU run."""

import json

from benchmarks import common
from benchmarks.diag import long_run_events


def _row(step: int, ms: float, keys: int = 0, loaded: int = 0, graphs: int = 0) -> dict:
    return {"step": step, "ms": ms, "autotuner_keys": keys, "kernels_loaded": loaded, "dynamo_graphs": graphs}


def test_summary_separates_stalled_steps_per_block():
    rows = [_row(1, 900.0, graphs=3), _row(2, 100.0), _row(3, 120.0), _row(4, 2700.0, keys=9), _row(5, 110.0)]
    first, second = long_run_events.summarize(rows, block=3)
    assert first == {"steps": "1-3", "stalled_steps": 1, "stalled_ms": 900.0, "calm_median_ms": 110.0,
                     "mean_ms": 373.33, "autotuner_keys": 0, "kernels_loaded": 0, "dynamo_graphs": 3}
    assert second["steps"] == "4-5" and second["stalled_steps"] == 1 and second["stalled_ms"] == 2700.0
    assert second["calm_median_ms"] == 110.0 and second["autotuner_keys"] == 9


def test_short_cpu_run_writes_every_step(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    result = long_run_events.main(["--preset", "gem-tiny", "--steps", "3", "--set", "num_workers=0",
                                   "--set", "eval_samples=64"])
    saved = json.loads((tmp_path / "long_run_events.json").read_text())
    assert [row["step"] for row in saved["rows"]] == [1, 2, 3] and saved["complete"]
    assert all(row["ms"] > 0 and row["max_len"] >= 1 and row["tokens"] >= row["max_len"] for row in saved["rows"])
    assert [e["attempt"] for e in result["evaluations"]] == [0, 1]
    assert "click/model/ne" in result["evaluations"][0]["metrics"]
