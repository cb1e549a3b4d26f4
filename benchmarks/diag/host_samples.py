"""Diagnostic (issue 10): where the host's time goes in steady training steps, sampled by py-spy instead of traced.

cProfile and the torch profiler run inside the process and slow its Python, so they move the time they measure
(session 53: 51.8 ms of opengem op calls a gem-large step under cProfile, 7.3 ms of it the profiler's own). py-spy
reads the process's stacks from outside at a fixed rate and, with ``--nonblocking``, never pauses it, so a
host-paced step keeps its pace (``--native`` excepted: see :func:`sample_self`). After the warm-up (compiled,
batches staged on the device, as ``launch_ab``), the process attaches py-spy to itself for ``--seconds`` and runs
steps until py-spy detaches. py-spy records a thread only while it is active (not waiting), so each sample is
``1 / rate`` s of that thread's active time. Each sample goes into one part of the step by its stack
(:func:`part_of`), per thread: the forward and the optimizer run on the main thread, the backward on autograd's
device thread. A thread waiting for the GPU inside the CUDA driver may spin rather than sleep, and then counts as
active at the line that waits (the top lines of each part name them; ``--native`` names the library).

    PYTHONPATH=src:. python -m benchmarks.diag.host_samples [--preset gem-large] [--batch-size 256] [--steps 4]
        [--seconds 20] [--rate 200] [--native] [--gil] [--py-spy PATH]
        [--out benchmarks/results/host_samples_gem-large_b256.json]

py-spy (the ``test`` extra installs it) needs the right to read this process's memory (``ptrace``), which
containers without ``CAP_SYS_PTRACE`` may refuse: the error then says so.
"""

from __future__ import annotations

import collections
import itertools
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch._inductor.runtime.cache_dir_utils import cache_dir

from benchmarks.diag.compiled_learner import (
    diagnostic_parser,
    parse_diagnostic_args,
    timed,
    warmed_learner,
    write_diagnostic,
)
from opengem.train.bench.host_speed import host_speed

# A raw (collapsed) py-spy line with --threads: "thread (TID): NAME;frame;frame ... COUNT", a frame "function
# (file:line)"; native frames (--native) may carry no file.
_LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")
_FRAME = re.compile(r"^(?P<function>.*?) \((?P<file>.*?)(?::(?P<line>\d+))?\)$")
_THREAD = re.compile(r"^thread \((?P<tid>0x[0-9a-fA-F]+|\d+)\)(?:: (?P<name>.*))?$")

# The parts of a step. Inside an opengem op (ops are called from Inductor's generated code, so they are checked
# first) the innermost frame says which; elsewhere the innermost frame of a known component does.
PARTS = (
    "compile or tuning",  # a steady step compiles and times nothing: samples here mean the warm-up did not settle
    "opengem op: launch",  # inside an opengem custom op, in Triton's or opengem's launcher
    "opengem op: own lines",  # an opengem op's Python (work lists, tuner lookups, checks) and the C calls it makes
    "opengem op: library python",  # inside an opengem op, in torch's or another library's Python (dispatch, numpy)
    "inductor: launch",  # Inductor's generated code launching its Triton kernels
    "inductor: generated lines",  # the generated code's own lines and their C calls: cuBLAS, allocations, views
    "compiled-region wrappers",  # dynamo's guards and AOT autograd's runtime wrappers around the generated code
    "optimizer",  # torch.optim (zero_grad, the fused AdamW's Python) and gradient clipping
    "autograd engine",  # backward() and the engine's own work (eager backward nodes) below it
    "model and trainer (eager)",  # opengem's Python outside the ops and the eager torch calls it makes
    "other",
)


@dataclass(frozen=True)
class Frame:
    function: str
    file: str
    line: int = 0

    def __str__(self) -> str:
        return f"{self.function} ({self.file}:{self.line})" if self.file else self.function


