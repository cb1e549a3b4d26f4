"""Where the traced FP8 linear loses its gradients (session 12: every gradient exactly zero, the output right).

One `LowPrecisionLinear` (fp8_rowwise, then a recipe with only the forward in FP8) with
`TRACE_UNDER_COMPILE` on, compiled with each backend in turn: ``eager`` (Dynamo only), ``aot_eager``
(Dynamo and AOTAutograd, no Inductor) and ``inductor``. The first backend whose gradients are wrong names
the layer at fault. Per row: relative errors against eager and the norm of each gradient (0 = lost). The
AOTAutograd forward and backward graphs of the ``aot_eager`` fp8_rowwise case go to the log
(``TORCH_LOGS`` style, via `torch._logging.set_logs`).

Run on a GPU: ``PYTHONPATH=src:. python -m benchmarks.diag.fp8_compile_backends``; writes
``benchmarks/results/fp8_compile_backends.json`` after every row.
"""

from __future__ import annotations

import logging

import torch

from benchmarks.common import relative_error, write_results
from opengem.nn import low_precision
from opengem.nn.low_precision import LowPrecisionLinear, LowPrecisionRecipe

DEVICE = "cuda"
TOKENS, WIDTH, HIDDEN = 4096, 1024, 2048
RECIPES = {"fp8_rowwise": "fp8_rowwise", "forward_only": LowPrecisionRecipe("fp8_rowwise", "bf16", "bf16")}


def _gradients(layer: torch.nn.Module, run, x: torch.Tensor, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y = run(x)
    y.backward(grad)
    return {"y": y.detach(), "dx": x.grad, "dw": layer.weight.grad, "db": layer.bias.grad}


def main() -> None:
    rows: list[dict] = []
    torch.manual_seed(0)
    x = torch.randn(TOKENS, WIDTH, device=DEVICE, dtype=torch.bfloat16)
    grad = torch.randn(TOKENS, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    low_precision.TRACE_UNDER_COMPILE = True
    try:
        for recipe_name, recipe in RECIPES.items():
            linear = torch.nn.Linear(WIDTH, HIDDEN).to(DEVICE, torch.bfloat16)
            layer = LowPrecisionLinear.from_linear(linear, recipe)
            eager = _gradients(layer, layer, x, grad)
            for backend in ("eager", "aot_eager", "inductor"):
                torch._dynamo.reset()
                graphs = backend == "aot_eager" and recipe_name == "fp8_rowwise"
                if graphs:
                    torch._logging.set_logs(aot_graphs=True, graph_breaks=True)
                row: dict = {"recipe": recipe_name, "backend": backend}
                try:
                    got = _gradients(layer, torch.compile(layer, backend=backend), x, grad)
                    row["errors"] = {k: relative_error(got[k].float(), eager[k].float()) for k in eager}
                    row["norms"] = {k: float(got[k].float().norm()) for k in eager}
                    row["eager_norms"] = {k: float(eager[k].float().norm()) for k in eager}
                except Exception as error:  # a backend that fails is a row, not the end
                    row["failed"] = f"{type(error).__name__}: {error}"[:600]
                finally:
                    if graphs:
                        torch._logging.set_logs(aot_graphs=False, graph_breaks=False)
                rows.append(row)
                print(row, flush=True)
                write_results("fp8_compile_backends", rows)
    finally:
        low_precision.TRACE_UNDER_COMPILE = False
    logging.shutdown()


if __name__ == "__main__":
    main()
