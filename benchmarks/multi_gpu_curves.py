"""Distributed vs single-GPU loss curves within bf16 noise (issue 11's correctness point).

    # the same global batch (here 1024) on 1 and on N GPUs, every step's loss kept (--curve):
    torchrun --nproc-per-node 1 -m benchmarks.multi_gpu --curve --preset gem-small --batch-per-gpu 1024 \\
        --warmup 1 --steps 199 --set compile=false --out single.json
    torchrun --nproc-per-node 1 -m benchmarks.multi_gpu --curve ... --set precision=fp32 --out single_fp32.json
    torchrun --nproc-per-node 2 -m benchmarks.multi_gpu --curve --layouts fsdp --batch-per-gpu 512 ... --out fsdp.json
    python -m benchmarks.multi_gpu_curves --single single.json --single-fp32 single_fp32.json --distributed fsdp.json

The noise floor is measured, as in ``benchmarks.gem_curves``: how far the single-GPU curve moves when the
same model on the same data computes in fp32 instead of bf16. A distributed layout differs from the
single process by bf16 parameters (FSDP mixed precision), reduction order and bf16 all-gathers: roundings
of the same kind. PASS when the max and the mean of the smoothed divergence of every distributed layout
from the single-GPU run are at most ``k`` (default 2) times the noise pair's (``gem_curves.judge``
explains the smoothing and the factor).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import write_results
from benchmarks.gem_curves import divergence, ratio


def curve_rows(path: Path) -> dict[str, list[float]]:
    """layout -> per-step losses of a ``benchmarks.multi_gpu --curve`` result file."""
    payload = json.loads(path.read_text())
    curves = {row["layout"]: row["losses"] for row in payload["rows"] if "losses" in row}
    if not curves:
        raise ValueError(f"{path}: no row has 'losses'; run benchmarks.multi_gpu with --curve")
    return curves


def compare(single: list[float], single_fp32: list[float], distributed: dict[str, list[float]],
            window: int, k: float) -> dict[str, Any]:
    """Divergences of every distributed curve from the single-GPU one, against the bf16-vs-fp32 noise."""
    lengths = {len(single), len(single_fp32), *(len(v) for v in distributed.values())}
    if len(lengths) != 1:
        raise ValueError(f"curves of different lengths {sorted(lengths)}: rerun with the same --warmup/--steps")
    noise = divergence(single, single_fp32, window)
    layouts = {}
    for name, losses in distributed.items():
        d = divergence(losses, single, window)
        ratios = {key: ratio(d[key], noise[key]) for key in ("max_smoothed", "mean_smoothed")}
        layouts[name] = {**d, "ratio_max": ratios["max_smoothed"], "ratio_mean": ratios["mean_smoothed"],
                         "passed": max(ratios.values()) <= k}
    return {"steps": lengths.pop(), "window": window, "k": k, "noise_bf16_vs_fp32": noise, "layouts": layouts,
            "passed": all(v["passed"] for v in layouts.values())}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--single", type=Path, required=True, help="1-GPU bf16 run (layout 'single')")
    parser.add_argument("--single-fp32", type=Path, required=True, help="the same with --set precision=fp32")
    parser.add_argument("--distributed", type=Path, nargs="+", required=True, help="N-GPU runs, any layouts")
    parser.add_argument("--smooth", type=int, default=20, help="moving-average window, steps")
    parser.add_argument("--k", type=float, default=2.0, help="allowed multiple of the noise divergence")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/multi_gpu_curves.json")
    args = parser.parse_args(argv)
    single, single_fp32 = curve_rows(args.single)["single"], curve_rows(args.single_fp32)["single"]
    distributed = {}
    for path in args.distributed:
        world = json.loads(path.read_text())["device_count"]
        distributed.update({f"{name}@{world}": losses for name, losses in curve_rows(path).items()})
    result = compare(single, single_fp32, distributed, args.smooth, args.k)
    rows = [{"layout": name, **values} for name, values in result["layouts"].items()]
    noise = result["noise_bf16_vs_fp32"]
    print(f"{result['steps']} steps; noise (1 GPU bf16 vs fp32): max {noise['max_smoothed']:.4g}, "
          f"mean {noise['mean_smoothed']:.4g} (smoothed over {args.smooth})")
    for row in rows:
        print(f"{row['layout']}: max {row['max_smoothed']:.4g} ({row['ratio_max']:.2f}x noise), "
              f"mean {row['mean_smoothed']:.4g} ({row['ratio_mean']:.2f}x) -> {'PASS' if row['passed'] else 'FAIL'}")
    extra = {key: value for key, value in result.items() if key != "layouts"}
    if args.out is None:
        write_results("multi_gpu_curves", rows, extra)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"family": "multi_gpu_curves", "rows": rows, **extra}, indent=2))
    print("PASS" if result["passed"] else "FAIL")
    return result


if __name__ == "__main__":
    main()
