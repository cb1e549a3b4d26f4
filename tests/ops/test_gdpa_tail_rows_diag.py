"""benchmarks.diag.gdpa_tail_rows on the CPU (the op's reference path): every case runs, a correct op reads as ok,
and an op whose backward writes into its forward's output is caught."""

import json
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.diag import gdpa_tail_rows


def test_every_case_is_ok_on_the_reference_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "tail.json"
    monkeypatch.setattr(sys, "argv", ["gdpa_tail_rows", "--out", str(out), "--device", "cpu"])
    gdpa_tail_rows.main()
    cases = json.loads(out.read_text())["cases"]
    assert set(cases) == set(gdpa_tail_rows.CASES)
    assert all(case["ok"] for case in cases.values()), cases
    failing = cases["failing"]
    assert [s["length"] for s in failing["samples"]] == [130, 7, 0, 64, 255] and failing["padding_rows"] == 0


class _ScribbleOnBackward(torch.autograd.Function):
    """The identity forward; the backward overwrites the output's last row, as an out-of-bounds write would."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        ctx.out = out
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        ctx.out[-1].fill_(float("nan"))
        return grad


def test_a_backward_that_writes_into_the_output_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    real = gdpa_tail_rows.gdpa
    monkeypatch.setattr(gdpa_tail_rows, "gdpa", lambda *a, **k: _ScribbleOnBackward.apply(real(*a, **k)))
    case = gdpa_tail_rows.run_case([5, 0, 9], 1.0, "silu", 0, "cpu")
    assert case["rows_changed_by_backward"] == 1 and case["first_rows_changed"] == [13] and not case["ok"]
    assert all(s["non_finite_rows"] == 0 for s in case["samples"])  # the forward's own rows were right
