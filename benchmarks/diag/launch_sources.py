"""Diagnostic (issue 10): which op and which source line launch each of a compiled step's device kernels.

gem-small b2048 launches 2,705 kernels a step (session 49), among them 402 memsets, 154 fp32 ``reduce_kernel`` sums
and ~120 eager copies, each a launch the host pays for whatever its GPU time. The kernel table names the kernels,
not their callers. This profiles compiled steps (built and warmed as ``opengem bench train --compile``) with Python
stacks and groups every device event by the kernel, the chain of ops around its launch (innermost first: e.g.
``aten::fill_ < aten::zero_ < aten::zeros``) and the innermost source line of opengem or of Inductor's generated
code. Where no Python frame is recorded the op chain names the caller: autograd's C++ thread runs the backward
(``autograd::engine::evaluate_function: ...``), and a compiled region's launches sit under
``## Call CompiledFxGraph <key> ##``, the key naming its entry in Inductor's cache (session 50, H100: no frames were
recorded for them).

It also reports each op's and each Python function's self CPU time a step: set against another process's, it says
where a host-paced step spends its time (gem-large b256 idles the GPU 4-76 ms a step, by the machine's host). On
the H100 (session 51, torch 2.11) the Python-function table came back empty, while it fills on the CPU: the op table
is the one to read there, and `benchmarks.diag.op_host_time` names the Python functions inside opengem's ops.
On the CPU (no device events) every leaf op counts as a launch, so the grouping runs in the tests.

    PYTHONPATH=src:. python -m benchmarks.diag.launch_sources [--preset gem-small] [--batch-size 2048] [--steps 2]
        [--out benchmarks/results/launch_sources_gem-small_b2048.json]
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.autograd import DeviceType

# Frames worth naming: our code, or the graphs Inductor generated (their files live under its cache folder).
_SOURCE_MARKERS = ("opengem/", "torchinductor")
_CHAIN_DEPTH = 5


def kernel_kind(name: str) -> str:
    """A short name for a device event: a memset / memcpy as such, a templated kernel by its name before ``<``."""
    if name.startswith(("Memset", "Memcpy")):
        return name
    short = name.removeprefix("void ").split("<", 1)[0].split("(", 1)[0]
    return short[:90]


def _is_python(event: Any) -> bool:
    return bool(getattr(event, "is_python_function", False))


def op_chain(event: Any) -> str:
    """The names of ``event`` and its enclosing ops, innermost first (up to five; Python frames and profiler step
    markers left out)."""
    names = []
    while event is not None and len(names) < _CHAIN_DEPTH:
        if not _is_python(event) and not event.name.startswith("ProfilerStep"):
            names.append(event.name[:80])
        event = event.cpu_parent
    return " < ".join(names)


def source_line(event: Any) -> str:
    """The innermost frame of opengem's code or of Inductor's generated graphs around ``event``, else the innermost
    Python frame (built-in methods aside); ``"(no Python frame recorded)"`` when there is none. Frames come
    from the Python tracer (enclosing events named ``file(line): function``, the line the function starts on) or,
    where a profiler records them instead, from an op's ``stack``."""
    fallback = None
    while event is not None:
        frames = [event.name] if _is_python(event) else list(event.stack)
        for frame in frames:
            if any(marker in frame for marker in _SOURCE_MARKERS):
                return frame
            if not frame.startswith("<built-in"):
                fallback = fallback or frame
        event = event.cpu_parent
    return fallback or "(no Python frame recorded)"


