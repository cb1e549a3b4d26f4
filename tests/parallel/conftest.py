"""One 4-rank and one 2-rank gloo session per test run; the tests assert on their results.

Starting processes dominates the cost on a small CPU machine, so each world size is spawned once
and runs several scenarios (see ``scenarios.py``); the 2-rank session resumes the 4-rank checkpoints.
Under pytest-xdist the sessions still run once (``run_once``, in the run's shared temporary directory,
the ``shared_dir`` fixture of ``tests/conftest.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import scenarios

from opengem.parallel.testing import run_once


@pytest.fixture(scope="session")
def checkpoint_root(shared_dir: Path) -> Path:
    return shared_dir / "dcp"


@pytest.fixture(scope="session")
def world4(shared_dir: Path, checkpoint_root: Path) -> list[dict[str, Any]]:
    return run_once(shared_dir, "world4", scenarios.session_world4, 4, str(checkpoint_root))


@pytest.fixture(scope="session")
def world2(shared_dir: Path, world4: list[dict[str, Any]], checkpoint_root: Path) -> list[dict[str, Any]]:
    return run_once(shared_dir, "world2", scenarios.session_world2, 2, str(checkpoint_root))


@pytest.fixture(scope="session")
def reference() -> dict:
    return scenarios.reference_run()


@pytest.fixture(scope="session")
def reference_experts() -> dict:
    return scenarios.reference_run(experts=2)


@pytest.fixture
def single_process_group():
    """A 1-rank gloo process group in the test process (the world-size-1 path, as on one GPU)."""
    import torch.distributed as dist

    from opengem.parallel.testing import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
