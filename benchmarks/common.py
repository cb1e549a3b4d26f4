"""Shared benchmark plumbing: workload lengths, timing, environment, and the results JSON."""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import gc
import json
import math
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile

from opengem.jagged.host import to_device
from opengem.train.bench.timing import WindowTimer, opengem_settings

RESULTS_DIR = Path(__file__).parent / "results"
H100_BF16_PEAK_TFLOPS = 989.0  # dense BF16 peak of H100 SXM / H200 (GEM_SPEC section 8)


def sparsity_lengths(batch: int, max_len: int, sparsity: float, generator: torch.Generator) -> torch.Tensor:
    """GEM_SPEC section 9: s >= 0.5 -> uniform on [(2s-1) Lmax, Lmax]; s < 0.5 -> uniform on [1, 2 s Lmax]."""
    if sparsity >= 0.5:
        low, high = max(1, round((2 * sparsity - 1) * max_len)), max_len
    else:
        low, high = 1, max(1, round(2 * sparsity * max_len))
    return torch.randint(low, high + 1, (batch,), generator=generator)


def power_law_lengths(
    total_tokens: int, low: int, high: int, generator: torch.Generator, exponent: float = 1.5
) -> torch.Tensor:
    """Heavy-tailed history lengths in [low, high] (pdf ~ x^-exponent) until about ``total_tokens``."""
    lengths: list[int] = []
    a = 1.0 - exponent
    while sum(lengths) < total_tokens:
        u = float(torch.rand((), generator=generator))
        x = (low**a + u * (high**a - low**a)) ** (1.0 / a)
        lengths.append(int(min(high, max(low, math.floor(x)))))
    return torch.tensor(lengths)


