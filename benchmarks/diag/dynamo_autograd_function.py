"""Two torch Dynamo bugs met by the traced FP8 linear (`opengem.nn.low_precision_traced`), as minimal repros.

1. ``noop_to``: an autograd.Function whose forward returns ``y.to(x.dtype)`` with ``y`` already in that dtype (so
   ``to`` returns its input), compiled with fullgraph: torch 2.11 returns zero gradients (torch 2.13 is right).
2. ``module_float``: two chained autograd.Functions reading a module-level float inside ``forward``, compiled with
   ``dynamic=True`` (the trainer's setting): Dynamo raises "lift_tracked_freevar_to_input should not be called on
   root SubgraphTracer" (torch 2.11 and 2.13); a literal float compiles.

Each row says whether the bug shows on this torch. CPU only, seconds: ``PYTHONPATH=src:. python -m
benchmarks.diag.dynamo_autograd_function``; writes ``benchmarks/results/dynamo_autograd_function.json``.
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.common import write_results

SCALE = 448.0  # read as a module-level float by the second repro


class _NoopTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return (x @ w.t()).to(x.dtype)  # a bf16 product: this `to` returns its input

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return dy @ w, dy.t() @ x


class _ModuleFloat(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x.clamp(-SCALE, SCALE) @ w.t()

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return dy @ w, dy.t() @ x


def _noop_to() -> dict:
    x = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(48, 32, dtype=torch.bfloat16, requires_grad=True)
    torch.compile(_NoopTo.apply, fullgraph=True, backend="eager")(x, w).float().square().mean().backward()
    norm = float(x.grad.float().norm())
    return {"repro": "noop_to", "input_grad_norm": norm, "bug": norm == 0.0}


def _module_float() -> dict:
    w1, w2 = torch.randn(128, 64, requires_grad=True), torch.randn(64, 128, requires_grad=True)
    x = torch.randn(32, 64, requires_grad=True)
    try:
        chained = torch.compile(lambda t: _ModuleFloat.apply(_ModuleFloat.apply(t, w1), w2), fullgraph=True,
                                backend="eager", dynamic=True)
        chained(x).sum().backward()
        return {"repro": "module_float", "bug": False}
    except Exception as error:  # the bug is this error: report it as a row
        return {"repro": "module_float", "bug": True, "error": f"{type(error).__name__}: {error}".splitlines()[0][:200]}


def main() -> None:
    rows = []
    for repro in (_noop_to, _module_float):
        torch._dynamo.reset()
        rows.append({"torch": torch.__version__, **repro()})
        print(rows[-1], flush=True)
    write_results("dynamo_autograd_function", rows)


if __name__ == "__main__":
    main()