def launch_groups(events: Iterable[Any], steps: int) -> list[dict[str, Any]]:
    """Device events of ``steps`` profiled steps grouped by (kernel, op chain, source line), most launched first.

    A CPU op's ``kernels`` are the device events whose launch the profiler linked to it (its innermost enclosing
    op). With no device event at all (a CPU run), each leaf op (no child event; Python frames are not ops) counts as
    one launch."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    events = [e for e in events if e.device_type == DeviceType.CPU]
    launched = [(e, kernel) for e in events for kernel in e.kernels]
    if launched:
        rows = [(kernel_kind(kernel.name), e, kernel.duration) for e, kernel in launched]
    else:
        rows = [(e.name, e, 0.0) for e in events if not e.cpu_children and not _is_python(e)]
    grouped: dict[tuple[str, str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for kind, event, duration_us in rows:
        entry = grouped[kind, op_chain(event), source_line(event)]
        entry[0] += 1
        entry[1] += duration_us
    table = [{"kernel": kind, "ops": chain, "source": source, "per_step": count / steps,
              "device_ms_per_step": total_us / steps / 1e3}
             for (kind, chain, source), (count, total_us) in grouped.items()]  # fmt: skip
    return sorted(table, key=lambda row: (-row["per_step"], row["kernel"], row["ops"]))


def launches_by_kind(groups: list[dict[str, Any]]) -> dict[str, float]:
    """Launches a step per kernel kind, most first."""
    totals: dict[str, float] = collections.Counter()
    for row in groups:
        totals[row["kernel"]] += row["per_step"]
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def host_time(events: Iterable[Any], steps: int, top: int = 40) -> dict[str, dict[str, float]]:
    """Self CPU ms a step of the ``top`` heaviest ops (``"ops"``) and Python functions (``"python"``): where the host
    spends a step, to set one process against another (the Python tracer slows Python code, so compare shares)."""
    totals: dict[str, dict[str, float]] = {"ops": collections.Counter(), "python": collections.Counter()}
    for event in events:
        if event.device_type == DeviceType.CPU:
            totals["python" if _is_python(event) else "ops"][event.name[:120]] += event.self_cpu_time_total
    return {kind: {name: us / steps / 1e3 for name, us in sorted(table.items(), key=lambda kv: -kv[1])[:top]}
            for kind, table in totals.items()}


def profile_launches(step: Callable[[], None], steps: int,
                     sync: Callable[[], None]) -> tuple[list[dict[str, Any]], dict[str, dict[str, float]]]:
    """Run ``step`` ``steps`` times under the profiler with Python stacks: :func:`launch_groups` and
    :func:`host_time` of them."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, with_stack=True) as profiler:
        for _ in range(steps):
            step()
        sync()
    events = profiler.events()
    return launch_groups(events, steps), host_time(events, steps)


def main() -> None:
    from benchmarks.diag.compiled_learner import (
        diagnostic_parser,
        parse_diagnostic_args,
        warmed_learner,
        write_diagnostic,
    )

    parser = diagnostic_parser(__doc__.splitlines()[0], "gem-small", 2048, "profiled steps (after the warm-up)",
                               "benchmarks/results/launch_sources_gem-small_b2048.json")  # fmt: skip
    parser.add_argument("--top", type=int, default=60, help="groups printed (all are written)")
    args = parse_diagnostic_args(parser, "launch_sources groups device kernels by their callers")
    options, learner, batches = warmed_learner(args.preset, args.batch_size, args.steps, args.overrides)
    queue = iter(batches)
    groups, host = profile_launches(lambda: learner.step(next(queue)), args.steps, torch.cuda.synchronize)
    kinds = launches_by_kind(groups)
    print(f"{sum(kinds.values()):.0f} device events a step in {len(groups)} groups; by kernel:")
    for kind, count in list(kinds.items())[:25]:
        print(f"  {count:7.1f}  {kind}")
    print("per step, device ms, kernel | ops (innermost first) | source")
    for row in groups[:args.top]:
        print(f"{row['per_step']:6.1f} {row['device_ms_per_step']:7.3f}  "
              f"{row['kernel']} | {row['ops']} | {row['source']}")
    for kind, table in host.items():
        print(f"host self-CPU ms a step, heaviest {kind}:")
        for name, ms in list(table.items())[:15]:
            print(f"  {ms:8.3f}  {name}")
    write_diagnostic("launch_sources", args, options, launches_by_kernel=kinds, groups=groups, host_ms_per_step=host)


if __name__ == "__main__":
    main()
