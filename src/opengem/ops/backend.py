"""Which implementation an op runs: its Triton kernels or its PyTorch reference (``opengem.ops.reference``).

Every op with both takes the same choice: ``"auto"`` runs the kernels on CUDA tensors and the reference elsewhere,
``"triton"`` forces the kernels (on the CPU too, under ``TRITON_INTERPRET=1``), ``"reference"`` the reference. Ops
that read an environment variable (``OPENGEM_JFA_BACKEND`` and the like) take it where the caller left the choice
(None or ``"auto"``), so a whole training run can switch an op without code changes.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "triton", "reference")


def triton_chosen(device: torch.device, backend: str | None = None, env: str | None = None) -> bool:
    """Whether an op on ``device`` runs its Triton kernels: ``backend`` (one of ``BACKENDS``), except that None or
    ``"auto"`` takes the environment variable ``env`` when it is set. A value outside ``BACKENDS`` is a ``ValueError``
    that names where it came from."""
    source = "backend"
    if backend in (None, "auto") and env is not None and os.environ.get(env):
        backend, source = os.environ[env], f"the environment variable {env}"
    backend = "auto" if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"{source} must be one of {BACKENDS}, got {backend!r}")
    return backend == "triton" or (backend == "auto" and device.type == "cuda")
