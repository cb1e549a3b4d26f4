"""Where the compiled FP8 layers lose time against eager (session 12: fullgraph custom ops, exact, but 2.94 ms
against 2.16 ms for `LowPrecisionMLP` at 16384 x 1024 -> 4096): GPU kernel time per name, eager against
compiled, over a few forward + backward steps under the profiler.

Run on a GPU: ``PYTHONPATH=src:. python -m benchmarks.diag.fp8_compile_profile``; writes
``benchmarks/results/fp8_compile_profile.json``.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import write_results
from benchmarks.diag.fp8_compile import DEVICE, TOKENS, WIDTH, _linears, _mlp

STEPS = 5


def _kernel_us(run, x: torch.Tensor, grad: torch.Tensor) -> dict[str, float]:
    for _ in range(3):
        run(x).backward(grad)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            run(x).backward(grad)
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_time_total > 0:
            times[event.key[:90]] = event.device_time_total / STEPS
    return dict(sorted(times.items(), key=lambda kv: -kv[1])[:25])


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(TOKENS, WIDTH, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(TOKENS, WIDTH, device=DEVICE, dtype=torch.bfloat16)
    rows = []
    for name, build in (("LowPrecisionMLP", _mlp), ("two fp8 linears + gelu", _linears)):
        module = build()
        for mode, run in (("eager", module), ("compiled", torch.compile(module, fullgraph=True))):
            kernels = _kernel_us(run, x, grad)
            row = {"layer": name, "mode": mode, "kernel_us_per_step": kernels, "sum_top_us": sum(kernels.values())}
            rows.append(row)
            print(name, mode, f"{row['sum_top_us']:.0f} us", flush=True)
            for key, us in kernels.items():
                print(f"  {us:9.1f}  {key}", flush=True)
            write_results("fp8_compile_profile", rows)


if __name__ == "__main__":
    main()
