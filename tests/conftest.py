"""Without a GPU, Triton kernels run in Triton's CPU interpreter.

Set before anything imports triton: importing torch.utils.flop_counter (done by every op that registers
a FLOP formula) loads triton.language, and the interpreter flag is read at that point.
"""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

    # Triton 3.6's interpreter converts loaded scalars (1-element arrays) with int(array), which NumPy
    # >= 2.3 rejects, so loops with bounds loaded from memory fail; convert with .item() instead.
    import triton.runtime.interpreter as _interpreter

    _original_patch = _interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope) -> None:
        _original_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _interpreter._patch_lang_tensor = _patch_lang_tensor


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A temporary directory shared by all pytest-xdist workers of this run (for once-per-run sessions)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if "PYTEST_XDIST_WORKER" in os.environ else base


@pytest.fixture(scope="session")
def gelu_float64():
    """x -> (gelu(x), gelu'(x)) in float64 from erfc (no cancellation in the left tail): the reference of the
    FP8 quantizers' fused GELUs, on CPU and GPU."""

    def reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x64 = x.double()
        cdf = 0.5 * torch.erfc(-x64 / 2**0.5)
        return x64 * cdf, cdf + x64 * torch.exp(-0.5 * x64 * x64) / (2 * torch.pi) ** 0.5

    return reference

