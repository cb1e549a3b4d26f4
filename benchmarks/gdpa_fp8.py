"""FP8 GDPA (issue 12) against GDPA in bf16 on workloads (a) and (b) of :mod:`benchmarks.gdpa`, same process,
same data.

B = 1152 samples, H = 4, D = 128, fast_gelu, pre_scale 1 / sqrt(D), norm "max_len". (a) self-attention,
non-causal, L in {1024, 2048} at sparsity 0.5 and 1.0; (b) cross-attention, jagged Q up to 2048 (sparsity 0.5)
against K/V of 128 and 256 per sample (``--quick``: (a) L 1024 sparsity 1.0 and (b) K/V 256, default configs).
Per shape: the bf16 and fp8 forwards through ``gdpa`` (fp8: the shared quantize pass included), the fp8 kernel
alone on pre-quantized inputs and the quantize pass alone, timed in interleaved rounds (the speedups are medians
of per-round ratios), and the MXFP8 op beside them (``precision="mxfp8"``: MX-E4M3 numerics on the bf16
kernels); each forward's backward (fp8, mxfp8: straight through the quantization).
Correctness in the same run on the first 8 samples: both outputs against the fp32 reference, and the fp8 kernel
against its exact emulation (:mod:`opengem.ops.reference.gdpa_fp8`). FLOPs: 4 H D per pair, backward 2.5x.

Run: ``PYTHONPATH=src python -m benchmarks.gdpa_fp8 [--quick]``; writes ``benchmarks/results/gdpa_fp8.json``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics

import torch

from benchmarks.common import (
    bench_ms,
    interleaved_ms,
    paired_speedup,
    print_table,
    relative_error,
    tuner_config_label,
    write_results,
)
from benchmarks.gdpa import HEAD_DIM, HEADS, Workload, _tensors, workloads
from opengem.ops.activations import activation_id
from opengem.ops.gdpa import gdpa
from opengem.ops.reference.gdpa import gdpa as reference
from opengem.ops.reference.gdpa_fp8 import gdpa_fp8 as emulation
from opengem.ops.triton import gdpa_fp8 as kernels
from opengem.ops.triton.gdpa import GdpaArgs
from opengem.ops.triton.jagged_attention_fp8 import BLOCK

COLUMNS = ["workload", "tokens", "bf16_ms", "fp8_ms", "fp8_kernel_ms", "fp8_kernel_tile", "quantize_ms", "speedup",
           "kernel_speedup",
           "mxfp8_ms", "mxfp8_speedup", "mxfp8_bwd_ms", "mxfp8_err",
           "bf16_bwd_ms", "fp8_bwd_ms", "bwd_speedup", "bf16_tflops", "fp8_tflops", "fp8_kernel_tflops",
           "bf16_err", "fp8_err", "err_ratio", "fp8_vs_emulation"]  # fmt: skip
ERROR_SAMPLES = 8
PRECISIONS = ("bf16", "fp8", "mxfp8")
PRE_SCALE = 1 / math.sqrt(HEAD_DIM)


def _selected(quick: bool) -> list[Workload]:
    chosen = ("a self L=1024 s=1.0", "b cross Q<=2048 KV=256") if quick else ("a self L=1024", "a self L=2048", "b ")
    return [w for w in workloads(quick=False) if w.name.startswith(chosen)]


def _tensors_of(w: Workload) -> dict:
    """:func:`benchmarks.gdpa._tensors`, self-attention's K/V offsets being Q's tensor (FP8 GDPA then quantizes Q,
    K and V in one launch, as a model passing one offsets tensor gets)."""
    t = _tensors(w, "cuda")
    if w.self_attention:
        t["k_offsets"] = t["q_offsets"]
    return t


def _attend(t: dict, precision: str):
    def run() -> torch.Tensor:
        return gdpa(t["q"], t["k"], t["v"], t["q_offsets"], t["k_offsets"], t["max_len_q"], t["max_len_k"],
                    activation="fast_gelu", pre_scale=PRE_SCALE, norm="max_len", precision=precision)

    return run


def measure(w: Workload) -> dict:
    t = _tensors_of(w)
    leaves = (t["q"], t["k"], t["v"])
    args = GdpaArgs((activation_id("fast_gelu"),) * HEADS, PRE_SCALE, 1.0 / t["max_len_k"], False, 0, None, False,
                    t["max_len_q"], t["max_len_k"])  # fmt: skip
    q, k, v = (x.detach() for x in leaves)
    pb = kernels.problem(q, t["q_offsets"], None, args, t["max_len_q"])
    k_pb = None if w.self_attention else kernels.problem(k, t["k_offsets"], None, args, t["max_len_k"])
    quantized = kernels.quantize(q, k, v, pb, k_pb)
    out = torch.empty_like(q)
    forwards = {p: _attend(t, p) for p in PRECISIONS}
    with torch.no_grad():
        times = interleaved_ms({
            **forwards,
            "kernel": lambda: kernels.attend(quantized, out, pb, args),
            "quantize": lambda: kernels.quantize(q, k, v, pb, k_pb),
        })  # fmt: skip
    backward = {}
    for precision, forward in forwards.items():
        result = forward()
        grad = torch.randn_like(result)
        torch.autograd.grad(result, leaves, grad, retain_graph=True)  # tuning outside the timed region
        backward[precision] = bench_ms(lambda: torch.autograd.grad(result, leaves, grad, retain_graph=True))
    median = {name: statistics.median(ms) for name, ms in times.items()}
    pairs = float((w.q_lengths.double() * w.k_lengths.double()).sum())  # every key visible: (a) and (b)
    flops = 4 * HEADS * HEAD_DIM * pairs
    errors = _errors(w, t)
    torch.cuda.synchronize()
    return {
        "workload": w.name, "tokens": int(w.q_lengths.sum()),
        "bf16_ms": median["bf16"], "fp8_ms": median["fp8"], "fp8_kernel_ms": median["kernel"],
        "fp8_kernel_tile": tuner_config_label(kernels._gdpa_fp8_fwd_kernel.best_config),  # the tuner's pick
        "quantize_ms": median["quantize"],
        "speedup": paired_speedup(times["bf16"], times["fp8"]),
        "kernel_speedup": paired_speedup(times["bf16"], times["kernel"]),
        "mxfp8_ms": median["mxfp8"], "mxfp8_speedup": paired_speedup(times["bf16"], times["mxfp8"]),
        "mxfp8_bwd_ms": backward["mxfp8"],
        "bf16_bwd_ms": backward["bf16"], "fp8_bwd_ms": backward["fp8"],
        "bwd_speedup": backward["bf16"] / backward["fp8"],
        "bf16_tflops": flops / median["bf16"] / 1e9, "fp8_tflops": flops / median["fp8"] / 1e9,
        "fp8_kernel_tflops": flops / median["kernel"] / 1e9, **errors,
    }  # fmt: skip


def _errors(w: Workload, t: dict) -> dict:
    """bf16 and fp8 outputs against fp32 on the first samples (the full batch's max lengths: same scale and
    tuning key), and the fp8 output against its emulation."""
    n = ERROR_SAMPLES
    sub = Workload(w.name, w.q_lengths[:n], w.k_lengths[:n], w.activation)
    s = {**_tensors_of(sub), "max_len_q": t["max_len_q"], "max_len_k": t["max_len_k"]}
    q, k, v = (s[name].detach() for name in ("q", "k", "v"))
    options = dict(head_activations=["fast_gelu"] * HEADS, pre_scale=PRE_SCALE, out_scale=1.0 / s["max_len_k"])
    with torch.no_grad():
        outs = {p: _attend(s, p)() for p in PRECISIONS}
    want = reference(q.float(), k.float(), v.float(), s["q_offsets"], s["k_offsets"], **options)
    emulated = emulation(q, k, v, s["q_offsets"], s["k_offsets"], block=BLOCK, **options)
    bf16_err, fp8_err = (relative_error(outs[p], want) for p in ("bf16", "fp8"))
    return {"bf16_err": bf16_err, "fp8_err": fp8_err, "err_ratio": fp8_err / bf16_err,
            "fp8_vs_emulation": relative_error(outs["fp8"], emulated),
            "mxfp8_err": relative_error(outs["mxfp8"], want)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="L 1024 at sparsity 1.0, default configs")
    args = parser.parse_args()
    if args.quick:
        for name in ("OPENGEM_GDPA_TUNE", "OPENGEM_JFA_AUTOTUNE"):
            os.environ.setdefault(name, "0")
    rows = []
    for w in _selected(args.quick):
        rows.append(measure(w))
        print_table(rows[-1:], COLUMNS)
        write_results("gdpa_fp8", rows, extra={"quick": args.quick, "flop_convention": "4 H D per pair, bwd 2.5x"})
    print()
    print_table(rows, COLUMNS)


if __name__ == "__main__":
    main()
