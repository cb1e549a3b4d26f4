"""Where the FP8 MLP block's time goes (issue 6: 1.127x BF16 against the 1.3x bar, 65536 tokens, 1024 -> 4096
-> GELU -> 1024): each kernel's share, each quantization's bandwidth, the row quantizer's tile options on
the GELU passes, and the FP8 GEMMs with and without fast accumulation.

1. The block forward + backward, BF16 `nn.Linear` against `LowPrecisionMLP` fp8_rowwise and fp8_rowwise_fast
   (the benchmark's protocol: weights touched every step, so re-quantized; the variants timed in interleaved
   rounds), timed in this run, with the GPU time per kernel name.
2. Each quantization of the block alone (autotuned): milliseconds and GB/s of the bytes it must move.
3. The GELU passes (forward and backward) launched directly with every (rows, warps, column chunk): one
   chunk in registers, or column chunks of 1024 / 2048 re-read.
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
import triton

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
    for recipe in ("fp8_rowwise", "fp8_rowwise_fast"):
        plain = mlp(HIDDEN, INNER).to(DEVICE, torch.bfloat16)
        fp8 = LowPrecisionMLP(plain[0], plain[2], recipe)
        models.append((f"fp8 LowPrecisionMLP {recipe}", fp8, (fp8.fc1.weight, fp8.fc2.weight)))
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
        out[name] = {"ms": ms, "ms_rounds": rounds[name], "kernel_ms_sum": sum(table.values()),
                     "kernels": dict(list(table.items())[:20])}
        print(f"{name}: {ms:.3f} ms (rounds {', '.join(f'{t:.3f}' for t in rounds[name])}; kernels "
              f"{out[name]['kernel_ms_sum']:.3f})", flush=True)
        for kernel, kms in list(table.items())[:12]:
            print(f"  {kms:8.3f}  {kernel}", flush=True)
    out["speedups"] = {name: paired_speedup(rounds["bf16"], rounds[name]) for name, _, _ in models[1:]}
    print(f"speedups over BF16 (median of per-round ratios): {out['speedups']}", flush=True)
    return out


def _quantizations(tokens: int) -> list[dict[str, Any]]:
    g = torch.Generator(device=DEVICE).manual_seed(1)
    x = torch.randn(tokens, HIDDEN, device=DEVICE, generator=g).to(torch.bfloat16)
    u = torch.randn(tokens, INNER, device=DEVICE, generator=g).to(torch.bfloat16)
    dh = torch.randn(tokens, INNER, device=DEVICE, generator=g).to(torch.bfloat16)
    small, big = x.numel(), u.numel()
    cases = (  # (name, call, bytes moved: reads + writes)
        ("x [T, 1024]", lambda: kernels.rowwise_quantize(x), small * 3),
        ("gelu(u) [T, 4096]", lambda: kernels.rowwise_quantize(u, "gelu"), big * 5),
        ("gelu backward [T, 4096]", lambda: kernels.rowwise_quantize(dh, "gelu_backward", u), big * 7),
    )
    rows = []
    for name, call, nbytes in cases:
        ms = bench_ms(call)
        rows.append({"quantization": name, "ms": ms, "gb_per_s": nbytes / ms / 1e6})
        print(f"{name}: {ms:.3f} ms, {rows[-1]['gb_per_s']:.0f} GB/s", flush=True)
    return rows


def _gelu_tiles(tokens: int) -> list[dict[str, Any]]:
    g = torch.Generator(device=DEVICE).manual_seed(2)
    u = torch.randn(tokens, INNER, device=DEVICE, generator=g).to(torch.bfloat16)
    dh = torch.randn(tokens, INNER, device=DEVICE, generator=g).to(torch.bfloat16)
    q = torch.empty(tokens, INNER, device=DEVICE, dtype=torch.float8_e4m3fn)
    scale = torch.empty(tokens, device=DEVICE)
    out = torch.empty_like(u)
    options = [(rows, warps, INNER) for rows in (1, 2, 4) for warps in (4, 8, 16)]
    options += [(rows, warps, chunk) for chunk in (1024, 2048) for rows in (2, 4, 8) for warps in (4, 8)]
    results = []
    for prologue, x in (("gelu", u), ("gelu_backward", dh)):
        for rows, warps, chunk in options:

            def launch(x=x, prologue=prologue, rows=rows, warps=warps, chunk=chunk):
                kernels._row_amax_quant_kernel[(triton.cdiv(tokens, rows),)](
                    x, u, out, q, scale, tokens, INNER, PROLOGUE=kernels.PROLOGUES[prologue], BLOCK_R=rows,
                    BLOCK_C=chunk, ONE_CHUNK=chunk >= INNER, COMPILED=True, num_warps=warps)

            try:
                ms = bench_ms(launch)
            except Exception as exc:  # noqa: BLE001  (a tile that does not compile is recorded, the sweep goes on)
                results.append({"prologue": prologue, "rows": rows, "warps": warps, "chunk": chunk, "error": str(exc)[:200]})
                continue
            results.append({"prologue": prologue, "rows": rows, "warps": warps, "chunk": chunk, "ms": ms})
            print(f"{prologue} rows {rows} warps {warps} chunk {chunk}: {ms:.3f} ms", flush=True)
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
                      ("gelu_tiles", _gelu_tiles)):
        try:
            sections[name] = run(args.tokens)
        except Exception as exc:  # noqa: BLE001  (a failing section is recorded; the next ones still run)
            sections[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            print(f"{name} failed: {sections[name]['error']}", flush=True)
        write_results("fp8_mlp_kernels", [], sections)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
