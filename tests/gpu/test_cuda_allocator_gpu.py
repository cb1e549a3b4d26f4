"""`resolve_device("cuda")` gives training expandable segments, before or after CUDA starts, unless the user's
PYTORCH_ALLOC_CONF says otherwise. Each case runs in a fresh process: the allocator reads its settings once."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROOT = Path(__file__).resolve().parents[2]
# Prints whether the segment holding a tensor allocated after resolve_device is expandable.
PROBE = """
import sys, torch
from opengem.train.trainer import resolve_device
if sys.argv[1] == "cuda_first":
    torch.empty(1 << 20, device="cuda")  # the allocator starts with its default settings
device = resolve_device("cuda")
x = torch.empty(64 << 20, dtype=torch.uint8, device=device)
segments = torch.cuda.memory._snapshot()["segments"]
print(any(s["is_expandable"] and s["address"] <= x.data_ptr() < s["address"] + s["total_size"] for s in segments))
"""


def _probe(order: str, user_settings: str | None) -> bool:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    env["PYTHONPATH"] = str(ROOT / "src")
    if user_settings is not None:
        env["PYTORCH_ALLOC_CONF"] = user_settings
    done = subprocess.run([sys.executable, "-c", PROBE, order], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1] == "True"


@pytest.mark.parametrize("order", ["device_first", "cuda_first"])
def test_training_segments_are_expandable(order):
    assert _probe(order, None)


def test_the_users_settings_stand():
    assert not _probe("device_first", "expandable_segments:False")
