"""Every tile of the embedding forward, timed alone on issue 8's workloads, beside the device copy bandwidth.

Each tuning candidate of ``_lookup_kernel`` launched directly (not through the autotuner), checked against
the eager reference of the same batch, then the public path through its autotuner, with the pick. GB/s
counts rows read plus outputs written (``benchmarks.embedding``). Session 11 also ran a grouped forward
(16-32 bags per program, one-hot sums) and the per-bag forward without its ids loaded a step ahead; both
lost (RESULTS.md) and were removed.

Run on a GPU: ``PYTHONPATH=src:. python -m benchmarks.diag.embedding_lookup_configs [--workloads quick,full]``;
writes ``benchmarks/results/embedding_lookup_configs.json`` after every row.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from benchmarks.common import bench_ms, relative_error, write_results
from benchmarks.embedding import DEVICE, Ours, copy_bandwidth_gbs, forward_bytes, make_batch, workload
from opengem.ops.embedding import LookupLayout
from opengem.ops.reference import embedding as reference
from opengem.ops.triton import embedding as kernels


def _launchers(weights, layout: LookupLayout, ids, offsets) -> dict[str, Callable[[], torch.Tensor]]:
    """name -> a call of the forward with one config (past its autotuner), then through its autotuner."""
    args = (weights, layout.feature_meta, ids, offsets, layout.batch_size, layout.out_numel, layout.max_dim, layout.dim_align)
    found = {}
    for config in kernels.lookup_configs():
        name = " ".join(f"{key}={value}" for key, value in config.items())
        found[name] = lambda config=config: kernels.embedding_lookup(*args, config)
    found["autotuned"] = lambda: kernels.embedding_lookup(*args)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="quick,full", type=lambda text: text.split(","))
    args = parser.parse_args()
    rows: list[dict] = []
    extra: dict = {"copy_GBps": copy_bandwidth_gbs()}
    print(f"copy bandwidth {extra['copy_GBps']:.0f} GB/s", flush=True)
    for name in args.workloads:
        w = workload(name == "quick", power_law_ids=True)
        batch = make_batch(w, DEVICE, seed=0)
        moved = forward_bytes(w, batch)
        ours = Ours.build(w, batch)  # the benchmark's collection: its flat weights and this batch's layout
        weights, layout, offsets = ours.weights.detach(), ours.layout, ours.offsets
        expected = reference.embedding_lookup(weights, layout.feature_meta, batch.values, offsets, batch.stride, layout.out_numel)
        extra[name] = {"num_ids": batch.values.numel(), "forward_bytes": moved}
        for impl, run in _launchers(weights, layout, batch.values, offsets).items():
            row: dict = {"workload": name, "impl": impl}
            try:
                row["error"] = relative_error(run(), expected)
                row["forward_ms"] = bench_ms(run)
                row["pct_of_copy"] = 100 * moved / row["forward_ms"] / 1e6 / extra["copy_GBps"]
            except Exception as error:  # a config that fails to compile or launch is a row, not the end
                row["failed"] = f"{type(error).__name__}: {error}"[:300]
            rows.append(row)
            print(row, flush=True)
            write_results("embedding_lookup_configs", rows, extra)
        extra[f"{name}_pick"] = {str(key): str(config) for key, config in kernels._lookup_kernel.cache.items()}
        kernels._lookup_kernel.cache.clear()  # the next workload tunes afresh
        write_results("embedding_lookup_configs", rows, extra)
        del ours, weights, expected
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
