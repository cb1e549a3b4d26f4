"""FP8 layers under torch.compile against eager, on the GPU: output and gradient errors, step time.

For each layer (two `LowPrecisionLinear` fp8_rowwise around a GELU; `LowPrecisionMLP`) and each compile path
(``OPENGEM_FP8_COMPILE``: ``inductor``, the torch-op linear of `opengem.nn.low_precision_traced` whose
quantizations Inductor generates and fuses; ``custom_op``, the opaque ops of `opengem.nn.low_precision_autograd`
with eager's kernels), one compiled (fullgraph) forward + backward against the same layer in eager: relative
errors of the output, the input gradient and every parameter gradient (~1e-2 or less: bf16 GEMM outputs and
fusions; 1.0 is a lost gradient, session 12), then forward + backward milliseconds of eager, compiled, and the
BF16 block compiled (the peer: ``bf16_ms / compiled_ms`` is the speedup).

Run on a GPU: ``PYTHONPATH=src:. python -m benchmarks.diag.fp8_compile``; writes
``benchmarks/results/fp8_compile.json`` after every row.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from benchmarks.common import bench_ms, relative_error, write_results
from opengem.nn.low_precision import LowPrecisionLinear
from opengem.nn.low_precision_mlp import LowPrecisionMLP

DEVICE = "cuda"
TOKENS, WIDTH, HIDDEN = 16384, 1024, 4096


def _linears() -> torch.nn.Module:
    layers = torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, WIDTH))
    layers = layers.to(DEVICE, torch.bfloat16)
    for index in (0, 2):
        layers[index] = LowPrecisionLinear.from_linear(layers[index], "fp8_rowwise")
    return layers


def _mlp() -> torch.nn.Module:
    fc1, fc2 = torch.nn.Linear(WIDTH, HIDDEN), torch.nn.Linear(HIDDEN, WIDTH)
    return LowPrecisionMLP(fc1.to(DEVICE, torch.bfloat16), fc2.to(DEVICE, torch.bfloat16))


def _step(run: Callable, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        run(x).backward(grad)

    return step


def _gradients(module: torch.nn.Module, run: Callable, x: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y = run(x)
    y.backward(grad)
    return [y.detach(), x.grad, *(p.grad for p in module.parameters())]


def main() -> None:
    rows: list[dict] = []
    torch.manual_seed(0)
    x = torch.randn(TOKENS, WIDTH, device=DEVICE, dtype=torch.bfloat16)
    grad = torch.randn(TOKENS, WIDTH, device=DEVICE, dtype=torch.bfloat16)
    bf16 = torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, WIDTH))
    bf16 = bf16.to(DEVICE, torch.bfloat16)
    bf16_ms = bench_ms(_step(torch.compile(bf16, fullgraph=True), x.clone().requires_grad_(), grad))
    for path in ("inductor", "custom_op"):
        os.environ["OPENGEM_FP8_COMPILE"] = path
        for name, build in (("two fp8 linears + gelu", _linears), ("LowPrecisionMLP", _mlp)):
            module = build()
            eager = _gradients(module, module, x, grad)
            torch._dynamo.reset()
            compiled = torch.compile(module, fullgraph=True)
            row: dict = {"layer": name, "compiled": f"{path}, fullgraph", "bf16_compiled_ms": bf16_ms}
            try:
                got = _gradients(module, compiled, x, grad)
                names = ["y", "dx", *(n for n, _ in module.named_parameters())]
                row["errors"] = {n: relative_error(a.float(), b.float()) for n, a, b in zip(names, got, eager)}
                xg = x.clone().requires_grad_()
                row["eager_ms"] = bench_ms(_step(module, xg, grad))
                row["compiled_ms"] = bench_ms(_step(compiled, xg, grad))
                row["speedup_vs_bf16_compiled"] = bf16_ms / row["compiled_ms"]
            except Exception as error:  # a layer that fails to compile is a row, not the end
                row["failed"] = f"{type(error).__name__}: {error}"[:400]
            rows.append(row)
            print(row, flush=True)
            write_results("fp8_compile", rows)
    os.environ.pop("OPENGEM_FP8_COMPILE")


if __name__ == "__main__":
    main()
