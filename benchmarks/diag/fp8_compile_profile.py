"""Where the compiled FP8 layers lose time against eager (session 12: fullgraph custom ops, exact, but 2.94 ms
against 2.16 ms for `LowPrecisionMLP` at 16384 x 1024 -> 4096): GPU kernel time per name, eager against
compiled, over a few forward + backward steps under the profiler.

Run on a GPU: ``PYTHONPATH=src:. python -m benchmarks.diag.fp8_compile_profile``; writes
``benchmarks/results/fp8_compile_profile.json``.
"""

from __future__ import annotations

import torch

from benchmarks.common import kernel_ms, write_results
from benchmarks.diag.fp8_compile import DEVICE, TOKENS, WIDTH, _linears, _mlp

STEPS = 5


def _kernel_ms(run, x: torch.Tensor, grad: torch.Tensor) -> dict[str, float]:
    for _ in range(2):  # with kernel_ms's own first call: three warm-up steps
        run(x).backward(grad)
    return dict(list(kernel_ms(lambda: run(x).backward(grad), calls=STEPS, name_width=90).items())[:25])


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(TOKENS, WIDTH, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(TOKENS, WIDTH, device=DEVICE, dtype=torch.bfloat16)
    rows = []
    for name, build in (("LowPrecisionMLP", _mlp), ("two fp8 linears + gelu", _linears)):
        module = build()
        for mode, run in (("eager", module), ("compiled", torch.compile(module, fullgraph=True))):
            kernels = _kernel_ms(run, x, grad)
            row = {"layer": name, "mode": mode, "kernel_ms_per_step": kernels, "sum_top_ms": sum(kernels.values())}
            rows.append(row)
            print(name, mode, f"{row['sum_top_ms']:.3f} ms", flush=True)
            for key, ms in kernels.items():
                print(f"  {ms:9.3f}  {key}", flush=True)
            write_results("fp8_compile_profile", rows)


if __name__ == "__main__":
    main()
