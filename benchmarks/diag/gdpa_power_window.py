"""Diagnostic (issue 4): GDPA's forward through a long window on a power-capped card, from rested to sustained.

`benchmarks.gdpa` times each variant in `triton.testing.do_bench`'s window (25 ms of warm-up, 100 ms timed). Under
GDPA's heavy rows an H100 reaches its 700 W cap within ~0.2-0.7 s and then runs a ~1 s limiter cycle: ~0.6 s at
1,740-1,770 MHz, ~0.4 s at 1,500-1,560 (session 48's clock logs), so one 250 ms slice in every second runs 15-17%
slower. A 125 ms window reads wherever it lands: (b) K/V 256's forward read 403.1, 385.1 and 339.0 TFLOP/s in three
runs of the one kernel (sessions 45, 46, 48). A training step meets the sustained state.

Per workload, after ``--rest`` seconds idle, the op's forward runs back to back for ``--seconds`` (no grad), each call
between two CUDA events. Reported: the median call in the first 125 ms (the benchmark window's length), in each
``--slice-ms`` slice, and over the second half ("sustained": median and mean; the mean counts the dips). The host
runs ahead by the launch queue, so a window outlasts ``--seconds`` (4.6-10.7 s for 4 s, session 48). For
self-attention workloads JFA's forward also runs alone (the clock its own power draw sets, as in a run of only that
kernel), then interleaved call by call with GDPA's, so both meet one clock; the ratios of the sustained figures are
issue 4's forward-against-JFA check in the sustained state.
Start times are wall-clock (``time.time()`` at the first event plus the events' offsets) so they line up with the
chain's clock log.

    PYTHONPATH=src:. python -m benchmarks.diag.gdpa_power_window
        [--workloads "b cross Q<=2048 KV=256,a self L=2048 s=1.0"] [--seconds 4] [--rest 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import by_name_prefix, environment
from benchmarks.gdpa import Workload, _jfa_peer, _ours, _tensors, workload_flops, workloads

BENCH_WINDOW_MS = 125.0  # do_bench's 25 ms of warm-up and 100 ms timed: what benchmarks.gdpa reads
DEFAULT_WORKLOADS = "b cross Q<=2048 KV=256,a self L=2048 s=1.0"


def window_medians(starts_ms: Sequence[float], durations_ms: Sequence[float], slice_ms: float,
                   first_ms: float = BENCH_WINDOW_MS) -> dict[str, Any]:
    """Medians of ``durations_ms`` by the calls' ``starts_ms`` (from the window's start): the first ``first_ms``,
    each ``slice_ms`` slice (``[start, median, calls]``), and the second half of the window ("sustained")."""
    if len(starts_ms) != len(durations_ms) or not starts_ms:
        raise ValueError(f"need one duration a start and at least one call, got {len(starts_ms)} starts and "
                         f"{len(durations_ms)} durations")
    if slice_ms <= 0:
        raise ValueError(f"slice_ms must be > 0, got {slice_ms}")
    end = max(s + d for s, d in zip(starts_ms, durations_ms))
    slices: dict[int, list[float]] = {}
    for s, d in zip(starts_ms, durations_ms):
        slices.setdefault(int(s // slice_ms), []).append(d)
    first = [d for s, d in zip(starts_ms, durations_ms) if s < first_ms]
    second_half = [d for s, d in zip(starts_ms, durations_ms) if s >= end / 2]
    return {
        "first_window_ms": statistics.median(first) if first else None,
        "sustained_ms": statistics.median(second_half) if second_half else None,
        # the mean counts the limiter's dips (the H100 dropped the clock ~15% for a quarter of every second, session
        # 48): a training run's throughput is the mean, the median shows the undipped state
        "sustained_mean_ms": statistics.fmean(second_half) if second_half else None,
        "slices": [[k * slice_ms, statistics.median(v), len(v)] for k, v in sorted(slices.items())],
        "calls": len(durations_ms),
        "window_ms": end,
    }


def timeline(fns: dict[str, Callable[[], Any]], seconds: float) -> dict[str, tuple[list[float], list[float]]]:
    """Every ``fns`` entry called in turn until ``seconds`` of host time have passed (the host runs ahead by the
    launch queue), each call between CUDA events. Returns per entry (start offsets, durations) in ms from the
    window's first event, and under ``"wall"`` the host's ``time.time()`` at that first event."""
    origin = torch.cuda.Event(enable_timing=True)
    events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {name: [] for name in fns}
    torch.cuda.synchronize()
    wall = time.time()
    origin.record()
    stop = time.perf_counter() + seconds
    with torch.no_grad():
        while time.perf_counter() < stop:
            for name, fn in fns.items():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                events[name].append((start, end))
    torch.cuda.synchronize()
    out: dict[str, Any] = {name: ([origin.elapsed_time(s) for s, _ in pairs], [s.elapsed_time(e) for s, e in pairs])
                           for name, pairs in events.items()}
    out["wall"] = wall
    return out


def measure(w: Workload, seconds: float, rest: float, slice_ms: float) -> dict[str, Any]:
    """GDPA's forward alone, then (self-attention) JFA's alone and the two interleaved, each window after ``rest`` s
    idle. Alone, each kernel meets the clock its own power draw sets, as a run of only that kernel would;
    interleaved, both meet one clock."""
    t = _tensors(w, "cuda")
    fns = {"gdpa": _ours(w, t)}
    if w.self_attention:
        fns["jfa"] = _jfa_peer(w, t)
    with torch.no_grad():
        for fn in fns.values():  # tune and compile outside the windows
            fn()
    flops = workload_flops(w)[0]
    row: dict[str, Any] = {"workload": w.name, "fwd_flops": flops}
    windows = {"gdpa_alone": {"gdpa": fns["gdpa"]}}
    if "jfa" in fns:
        windows["jfa_alone"] = {"jfa": fns["jfa"]}
        windows["interleaved"] = fns
    for window, chosen in windows.items():
        time.sleep(rest)
        times = timeline(chosen, seconds)
        row[window] = {"wall_start": times["wall"]}
        for name in chosen:
            stats = window_medians(*times[name], slice_ms)
            for key in ("first_window", "sustained", "sustained_mean"):
                ms = stats[f"{key}_ms"]
                stats[f"{key}_tflops"] = None if ms is None else flops / ms / 1e9
            row[window][name] = stats
        if {"gdpa", "jfa"} <= set(chosen):  # the interleaved window
            gdpa, jfa = row[window]["gdpa"], row[window]["jfa"]
            row[window]["x_fwd_jfa_sustained"] = jfa["sustained_ms"] / gdpa["sustained_ms"]
            row[window]["x_fwd_jfa_first_window"] = jfa["first_window_ms"] / gdpa["first_window_ms"]
    if "jfa_alone" in row:
        gdpa, jfa = row["gdpa_alone"]["gdpa"], row["jfa_alone"]["jfa"]
        row["x_fwd_jfa_alone_sustained"] = jfa["sustained_ms"] / gdpa["sustained_ms"]
        row["x_fwd_jfa_alone_sustained_mean"] = jfa["sustained_mean_ms"] / gdpa["sustained_mean_ms"]
    return row


def _summary(row: dict[str, Any]) -> str:
    lines = [row["workload"]]
    for window in ("gdpa_alone", "jfa_alone", "interleaved"):
        if window not in row:
            continue
        for name, stats in row[window].items():
            if isinstance(stats, dict):
                lines.append(f"  {window:11s} {name:4s} first 125 ms {stats['first_window_ms']:.3f} ms "
                             f"({stats['first_window_tflops']:.1f} TFLOP/s), sustained {stats['sustained_ms']:.3f} "
                             f"ms ({stats['sustained_tflops']:.1f}; mean {stats['sustained_mean_ms']:.3f} ms, "
                             f"{stats['sustained_mean_tflops']:.1f}), {stats['calls']} calls in "
                             f"{stats['window_ms']:.0f} ms")
        if "x_fwd_jfa_sustained" in row[window]:
            lines.append(f"  forward x JFA: sustained {row[window]['x_fwd_jfa_sustained']:.3f}, first 125 ms "
                         f"{row[window]['x_fwd_jfa_first_window']:.3f}")
    if "x_fwd_jfa_alone_sustained" in row:
        lines.append(f"  forward x JFA, each alone: sustained median {row['x_fwd_jfa_alone_sustained']:.3f}, mean "
                     f"{row['x_fwd_jfa_alone_sustained_mean']:.3f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", type=lambda text: text.split(","), default=DEFAULT_WORKLOADS.split(","))
    parser.add_argument("--seconds", type=float, default=4.0, help="length of each window")
    parser.add_argument("--rest", type=float, default=5.0, help="idle seconds before each window")
    parser.add_argument("--slice-ms", type=float, default=250.0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.rest < 0:
        parser.error(f"--seconds must be > 0 and --rest >= 0, got {args.seconds} and {args.rest}")
    rows = []
    for w in by_name_prefix(workloads(quick=False), args.workloads, "--workloads"):
        rows.append(measure(w, args.seconds, args.rest, args.slice_ms))
        print(_summary(rows[-1]), flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gdpa_power_window.json").write_text(
            json.dumps({"environment": environment(), "args": vars(args) | {"out": str(args.out)}, "rows": rows},
                       indent=1))
    return rows


if __name__ == "__main__":
    main()
