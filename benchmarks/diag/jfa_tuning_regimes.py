"""Does JFA's autotuner pick the tile that is fastest where the kernels run? On a power-capped H200 the SM clock
falls from 1980 MHz to 1400-1900 under attention within ~100 ms (session 24), while the autotuner times each
candidate right after compiling it, on a rested card. Session 27: the tuner picked the forward's 64 x 32 tile on
workload (a), which ran 2.01 ms in a 100 ms window against 1.69 for 128 x 128 x 8 x 3.

For each workload and pass: the autotuner's own timings (a fresh tune), then every candidate forced alone and
timed twice: ``rested`` (1 s idle, a 40 ms window: the tuner's conditions) and ``hot`` (300 ms of the pass, then
a 100 ms window: a training step's conditions). Session 27 found no rested-versus-hot bias in the ranking, but
the tuner's one-window timings 2-16% above the rested ones, unevenly: a coin flip between tiles within ~5%. An
interleaved tuner (three rotating rounds of 5 + 20 ms, median) was measured against it over 5 fresh tunings per
pass (commit 93271af) and was no better. ``--retunes N`` now runs N fresh tunings with each of Triton's one window
(``ConfirmingAutotuner.finalists = 1``) and opengem's confirming tuner (the close finalists timed again after 100 ms
of their own runs, over 100 ms), alternating, and gives each pick's hot time over the hot-fastest tile's.

Run on a GPU: ``PYTHONPATH=src:. python -m benchmarks.diag.jfa_tuning_regimes [--workloads a_,c_1024]
[--passes fwd,dkdv,dq] [--retunes 6]``; writes ``benchmarks/results/jfa_tuning_regimes.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Iterator

import torch

from benchmarks.common import bench_ms, forced_configs, rested_ms, write_results
from benchmarks.jfa import _batch, config_label, jfa_impl, selected
from opengem.ops.triton import jagged_attention as kernels


@contextlib.contextmanager
def fresh_tuning(kernel, finalists: int | None) -> Iterator[None]:
    """Inside the block ``kernel`` tunes afresh with ``finalists`` finalists for its second look (None: the class's
    setting); the class's setting and a fresh cache after."""
    if finalists is not None:
        kernel.finalists = finalists
    kernel.cache.clear()
    try:
        yield
    finally:
        vars(kernel).pop("finalists", None)
        kernel.cache.clear()


def tuner_timings(name: str, run) -> dict[str, float]:
    """Median milliseconds the autotuner's first look (one window each) measured for each candidate of pass ``name``
    in a fresh tune."""
    kernel = kernels.KERNELS[name]
    with fresh_tuning(kernel, finalists=1):
        run()
        torch.cuda.synchronize()
    return {config_label(c): t[0] for c, t in kernel.configs_timings.items()}


def forced_timings(name: str, run) -> dict[str, dict[str, float]]:
    """Each candidate of pass ``name`` forced alone, timed rested and hot."""
    times: dict[str, dict[str, float]] = {}
    for config, error in forced_configs(kernels.KERNELS[name], run):
        label = config_label(config)
        if error is None:
            times[label] = {"rested": rested_ms(run, rep_ms=40), "hot": bench_ms(run, warmup_ms=300, rep_ms=100)}
        print(f"{name} {label}: {times.get(label, type(error).__name__)}", flush=True)
    return times


TUNERS = {"one_window": 1, "confirm": None}  # finalists of the second look (None: the class's setting)


def retuned_picks(name: str, run, retunes: int) -> tuple[dict[str, list[str]], dict[str, list[float]]]:
    """The pick of ``retunes`` fresh tunings of pass ``name`` with each of ``TUNERS`` (alternating), and each tuning's
    seconds."""
    kernel = kernels.KERNELS[name]
    picks: dict[str, list[str]] = {tuner: [] for tuner in TUNERS}
    seconds: dict[str, list[float]] = {tuner: [] for tuner in TUNERS}
    for _ in range(retunes):
        for tuner, finalists in TUNERS.items():
            with fresh_tuning(kernel, finalists):
                run()
                torch.cuda.synchronize()
                picks[tuner].append(config_label(kernel.best_config))
                seconds[tuner].append(round(kernel.bench_time, 2))
    return picks, seconds


def fastest(times: dict[str, float]) -> str:
    return min(times, key=times.get)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="a_power_law_causal,c_1024", type=lambda text: text.split(","))
    parser.add_argument("--passes", default="fwd,dkdv,dq", type=lambda text: text.split(","))
    parser.add_argument("--retunes", default=0, type=int)
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
            if args.retunes:
                row["retuned_picks"], row["tuning_seconds"] = retuned_picks(name, run, args.retunes)
                row["retuned_slowdown"] = {  # each pick's hot time over the hot-fastest tile's
                    tuner: [round(hot.get(p, math.nan) / row["hot_ms_of_hot_pick"], 4) for p in picks]
                    for tuner, picks in row["retuned_picks"].items()
                }
            rows.append(row)
            print({k: row.get(k) for k in ("workload", "pass", "tuner_pick", "rested_pick", "hot_pick",
                                           "hot_ms_of_tuner_pick", "hot_ms_of_hot_pick", "retuned_slowdown",
                                           "tuning_seconds")}, flush=True)
            write_results("jfa_tuning_regimes", rows)
        del b, jfa
        torch.cuda.empty_cache()
    print(f"wrote {write_results('jfa_tuning_regimes', rows)}")


if __name__ == "__main__":
    main()
