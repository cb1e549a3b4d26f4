"""The JFA benchmark's control flow on CPU (tiny shapes, interpreter kernels, CUDA calls stubbed): it runs
once on the GPU, so its ordering, incremental results and failure handling are checked here."""

import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

import benchmarks.common as common
from benchmarks import jfa



@pytest.fixture
def cpu_bench(monkeypatch, tmp_path):
    monkeypatch.setattr(jfa, "DEVICE", "cpu")
    monkeypatch.setattr(jfa, "HEADS", 2)
    monkeypatch.setattr(jfa, "HEAD_DIM", 16)
    monkeypatch.setattr(jfa, "DTYPE", torch.float32)
    monkeypatch.setattr(jfa, "SUB_BATCH_TOKENS", 20)
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(jfa, "bench_ms", lambda fn: (fn(), 1.0)[1])
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *args: None)
    for name in ("memory_allocated", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda *args: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "cpu (stubbed)")
    lengths = torch.tensor([21, 3, 40])

    def tiny(quick):
        return [jfa.Workload("a_power_law_causal", lengths), jfa.Workload("d_power_law_window256", lengths, window=5)]

    monkeypatch.setattr(jfa, "workloads", tiny)
    monkeypatch.setattr(sys, "argv", ["jfa", "--quick"])
    monkeypatch.delenv("OPENGEM_JFA_AUTOTUNE", raising=False)
    return tmp_path / "jfa.json"


def test_quick_run_orders_steps_checks_errors_and_saves_rows(cpu_bench, capsys):
    jfa.main()
    lines = capsys.readouterr().out.splitlines()
    steps = [line for line in lines if line.startswith("[a_power_law_causal] jfa:")]
    assert [s.split(": ")[1].split(" ")[0:2] for s in steps[:2]] == [["first", "forward"], ["first", "backward"]]
    assert lines.index(steps[-1]) < min(i for i, line in enumerate(lines) if "torch_varlen_flash" in line)
    rows = json.loads(cpu_bench.read_text())["rows"]
    impls = ("jfa", "torch_varlen_flash", "nested_sdpa")
    assert [(r["workload"], r["impl"]) for r in rows] == [
        (w, i) for w in ("a_power_law_causal", "d_power_law_window256") for i in impls
    ]
    for row in (r for r in rows if r["impl"] == "jfa"):
        assert row["max_rel_err"] < 1e-5 and row["fwd_bwd_ms"] == 1.0
        assert set(row["tuned"]) == {"fwd", "dkdv", "dq"}  # each kernel's tile config, recorded per workload
    assert rows[-1]["note"].startswith("skipped")  # nested SDPA cannot express a window
    assert all("note" in r or "fwd_bwd_ms" in r for r in rows)


def test_flex_pass_only_on_the_named_workloads(cpu_bench, monkeypatch):
    def flex_unavailable(wl, b):
        raise NotImplementedError("no FlexAttention on this machine")

    monkeypatch.setattr(jfa, "flex_impl", flex_unavailable)
    argv = ["jfa", "--workloads", "a_,d_", "--flex-workloads", "d_", "--peers", "torch_varlen_flash"]
    monkeypatch.setattr(sys, "argv", argv)
    jfa.main()
    saved = json.loads(cpu_bench.read_text())
    assert [r["workload"] for r in saved["rows"] if r["impl"] == "flex_attention"] == ["d_power_law_window256"]
    assert saved["flex"] == ["d_power_law_window256"]
    monkeypatch.setattr(sys, "argv", ["jfa", "--workloads", "a_", "--flex-workloads", "b_"])
    with pytest.raises(SystemExit, match="--flex-workloads"):
        jfa.main()


def test_lost_context_stops_the_run_and_keeps_rows(cpu_bench, monkeypatch):
    def faulting_peer(wl, b):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(jfa, "flash_impl", faulting_peer)
    monkeypatch.setattr(jfa, "_cuda_alive", lambda: False)
    with pytest.raises(SystemExit, match="ABORTED: CUDA context lost"):
        jfa.main()
    saved = json.loads(cpu_bench.read_text())
    assert [r["impl"] for r in saved["rows"]] == ["jfa", "torch_varlen_flash"]
    assert "fwd_bwd_ms" in saved["rows"][0]
    assert saved["rows"][1]["note"].startswith("error in setup: CUDA error: an illegal memory access")
    assert "aborted" in saved


def test_tile_sweep_records_a_tile_the_schedule_cannot_run_and_times_the_rest(monkeypatch):
    """``benchmarks.diag.jfa_configs``: an extra tile the host schedule has no size for is a row with the reason,
    not a ``KeyError`` from the launch (session 37's 32-row forward tile); every other tile is forced and timed."""
    from benchmarks.diag import jfa_configs
    from opengem.ops.triton import jagged_attention as kernels

    monkeypatch.setattr(kernels, "_TILES", (64, 128))
    monkeypatch.setattr(kernels, "full_product", lambda name: [(64, 64, 4, 3)])
    monkeypatch.setattr(jfa_configs, "bench_ms", lambda fn, **kwargs: (fn(), 2.5)[1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    forced: list[dict] = []
    rows: list[dict] = []
    fn = lambda: forced.append(dict(kernels.KERNELS["fwd"].configs[0].kwargs))  # noqa: E731
    jfa_configs.sweep("fwd", fn, rows, "w", extra=[(32, 64, 4, 3), (64, 32, 4, 3)])
    assert [row["config"] for row in rows] == ["m32_n64_w4_s3", "m64_n64_w4_s3", "m64_n32_w4_s3"]
    assert "BLOCK_M = 32 is not a scheduled tile size" in rows[0]["error"] and "ms" not in rows[0]
    assert [row["ms"] for row in rows[1:]] == [2.5, 2.5]
    assert {"BLOCK_M": 64, "BLOCK_N": 32} in forced and {"BLOCK_M": 32, "BLOCK_N": 64} not in forced
