"""Warp-specialized Hopper kernels in Gluon (Triton's lower-level dialect: explicit partitions, shared-memory rings,
mbarriers and asynchronous warpgroup MMAs), used where they measure faster than the Triton kernels.

Gluon has no interpreter and its API moves between Triton releases: these kernels are written for and built with
triton 3.6 (the GPU image's). :func:`available` says whether they can run here; where not, the ops keep their Triton
kernels, which run everywhere.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

TESTED_TRITON = "3.6."  # 3.9's Gluon rejects these kernels (layouts and partition arguments changed)

# The GDPA forward's tile (``gdpa_forward``): query rows a work item (64 a consumer warpgroup, fixed by its two
# consumers), keys a tile and K/V stages. Here, not in that module, so the Triton tuner names its candidate without
# importing Gluon's Hopper API. 128 keys fit only 2 stages beside the Q ring: 0.91-1.02x this tile on (a) (H100,
# session 43, same run).
GDPA_FORWARD_BLOCK_M, GDPA_FORWARD_BLOCK_N, GDPA_FORWARD_STAGES = 128, 64, 3


def available(device: torch.device) -> bool:
    """True on an sm_90 GPU (H100 / H200) with triton 3.6, outside the interpreter."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _sm90_with_tested_triton(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)  # asked on every GDPA forward: a few microseconds saved a call
def _sm90_with_tested_triton(index: int) -> bool:
    return triton.__version__.startswith(TESTED_TRITON) and torch.cuda.get_device_capability(index) == (9, 0)
