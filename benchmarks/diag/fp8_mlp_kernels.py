"""Where the FP8 MLP block's time goes (issue 6: 1.256x BF16 against the 1.3x bar, 65536 tokens, 1024 -> 4096
-> GELU -> 1024): each kernel's share, each quantization's bandwidth, the row quantizer's tiles, and the FP8
GEMMs with and without fast accumulation.

1. The block forward + backward, BF16 `nn.Linear` against `LowPrecisionMLP` fp8_rowwise, fp8_rowwise_fast and
   fp8_rowwise_fast with torch's bias reductions instead of the quantizers' column sums (the benchmark's protocol: weights touched
   every step, so re-quantized; the variants timed in interleaved rounds), with the GPU time per kernel name
   and per launching operator.
2. Each quantization of the block alone (autotuned, the kept tile recorded): milliseconds and GB/s of the
   bytes it must move; with column sums against torch's bias reductions.
3. The row quantizer launched directly with each tile: the GELU passes at 4096 columns and x at 1024, plain,
   persistent (a row block loaded ahead) and column-summing programs.
4. The four FP8 GEMM shapes prequantized, fast accumulation on and off, and the BF16 GEMMs of the block
   (the weight gradients' transposed operands included).

Run on a GPU: ``PYTHONPATH=src:. python -m benchmarks.diag.fp8_mlp_kernels``; writes
``benchmarks/results/fp8_mlp_kernels.json`` after every section.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import bench_ms, interleaved_ms, kernel_ms, paired_speedup, write_results
from benchmarks.low_precision import HIDDEN, INNER, MLP_ROUNDS, mlp
from opengem.nn.low_precision_mlp import LowPrecisionMLP
from opengem.ops.fp8_gemm import quantize_operand, scaled_gemm
from opengem.ops.triton import fp8_gemm as kernels

DEVICE = "cuda"


def _block(tokens: int) -> dict[str, Any]:
    torch.manual_seed(0)
    x = torch.randn(tokens, HIDDEN, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    bf16 = mlp(HIDDEN, INNER).to(DEVICE, torch.bfloat16)
    models: list[tuple[str, torch.nn.Module, tuple[torch.Tensor, ...]]] = [
        ("bf16", bf16, (bf16[0].weight, bf16[2].weight))]
    for recipe, bias_sums in (("fp8_rowwise", True), ("fp8_rowwise_fast", True), ("fp8_rowwise_fast", False)):
        plain = mlp(HIDDEN, INNER).to(DEVICE, torch.bfloat16)
        fp8 = LowPrecisionMLP(plain[0], plain[2], recipe, fuse_bias_grads=bias_sums)
        name = f"fp8 LowPrecisionMLP {recipe}{'' if bias_sums else ' torch bias reductions'}"
        models.append((name, fp8, (fp8.fc1.weight, fp8.fc2.weight)))
    steps: dict[str, Callable[[], None]] = {}
    for name, model, weights in models:
        def step(model=model, weights=weights) -> None:
            with torch.no_grad():
                for weight in weights:
                    weight.mul_(1.0)  # a new version: the FP8 layers re-quantize, as after an optimizer step
            x.grad = None
            for p in model.parameters():
                p.grad = None
            model(x).backward(dy)

        step()  # first calls (autotuning) before any timing
        steps[name] = step
    rounds = interleaved_ms(steps, rounds=MLP_ROUNDS)  # as the benchmark: later variants not on a warmer card
    out: dict[str, Any] = {}
    for name, step in steps.items():
        table = kernel_ms(step, calls=5, name_width=90)
        ms = statistics.median(rounds[name])
        ops = _op_ms(step)
        out[name] = {"ms": ms, "ms_rounds": rounds[name], "kernel_ms_sum": sum(table.values()),
                     "kernels": dict(list(table.items())[:20]), "ops": ops[:20]}
        print(f"{name}: {ms:.3f} ms (rounds {', '.join(f'{t:.3f}' for t in rounds[name])}; kernels "
              f"{out[name]['kernel_ms_sum']:.3f})", flush=True)
        for kernel, kms in list(table.items())[:12]:
            print(f"  {kms:8.3f}  {kernel}", flush=True)
        for op in ops[:12]:
            print(f"  {op['ms']:8.3f}  {op['op']} {op['shapes']}", flush=True)
    out["speedups"] = {name: paired_speedup(rounds["bf16"], rounds[name]) for name, _, _ in models[1:]}
    print(f"speedups over BF16 (median of per-round ratios): {out['speedups']}", flush=True)
    return out


def _op_ms(fn: Callable[[], None], calls: int = 3) -> list[dict[str, Any]]:
    """Device milliseconds per call that each operator launches itself (torch ops by input shapes, custom
    kernels by name), most first: which call launched a kernel of the table above (session 14's unnamed
    0.06 ms element-wise kernel of the FP8 block)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = [{"op": event.key, "shapes": str(event.input_shapes)[:160],
             "ms": event.self_device_time_total / 1000 / calls}
            for event in prof.key_averages(group_by_input_shape=True) if event.self_device_time_total > 0]
    return sorted(rows, key=lambda row: -row["ms"])


