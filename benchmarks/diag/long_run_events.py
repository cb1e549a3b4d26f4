"""What a long training run meets that a short benchmark window does not (session 13: issue 6's 2000-step
gem-small run reached step ~1500 in 590 s, ~0.33 s a step, while `bench train` timed a 153 ms median step
and a 303 ms mean whose 20 steps held a 2.7 s and a 0.56 s stall).

Trains the preset like the trainer does (`LocalRun`: compiled blocks, the loader in the loop) for
``--steps`` steps, each timed between two synchronizations, and records per step: milliseconds, the
batch's longest history and token count, and the host events of `opengem.train.bench.watch` (autotuner
keys met, by kernel and key; Triton kernels loaded; Dynamo graphs; collection time). Dynamo's recompile
reasons go to the log (``TORCH_LOGS=recompiles``). Then one held-out evaluation, timed twice (the first
compiles the no-grad graphs). The summary gives per block of 50 steps the stalled steps and their time.

    PYTHONPATH=src:. python -m benchmarks.diag.long_run_events [--steps 300] [--set low_precision_mlp=fp8_rowwise]

Writes ``benchmarks/results/long_run_events.json`` every 25 steps (a run cut short keeps what it did).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks.common import write_results
from opengem.ops.triton.tuning import tuned_key_names
from opengem.train.bench.timing import synchronize
from opengem.train.bench.watch import events_report, host_events
from opengem.train.config import load_config
from opengem.train.trainer import LocalRun, evaluate

BLOCK = 50


def summarize(rows: list[dict[str, Any]], block: int = BLOCK) -> list[dict[str, Any]]:
    """Per block of ``block`` steps: how many stalled (tuned, loaded or compiled something), their total ms,
    the median calm step, and the new keys / kernels / graphs met."""
    out = []
    for first in range(0, len(rows), block):
        part = rows[first:first + block]
        stalled = [r for r in part if r["autotuner_keys"] or r["kernels_loaded"] or r["dynamo_graphs"]]
        calm = [r["ms"] for r in part if r not in stalled]
        out.append({
            "steps": f"{part[0]['step']}-{part[-1]['step']}", "stalled_steps": len(stalled),
            "stalled_ms": round(sum(r["ms"] for r in stalled), 1),
            "calm_median_ms": round(statistics.median(calm), 2) if calm else None,
            "mean_ms": round(statistics.fmean(r["ms"] for r in part), 2),
            "autotuner_keys": sum(r["autotuner_keys"] for r in part),
            "kernels_loaded": sum(r["kernels_loaded"] for r in part),
            "dynamo_graphs": sum(r["dynamo_graphs"] for r in part),
        })
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gem-small")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting")
    parser.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation at the end")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    torch._logging.set_logs(recompiles=True)
    config = load_config(args.preset, overrides=[f"steps={args.steps}", "baseline=false", *args.set])
    run = LocalRun(config)
    learner, device = run.learners["model"], run.device
    stream = run.batches(0)
    rows: list[dict[str, Any]] = []
    keys = tuned_key_names()

    def save(evaluations: list[dict[str, Any]] | None = None) -> None:
        write_results("long_run_events", rows, {
            "preset": config.preset, "batch_size": config.batch_size, "overrides": args.set,
            "low_precision_mlp": config.low_precision_mlp, "summary": summarize(rows),
            "evaluations": evaluations or [], "complete": evaluations is not None})

    for step in range(1, args.steps + 1):
        fetch = time.perf_counter()
        batch = next(stream)
        data_ms = 1e3 * (time.perf_counter() - fetch)
        lengths = batch.history_age.lengths_host()
        before = host_events()
        synchronize(device)
        begin = time.perf_counter()
        learner.step(batch.to(device, non_blocking=True))
        synchronize(device)
        ms = 1e3 * (time.perf_counter() - begin)
        now_keys = tuned_key_names()
        rows.append({"step": step, "ms": round(ms, 2), "data_ms": round(data_ms, 2), "max_len": int(lengths.max()),
                     "tokens": int(lengths.sum()), **events_report(before, limit=8),
                     "new_keys": sorted(now_keys - keys)[:12]})
        keys = now_keys
        if rows[-1]["autotuner_keys"] or rows[-1]["kernels_loaded"] or rows[-1]["dynamo_graphs"] or ms > 1000:
            print(f"step {step}: {ms:.0f} ms, max_len {rows[-1]['max_len']}, keys {rows[-1]['autotuner_keys']}, "
                  f"kernels {rows[-1]['kernels_loaded']}, graphs {rows[-1]['dynamo_graphs']}: "
                  f"{rows[-1]['new_keys'][:3]} {rows[-1]['kernels'][:3]}", flush=True)
        if step % 25 == 0:
            save()
            print(f"step {step}: {summarize(rows)[-1]}", flush=True)
    evaluations = []
    if not args.no_eval:
        holdout = run.holdout()
        for attempt in range(2):
            before = host_events()
            begin = time.perf_counter()
            metrics = evaluate(*run.predictions(holdout))
            evaluations.append({"attempt": attempt, "s": round(time.perf_counter() - begin, 2),
                                **events_report(before, limit=8), "metrics": metrics})
            print(f"evaluation {attempt}: {evaluations[-1]['s']} s", flush=True)
    save(evaluations)
    return {"summary": summarize(rows), "evaluations": evaluations}


if __name__ == "__main__":
    main()