def parse_raw(lines: Iterable[str]) -> list[tuple[str, tuple[Frame, ...], int]]:
    """``(thread, frames root first, samples)`` for each line of py-spy's raw output written with ``--threads``.
    Raises ``ValueError`` naming the line that is not in that form."""
    stacks = []
    for number, line in enumerate(lines, 1):
        line = line.rstrip("\n")
        if not line:
            continue
        match = _LINE.match(line)
        parts = match["stack"].split(";") if match else []
        thread = _THREAD.match(parts[0]) if parts else None
        if match is None or thread is None:
            raise ValueError(f"py-spy raw output line {number} is not 'thread (TID): NAME;frames COUNT' "
                             f"(was it written with --threads?): {line[:200]!r}")  # fmt: skip
        frames = []
        for text in parts[1:]:
            frame = _FRAME.match(text)
            frames.append(Frame(frame["function"], frame["file"], int(frame["line"] or 0)) if frame
                          else Frame(text, ""))
        name = thread["name"] or f"thread {thread['tid']}"
        stacks.append((name, tuple(frames), int(match["count"])))
    return stacks


# files whose frames compile or tune: Dynamo's frame conversion, Inductor's compile and autotuning, Triton's compiler
_COMPILING = ("/torch/_dynamo/convert_frame", "/torch/_inductor/compile_fx", "/torch/_inductor/autotune_process",
              "/torch/_inductor/select_algorithm", "/triton/compiler/", "/triton/testing.py")


def _in(frame: Frame, *markers: str) -> bool:
    return any(marker in frame.file for marker in markers)


def part_of(frames: tuple[Frame, ...], generated_code_dir: str) -> str:
    """The part of the step (one of :data:`PARTS`) a stack (root first) was sampled in. ``generated_code_dir``:
    where Inductor writes its generated modules (its cache directory)."""
    if any(_in(f, *_COMPILING) or f.function.endswith(("benchmark_all_configs", "do_bench")) for f in frames):
        return "compile or tuning"
    leaf = frames[-1] if frames else Frame("", "")
    if any(_in(f, "/opengem/ops/") for f in frames):
        if _in(leaf, "/triton/", "/opengem/ops/triton/launcher.py"):
            return "opengem op: launch"
        if _in(leaf, "/opengem/"):
            return "opengem op: own lines"
        return "opengem op: library python"
    for frame in reversed(frames):
        if generated_code_dir and frame.file.startswith(generated_code_dir):
            launching = _in(leaf, "/triton/", "/torch/_inductor/runtime/")
            return "inductor: launch" if launching else "inductor: generated lines"
        part = _component(frame)
        if part is not None:
            return part
    return "other"


def _component(frame: Frame) -> str | None:
    """The part a frame outside the ops and the generated code belongs to, if any (the innermost such frame wins)."""
    if _in(frame, "/torch/optim/", "/torch/nn/utils/clip_grad"):
        return "optimizer"
    if _in(frame, "/torch/_dynamo/", "/torch/_functorch/", "/torch/autograd/function.py"):
        return "compiled-region wrappers"
    if frame.function.endswith(("_engine_run_backward", "Tensor.backward")) or (
            _in(frame, "/torch/autograd/__init__.py") and frame.function == "backward"):
        return "autograd engine"
    if _in(frame, "/opengem/"):
        return "model and trainer (eager)"
    return None


def is_python(frame: Frame) -> bool:
    """A Python frame (a ``.py`` file, or code made from a string such as Triton's launchers), not a native one."""
    return frame.file.endswith(".py") or frame.file.startswith("<")


def native_library(frames: tuple[Frame, ...]) -> str | None:
    """The shared library (``libcuda.so``, ``libcublasLt.so``, ...) of the innermost frame when it is native code
    below the innermost Python frame (``--native`` samples), ``"(Python)"`` when the leaf is Python, None when the
    stack has no native frame at all (samples taken without ``--native``)."""
    if not frames or all(is_python(frame) for frame in frames):
        return None
    leaf = frames[-1]
    if is_python(leaf):
        return "(Python)"
    name = leaf.file.rsplit("/", 1)[-1] or leaf.function
    return re.sub(r"(\.so)(\.[\d.]+)$", r"\1", name)  # libcuda.so.1 -> libcuda.so


