"""Where GDPA's op time goes on short ragged batches: issue 4's (a) L256 s0.5 forward took 0.816 ms in session 20
against 0.298 ms for its tuned kernel launch alone and 0.437 ms for the op in session 10 (its bar, 3x the compiled
padded reference, met then and missed now), while L256 s1.0's op ran at its launch's time (0.534 / 0.516 ms).

For each workload (the (a) L256 / L512 ones of ``benchmarks.gdpa``), forward and backward:
- ``op_ms``: the op through ``opengem.ops.gdpa`` as the benchmark times it (``do_bench``: host time shows once it
  exceeds the device's),
- ``graph_ms``: the same calls replayed from a CUDA graph (device time only; None where a call syncs),
- ``host_ms``: host time per call, enqueued back to back without a sync (the device catches up at the end),
- ``syncs``: whether a call synchronizes with the device (``torch.cuda.set_sync_debug_mode("error")``),
- the forward again with every load on pointers (``TMA_PASSES`` empty), the profiler's top host ops of 5 calls,
  cProfile's top Python functions (own time per call), and the host time and cProfile of the forward with autograd
  recording (session 21: 0.86 ms a call at L256 s0.5 against 0.33 ms without; this CPU's torch spends ~0.1 ms on
  the custom op's autograd glue, so most of that gap is not yet explained),
- ``fwd_kernels``: the profiler's device kernels of 5 forward calls (name, device ms per call): whether anything
  but GDPA's kernel runs (session 23: the op 0.05-0.35 ms over the tuner's kernel time at L512),
- ``fwd_op_ms_by_rep``: the op timed over 20 ms (the tuner's window) and 100 ms (the benchmark's) after 1 s idle,
  beside ``fwd_kernel_ms`` (the profiler's figure): a card that clocks down under a longer window shows it here,
- ``jfa_fwd`` and ``jfa_fwd_python_profile``: JFA's forward on the same inputs (session 24: at L256 s0.5 GDPA's op
  took 0.304 ms against its 0.248 ms kernel, JFA's 0.272: which host path is shorter, and where the time goes).

Run on a GPU: ``PYTHONPATH=src:. python -m benchmarks.diag.gdpa_small_overhead``; writes
``benchmarks/results/gdpa_small_overhead.json``.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import bench_graph_ms, bench_ms, rested_ms, write_results
from benchmarks.gdpa import _jfa_peer, _ours, _tensors, workloads
from opengem.ops.triton import gdpa as host

NAMES = ("a self L=256 s=0.5", "a self L=256 s=1.0", "a self L=512 s=0.5", "a self L=512 s=1.0")
HOST_CALLS = 200


def _host_ms(fn: Callable[[], Any]) -> float:
    """Mean host milliseconds per call, calls enqueued back to back (no sync between them)."""
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(HOST_CALLS):
        fn()
    elapsed = time.perf_counter() - began
    torch.cuda.synchronize()
    return elapsed * 1e3 / HOST_CALLS


def _syncs(fn: Callable[[], Any]) -> str | None:
    """The error a synchronizing call raises under sync debug mode "error", else None."""
    torch.cuda.synchronize()
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return None
    except RuntimeError as exc:
        return str(exc).splitlines()[0][:300]
    finally:
        torch.cuda.set_sync_debug_mode(mode)
        torch.cuda.synchronize()


def _top_host_ops(fn: Callable[[], Any], calls: int = 5, top: int = 12) -> list[tuple[str, float]]:
    """(name, host ms per call) of the profiler's CPU ops with the most self time."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return [(e.key[:80], e.self_cpu_time_total / 1e3 / calls) for e in rows]


def _device_kernels(fn: Callable[[], Any], calls: int = 5) -> list[tuple[str, float]]:
    """(kernel name, device ms per call) of every device kernel ``calls`` calls of ``fn`` ran, longest first."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda e: -e.device_time_total)
    return [(e.key[:100], e.device_time_total / 1e3 / calls) for e in rows]


def _ms_by_rep(fn: Callable[[], Any]) -> dict[str, float]:
    """``fn``'s median ms over a 20 ms and a 100 ms window, each after 1 s with the card idle."""
    return {f"rep{rep}": rested_ms(fn, rep) for rep in (20, 100)}


def _python_profile(fn: Callable[[], Any], calls: int = 100, top: int = 30) -> list[dict[str, Any]]:
    """cProfile's functions with the most own time over ``calls`` calls (microseconds per call): which Python
    (ours, torch's custom-op dispatch, Triton's launcher) the host time goes to."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, callers)
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    return [{"function": f"{name} ({file.rsplit('/', 2)[-1]}:{line})", "calls_per_call": n / calls,
             "own_us": own * 1e6 / calls, "cumulative_us": cumulative * 1e6 / calls}
            for (file, line, name), (_, n, own, cumulative, _) in rows]


def _measure(fn: Callable[[], Any]) -> dict[str, Any]:
    fn()
    torch.cuda.synchronize()
    return {"op_ms": bench_ms(fn), "graph_ms": bench_graph_ms(fn), "host_ms": _host_ms(fn), "syncs": _syncs(fn)}


def main() -> None:
    rows = []
    for w in (w for w in workloads(quick=False) if w.name in NAMES):
        t = _tensors(w, "cuda")
        forward = _ours(w, t)
        leaves = (t["q"], t["k"], t["v"])
        out = forward()
        grad = torch.randn_like(out)
        with torch.no_grad():
            row: dict[str, Any] = {"workload": w.name, "fwd": _measure(forward)}
        row["bwd"] = _measure(lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True))
        with torch.no_grad():
            row["fwd_top_host_ops"] = _top_host_ops(forward)
            row["fwd_kernels"] = _device_kernels(forward)
            row["fwd_kernel_ms"] = sum(ms for _, ms in row["fwd_kernels"])
            row["fwd_op_ms_by_rep"] = _ms_by_rep(forward)
            row["fwd_python_profile"] = _python_profile(forward)
            jfa_forward = _jfa_peer(w, t)  # the same forward through JFA: whose host time is shorter, and where
            jfa_forward()
            row["jfa_fwd"] = _measure(jfa_forward)
            row["jfa_fwd_python_profile"] = _python_profile(jfa_forward)
            passes = host.TMA_PASSES
            host.TMA_PASSES = frozenset()  # pointer loads everywhere (other candidates: tuned anew)
            try:
                row["fwd_pointer_loads"] = _measure(forward)
            finally:
                host.TMA_PASSES = passes
        row["fwd_with_grad_host_ms"] = _host_ms(forward)  # the autograd path: torch's custom-op autograd glue
        row["fwd_with_grad_python_profile"] = _python_profile(forward)  # session 21: 0.86 ms against 0.33 no-grad
        bucket = host._bucket(int(w.q_lengths.max()))
        row["tuning"] = [r for r in host.tuning_report() if r["pass"] == "fwd" and r["bucket_q"] == bucket]
        rows.append(row)
        print(row, flush=True)
    write_results("gdpa_small_overhead", rows)


if __name__ == "__main__":
    main()
