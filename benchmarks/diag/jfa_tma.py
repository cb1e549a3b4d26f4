"""JFA's tile loads through ragged TMA descriptors against masked pointer loads, pass by pass, beside varlen
flash in the same run: forward and backward milliseconds, each backward kernel's device time, the tiles the
autotuner picked per mode, and the largest difference between the two modes' outputs and gradients.

Run on a GPU: ``PYTHONPATH=src:. python -m benchmarks.diag.jfa_tma [--workloads a_,b_L1024_s0.5_causal,...]``;
writes ``benchmarks/results/jfa_tma.json``. Flash is timed before and after JFA's modes (clock drift shows).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import bench_ms, kernel_ms, write_results
from benchmarks.jfa import _batch, flash_impl, jfa_impl, selected, tuned_configs
from opengem.ops.triton import jagged_attention as kernels

DEFAULT_WORKLOADS = "a_,b_L512_s0.5_full,b_L512_s1.0_causal,b_L1024_s0.5_causal,b_L2048_s0.5_causal,d_"
MODES = {"pointer": "none", "tma": ",".join(kernels.PASSES)}


def _timed(impl) -> dict:
    impl.fwd()
    impl.bwd()
    torch.cuda.synchronize()
    return {"fwd_ms": bench_ms(impl.fwd), "bwd_ms": bench_ms(impl.bwd), "bwd_kernels_ms": kernel_ms(impl.bwd)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=DEFAULT_WORKLOADS, type=lambda text: text.split(","))
    args = parser.parse_args()
    rows: list[dict] = []
    for wl in selected(False, args.workloads):
        b = _batch(wl, 0)
        flash = flash_impl(wl, b)
        rows.append({"workload": wl.name, "impl": "torch_varlen_flash", **_timed(flash)})
        print(rows[-1], flush=True)
        results = {}
        for mode, setting in MODES.items():
            kernels.TMA_PASSES = kernels._tma_passes(setting)
            jfa = jfa_impl(wl, b)
            row = {"workload": wl.name, "impl": f"jfa_{mode}", **_timed(jfa)}
            row["tuned"] = tuned_configs()
            results[mode] = [t.float() for t in jfa.fwd_bwd()]
            rows.append(row)
            print(row, flush=True)
        diffs = [(a - b_).abs().max().item() for a, b_ in zip(results["pointer"], results["tma"])]
        rows[-1]["max_abs_diff_vs_pointer"] = dict(zip(("out", "dq", "dk", "dv"), diffs))
        flash_after = _timed(flash)
        rows.append({"workload": wl.name, "impl": "torch_varlen_flash_after", **flash_after})
        print(rows[-1], flush=True)
        write_results("jfa_tma", rows)
        del b, flash, jfa, results
        torch.cuda.empty_cache()
    kernels.TMA_PASSES = kernels._tma_passes(MODES["tma"])
    print(f"wrote {write_results('jfa_tma', rows)}")


if __name__ == "__main__":
    main()
