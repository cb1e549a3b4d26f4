"""GDPA's forward with more tile candidates on the workloads whose bars it misses on short samples (issue 4):
1.1x JFA's forward at (a) L256-L1024 (session 22: 1.025x at L512 s0.5, the 64 x 64 4-warp tile the fastest of
the shipped key-loop candidates) and 400 TFLOP/s at (b) K/V 256 (375: the resident 64-row tile at 16 Q tiles per
program, faster with every step up in Q tiles timed so far).

The extra candidates are tuned beside the shipped ones (the tuner times all and picks the fastest); the tuning
report in the JSON has every candidate's time per key, so one run shows which of them should ship.

Run on a GPU: ``PYTHONPATH=src:. python -m benchmarks.diag.gdpa_short_tiles``; writes
``benchmarks/results/gdpa_short_tiles.json``.
"""

from __future__ import annotations

from benchmarks import gdpa as bench
from benchmarks.common import print_table, write_results
from opengem.ops.triton import gdpa as triton_gdpa

Config = triton_gdpa.Config
# key loop: a wider key tile (half the iterations), shallower and deeper pipelines of the 64 x 64 tile
EXTRA_KEY_LOOP = (Config(64, 128, 4, 2), Config(64, 64, 4, 2), Config(64, 64, 4, 4), Config(64, 32, 4, 4))
# resident K/V: a whole 2048-row sample per program (32 tiles of 64), and the pipeline depth at 16 tiles
EXTRA_RESIDENT = (Config(64, 0, 4, 3, 32), Config(64, 0, 4, 2, 16), Config(64, 0, 4, 4, 16))
WORKLOADS = ["a self L=256 s=0.5", "a self L=256 s=1.0", "a self L=512 s=0.5", "a self L=512 s=1.0",
             "a self L=1024 s=0.5", "b cross Q<=2048 KV=256"]


def main() -> None:
    # those of the extras that shipped since (session 23: 64 x 32, 32 resident Q tiles) are timed once
    triton_gdpa._FWD = (*triton_gdpa._FWD, *(c for c in EXTRA_KEY_LOOP if c not in triton_gdpa._FWD))
    triton_gdpa._FWD_RESIDENT = (*triton_gdpa._FWD_RESIDENT,
                                 *(c for c in EXTRA_RESIDENT if c not in triton_gdpa._FWD_RESIDENT))
    rows = bench.run(False, prefixes=WORKLOADS, peers=("jfa",))
    print_table(rows, bench.COLUMNS)
    report = [t for t in triton_gdpa.tuning_report() if t["pass"] == "fwd"]
    for t in report:
        best = sorted(((ms, name) for name, ms in t["candidates"].items() if ms is not None))[:4]
        print(t["bucket_q"], t["bucket_k"], t["pick"], [f"{name} {ms:.4f}" for ms, name in best])
    extra = {"extra_key_loop": [repr(c) for c in EXTRA_KEY_LOOP], "extra_resident": [repr(c) for c in EXTRA_RESIDENT],
             "tuning": triton_gdpa.tuning_report()}
    print(write_results("gdpa_short_tiles", rows, extra))


if __name__ == "__main__":
    main()
