"""JFA's fused backward (dQ by atomic adds from registers, or by TMA reductions) against its two-pass one and PyTorch's varlen FlashAttention-2 backward, same run.

The two-pass backward runs seven matrix products a (query tile, key tile) pair (its dQ pass recomputes S and dP);
the fused one five, adding each key tile's share of dQ into an fp32 buffer with atomic adds
(:mod:`opengem.ops.triton.jagged_attention_fused_backward`). Per workload: both tuned, each checked against the
fp32 reference on a sub-batch (as ``benchmarks.jfa``), then timed in five interleaved rounds beside flash where it
can express the mask; the tuned fused tile and the fused backward's kernels (delta, zero fill, fused pass, dQ
scaling) recorded. Backward FLOPs: 2.5 x 4 H D x unmasked pairs (GEM_SPEC section 8).

Run on a GPU: ``PYTHONPATH=src:. python -m benchmarks.diag.jfa_fused_backward [--workloads a_,c_]``; writes
``benchmarks/results/jfa_fused_backward.json``.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.common import interleaved_ms, kernel_ms, paired_speedup, tuner_config_label, write_results
from benchmarks.jfa import HEAD_DIM, HEADS, _batch, _errors, _reference_sub_batch, flash_impl, jfa_impl, selected
from opengem.ops.jagged_attention import attention_pairs
from opengem.ops.triton import jagged_attention as kernels
from opengem.ops.triton import jagged_attention_fused_backward as fused

DEFAULT_WORKLOADS = "a_power_law_causal,c_1024_hist_64_targets,b_L1024_s0.5_causal,b_L512_s0.5_full,b_L2048_s1.0_full"


# mode: (fused.BACKWARD, fused.DQ_ADDS)
MODES = {"two_pass": ("two_pass", "atomic"), "fused": ("fused", "atomic"), "fused_tma": ("fused", "tma")}


def _set(mode: str) -> None:
    fused.BACKWARD, fused.DQ_ADDS = MODES[mode]


def _in_mode(mode: str, fn):
    def run():
        _set(mode)
        return fn()

    return run


def _picked(tuner) -> str | None:
    return tuner_config_label(tuner.best_config) if getattr(tuner, "best_config", None) is not None else None


def measure(wl, rounds: int) -> dict:
    b = _batch(wl, 0)
    pairs = attention_pairs(b.offsets, causal=wl.causal, num_targets=b.targets, window=wl.window)
    flops = 2.5 * 4 * HEADS * HEAD_DIM * pairs
    jfa = jfa_impl(wl, b)
    want = _reference_sub_batch(wl, b)
    row: dict = {"workload": wl.name, "tokens": int(wl.lengths.sum()), "pairs": pairs, "errors": {}}
    runs = {}
    tiles = {}
    for mode in MODES:
        _set(mode)
        fused._fused_bwd_kernel.cache.clear()  # (each way of adding dQ tunes afresh)
        row["errors"][mode] = _errors(jfa.fwd_bwd(), wl, want)  # (tunes the mode's kernels)
        tiles[mode] = _picked(fused._fused_bwd_kernel)
        jfa.fwd()
        runs[mode] = _in_mode(mode, jfa.bwd)
        runs[mode]()
    row["tiles"] = {"fwd": _picked(kernels._fwd_kernel), "dkdv": _picked(kernels._dkdv_kernel),
                    "dq": _picked(kernels._dq_kernel), "fused": tiles["fused"], "fused_tma": tiles["fused_tma"]}
    try:
        flash = flash_impl(wl, b)
        out = flash.fwd()
        row["errors"]["flash"] = _errors((out, *flash.bwd()), wl, want)
        runs["flash"] = flash.bwd
    except NotImplementedError as err:
        row["flash_note"] = str(err)
    times = interleaved_ms(runs, rounds=rounds)
    row["ms_rounds"] = {k: [round(t, 4) for t in v] for k, v in times.items()}
    row["ms"] = {k: statistics.median(v) for k, v in times.items()}
    row["tflops"] = {k: flops / ms / 1e9 for k, ms in row["ms"].items()}
    row["speedups"] = {f"{mode}_over_two_pass": paired_speedup(times["two_pass"], times[mode]) for mode in MODES}
    if "flash" in times:
        row["speedups"] |= {f"{mode}_over_flash": paired_speedup(times["flash"], times[mode]) for mode in MODES}
    row["kernels_ms"] = {mode: kernel_ms(runs[mode]) for mode in ("fused", "fused_tma")}
    _set("two_pass")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=DEFAULT_WORKLOADS, type=lambda text: text.split(","))
    parser.add_argument("--rounds", default=5, type=int)
    args = parser.parse_args()
    rows = []
    for wl in selected(False, args.workloads):
        rows.append(measure(wl, args.rounds))
        print({k: rows[-1][k] for k in ("workload", "ms", "tflops", "errors", "tiles", "speedups")},
              flush=True)
        write_results("jfa_fused_backward", rows)
        torch.cuda.empty_cache()
    print(f"wrote {write_results('jfa_fused_backward', rows)}")


if __name__ == "__main__":
    main()
