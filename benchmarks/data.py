"""Data pipeline throughput on one CPU core: synthesize to Parquet, then read back (decode + collate).

    PYTHONPATH=src python -m benchmarks.data [--quick] [--preset gem-small] [--samples N] [--out DIR]

Defaults: 1M gem-small samples (``--quick``: 100k), written under a temporary directory that is
deleted afterwards unless ``--out`` is given. The read pass is single-process (num_workers=0) and
checks that every sample comes back exactly once, so the figures are per core.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import print_table, write_results
from opengem.data.parquet import inspect_files, read_unit, resolve_paths, synthesize_to_parquet


def measure(preset: str, num_samples: int, out: Path, batch_size: int) -> dict:
    start = time.perf_counter()
    paths = synthesize_to_parquet(out, num_samples, preset, seed=0, progress=False)
    synth_s = time.perf_counter() - start
    size_bytes = sum(p.stat().st_size for p in paths)

    layout, units = inspect_files(resolve_paths(out))
    decode_s = collate_s = 0.0
    tokens = 0
    seen = np.zeros(num_samples, dtype=np.int64)
    files: dict = {}
    for unit in units:
        t0 = time.perf_counter()
        block = read_unit(unit, layout, files)
        t1 = time.perf_counter()
        for begin in range(0, block.num_rows, batch_size):
            batch = block.slice(begin, min(begin + batch_size, block.num_rows)).to_batch(layout)
            tokens += batch.num_history_tokens()
            np.add.at(seen, batch.sample_id.numpy(), 1)
        collate_s += time.perf_counter() - t1
        decode_s += t1 - t0
    if not (seen == 1).all():
        raise AssertionError("read-back lost or duplicated samples")
    read_s = decode_s + collate_s
    return {
        "preset": preset,
        "samples": num_samples,
        "tokens": tokens,
        "mean_len": tokens / num_samples,
        "synth_s": synth_s,
        "synth_samples_per_s": num_samples / synth_s,
        "file_MiB": size_bytes / 2**20,
        "decode_s": decode_s,
        "collate_s": collate_s,
        "read_samples_per_s": num_samples / read_s,
        "read_Mtokens_per_s": tokens / read_s / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="100k samples instead of 1M")
    parser.add_argument("--preset", default="gem-small")
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=None, help="keep the files here (default: temporary)")
    args = parser.parse_args()
    num_samples = args.samples or (100_000 if args.quick else 1_000_000)
    out = args.out or Path(tempfile.mkdtemp(prefix="opengem-data-bench-"))
    try:
        row = measure(args.preset, num_samples, out, args.batch_size)
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)
    rows = [row]
    print_table(rows, list(row))
    print(f"wrote {write_results('data', rows)}")


if __name__ == "__main__":
    main()
