"""Low-precision benchmark: FP8 GEMM recipes and the MLP block (forward + backward) against BF16.

Run on the GPU: ``PYTHONPATH=src python -m benchmarks.low_precision [--quick]``.

GEMMs: out = x @ w^T with x [M, K] activations and w [N, K] weights, for model-preset shapes. Rows per
shape: BF16 cuBLAS; the raw `torch._scaled_mm` rowwise GEMM on pre-quantized operands (the ceiling
without quantization cost); each recipe with the activation quantization included (weights quantized
once, as the layer caches them per optimizer step).
MLP block: 65536 tokens, 1024 -> 4096 -> GELU -> 1024, forward + backward with each recipe, quantization
included, and `LowPrecisionMLP` (GELU fused into the FP8 quantizations); the weights are touched in
place every step so the layers re-quantize them once per step, as in training. Peers: BF16 nn.Linear and torchao float8 training (rowwise) if importable.
Correctness: relative error vs fp32 on the same inputs (outputs and, for the MLP, dx and dW1).
FLOPs (GEM_SPEC section 8): 2*M*N*K per GEMM; the MLP counts its 6 GEMMs; TFLOP/s are useful work.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import torch
from torch import nn

from benchmarks.common import bench_ms, print_table, relative_error, write_results
from opengem.nn.low_precision import LowPrecisionLinear
from opengem.nn.low_precision_mlp import LowPrecisionMLP
from opengem.ops.fp8_gemm import _cublas_blockwise_gemm, cublas_blockwise_available, quantize_operand, scaled_gemm

GEMM_SHAPES_QUICK = [(8192, 4096, 4096), (65536, 4096, 1024)]
GEMM_SHAPES_FULL = GEMM_SHAPES_QUICK + [
    (65536, 1024, 4096), (16384, 2048, 2048), (8192, 8192, 8192), (32768, 512, 2048),
]
GEMM_RECIPES = ("fp8_rowwise", "fp8_blockwise", "mxfp8")
MLP_RECIPES_QUICK = ("fp8_rowwise", "fp8_rowwise_all", "fp8_blockwise_all")
MLP_RECIPES_FULL = ("fp8_rowwise", "fp8_rowwise_all", "fp8_blockwise", "fp8_blockwise_all", "mxfp8")


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def gemm_rows(shapes: list[tuple[int, int, int]]) -> list[dict[str, Any]]:
    rows = []
    for m, n, k in shapes:
        g = torch.Generator(device="cuda").manual_seed(m + n + k)
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda", generator=g) * k**-0.5).to(torch.bfloat16)
        ref = x.float() @ w.float().t()
        flops = 2.0 * m * n * k

        native_mx = torch.cuda.get_device_capability()[0] >= 10

        def add(name: str, fn: Callable[[], torch.Tensor]) -> None:
            err = relative_error(fn(), ref)
            ms = bench_ms(fn)
            note = "emulated (no native MX before sm100)" if name.startswith("mxfp8") and not native_mx else ""
            rows.append({"bench": "gemm", "shape": f"{m}x{n}x{k}", "impl": name, "ms": ms,
                         "tflops": tflops(flops, ms), "rel_err": err, "note": note})

        add("bf16 cublas", lambda: x @ w.t())
        qx, qw = quantize_operand(x, "fp8_rowwise"), quantize_operand(w, "fp8_rowwise", weight=True)
        add("_scaled_mm rowwise (prequantized)", lambda: scaled_gemm(qx, qw, torch.bfloat16, fast_accum=True))
        for recipe in GEMM_RECIPES:
            qw_r = quantize_operand(w, recipe, weight=True)
            add(f"{recipe} (+x quant)", lambda r=recipe, q=qw_r: scaled_gemm(
                quantize_operand(x, r), q, torch.bfloat16, fast_accum=r == "fp8_rowwise"))
        qb_x, qb_w = quantize_operand(x, "fp8_blockwise"), quantize_operand(w, "fp8_blockwise", weight=True)
        add("fp8_blockwise triton (prequantized)", lambda: torch.ops.opengem.fp8_blockwise_gemm(
            qb_x.data, qb_x.scale, qb_w.data, qb_w.scale, True, torch.bfloat16))
        if cublas_blockwise_available(True):
            add("fp8_blockwise cuBLAS (prequantized)", lambda: _cublas_blockwise_gemm(qb_x, qb_w))
        bf16_ms = next(r["ms"] for r in rows if r["shape"] == f"{m}x{n}x{k}" and r["impl"] == "bf16 cublas")
        for r in rows:
            if r["shape"] == f"{m}x{n}x{k}":
                r["speedup_vs_bf16"] = bf16_ms / r["ms"]
        del x, w, ref
        torch.cuda.empty_cache()
    return rows


def mlp(hidden: int, inner: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(hidden, inner), nn.GELU(), nn.Linear(inner, hidden))


def torchao_float8(model: nn.Module) -> nn.Module | str:
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return "not installed"
    try:
        return convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("rowwise"))
    except Exception as exc:  # a wheel built for another torch fails here: report it, keep benchmarking
        return f"failed: {type(exc).__name__}: {exc}"[:200]


def mlp_rows(tokens: int, hidden: int, inner: int, recipes: tuple[str, ...], compile_torchao: bool) -> list[dict]:
    torch.manual_seed(0)
    base = mlp(hidden, inner).cuda()
    x = torch.randn(tokens, hidden, device="cuda")
    dy = torch.randn(tokens, hidden, device="cuda")
    # fp32 reference on the same inputs
    ref_model = mlp(hidden, inner).cuda()
    ref_model.load_state_dict(base.state_dict())
    xr = x.clone().requires_grad_()
    y_ref = ref_model(xr)
    y_ref.backward(dy)
    dx_ref, dw_ref = xr.grad, ref_model[0].weight.grad
    del ref_model, xr
    x16, dy16 = x.to(torch.bfloat16), dy.to(torch.bfloat16)
    flops = 6 * 2.0 * tokens * hidden * inner
    rows: list[dict[str, Any]] = []

    def run(name: str, model: nn.Module | str, note: str = "") -> None:
        if isinstance(model, str):
            rows.append({"bench": "mlp", "impl": name, "note": model})
            return
        xin = x16.clone().requires_grad_()
        layers = getattr(model, "_orig_mod", model)  # the Sequential behind a torch.compile wrapper
        first, second = (layers.fc1, layers.fc2) if isinstance(layers, LowPrecisionMLP) else (layers[0], layers[2])

        def step() -> torch.Tensor:
            with torch.no_grad():
                for p in model.parameters():
                    p.grad = None
                first.weight.mul_(1.0)  # a new weight version each step: the FP8 layers re-quantize it
                second.weight.mul_(1.0)
            xin.grad = None
            y = model(xin)
            y.backward(dy16)
            return y

        y = step()
        errs = (relative_error(y, y_ref), relative_error(xin.grad, dx_ref), relative_error(first.weight.grad, dw_ref))
        ms = bench_ms(step)
        rows.append({"bench": "mlp", "impl": name, "ms": ms, "tflops": tflops(flops, ms), "rel_err_y": errs[0],
                     "rel_err_dx": errs[1], "rel_err_dw1": errs[2], "note": note})

    def bf16_copy() -> nn.Sequential:
        m = mlp(hidden, inner).cuda()
        m.load_state_dict(base.state_dict())
        return m.to(torch.bfloat16)

    run("bf16 nn.Linear", bf16_copy())
    for recipe in recipes:
        model = bf16_copy()
        for i in (0, 2):
            model[i] = LowPrecisionLinear.from_linear(model[i], recipe)
        run(f"LowPrecisionLinear {recipe}", model, "wgrad bf16" if not recipe.endswith("_all") else "all fp8")
    plain = bf16_copy()
    run("LowPrecisionMLP fp8_rowwise (fused GELU)", LowPrecisionMLP(plain[0], plain[2]), "wgrad bf16")
    ao = torchao_float8(bf16_copy())
    run("torchao float8 rowwise (eager)", ao)
    if compile_torchao and not isinstance(ao, str):
        run("torchao float8 rowwise (compiled)", torch.compile(ao))
    bf16_ms = rows[0]["ms"]
    for r in rows:
        if "ms" in r:
            r["speedup_vs_bf16"] = bf16_ms / r["ms"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few representative shapes (< 90 s)")
    parser.add_argument("--tokens", type=int, default=65536)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.low_precision needs a CUDA GPU")
    gemms = gemm_rows(GEMM_SHAPES_QUICK if args.quick else GEMM_SHAPES_FULL)
    print("GEMM out = x @ w^T (M x N x K); TFLOP/s = 2MNK / time; rel_err vs fp32 on the same inputs")
    print_table(gemms, ["shape", "impl", "ms", "tflops", "speedup_vs_bf16", "rel_err", "note"])
    mlps = mlp_rows(args.tokens, 1024, 4096, MLP_RECIPES_QUICK if args.quick else MLP_RECIPES_FULL,
                    compile_torchao=not args.quick)
    print(f"\nMLP block {args.tokens} tokens, 1024 -> 4096 -> GELU -> 1024, forward + backward (6 GEMMs counted)")
    print_table(mlps, ["impl", "ms", "tflops", "speedup_vs_bf16", "rel_err_y", "rel_err_dx", "rel_err_dw1", "note"])
    best = max((r for r in mlps if "ms" in r and r["impl"].startswith("LowPrecision")),
               key=lambda r: r["speedup_vs_bf16"])
    print(f"\nbest FP8 recipe: {best['impl']} {best['speedup_vs_bf16']:.2f}x BF16 (acceptance: >= 1.3x)")
    cublas = {"weights_128x128": cublas_blockwise_available(True),
              "activations_1x128": cublas_blockwise_available(False)}
    print(f"cuBLAS blockwise _scaled_mm usable: {cublas}")
    path = write_results("low_precision", gemms + mlps, {"best_mlp": best, "quick": args.quick,
                                                         "cublas_blockwise": cublas})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