def summarize(stacks: list[tuple[str, tuple[Frame, ...], int]], rate: float, steps: int, generated_code_dir: str,
              top: int = 15) -> dict[str, Any]:
    """Per thread: its active ms a step, by part, and the lines (innermost Python frames) with the most samples in
    each part; the parts' ms a step over all threads. Stacks with native frames (``--native``) go into their parts by
    their Python frames alone, so the parts read as without ``--native``; ``native_libraries`` then splits each part
    by the library its samples were running in."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1 to put samples per step, got {steps}")
    ms_per_sample = 1e3 / rate / steps
    threads: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    leaves: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    libraries: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for thread, frames, count in stacks:
        python = tuple(frame for frame in frames if is_python(frame))
        part = part_of(python, generated_code_dir)
        threads[thread][part] += count
        leaves[part][str(python[-1]) if python else "(no Python frame)"] += count
        library = native_library(frames)
        if library is not None:
            libraries[part][library] += count
    by_thread = {
        thread: {"active_ms_per_step": ms_per_sample * sum(parts.values()),
                 "parts_ms_per_step": {part: ms_per_sample * parts[part] for part in PARTS if parts[part]}}
        for thread, parts in sorted(threads.items(), key=lambda item: -sum(item[1].values()))
    }  # fmt: skip
    totals = collections.Counter()
    for parts in threads.values():
        totals.update(parts)
    return {
        "threads": by_thread,
        "parts_ms_per_step": {part: ms_per_sample * totals[part] for part in PARTS if totals[part]},
        "top_lines": {part: [{"line": line, "ms_per_step": ms_per_sample * count}
                             for line, count in leaves[part].most_common(top)] for part in PARTS if leaves[part]},
        "native_libraries": {part: {library: ms_per_sample * count for library, count in libraries[part].most_common()}
                             for part in PARTS if libraries[part]},
    }  # fmt: skip


def find_py_spy(path: str | None) -> str:
    """The py-spy executable: ``path``, else the one on ``PATH`` or beside this Python (a virtual environment's
    ``bin``, where pip puts it, need not be on ``PATH``); exits naming the missing program."""
    found = shutil.which(path or "py-spy")
    if found is None and path is None:
        found = shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if found is None:
        raise SystemExit(f"py-spy not found ({path or 'py-spy'}): install it (pip install py-spy; the test extra has "
                         "it) or pass --py-spy PATH")  # fmt: skip
    return found


def check_py_spy(py_spy: str) -> None:
    """Fails at once, with py-spy's own words, where it may not read this process (before a long warm-up)."""
    done = subprocess.run([py_spy, "dump", "--pid", str(os.getpid()), "--nonblocking"], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"py-spy cannot sample this process (exit {done.returncode}; in a container it needs "
                         f"CAP_SYS_PTRACE): {(done.stderr or done.stdout).strip()[:500]}")  # fmt: skip


def sample_self(run_step: Callable[[], None], sync: Callable[[], None], py_spy: str, seconds: float, rate: int,
                flags: Sequence[str] = ()) -> tuple[list[tuple[str, tuple[Frame, ...], int]], int, float]:
    """Runs ``run_step`` while py-spy samples this process for ``seconds``: ``(stacks, steps run, seconds they
    took)``, timed from py-spy's start to the end of the last step (``sync`` drains the device queue). ``flags``:
    py-spy's own (``--native``: C/C++ frames too; ``--gil``: only the thread holding the interpreter lock).
    ``--native`` cannot unwind a running process, so py-spy then pauses it for each sample (``--nonblocking`` is
    left out): the sampled steps run slower, by what the caller's unsampled steps show."""
    pausing = "--native" in flags
    with tempfile.TemporaryDirectory() as scratch:
        raw = Path(scratch) / "samples.txt"
        command = [py_spy, "record", "--pid", str(os.getpid()), "--duration", str(int(seconds)), "--rate", str(rate),
                   "--format", "raw", "--threads", "--full-filenames", *([] if pausing else ["--nonblocking"]),
                   "--output", str(raw), *flags]  # fmt: skip
        sync()
        spy = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        start = time.perf_counter()
        steps = 0
        try:
            while spy.poll() is None:
                run_step()
                steps += 1
            sync()
        except BaseException:
            spy.kill()  # a failed step ends the sampling too
            spy.wait()
            raise
        elapsed = time.perf_counter() - start
        output = spy.stdout.read() if spy.stdout else ""
        if spy.returncode != 0 or not raw.exists():
            raise RuntimeError(f"py-spy failed (exit {spy.returncode}); it needs ptrace rights on this process "
                               f"(CAP_SYS_PTRACE in a container). Its output:\n{output}")  # fmt: skip
        stacks = parse_raw(raw.read_text().splitlines())
        if not stacks:
            raise RuntimeError(f"py-spy recorded no samples of this process in {seconds} s. Its output:\n{output}")
        return stacks, steps, elapsed


