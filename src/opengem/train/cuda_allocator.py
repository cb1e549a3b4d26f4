"""The CUDA caching allocator's settings for training: expandable segments unless the user chose otherwise.

Jagged batches change size every step, so the default allocator keeps carving and caching new blocks of new
sizes; on gem-small (one H200, b2048, compiled) its steps ran 162.4 ms median against 140.5 ms with
``expandable_segments:True``, on the same kernels (137 ms of GPU time; session 18,
``benchmarks/results/train_gem-small_b2048_s18_*.json``). A user's ``PYTORCH_ALLOC_CONF`` or
``PYTORCH_CUDA_ALLOC_CONF`` (any value, ``expandable_segments:False`` included) always wins.
"""

from __future__ import annotations

import os

import torch

TRAINING_ALLOCATOR_SETTINGS = "expandable_segments:True"
USER_SETTINGS_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def configure_cuda_allocator(settings: str = TRAINING_ALLOCATOR_SETTINGS) -> str | None:
    """Apply ``settings`` to the CUDA caching allocator unless a ``USER_SETTINGS_VARIABLES`` variable is set.

    Before CUDA initializes, the settings go into ``PYTORCH_ALLOC_CONF``, which the allocator reads when it
    starts (and which child processes inherit); after, they are applied to the running allocator, where they
    govern the segments it creates from then on. Returns the settings applied, or None when the user's stand.
    """
    if any(os.environ.get(name) for name in USER_SETTINGS_VARIABLES):
        return None
    if torch.cuda.is_initialized():
        torch._C._accelerator_setAllocatorSettings(settings)  # the setter behind torch.cuda.memory's deprecated one
    else:
        os.environ["PYTORCH_ALLOC_CONF"] = settings
    return settings