def _quantizations(tokens: int) -> list[dict[str, Any]]:
    """Each quantization of the block alone (autotuned; the tile the tuner kept is recorded), the column-summing
    ones against the plain quantization plus torch's bias reduction they replace."""
    g = torch.Generator(device=DEVICE).manual_seed(1)
    x = torch.randn(tokens, HIDDEN, device=DEVICE, generator=g).to(torch.bfloat16)
    u = torch.randn(tokens, INNER, device=DEVICE, generator=g).to(torch.bfloat16)
    dh = torch.randn(tokens, INNER, device=DEVICE, generator=g).to(torch.bfloat16)
    du = torch.randn(tokens, INNER, device=DEVICE, generator=g).to(torch.bfloat16)
    small, big = x.numel(), u.numel()
    tuners = {"row": lambda c: kernels._ROW_TUNERS[c], "sums": lambda c: kernels._COLUMN_SUM_TUNERS[c], "": None}
    cases = (  # (name, call, bytes moved: reads + writes, tuner kind, columns)
        ("x [T, 1024]", lambda: kernels.rowwise_quantize(x), small * 3, "row", HIDDEN),
        ("x [T, 1024] + column sums", lambda: kernels.rowwise_quantize_with_sums(x), small * 3, "sums", HIDDEN),
        ("torch sum of x over rows (db2)", lambda: x.sum(0), small * 2, "", HIDDEN),
        ("gelu(u) [T, 4096]", lambda: kernels.rowwise_quantize(u, "gelu"), big * 5, "row", INNER),
        ("gelu backward [T, 4096]", lambda: kernels.rowwise_quantize(dh, "gelu_backward", u), big * 7, "row", INNER),
        ("gelu backward [T, 4096] + column sums", lambda: kernels.rowwise_quantize_with_sums(dh, "gelu_backward", u),
         big * 7, "sums", INNER),
        ("torch sum of du over rows (db1)", lambda: du.sum(0), big * 2, "", INNER),
    )
    rows = []
    for name, call, nbytes, kind, columns in cases:
        ms = bench_ms(call)
        row = {"quantization": name, "ms": ms, "gb_per_s": nbytes / ms / 1e6}
        if kind:
            best = tuners[kind](columns).best_config
            row["tile"] = {**best.kwargs, "num_warps": best.num_warps, "maxnreg": best.maxnreg}
        rows.append(row)
        print(f"{name}: {ms:.3f} ms, {row['gb_per_s']:.0f} GB/s {row.get('tile', '')}", flush=True)
    return rows


