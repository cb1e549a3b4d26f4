"""Run a function on N local processes with the gloo backend (tests, CPU demos).

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, each initializing a gloo
process group on a free localhost port, calls ``fn(*args)`` and returns the per-rank results in rank
order. ``fn`` must be importable by module path (a module-level function). Each worker uses one
intra-op thread (``OMP_NUM_THREADS=1``) so that N workers share a small machine without thrashing.
``run_once`` runs such a session once per test run, however many pytest-xdist workers need it.
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def free_port() -> int:
    """A TCP port free on localhost right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, result_dir: str, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    try:
        result = fn(*args)
        torch.save(result, Path(result_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` gloo processes; return each rank's result (rank order).

    A failing rank raises in the caller (``torch.multiprocessing.ProcessRaisedException``).
    """
    with tempfile.TemporaryDirectory() as result_dir:
        mp.spawn(_worker, args=(world_size, free_port(), result_dir, fn, args), nprocs=world_size, join=True)
        return [torch.load(Path(result_dir) / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]


def run_once(shared_dir: Path, name: str, fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """``run_distributed(fn, world_size, *args)`` once per ``shared_dir``: the first caller runs it under a
    file lock and leaves the results there for the others (pytest-xdist workers share the directory)."""
    results = shared_dir / f"{name}.pt"
    with open(shared_dir / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not results.exists():
            torch.save(run_distributed(fn, world_size, *args), results)
    return torch.load(results, weights_only=False)
