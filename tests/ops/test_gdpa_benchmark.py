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
