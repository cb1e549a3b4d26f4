"""The GDPA benchmark's workload and peer selection on CPU (the timed run itself needs the GPU)."""

import sys

import pytest

from benchmarks import gdpa


def test_workload_prefixes_choose_and_an_unknown_one_is_refused():
    names = [w.name for w in gdpa.workloads(quick=False)]
    assert [n for n in names if n.startswith("b ")] == ["b cross Q<=2048 KV=128", "b cross Q<=2048 KV=256"]
    with pytest.raises(SystemExit, match="no workload starts with"):
        gdpa.run(quick=True, device="cpu", prefixes=["z "])


def test_unknown_peer_is_refused(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["gdpa", "--peers", "jfa,flash"])
    with pytest.raises(SystemExit, match="unknown \\['flash'\\]"):
        gdpa.main()


def test_paired_forward_ratio_interleaves_the_two_without_autograd(monkeypatch):
    """x_fwd_paired: JFA's time over ours, round by round, with autograd off (the forward alone is timed)."""
    import torch

    calls = []

    def fake_peer(name, ms):
        def fn():
            calls.append((name, torch.is_grad_enabled()))
            return ms

        return lambda w, t: fn

    monkeypatch.setattr(gdpa, "_jfa_peer", fake_peer("jfa", 2.0))
    monkeypatch.setattr(gdpa, "_ours", fake_peer("gdpa", 0.8))
    monkeypatch.setattr(gdpa, "bench_ms", lambda fn: fn())
    lengths = torch.tensor([3, 5])
    w = gdpa.Workload("a tiny", lengths, lengths, "fast_gelu")
    assert gdpa._paired_fwd_x_jfa(w, "cpu", rounds=3) == 2.5
    # an untimed warm-up call each (host caches filled before a graph capture), then each round starts later
    assert [name for name, _ in calls] == ["jfa", "gdpa", "jfa", "gdpa", "gdpa", "jfa", "jfa", "gdpa"]
    assert not any(grad for _, grad in calls)
    # a timer that gives no figure (bench_graph_ms on a call that syncs) gives no ratio rather than a wrong one
    assert gdpa._paired_fwd_x_jfa(w, "cpu", rounds=2, bench=lambda fn: None) is None
    assert gdpa._paired_fwd_x_jfa(w, "cpu", rounds=2, bench=lambda fn: 2 * fn()) == 2.5


def test_acceptance_checks_the_interleaved_and_device_time_ratios_beside_the_separate_one():
    rows = [{"workload": "a self L=512 s=0.5", "impl": "gdpa", "fwd_ms": 1.0},
            {"workload": "a self L=512 s=0.5", "impl": "jfa", "x_fwd": 1.05, "x_fwd_paired": 1.12,
             "x_fwd_graph": 1.08}]
    checks = {c["check"]: c for c in gdpa.acceptance(rows)}
    assert checks["fwd x jfa"]["pass"] is False and checks["fwd x jfa (interleaved)"]["pass"] is True
    assert checks["fwd x jfa (interleaved, device time)"]["pass"] is False
    assert checks["fwd x jfa (interleaved)"]["value"] == 1.12
    assert checks["fwd x padded-compiled"]["pass"] is None  # the peer did not run: no verdict
