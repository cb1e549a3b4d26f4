"""Warp-specialized Hopper kernels in Gluon (Triton's lower-level dialect: explicit partitions, shared-memory rings,
mbarriers and asynchronous warpgroup MMAs), used where they measure faster than the Triton kernels.

Gluon has no interpreter and its API moves between Triton releases: these kernels are written for and built with
triton 3.6 (the GPU image's). :func:`available` says whether they can run here; where not, the ops keep their Triton
kernels, which run everywhere.
"""

from __future__ import annotations

import os

import torch
import triton

TESTED_TRITON = "3.6."  # 3.9's Gluon rejects these kernels (layouts and partition arguments changed)


def available(device: torch.device) -> bool:
    """True on an sm_90 GPU (H100 / H200) with triton 3.6, outside the interpreter."""
    return (device.type == "cuda" and triton.__version__.startswith(TESTED_TRITON)
            and os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.get_device_capability(device) == (9, 0))
