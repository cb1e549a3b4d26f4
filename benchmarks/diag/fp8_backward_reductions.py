"""The traced FP8 linear's backward reductions of dy alone, compiled: where Inductor's mix-order reduction fusion
costs gem-large its FP8 speed (issue 10), and which formulation of the bias gradient avoids it.

The traced linear's backward (`opengem.nn.low_precision_traced`) reads dy ``[M, N]`` three ways: its row amax
(quantizing dy for dx), its column amax (quantizing dy^T for dW) and its column sum (the bias gradient). Compiled,
Inductor fused them into mix-order reduction kernels that ran 0.66-2.8 ms a call on gem-large (sessions 22-23,
H200; dy's shapes there not recorded: ``SHAPES`` guesses). With the fusion off, gem-large's FP8 step took 312.86 ms
(session 22, call 4) against 356.17 ms with it (call 3, another call), but BF16 lost 18.6 ms (its layer-norm
backward wants the fusion), so the fix must be local.

Variants of the bias gradient, each compiled with the fusion on and off (Inductor's `triton.mix_order_reduction`):
``sum`` (``dy.sum(0)``, shipped), ``mm`` (``ones[1, M] @ dy``: an extern cuBLAS call Inductor cannot fuse; aten.mv
is decomposed into a reduction, which session 23 measured fused alike), ``none`` (no bias: the row and column amax
alone). Per case: milliseconds (``bench_ms``), the HBM floor (one read of dy, two FP8 writes), the largest kernels,
and the result against eager (the scales and the bias gradient must agree: the codes to rounding ties).

Run on a GPU: ``PYTHONPATH=src:. python -m benchmarks.diag.fp8_backward_reductions``; writes
``benchmarks/results/fp8_backward_reductions.json``. ``--device cpu --shapes 256x64`` checks the script on a CPU.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import bench_ms, int_tuples, kernel_ms, print_table, relative_error, write_results
from opengem.ops.fp8_gemm import _rowwise_torch

# (tokens, features): a guess at gem-large's sequence MLP at batch 512 (~1M tokens of d_model 512), the
# fp8_compile diag's layer (16384 x 1024 and its hidden 4096)
SHAPES = ((1 << 20, 512), (16384, 1024), (16384, 4096))
HBM_BYTES_PER_S = 4.8e12  # H200
VARIANTS = ("sum", "mm", "none")


def backward_reductions(variant: str) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    """The traced linear's quantizations of dy (`rowwise_matmul`'s, round to nearest) and its bias gradient."""
    def fn(dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q_rows, s_rows = _rowwise_torch(dy, False, None)  # dx = dy @ W
        q_cols, s_cols = _rowwise_torch(dy.t(), False, None)  # dW = dy^T @ x
        out = (q_rows, s_rows, q_cols.contiguous(), s_cols)
        if variant == "sum":
            return (*out, dy.sum(0))
        if variant == "mm":
            return (*out, (dy.new_ones(1, dy.shape[0]) @ dy)[0])
        return out

    return fn


def _agreement(ours: tuple[torch.Tensor, ...], eager: tuple[torch.Tensor, ...]) -> dict[str, float]:
    codes = max((a.float() != b.float()).float().mean().item() for a, b in ((ours[0], eager[0]), (ours[2], eager[2])))
    scales = max(relative_error(ours[i], eager[i]) for i in (1, 3))
    bias = relative_error(ours[4], eager[4]) if len(eager) > 4 else 0.0
    return {"codes_differing": codes, "scale_err": scales, "bias_err": bias}


def run(device: str, shapes: list[tuple[int, ...]] | tuple[tuple[int, int], ...]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    timer = bench_ms if device == "cuda" else _cpu_ms
    for tokens, features in shapes:
        dy = torch.randn(tokens, features, device=device).to(torch.bfloat16)
        floor_ms = (2 + 1 + 1) * dy.numel() / HBM_BYTES_PER_S * 1e3  # read bf16 dy, write two fp8 copies
        for variant in VARIANTS:
            eager_fn = backward_reductions(variant)
            eager = eager_fn(dy)
            row = {"shape": f"{tokens}x{features}", "variant": variant, "floor_ms": floor_ms,
                   "eager_ms": timer(lambda: eager_fn(dy))}
            for mix_order in (True, False):
                torch._dynamo.reset()
                compiled = torch.compile(eager_fn, fullgraph=True, options={"triton.mix_order_reduction": mix_order})
                ours = compiled(dy)
                label = "mix" if mix_order else "nomix"
                row[f"{label}_ms"] = timer(lambda: compiled(dy))
                kernels = kernel_ms(lambda: compiled(dy), name_width=120) if device == "cuda" else {}
                row[f"{label}_kernels"] = dict(list(kernels.items())[:4])  # ms per call, the largest first
                row.update({f"{label}_{k}": v for k, v in _agreement(ours, eager).items()})
            rows.append(row)
            print({k: v for k, v in row.items() if not k.endswith("kernels")}, flush=True)
    return rows


def _cpu_ms(fn: Callable[[], Any]) -> float:
    """One call's wall time: ``--device cpu`` checks the script, its times mean nothing."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", type=lambda text: int_tuples(text, 2, "16384x1024"), default=SHAPES,
                        help="comma-separated TOKENSxFEATURES")
    args = parser.parse_args()
    rows = run(args.device, args.shapes)
    print_table(rows, ["shape", "variant", "floor_ms", "eager_ms", "mix_ms", "nomix_ms", "mix_codes_differing",
                       "mix_bias_err"])
    print(write_results("fp8_backward_reductions", rows, {"hbm_bytes_per_s": HBM_BYTES_PER_S}))


if __name__ == "__main__":
    main()
