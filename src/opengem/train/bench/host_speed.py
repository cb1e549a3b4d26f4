"""How fast this machine's host issues work, recorded with every `bench train` run so two runs can be compared.

A compiled GEM step issues thousands of kernels (gem-large b256: 3,799), so on a slower host the GPU waits and
the step grows while every kernel takes as long as before. gem-large b256 took 221.6-252.0 ms a step on two
H100 machines and 151-181 ms on others, with equal kernel times (sessions 50-51). Without a figure of the
host's own speed in each result, such a difference cannot be told from a change in the code.

Two probes, each the median of a few rounds: the host time to enqueue one trivial kernel (the CUDA launch
path a host-paced step spends its time in), and a fixed piece of pure Python (the pace of the compiled
graphs' wrappers and the attention ops' host schedules).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Any

import torch

LAUNCHES_PER_ROUND = 1000  # under the CUDA launch queue's depth (~1,024): the host never waits for the GPU
ROUNDS = 5
PYTHON_WORK = 200_000  # loop iterations: 22-48 ms on the H100 machines of session 51


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def launch_us(device: torch.device, launches: int = LAUNCHES_PER_ROUND, rounds: int = ROUNDS) -> float:
    """Median over ``rounds`` of the host microseconds to enqueue one in-place add on a one-element tensor."""
    if launches < 1 or rounds < 1:
        raise ValueError(f"launches and rounds must be >= 1, got {launches}, {rounds}")
    one = torch.zeros(1, device=device)
    per_launch = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # an empty queue: every launch below is enqueued, never waited for
        start = time.perf_counter()
        for _ in range(launches):
            one.add_(1.0)
        per_launch.append(1e6 * (time.perf_counter() - start) / launches)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(per_launch)


def python_ms(iterations: int = PYTHON_WORK, rounds: int = ROUNDS) -> float:
    """Median over ``rounds`` of the milliseconds a fixed loop of dict lookups and method calls takes."""
    if iterations < 1 or rounds < 1:
        raise ValueError(f"iterations and rounds must be >= 1, got {iterations}, {rounds}")
    took = []
    for _ in range(rounds):
        start = time.perf_counter()
        table: dict[int, int] = {}
        for i in range(iterations):
            table[i & 1023] = table.get(i & 1023, 0) + i.bit_length()
        took.append(1e3 * (time.perf_counter() - start))
    return statistics.median(took)


def host_speed(device: torch.device) -> dict[str, Any]:
    """The host's CPU, load and the two probes (``launch_us``: a device launch; ``python_ms``: fixed Python)."""
    return {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "load_avg": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "launch_us": round(launch_us(device), 3),
        "python_ms": round(python_ms(), 3),
    }


def format_host_speed(speed: dict[str, Any] | None) -> list[str]:
    """The report's host line (empty for results written before session 51, which have none)."""
    if not speed:
        return []
    load = "" if speed.get("load_avg") is None else f", load {speed['load_avg'][0]:.2f}"
    return [f"  host              {speed['launch_us']:>12.2f} us / launch, {speed['python_ms']:.1f} ms of fixed Python "
            f"({speed['cpu']}, {speed['cpus']} CPUs{load})"]
