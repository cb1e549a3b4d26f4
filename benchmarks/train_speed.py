"""End-to-end training speed (GEM issue 10): `opengem bench train` and `bench layers` over the GPU presets.

Per run it writes the CLI's own JSON (benchmarks/results/train_<preset>[_<mlp>].json + PNG,
layers_<preset>.json) and a summary in benchmarks/results/train_speed.json with the acceptance figures:
E2E MFU (>= 40 % of the dense BF16 peak), FP8 MLP speed-up over BF16 (>= 1.2x), loader rate over the
step rate (>= 2x). ``--quick``: gem-small only, BF16 (< 90 s); default: gem-small and gem-large, BF16 and
FP8 MLPs.

    PYTHONPATH=src python -m benchmarks.train_speed [--quick] [--num-workers N] [--precision bf16|fp32]
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.common import RESULTS_DIR, print_table, write_results
from opengem.train.bench.layers import bench_layers
from opengem.train.bench.plot import matplotlib_available, plot_phases
from opengem.train.bench.step import TrainBenchOptions, bench_train
from opengem.train.bench.timing import write_json


def run(quick: bool, precision: str, num_workers: int | None) -> list[dict[str, Any]]:
    presets = ["gem-small"] if quick else ["gem-small", "gem-large"]
    mlps = ["none"] if quick else ["none", "fp8_rowwise"]
    steps, warmup = (20, 5) if quick else (50, 10)
    rows = []
    for preset in presets:
        layers = bench_layers(TrainBenchOptions(preset, precision=precision), repeats=5 if quick else 10)
        write_json(RESULTS_DIR / f"layers_{preset}.json", layers)
        bf16_rate = None
        for mlp in mlps:
            options = TrainBenchOptions(preset, steps=steps, warmup=warmup, precision=precision,
                                        low_precision_mlp=mlp, num_workers=num_workers)
            payload = bench_train(options)
            name = f"train_{preset}" + ("" if mlp == "none" else f"_{mlp}")
            path = write_json(RESULTS_DIR / f"{name}.json", payload)
            if matplotlib_available():
                plot_phases(payload, path.with_suffix(".png"))
            r = payload["results"]
            bf16_rate = bf16_rate or r["samples_per_s"]
            rows.append({
                "preset": preset, "mlp": mlp, "batch": payload["settings"]["batch_size"],
                "samples_per_s": r["samples_per_s"], "tokens_per_s": r["tokens_per_s"],
                "gflop_per_sample": r["train_flops_per_sample"] / 1e9, "attention_pct": 100 * r["attention_share"],
                "mfu_pct": 100 * r["mfu"], "vs_ceiling_pct": 100 * r["mfu_vs_matmul_ceiling"],
                "speedup_vs_bf16": r["samples_per_s"] / bf16_rate, "loader_x": r["loader_over_step_rate"],
                "peak_gib": r["peak_memory_gb"], "local_mfu_pct": 100 * layers["local_mfu"],
                "scaling_ratio": r["mfu"] / layers["local_mfu"],
            })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="gem-small, BF16 only")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--num-workers", type=int, help="data loader workers (default: the preset's)")
    args = parser.parse_args()
    rows = run(args.quick, args.precision, args.num_workers)
    print_table(rows, list(rows[0]))
    print(f"wrote {write_results('train_speed', rows, {'quick': args.quick, 'precision': args.precision})}")


if __name__ == "__main__":
    main()
