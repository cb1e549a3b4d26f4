"""Data pipeline throughput on one CPU core: synthesize to Parquet, then read back (decode + collate).

    PYTHONPATH=src python -m benchmarks.data [--quick] [--preset gem-small] [--samples N] [--out DIR]

Defaults: 1M gem-small samples (``--quick``: 100k), written under a temporary directory that is
deleted afterwards unless ``--out`` is given. The read pass is single-process (num_workers=0, Arrow
without threads) and checks that every sample comes back exactly once. Rates are given per CPU
second of this process (``*_per_cpu_s``: what one loader worker sustains on a core, robust to other
load on the machine) and per wall-clock second. A last pass times the real DataLoader
(``--workers`` processes, pinned memory, each batch copied to the GPU when there is one).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import print_table, write_results
from opengem.data.parquet import inspect_files, make_loader, read_unit, resolve_paths, synthesize_to_parquet


def loader_rate(out: Path, batch_size: int, workers: int) -> float:
    """Wall-clock samples/s of the multi-worker pinned DataLoader (+ host-to-device copy on CUDA)."""
    device = "cuda" if torch.cuda.is_available() else None
    loader = make_loader(out, batch_size=batch_size, num_workers=workers, pin_memory=device is not None)
    samples, start = 0, time.perf_counter()
    for batch in loader:
        if device is not None:
            batch = batch.to(device, non_blocking=True)
        samples += batch.batch_size()
    if device is not None:
        torch.cuda.synchronize()
    return samples / (time.perf_counter() - start)


def measure(preset: str, num_samples: int, out: Path, batch_size: int) -> dict:
    wall, cpu = time.perf_counter(), time.process_time()
    paths = synthesize_to_parquet(out, num_samples, preset, seed=0, progress=False)
    synth_wall, synth_cpu = time.perf_counter() - wall, time.process_time() - cpu
    size_bytes = sum(p.stat().st_size for p in paths)

    layout, units = inspect_files(resolve_paths(out))
    decode_cpu = collate_cpu = 0.0
    tokens = 0
    seen = np.zeros(num_samples, dtype=np.int64)
    files: dict = {}
    wall = time.perf_counter()
    for unit in units:
        t0 = time.process_time()
        block = read_unit(unit, layout, files)
        t1 = time.process_time()
        for begin in range(0, block.num_rows, batch_size):
            batch = block.slice(begin, min(begin + batch_size, block.num_rows)).to_batch(layout)
            tokens += batch.num_history_tokens()
            seen[batch.sample_id.numpy()] += 1
        collate_cpu += time.process_time() - t1
        decode_cpu += t1 - t0
    read_wall = time.perf_counter() - wall
    if not (seen == 1).all():
        raise AssertionError("read-back lost or duplicated samples")
    read_cpu = decode_cpu + collate_cpu
    return {
        "preset": preset,
        "samples": num_samples,
        "tokens": tokens,
        "mean_len": tokens / num_samples,
        "file_MiB": size_bytes / 2**20,
        "synth_wall_s": synth_wall,
        "synth_cpu_s": synth_cpu,
        "decode_cpu_s": decode_cpu,
        "collate_cpu_s": collate_cpu,
        "read_samples_per_cpu_s": num_samples / read_cpu,
        "read_Mtokens_per_cpu_s": tokens / read_cpu / 1e6,
        "read_samples_per_wall_s": num_samples / read_wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="100k samples instead of 1M")
    parser.add_argument("--preset", default="gem-small")
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=None, help="keep the files here (default: temporary)")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="DataLoader workers")
    args = parser.parse_args()
    num_samples = args.samples or (100_000 if args.quick else 1_000_000)
    out = args.out or Path(tempfile.mkdtemp(prefix="opengem-data-bench-"))
    try:
        row = measure(args.preset, num_samples, out, args.batch_size)
        row["loader_workers"] = args.workers
        row["loader_samples_per_wall_s"] = loader_rate(out, args.batch_size, args.workers)
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)
    rows = [row]
    print_table(rows, list(row))
    print(f"wrote {write_results('data', rows)}")


if __name__ == "__main__":
    main()
