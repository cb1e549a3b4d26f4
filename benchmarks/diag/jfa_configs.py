"""JFA on issue 3's workload (b), where it trails varlen flash (short causal sequences): each kernel's device
time (profiler), the configs the autotuner picked, and every tile config of the {64, 128}^2 x {4, 8} warps x
{2, 3, 4} stages product forced alone per kernel, beside flash's kernels. ``--extra-tiles 64x32x4x4,...``
(BLOCK_M x BLOCK_N x warps x stages) adds tiles outside that product to each sweep: GDPA's forward, the same
dot -> element-wise -> dot chain, ran fastest on 64 x 32 at 4 stages on every (a) workload up to L1024 (session 23).

Run on a GPU: ``PYTHONPATH=src:. python -m benchmarks.diag.jfa_configs [--workloads b_L512_s0.5_causal,...]
[--sweep fwd,dkdv,dq] [--extra-tiles 64x32x4x4]``; writes ``benchmarks/results/jfa_configs.json``.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import bench_ms, forced_configs, int_tuples, kernel_ms, write_results
from benchmarks.jfa import _batch, config_label, flash_impl, jfa_impl, selected, tile_label, tuned_configs
from opengem.ops.triton import jagged_attention as kernels

DEFAULT_WORKLOADS = "b_L512_s0.5_causal,b_L1024_s0.5_causal,b_L1024_s1.0_causal"


def sweep(name: str, fn, rows: list[dict], workload: str, extra: list[tuple[int, int, int, int]] = ()) -> None:
    """Time ``fn`` with each config of the full product (and ``extra``) forced on kernel ``name`` (the others stay
    tuned)."""
    product = kernels.full_product(name)
    configs = []
    for tile in [*product, *(t for t in extra if t not in product)]:
        try:
            configs.append(kernels.tile_config(name, *tile))
        except ValueError as err:  # a tile the host's schedule has no size for (BLOCK_M = 32 in the forward)
            rows.append({"workload": workload, "kernel": name, "config": tile_label(*tile), "error": str(err)})
            print(f"[{workload}] {name} {rows[-1]['config']}: {err}", flush=True)
    for config, error in forced_configs(kernels.KERNELS[name], fn, configs):
        row = {"workload": workload, "kernel": name, "config": config_label(config)}
        if error is None:
            row["ms"] = bench_ms(fn, warmup_ms=10, rep_ms=40)
        else:  # (out of shared memory: the config is not possible)
            row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
        rows.append(row)
        print(f"[{workload}] {name} {row['config']}: {row.get('ms', row.get('error'))}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=DEFAULT_WORKLOADS, type=lambda text: text.split(","))
    parser.add_argument("--sweep", default="dkdv,dq", type=lambda text: [s for s in text.split(",") if s])
    parser.add_argument("--extra-tiles", default=[], type=lambda text: int_tuples(text, 4, "64x32x4x4"),
                        help="BLOCK_MxBLOCK_NxWARPSxSTAGES tiles outside the product, e.g. 64x32x4x4")
    args = parser.parse_args()
    rows: list[dict] = []
    for wl in selected(False, args.workloads):
        b = _batch(wl, 0)
        jfa, impls = jfa_impl(wl, b), []
        try:
            impls.append(flash_impl(wl, b))
        except NotImplementedError as err:  # varlen flash has no target mask: JFA's tiles are still swept
            rows.append({"workload": wl.name, "impl": "torch_varlen_flash", "error": str(err)})
            print(f"[{wl.name}] no flash peer: {err}", flush=True)
        for impl in (jfa, *impls):
            impl.fwd()
            impl.bwd()
            row = {"workload": wl.name, "impl": impl.name, "fwd_ms": bench_ms(impl.fwd), "bwd_ms": bench_ms(impl.bwd)}
            row["bwd_kernels_ms"] = kernel_ms(impl.bwd)
            if impl is jfa:
                row["tuned"] = tuned_configs()
            rows.append(row)
            print(row, flush=True)
        for name in args.sweep:
            sweep(name, jfa.fwd if name == "fwd" else jfa.bwd, rows, wl.name, args.extra_tiles)
        write_results("jfa_configs", rows)
        del b, jfa, impls
        torch.cuda.empty_cache()
    best: dict[tuple, dict] = {}
    for r in (r for r in rows if "config" in r and "ms" in r):
        key = (r["workload"], r["kernel"])
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    for (workload, name), r in best.items():
        print(f"best {workload} {name}: {r['config']} {r['ms']:.3f} ms")
    print(f"wrote {write_results('jfa_configs', rows)}")


if __name__ == "__main__":
    main()
