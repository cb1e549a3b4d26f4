"""Does JFA's autotuner pick the tile that is fastest where the kernels run? On a power-capped H200 the SM clock
falls from 1980 MHz to 1400-1900 under attention within ~100 ms (session 24), while the autotuner times each
candidate right after compiling it, on a rested card. Session 27: the tuner picked the forward's 64 x 32 tile on
workload (a), which ran 2.01 ms in a 100 ms window against 1.69 for 128 x 128 x 8 x 3.

For each workload and pass: the autotuner's own timings (a fresh tune), then every candidate forced alone and
timed twice: ``rested`` (1 s idle, a 40 ms window: the tuner's conditions) and ``hot`` (300 ms of the pass, then
a 100 ms window: a training step's conditions); then ``--retunes`` fresh tunings with Triton's one window (1
round of 10 + 40 ms) and with opengem's interleaved rounds (3 of 5 + 20 ms), each pick's hot time over the best's.

Run on a GPU: ``PYTHONPATH=src:. python -m benchmarks.diag.jfa_tuning_regimes [--workloads a_,c_1024]
[--passes fwd,dkdv,dq] [--retunes 6]``; writes ``benchmarks/results/jfa_tuning_regimes.json``.
"""

from __future__ import annotations

import argparse
import math

import torch

from benchmarks.common import bench_ms, rested_ms, write_results
from benchmarks.jfa import _batch, config_label, jfa_impl, selected
from opengem.ops.triton import jagged_attention as kernels


def tuner_timings(name: str, run) -> dict[str, float]:
    """Median milliseconds the autotuner measured for each candidate of pass ``name`` in a fresh tune."""
    kernel = kernels.KERNELS[name]
    kernel.cache.clear()
    run()
    torch.cuda.synchronize()
    return {config_label(c): t[0] for c, t in kernel.configs_timings.items()}


def forced_timings(name: str, run) -> dict[str, dict[str, float]]:
    """Each candidate of pass ``name`` forced alone, timed rested and hot."""
    kernel = kernels.KERNELS[name]
    every = list(kernel.configs)
    times: dict[str, dict[str, float]] = {}
    try:
        for config in every:
            kernel.configs, label = [config], config_label(config)
            kernel.cache.clear()
            try:
                run()
                torch.cuda.synchronize()
            except Exception as err:  # noqa: BLE001  (pruned for this shape or out of shared memory)
                print(f"{name} {label}: {type(err).__name__}", flush=True)
                continue
            times[label] = {"rested": rested_ms(run, rep_ms=40), "hot": bench_ms(run, warmup_ms=300, rep_ms=100)}
            print(f"{name} {label}: {times[label]}", flush=True)
    finally:
        kernel.configs = every
        kernel.cache.clear()
    return times


# (rounds, (warm-up ms, timed ms)): Triton's autotuner as opengem called it before session 27, and opengem's now
TUNERS = {"one_window": (1, (10, 40)), "interleaved": (3, (5, 20))}


def retuned_picks(name: str, run, retunes: int) -> dict[str, list[str]]:
    """The pick of ``retunes`` fresh tunings of pass ``name`` with each of ``TUNERS``, alternating tuners."""
    kernel = kernels.KERNELS[name]
    picks: dict[str, list[str]] = {tuner: [] for tuner in TUNERS}
    try:
        for _ in range(retunes):
            for tuner, (rounds, window) in TUNERS.items():
                kernel.rounds, kernel.window_ms = rounds, window
                kernel.cache.clear()
                run()
                torch.cuda.synchronize()
                picks[tuner].append(config_label(kernel.best_config))
    finally:
        vars(kernel).pop("rounds", None)  # back to the class's settings
        vars(kernel).pop("window_ms", None)
        kernel.cache.clear()
    return picks


def fastest(times: dict[str, float]) -> str:
    return min(times, key=times.get)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="a_power_law_causal,c_1024", type=lambda text: text.split(","))
    parser.add_argument("--passes", default="fwd,dkdv,dq", type=lambda text: text.split(","))
    parser.add_argument("--retunes", default=6, type=int)
    args = parser.parse_args()
    rows = []
    for wl in selected(False, args.workloads):
        b = _batch(wl, 0)
        jfa = jfa_impl(wl, b)
        jfa.fwd()
        for name in args.passes:
            run = jfa.fwd if name == "fwd" else jfa.bwd
            tuner = tuner_timings(name, run)
            forced = forced_timings(name, run)
            row = {"workload": wl.name, "pass": name, "tuner_ms": tuner, "forced_ms": forced,
                   "tuner_pick": fastest(tuner),
                   "rested_pick": fastest({k: v["rested"] for k, v in forced.items()}),
                   "hot_pick": fastest({k: v["hot"] for k, v in forced.items()})}
            hot = {k: v["hot"] for k, v in forced.items()}
            row["hot_ms_of_tuner_pick"] = hot.get(row["tuner_pick"])
            row["hot_ms_of_hot_pick"] = hot[row["hot_pick"]]
            row["retuned_picks"] = retuned_picks(name, run, args.retunes)
            row["retuned_slowdown"] = {  # each pick's hot time over the hot-fastest tile's
                tuner: [round(hot.get(p, math.nan) / row["hot_ms_of_hot_pick"], 4) for p in picks]
                for tuner, picks in row["retuned_picks"].items()
            }
            rows.append(row)
            print({k: row[k] for k in ("workload", "pass", "tuner_pick", "rested_pick", "hot_pick",
                                       "hot_ms_of_tuner_pick", "hot_ms_of_hot_pick", "retuned_slowdown")}, flush=True)
            write_results("jfa_tuning_regimes", rows)
        del b, jfa
        torch.cuda.empty_cache()
    print(f"wrote {write_results('jfa_tuning_regimes', rows)}")


if __name__ == "__main__":
    main()