def _row_tiles(tokens: int) -> list[dict[str, Any]]:
    """The row quantizer launched directly with each tile: the GELU passes at 4096 columns and x at 1024 (plain
    programs of (rows, warps), persistent ones, and the column-summing candidates)."""
    g = torch.Generator(device=DEVICE).manual_seed(2)
    u = torch.randn(tokens, INNER, device=DEVICE, generator=g).to(torch.bfloat16)
    dh = torch.randn(tokens, INNER, device=DEVICE, generator=g).to(torch.bfloat16)
    x = torch.randn(tokens, HIDDEN, device=DEVICE, generator=g).to(torch.bfloat16)
    sms = kernels._multiprocessors(x.device)
    partial = torch.empty(kernels.MAX_COLUMN_SUM_PROGRAMS_PER_SM * sms, INNER, device=DEVICE)
    # (rows, warps, persistent programs per SM, register cap, column sums)
    wide = [(1, warps, 0, None, False) for warps in (4, 8, 16)]
    wide += [(1, w, p, cap, False) for w, p, cap in ((16, 4, 32), (16, 2, None), (16, 3, 40), (8, 4, 64), (8, 8, 32))]
    narrow = [(rows, warps, 0, None, False) for rows, warps in ((2, 4), (2, 8), (4, 4), (4, 8), (4, 16), (8, 8),
                                                                (8, 16), (16, 16))]
    narrow += [(4, w, p, cap, False) for w, p, cap in ((16, 4, 32), (16, 2, None), (16, 3, 40), (8, 4, 64), (8, 8, 32))]
    cases = [("gelu", u, INNER, wide), ("gelu_backward", dh, INNER, wide), (None, x, HIDDEN, narrow)]
    for prologue, source, columns, _ in cases[1:]:  # the column-summing candidates (the MLP's backward)
        rows = max(1, 4096 // columns)
        cases.append((prologue, source, columns, [(rows, w, p, cap, True) for w, p, cap in kernels.COLUMN_SUM_PROGRAMS]))
    results = []
    for prologue, source, columns, options in cases:
        q = torch.empty(tokens, columns, device=DEVICE, dtype=torch.float8_e4m3fn)
        scale = torch.empty(tokens, device=DEVICE)
        out = torch.empty_like(source) if prologue else torch.empty(0, dtype=source.dtype, device=DEVICE)
        for rows, warps, programs, cap, col_sum in options:
            grid = kernels._row_grid(tokens, source.device)({"BLOCK_R": rows, "PROGRAMS_PER_SM": programs})
            sum_rows = partial.shape[0] if col_sum else 0

            def launch(source=source, prologue=prologue, columns=columns, rows=rows, warps=warps, programs=programs,
                       cap=cap, col_sum=col_sum, grid=grid, q=q, scale=scale, out=out, sum_rows=sum_rows):
                kernels._row_amax_quant_kernel[grid](
                    source, u, out, q, scale, partial, tokens, columns, sum_rows, PROLOGUE=kernels.PROLOGUES[prologue],
                    BLOCK_R=rows, BLOCK_C=columns, ONE_CHUNK=True, PROGRAMS_PER_SM=programs, COMPILED=True,
                    COL_SUM=col_sum, num_warps=warps, **({"maxnreg": cap} if cap else {}))

            tile = {"prologue": prologue, "columns": columns, "rows": rows, "warps": warps, "programs_per_sm": programs,
                    "maxnreg": cap, "column_sums": col_sum}
            try:
                ms = bench_ms(launch)
            except Exception as exc:  # noqa: BLE001  (a tile that does not compile is recorded, the sweep goes on)
                results.append({**tile, "error": str(exc)[:200]})
                continue
            results.append({**tile, "ms": ms})
            print(f"{prologue} C {columns} rows {rows} warps {warps} persistent {programs} maxnreg {cap} column sums "
                  f"{col_sum}: {ms:.3f} ms", flush=True)
    return results


def _gemms(tokens: int) -> list[dict[str, Any]]:
    g = torch.Generator(device=DEVICE).manual_seed(3)
    rows = []
    for m, n, k in ((tokens, INNER, HIDDEN), (tokens, HIDDEN, INNER)):
        a = torch.randn(m, k, device=DEVICE, generator=g).to(torch.bfloat16)
        b = (torch.randn(n, k, device=DEVICE, generator=g) * k**-0.5).to(torch.bfloat16)
        qa, qb = quantize_operand(a, "fp8_rowwise"), quantize_operand(b, "fp8_rowwise", weight=True)
        flops = 2.0 * m * n * k
        for name, call in (("bf16", lambda a=a, b=b: a @ b.t()),
                           ("fp8 fast accum", lambda qa=qa, qb=qb: scaled_gemm(qa, qb, torch.bfloat16, fast_accum=True)),
                           ("fp8 precise accum",
                            lambda qa=qa, qb=qb: scaled_gemm(qa, qb, torch.bfloat16, fast_accum=False))):
            ms = bench_ms(call)
            rows.append({"shape": f"{m}x{n}x{k}", "gemm": name, "ms": ms, "tflops": flops / ms / 1e9})
            print(f"{m}x{n}x{k} {name}: {ms:.3f} ms, {rows[-1]['tflops']:.0f} TFLOP/s", flush=True)
    x = torch.randn(tokens, HIDDEN, device=DEVICE, generator=g).to(torch.bfloat16)
    du = torch.randn(tokens, INNER, device=DEVICE, generator=g).to(torch.bfloat16)
    for name, shape, call in (("dW1 = du^T x", f"{INNER}x{HIDDEN}x{tokens}", lambda: du.t() @ x),
                              ("dW2 = dy^T h", f"{HIDDEN}x{INNER}x{tokens}", lambda: x.t() @ du)):
        ms = bench_ms(call)
        rows.append({"shape": shape, "gemm": f"bf16 {name}", "ms": ms, "tflops": 2.0 * tokens * HIDDEN * INNER / ms / 1e9})
        print(f"{name}: {ms:.3f} ms, {rows[-1]['tflops']:.0f} TFLOP/s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=65536)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.diag.fp8_mlp_kernels needs a CUDA GPU")
    sections: dict[str, Any] = {"tokens": args.tokens}
    for name, run in (("block", _block), ("quantizations", _quantizations), ("gemms", _gemms),
                      ("row_tiles", _row_tiles)):
        try:
            sections[name] = run(args.tokens)
        except Exception as exc:  # noqa: BLE001  (a failing section is recorded; the next ones still run)
            sections[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            print(f"{name} failed: {sections[name]['error']}", flush=True)
        write_results("fp8_mlp_kernels", [], sections)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
