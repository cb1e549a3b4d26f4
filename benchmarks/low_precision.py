"""Low-precision benchmark: FP8 GEMM recipes and the MLP block (forward + backward) against BF16.

Run on the GPU: ``PYTHONPATH=src python -m benchmarks.low_precision [--quick]``.

``--quick`` (< 60 s from a cold start): the MLP block with BF16 against the fastest FP8 recipes
(rowwise cuBLAS, with and without FP8 weight gradients, and the fused-GELU `LowPrecisionMLP`), plus one
GEMM shape (the MLP's fc1) with BF16 cuBLAS and the raw `torch._scaled_mm` rowwise ceiling; no Triton
autotuning (OPENGEM_FP8_AUTOTUNE=0), no torchao, no torch.compile.
Full (< 4 min): model-preset GEMM shapes with every recipe (quantization of x included; weights quantized
once, untimed, where a training step quantizes them in each forward), the prequantized Triton / cuBLAS blockwise GEMMs,
every MLP recipe, then in rounds of their own BF16, our fastest fused MLP and torchao's float8 training
(rowwise, and rowwise with BF16 weight gradients, compiled; rowwise eager): risky peers run last. torchao is
not on the GPU image: a carried wheel (``EXTRA_PYTHONPATH`` in ``benchmarks/next_gpu_session.sh``) or an error row.

MLP block: 65536 tokens, 1024 -> 4096 -> GELU -> 1024; the weights are touched in place every step so
the layers re-quantize them once per step, as in training. The variants are timed in interleaved rounds
(``MLP_ROUNDS``; each row's ``ms_rounds``): ms is the median over rounds, the speedup the median of the
per-round ratios to BF16, and BF16's spread over the rounds is the run's noise. The same rounds replayed
from CUDA graphs (``graph_ms``, ``graph_speedup_vs_bf16``) leave the host's launch gaps out. Correctness:
relative error vs fp32 on the same inputs (outputs and, for the MLP, dx and dW1). FLOPs (GEM_SPEC section
8): 2*M*N*K per GEMM; the MLP counts its 6 GEMMs; TFLOP/s are useful work. Each finished measurement prints
one line and rewrites ``benchmarks/results/low_precision.json``, so a run cut short keeps every number it
finished; a variant that raises is recorded with its error and the run goes on.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from functools import partial
from typing import Any, Callable

import torch
from torch import nn

from benchmarks.common import (
    bench_graph_ms,
    bench_ms,
    interleaved_ms,
    paired_speedup,
    print_table,
    relative_error,
    write_results,
)
from opengem.nn.low_precision import LowPrecisionLinear
from opengem.nn.low_precision_mlp import LowPrecisionMLP
from opengem.ops.fp8_gemm import (
    CUBLAS_BLOCKWISE_PROBE,
    _cublas_blockwise_gemm,
    cublas_blockwise_available,
    quantize_operand,
    scaled_gemm,
)

DEVICE = "cuda"  # a CPU test runs the MLP rows' control flow on "cpu"
HIDDEN, INNER = 1024, 4096
GEMM_SHAPES_QUICK = [(65536, INNER, HIDDEN)]
GEMM_SHAPES_FULL = GEMM_SHAPES_QUICK + [
    (65536, HIDDEN, INNER), (8192, 4096, 4096), (16384, 2048, 2048), (8192, 8192, 8192), (32768, 512, 2048),
]
EXTRA_GEMM_RECIPES = ("fp8_blockwise", "mxfp8")  # full mode, beside rowwise
MLP_RECIPES_QUICK = ("fp8_rowwise", "fp8_rowwise_fast", "fp8_rowwise_all")
MLP_RECIPES_FULL = ("fp8_rowwise", "fp8_rowwise_fast", "fp8_rowwise_all", "fp8_blockwise", "fp8_blockwise_all", "mxfp8")
FUSED_MLP_RECIPES = ("fp8_rowwise", "fp8_rowwise_fast")  # the fused MLP's: precise or fast input-gradient sums
BEST_FUSED = "fp8_rowwise_fast"  # also run with torch's bias reductions (the fused MLP sums them in its quantizers)
TORCHAO_RECIPES = ("rowwise", "rowwise_with_gw_hp")  # all three GEMMs FP8, or BF16 weight gradients as ours
BF16_MLP = "bf16 nn.Linear"
# The MLP variants are timed in rounds, each starting one variant later: timed one after another, the later ones
# ran on a warmer card (session 14: the same BF16 weight-gradient GEMM took 1.29, 1.36 then 1.44 ms)
MLP_ROUNDS = 5
MLP_GRAPH_ROUNDS = 3
COLUMNS = ["bench", "shape", "impl", "ms", "tflops", "speedup_vs_bf16", "graph_ms", "graph_speedup_vs_bf16", "rel_err",
           "rel_err_dx", "rel_err_dw1", "note", "error"]


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


class Results:
    """Rows so far: each `add` prints the row and rewrites the results JSON."""

    def __init__(self, quick: bool) -> None:
        self.rows: list[dict[str, Any]] = []
        self.quick = quick
        self.extra: dict[str, Any] = {}

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        parts = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items() if v not in ("", None)]
        print("  ".join(parts), flush=True)
        self.save()

    def save(self, **extra: Any) -> None:
        """Rewrite the JSON; ``extra`` facts are kept for every later save."""
        self.extra.update(extra)
        write_results("low_precision", self.rows,
                      {"quick": self.quick, "cublas_blockwise_probe": dict(CUBLAS_BLOCKWISE_PROBE), **self.extra})


def measure(results: Results, row: dict[str, Any], flops: float, bf16_ms: float | None,
            run: Callable[[], dict[str, float]], timed: Callable[[], Any]) -> float | None:
    """Record ``row`` with the errors ``run()`` returns and the median time of ``timed``; an exception
    (raised or asynchronous, hence the synchronizations) is recorded in the row instead."""
    try:
        row.update(run())
        torch.cuda.synchronize()
        ms = bench_ms(timed)
        torch.cuda.synchronize()
        row.update(ms=ms, tflops=tflops(flops, ms))
        if bf16_ms is not None:
            row["speedup_vs_bf16"] = bf16_ms / ms
    except Exception as exc:  # noqa: BLE001  (one failing variant must not end the run)
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    results.add(row)
    return row.get("ms")


def gemm_rows(results: Results, shapes: list[tuple[int, int, int]], full: bool) -> None:
    native_mx = torch.cuda.get_device_capability()[0] >= 10
    for m, n, k in shapes:
        g = torch.Generator(device=DEVICE).manual_seed(m + n + k)
        x = torch.randn(m, k, device=DEVICE, generator=g).to(torch.bfloat16)
        w = (torch.randn(n, k, device=DEVICE, generator=g) * k**-0.5).to(torch.bfloat16)
        ref = x.float() @ w.float().t()
        flops = 2.0 * m * n * k
        shape = f"{m}x{n}x{k}"
        bf16_ms = None

        def add(impl: str, make: Callable[[], Callable[[], torch.Tensor]], note: str = "") -> float | None:
            """``make()`` does the untimed setup (weight quantization) and returns the timed call."""
            row = {"bench": "gemm", "shape": shape, "impl": impl, "note": note}
            state: dict[str, Callable[[], torch.Tensor]] = {}

            def first() -> dict[str, float]:
                state["fn"] = make()
                return {"rel_err": relative_error(state["fn"](), ref)}

            return measure(results, row, flops, bf16_ms, first, lambda: state["fn"]())

        def prequantized(recipe: str) -> tuple:
            return quantize_operand(x, recipe), quantize_operand(w, recipe, weight=True)

        def with_x_quant(recipe: str) -> Callable[[], torch.Tensor]:
            qw = quantize_operand(w, recipe, weight=True)
            fast = recipe == "fp8_rowwise"
            return lambda: scaled_gemm(quantize_operand(x, recipe), qw, torch.bfloat16, fast_accum=fast)

        def rowwise_ceiling() -> Callable[[], torch.Tensor]:
            qx, qw = prequantized("fp8_rowwise")
            return lambda: scaled_gemm(qx, qw, torch.bfloat16, fast_accum=True)

        def blockwise_triton() -> Callable[[], torch.Tensor]:
            qx, qw = prequantized("fp8_blockwise")
            return lambda: torch.ops.opengem.fp8_blockwise_gemm(qx.data, qx.scale, qw.data, qw.scale, True,
                                                                torch.bfloat16)

        def blockwise_cublas() -> Callable[[], torch.Tensor]:
            qx, qw = prequantized("fp8_blockwise")
            return lambda: _cublas_blockwise_gemm(qx, qw)

        bf16_ms = add("bf16 cublas", lambda: lambda: x @ w.t())
        add("_scaled_mm rowwise (prequantized)", rowwise_ceiling, "ceiling: no quantization cost")
        add("fp8_rowwise (+x quant)", lambda: with_x_quant("fp8_rowwise"))
        if full:
            for recipe in EXTRA_GEMM_RECIPES:
                note = "emulated (no native MX before sm100)" if recipe == "mxfp8" and not native_mx else ""
                add(f"{recipe} (+x quant)", lambda r=recipe: with_x_quant(r), note)
            add("fp8_blockwise triton (prequantized)", blockwise_triton)
            if cublas_blockwise_available(True):
                add("fp8_blockwise cuBLAS (prequantized)", blockwise_cublas)
        del x, w, ref
        torch.cuda.empty_cache()


def mlp(hidden: int, inner: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(hidden, inner), nn.GELU(), nn.Linear(inner, hidden))


def torchao_float8(model: nn.Module, recipe: str = "rowwise") -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    return convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))


def mlp_rows(results: Results, tokens: int, recipes: tuple[str, ...], peers: bool = False) -> list[float] | None:
    """BF16, ``recipes`` and the fused MLP, timed in interleaved rounds; returns BF16's times per round. With
    ``peers``: BF16, our fastest fused MLP and torchao's float8 training (`TORCHAO_RECIPES` compiled, rowwise
    eager) in rounds of their own, rows marked ``mlp_peers`` (risky peers: run last, a failure recorded)."""
    bench = "mlp_peers" if peers else "mlp"
    torch.manual_seed(0)
    base = mlp(HIDDEN, INNER).to(DEVICE)
    x = torch.randn(tokens, HIDDEN, device=DEVICE)
    dy = torch.randn(tokens, HIDDEN, device=DEVICE)
    # fp32 reference on the same inputs
    ref_model = mlp(HIDDEN, INNER).to(DEVICE)
    ref_model.load_state_dict(base.state_dict())
    xr = x.clone().requires_grad_()
    y_ref = ref_model(xr)
    y_ref.backward(dy)
    y_ref = y_ref.detach()
    dx_ref, dw_ref = xr.grad, ref_model[0].weight.grad
    del ref_model, xr
    x16, dy16 = x.to(torch.bfloat16), dy.to(torch.bfloat16)
    del x, dy
    flops = 6 * 2.0 * tokens * HIDDEN * INNER
    shape = f"{tokens}x{HIDDEN}->{INNER}->{HIDDEN}"

    def bf16_copy() -> nn.Sequential:
        m = mlp(HIDDEN, INNER).to(DEVICE)
        m.load_state_dict(base.state_dict())
        return m.to(torch.bfloat16)

    variants: dict[str, dict[str, Any]] = {}  # name -> row and the step closure, in the order built

    def add(name: str, build: Callable[[], nn.Module], note: str = "") -> None:
        """Build ``name``'s model and run its first step (errors against fp32); the timing comes later."""
        row: dict[str, Any] = {"bench": bench, "shape": shape, "impl": name, "note": note}
        xin = x16.clone().requires_grad_()
        state: dict[str, Any] = {}

        def step() -> torch.Tensor:
            model, first, second = state["model"], state["first"], state["second"]
            with torch.no_grad():
                for p in model.parameters():
                    p.grad = None
                first.weight.mul_(1.0)  # a new weight version each step: the FP8 layers re-quantize it
                second.weight.mul_(1.0)
            xin.grad = None
            y = model(xin)
            y.backward(dy16)
            return y

        try:
            model = build()
            layers = getattr(model, "_orig_mod", model)  # the module behind a torch.compile wrapper
            first, second = (layers.fc1, layers.fc2) if isinstance(layers, LowPrecisionMLP) else (layers[0], layers[2])
            state.update(model=model, first=first, second=second)
            y = step()
            row.update(rel_err=relative_error(y.detach(), y_ref), rel_err_dx=relative_error(xin.grad, dx_ref),
                       rel_err_dw1=relative_error(first.weight.grad, dw_ref))
            torch.cuda.synchronize()
            variants[name] = {"row": row, "step": step}
        except Exception as exc:  # noqa: BLE001  (one failing variant must not end the run)
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            results.add(row)

    def time_all() -> list[float] | None:
        """Every built variant timed in interleaved rounds (`interleaved_ms`): ms is the median over rounds,
        the speedup the median of the per-round ratios against BF16, ms_rounds the rounds' times."""
        errors: dict[str, str] = {}

        def guarded(name: str) -> Callable[[], Any]:
            def call() -> Any:
                if name in errors:
                    return None
                try:
                    return variants[name]["step"]()
                except Exception as exc:  # noqa: BLE001
                    errors[name] = f"{type(exc).__name__}: {exc}"[:300]
            return call

        calls = {name: guarded(name) for name in variants}
        times = interleaved_ms(calls, rounds=MLP_ROUNDS)
        # the same rounds replayed from CUDA graphs: device time only, as a compiled step in a graph runs it
        # (bench_graph_ms catches a failed capture itself, so the steps go in unguarded)
        declined: dict[str, str] = {}

        def graph_ms(name: str) -> float:
            if name not in declined:
                ms = bench_graph_ms(variants[name]["step"], on_error=lambda why: declined.setdefault(name, why))
                if ms is not None:
                    return ms
                declined.setdefault(name, "no CUDA graph timing")
            return math.nan

        # each entry times its own variant's graph when called (the rounds' bench just calls it)
        graphed = {name: partial(graph_ms, name) for name in variants if name not in errors}
        graph_times = interleaved_ms(graphed, rounds=MLP_GRAPH_ROUNDS, bench=lambda timed: timed())
        paired = BF16_MLP in times and BF16_MLP not in errors  # else no speedups
        baseline = times[BF16_MLP] if paired else None
        for name, entry in variants.items():
            row, ms_rounds = entry["row"], times[name]
            if name in errors:
                row["error"] = errors[name]
            else:
                ms = statistics.median(ms_rounds)
                row.update(ms=ms, tflops=tflops(flops, ms), ms_rounds=ms_rounds)
                if baseline is not None:
                    row["speedup_vs_bf16"] = paired_speedup(baseline, ms_rounds)
                if name in declined:
                    row["graph_error"] = declined[name]
                else:
                    row.update(graph_ms=statistics.median(graph_times[name]), graph_ms_rounds=graph_times[name])
                    if paired and BF16_MLP not in declined:
                        row["graph_speedup_vs_bf16"] = paired_speedup(graph_times[BF16_MLP], graph_times[name])
            results.add(row)
        variants.clear()
        torch.cuda.empty_cache()
        return baseline

    def low_precision(recipe: str) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            model = bf16_copy()
            for i in (0, 2):
                model[i] = LowPrecisionLinear.from_linear(model[i], recipe)
            return model

        return build

    def fused(recipe: str, fuse_bias_grads: bool = True) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            plain = bf16_copy()
            return LowPrecisionMLP(plain[0], plain[2], recipe, fuse_bias_grads=fuse_bias_grads)

        return build

    add(BF16_MLP, bf16_copy)
    if peers:
        add(f"LowPrecisionMLP {BEST_FUSED} (fused GELU)", fused(BEST_FUSED), "wgrad bf16")
        for recipe in TORCHAO_RECIPES:
            add(f"torchao float8 {recipe} (compiled)", lambda r=recipe: torch.compile(torchao_float8(bf16_copy(), r)),
                "wgrad bf16" if recipe.endswith("gw_hp") else "all fp8")
        add("torchao float8 rowwise (eager)", lambda: torchao_float8(bf16_copy()), "all fp8")
        return time_all()
    for recipe in recipes:
        note = "all fp8" if recipe.endswith("_all") else "wgrad bf16"
        add(f"LowPrecisionLinear {recipe}", low_precision(recipe), note)
    for recipe in FUSED_MLP_RECIPES:
        add(f"LowPrecisionMLP {recipe} (fused GELU)", fused(recipe), "wgrad bf16; bias gradients from the quantizers")
    add(f"LowPrecisionMLP {BEST_FUSED} (fused GELU, torch bias reductions)", fused(BEST_FUSED, False),
        "wgrad bf16; the bias gradients as two reductions of their own")
    baseline = time_all()
    if baseline is not None:
        spread = max(baseline) / min(baseline) - 1
        print(f"BF16 over {len(baseline)} rounds: {min(baseline):.3f}-{max(baseline):.3f} ms ({100 * spread:.1f}% "
              "spread: a smaller difference between variants is noise)", flush=True)
        results.save(bf16_round_spread=spread)
    return baseline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="MLP block + one GEMM shape, untuned (< 60 s)")
    parser.add_argument("--tokens", type=int, default=65536)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.low_precision needs a CUDA GPU")
    if args.quick:
        os.environ.setdefault("OPENGEM_FP8_AUTOTUNE", "0")  # the blockwise GEMM takes its default config
    results = Results(args.quick)
    print(f"MLP block {args.tokens} tokens, {HIDDEN} -> {INNER} -> GELU -> {HIDDEN}, forward + backward "
          "(6 GEMMs counted); rel_err vs fp32 on the same inputs", flush=True)
    mlp_rows(results, args.tokens, MLP_RECIPES_QUICK if args.quick else MLP_RECIPES_FULL)
    print("GEMM out = x @ w^T (M x N x K); TFLOP/s = 2MNK / time", flush=True)
    gemm_rows(results, GEMM_SHAPES_QUICK if args.quick else GEMM_SHAPES_FULL, full=not args.quick)
    if not args.quick:
        cublas_blockwise_available(False)
        mlp_rows(results, args.tokens, (), peers=True)  # risky peers last, with BF16 in their rounds
    print()
    print_table(results.rows, COLUMNS)
    fp8 = [r for r in results.rows if r["bench"] == "mlp" and "ms" in r and r["impl"].startswith("LowPrecision")]
    best = max(fp8, key=lambda r: r.get("speedup_vs_bf16", 0.0)) if fp8 else None
    if best is not None:
        print(f"\nbest FP8 MLP: {best['impl']} {best.get('speedup_vs_bf16', float('nan')):.2f}x BF16 "
              "(acceptance: >= 1.3x)")
    print(f"cuBLAS blockwise _scaled_mm probe (True: 128x128 weight scales): {CUBLAS_BLOCKWISE_PROBE or 'not run'}")
    results.save(best_mlp=best)
    print("wrote benchmarks/results/low_precision.json", flush=True)


if __name__ == "__main__":
    main()
