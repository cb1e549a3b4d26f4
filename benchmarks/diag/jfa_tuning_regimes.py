"""Does JFA's autotuner pick the tile that is fastest where the kernels run? On a power-capped H200 the SM clock
falls from 1980 MHz to 1400-1900 under attention within ~100 ms (session 24), while the autotuner times each
candidate right after compiling it, on a rested card. Session 27: the tuner picked the forward's 64 x 32 tile on
workload (a), which ran 2.01 ms in a 100 ms window against 1.69 for 128 x 128 x 8 x 3.

For each workload and pass: the autotuner's own timings (a fresh tune), then every candidate forced alone and
timed twice: ``rested`` (1 s idle, a 40 ms window: the tuner's conditions) and ``hot`` (300 ms of the pass, then
a 100 ms window: a training step's conditions). Session 27 found no rested-versus-hot bias in the ranking, but
the tuner's one-window timings 2-16% above the rested ones, unevenly: a coin flip between tiles within ~5%. An
interleaved tuner (three rotating rounds of 5 + 20 ms, median) was measured against it over 5 fresh tunings per
pass (commit 93271af, ``--retunes``) and was no better, so Triton's tuner stays.

Run on a GPU: ``PYTHONPATH=src:. python -m benchmarks.diag.jfa_tuning_regimes [--workloads a_,c_1024]
[--passes fwd,dkdv,dq]``; writes ``benchmarks/results/jfa_tuning_regimes.json``.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import bench_ms, only_config, rested_ms, write_results
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
    times: dict[str, dict[str, float]] = {}
    for config in list(kernel.configs):
        label = config_label(config)
        with only_config(kernel, config):
            try:
                run()
                torch.cuda.synchronize()
            except Exception as err:  # noqa: BLE001  (pruned for this shape or out of shared memory)
                print(f"{name} {label}: {type(err).__name__}", flush=True)
                continue
            times[label] = {"rested": rested_ms(run, rep_ms=40), "hot": bench_ms(run, warmup_ms=300, rep_ms=100)}
        print(f"{name} {label}: {times[label]}", flush=True)
    return times


def fastest(times: dict[str, float]) -> str:
    return min(times, key=times.get)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="a_power_law_causal,c_1024", type=lambda text: text.split(","))
    parser.add_argument("--passes", default="fwd,dkdv,dq", type=lambda text: text.split(","))
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
            rested = {k: v["rested"] for k, v in forced.items()}
            hot = {k: v["hot"] for k, v in forced.items()}
            row = {"workload": wl.name, "pass": name, "tuner_ms": tuner, "forced_ms": forced,
                   "tuner_pick": fastest(tuner), "rested_pick": fastest(rested), "hot_pick": fastest(hot)}
            row["hot_ms_of_tuner_pick"] = hot.get(row["tuner_pick"])
            row["hot_ms_of_hot_pick"] = hot[row["hot_pick"]]
            rows.append(row)
            print({k: row[k] for k in ("workload", "pass", "tuner_pick", "rested_pick", "hot_pick",
                                       "hot_ms_of_tuner_pick", "hot_ms_of_hot_pick")}, flush=True)
            write_results("jfa_tuning_regimes", rows)
        del b, jfa
        torch.cuda.empty_cache()
    print(f"wrote {write_results('jfa_tuning_regimes', rows)}")


if __name__ == "__main__":
    main()