def main() -> None:
    parser = diagnostic_parser(__doc__.splitlines()[0], "gem-large", 256, "staged batches, run in turn",
                               "benchmarks/results/host_samples_gem-large_b256.json")  # fmt: skip
    parser.add_argument("--seconds", type=int, default=20, help="how long py-spy samples")
    parser.add_argument("--rate", type=int, default=200, help="samples a second")
    parser.add_argument("--native", action="store_true", help="py-spy also unwinds C/C++ frames")
    parser.add_argument("--gil", action="store_true",
                        help="only the thread holding the interpreter lock: its ms a step, summed over the threads, "
                             "near the step's ms say the host's Python paces the step")
    parser.add_argument("--py-spy", default=None,
                        help="the py-spy executable (default: the one on PATH or beside this Python)")
    parser.add_argument("--top", type=int, default=15, help="lines kept per part")
    args = parse_diagnostic_args(parser, "host_samples samples GPU training steps")
    if args.seconds < 1 or args.rate < 1:
        raise SystemExit(f"--seconds and --rate must be >= 1, got {args.seconds} and {args.rate}")
    py_spy = find_py_spy(args.py_spy)
    check_py_spy(py_spy)
    speed = host_speed(torch.device("cuda"))
    options, learner, batches = warmed_learner(args.preset, args.batch_size, args.steps, args.overrides)
    staged = itertools.cycle(batches)

    def run_step() -> None:
        learner.step(next(staged))

    def unsampled_step_ms(steps: int) -> float:
        seconds, _ = timed(lambda: [run_step() for _ in range(steps)], torch.cuda.synchronize)
        return 1e3 * seconds / steps

    before = unsampled_step_ms(2 * len(batches))
    flags = [flag for flag, wanted in (("--native", args.native), ("--gil", args.gil)) if wanted]
    stacks, steps, elapsed = sample_self(run_step, torch.cuda.synchronize, py_spy, args.seconds, args.rate, flags)
    after = unsampled_step_ms(2 * len(batches))
    result = summarize(stacks, args.rate, steps, str(cache_dir()), args.top)
    step_ms = {"unsampled_before": before, "sampled": 1e3 * elapsed / steps, "unsampled_after": after}
    print(f"host {speed['launch_us']:.2f} us / launch, {speed['python_ms']:.1f} ms of fixed Python")
    print(f"step ms: {step_ms} ({steps} sampled steps)")
    for thread, figures in result["threads"].items():
        print(f"{thread}: active {figures['active_ms_per_step']:.1f} ms a step")
        for part, ms in figures["parts_ms_per_step"].items():
            print(f"  {part:28s} {ms:8.2f} ms")
    for part, lines in result["top_lines"].items():
        print(f"{part}: " + "; ".join(f"{line['line']} {line['ms_per_step']:.2f}" for line in lines[:5]))
    for part, libraries in result["native_libraries"].items():
        print(f"{part}, native: " + "; ".join(f"{library} {ms:.2f}" for library, ms in list(libraries.items())[:5]))
    write_diagnostic("host_samples", args, options, host_speed=speed, step_ms=step_ms, sampled_steps=steps,
                     rate=args.rate, seconds=args.seconds, py_spy_flags=flags,
                     step_ms_unsampled=statistics.fmean([before, after]), **result)  # fmt: skip


if __name__ == "__main__":
    main()