def offsets_of(lengths: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """int32 offsets of ``lengths`` on ``device``, with their host mirror registered as the data loader does
    (``opengem.jagged.host.to_device``): an op's first call reads them without a device sync."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(lengths, 0)
    return to_device(offsets, device)


def by_name_prefix(items: list, prefixes: list[str] | None, option: str) -> list:
    """The ``items`` (anything with a ``name``) whose names start with one of ``prefixes``, all when None;
    a prefix that matches none is an error naming ``option`` and the names there are."""
    if prefixes is None:
        return list(items)
    unknown = [p for p in prefixes if not any(item.name.startswith(p) for item in items)]
    if unknown:
        raise SystemExit(f"{option}: no workload starts with {unknown}; names: {[item.name for item in items]}")
    return [item for item in items if any(item.name.startswith(p) for p in prefixes)]


def int_tuples(text: str, arity: int, example: str) -> list[tuple[int, ...]]:
    """Command-line lists of sizes: ``"64x32x4x4,128x32x8x3"`` -> ``[(64, 32, 4, 4), (128, 32, 8, 3)]``, each entry
    ``arity`` positive integers joined by ``x``; a malformed entry is refused by name (an argparse type error)."""
    out = []
    for entry in (e for e in text.split(",") if e):
        parts = entry.split("x")
        if len(parts) != arity or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"{entry!r}: want {arity} positive integers joined by x, e.g. {example}")
        out.append(tuple(int(p) for p in parts))
    return out


def bench_ms(fn: Callable[[], Any], warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median milliseconds of ``fn`` on the GPU (CUDA events through ``triton.testing.do_bench``)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


@contextlib.contextmanager
def only_config(tuner, config) -> Iterator[None]:
    """Inside the block, Triton autotuner ``tuner`` runs ``config`` alone (its tuned picks forgotten before and
    after)."""
    every = list(tuner.configs)
    tuner.configs = [config]
    tuner.cache.clear()
    try:
        yield
    finally:
        tuner.configs = every
        tuner.cache.clear()


def tuner_config_label(config) -> str:
    """A Triton config as ``BLOCK_M128_BLOCK_N64_w8_s3`` (its kwargs, warps, stages), ``_r168`` appended under a
    register cap."""
    label = "_".join(f"{k}{v}" for k, v in config.kwargs.items()) + f"_w{config.num_warps}_s{config.num_stages}"
    return label + (f"_r{config.maxnreg}" if config.maxnreg else "")


def forced_configs(tuner, fn: Callable[[], Any], configs: list | None = None) -> Iterator[tuple[Any, Exception | None]]:
    """Each of ``configs`` (by default ``tuner``'s candidates) forced alone on autotuner ``tuner`` and ``fn`` run once
    with it (compiled, synchronized): yields ``(config, None)`` with the config still forced, for the caller to time
    ``fn``, or ``(config, error)`` where it failed (pruned for this shape, out of shared memory: not a candidate)."""
    for config in list(tuner.configs if configs is None else configs):
        with only_config(tuner, config):
            try:
                fn()
                torch.cuda.synchronize()
            except Exception as err:  # noqa: BLE001
                yield config, err
                continue
            yield config, None


def fastest_forced(tuner, fn: Callable[[], Any]) -> tuple[float, str]:
    """``bench_ms`` of ``fn`` with each of autotuner ``tuner``'s candidates forced alone: the fastest time and its
    config (:func:`tuner_config_label`). The strongest-peer check of a tuned baseline: the one-window timings of
    close tiles were a coin flip (session 27: a pick 19% slower than the best tile under load)."""
    best: tuple[float, str] = (math.inf, "")
    for config, error in forced_configs(tuner, fn):
        if error is None:
            best = min(best, (bench_ms(fn), tuner_config_label(config)))
    return best


def rested_ms(fn: Callable[[], Any], rep_ms: int, rest_s: float = 1.0) -> float:
    """``bench_ms`` over a ``rep_ms`` window after ``rest_s`` seconds with the card idle. An H200 under a dense
    attention kernel reaches its power cap within ~100 ms and lowers its SM clock (1980 -> 1400-1900 MHz, throttle
    reason SW power cap, session 24): a short window after a rest times the kernel at full clock, as tuners do."""
    torch.cuda.synchronize()
    time.sleep(rest_s)
    return bench_ms(fn, warmup_ms=5, rep_ms=rep_ms)


def interleaved_ms(
    fns: dict[str, Callable[[], Any]], rounds: int = 5, bench: Callable[[Callable[[], Any]], float] = bench_ms
) -> dict[str, list[float]]:
    """``bench`` of every ``fns`` entry in ``rounds`` rounds, each round starting one entry later (A B C, B C
    A, C A B, ...): a slow drift of the card (clocks falling as it heats) spreads over all entries instead of
    landing on the ones timed last. Returns each entry's times, one per round, in round order."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds if names else 0):
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name].append(bench(fns[name]))
    return times


def paired_speedup(baseline: list[float], variant: list[float]) -> float:
    """Median over rounds of baseline / variant, each ratio from one round of `interleaved_ms`."""
    if len(baseline) != len(variant) or not baseline:
        raise ValueError(f"need equally many rounds, got {len(baseline)} and {len(variant)}")
    return statistics.median(b / v for b, v in zip(baseline, variant))


def kernel_ms(fn: Callable[[], Any], calls: int = 5, name_width: int = 60) -> dict[str, float]:
    """Device milliseconds per call of each kernel ``fn`` launches (names cut to ``name_width``
    characters), most first."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:name_width]] += event.device_time_total / 1000 / calls
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def bench_graph_ms(
    fn: Callable[[], Any], rep_ms: int = 100, replays: int = 10, on_error: Callable[[str], None] | None = None
) -> float | None:
    """Median milliseconds of ``fn`` replayed from a CUDA graph of calls captured back to back (as
    ``triton.testing.do_bench_cudagraph``), so host overhead (checks, dispatch, launches) drops out and only
    device time is left; None without a GPU, for a ``fn`` that syncs, or when capture fails (``on_error`` gets
    why).

    ``fn`` must have run eagerly before (compiles, autotuning and host caches warm). The capture is done
    here rather than by do_bench_cudagraph so that a failed one can be undone (see _undo_failed_capture)."""
    if not torch.cuda.is_available():
        return None
    device, pool = torch.cuda.current_device(), torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        try:
            debug_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")  # a call that syncs cannot be captured: refuse it before
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode(debug_mode)
            repeat = max(1, int(rep_ms / max(_event_ms(fn, 5) / 5, 1e-3)))
        except Exception as exc:  # noqa: BLE001 - no graph figure for this method
            return _declined(on_error, "before capture", exc)
        graph = torch.cuda.CUDAGraph()
        gc_was_enabled = gc.isenabled()
        gc.disable()  # a Triton kernel finalized by the GC would unload its module mid-capture
        try:
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                for _ in range(repeat):
                    fn()
        except Exception as exc:  # noqa: BLE001
            _undo_failed_capture(device, pool)
            return _declined(on_error, "capture", exc)
        finally:
            if gc_was_enabled:
                gc.enable()
        times = [_event_ms(graph.replay, 1) / repeat for _ in range(replays)]
    return statistics.median(times)


def _declined(on_error: Callable[[str], None] | None, stage: str, exc: BaseException) -> None:
    if on_error is not None:
        on_error(f"{stage}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200])


def _event_ms(fn: Callable[[], Any], calls: int) -> float:
    """Milliseconds of ``calls`` back-to-back calls on the current stream (CUDA events, one sync)."""
    timer = WindowTimer(torch.device("cuda", torch.cuda.current_device()))
    timer.start()
    for _ in range(calls):
        fn()
    return timer.stop() * 1e3


def _undo_failed_capture(device: int, pool: tuple[int, int]) -> None:
    """``CUDAGraph.capture_end`` raises before its clean-up when the capture broke, which leaves the caching
    allocator recording to the graph's pool (an H200 run ran out of its 140 GB a few methods after such
    failures) and the CUDA generator in capture mode (every later random op fails with "Offset increment
    outside graph capture"). Both are put back here (seen working on torch 2.11)."""
    with contextlib.suppress(Exception):
        torch.cuda.synchronize()  # raises, and so clears, an error the capture left
    try:
        torch._C._cuda_endAllocateToPool(device, pool)
    except RuntimeError:
        pass  # capture_end got past it: the graph releases its own pool
    else:
        torch._C._cuda_releasePool(device, pool)
    generator = torch.cuda.default_generators[device]
    generator.graphsafe_set_state(generator.clone_state())  # a fresh state is not capturing


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64 (METHOD.md); NaN anywhere gives inf."""
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return math.inf
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


def environment() -> dict[str, Any]:
    commit = os.environ.get("OPENGEM_GIT_COMMIT", "")  # the GPU machine gets a copy of the tree without .git
    try:
        measured = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False, cwd=Path(__file__).parent
        ).stdout.strip()
        commit = commit or (measured if len(measured) >= 7 and measured != "HEAD" else "")
    except OSError:
        pass
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "git_commit": commit or "unknown",
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "opengem_settings": opengem_settings(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def write_results(family: str, rows: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> Path:
    """Write ``benchmarks/results/<family>.json`` with the environment and every row."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{family}.json"
    payload = {"family": family, "environment": environment(), "rows": rows, **(extra or {})}
    path.write_text(json.dumps(payload, indent=2))
    return path


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns} if rows else {}
    print("  ".join(c.ljust(widths.get(c, len(c))) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)
