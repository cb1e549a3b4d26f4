"""Without a GPU, Triton kernels run in Triton's CPU interpreter.

Set before anything imports triton: importing torch.utils.flop_counter (done by every op that registers
a FLOP formula) loads triton.language, and the interpreter flag is read at that point.
"""

import math
import os
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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
def check_quantizer_gelu():
    """``check(device, near, tail, derivative_abs, derivative_rel)``: the FP8 row quantizer's fused GELU and
    GELU backward on fp32 rows over [-12, 8] (their outputs stay fp32) against float64 from erfc (no
    cancellation in the left tail): gelu within ``near`` relative from -3 up and ``tail`` everywhere, gelu'
    within ``derivative_abs + derivative_rel * |gelu'|``. Shared by the interpreter and GPU tests."""
    from opengem.ops.triton.fp8_gemm import rowwise_quantize

    def check(device: str, near: float, tail: float, derivative_abs: float, derivative_rel: float) -> None:
        x = torch.linspace(-12.0, 8.0, 4001, device=device)[None, :]
        x64 = x.double()
        cdf = 0.5 * torch.erfc(-x64 / 2**0.5)
        gelu, derivative = x64 * cdf, cdf + x64 * torch.exp(-0.5 * x64 * x64) / (2 * torch.pi) ** 0.5
        error = (rowwise_quantize(x, "gelu")[2].double() - gelu).abs()
        assert (error <= 1e-30 + tail * gelu.abs()).all()
        assert (error[x >= -3] <= near * gelu[x >= -3].abs() + 1e-30).all()
        grad = rowwise_quantize(torch.ones_like(x), "gelu_backward", x)[2]
        assert ((grad.double() - derivative).abs() <= derivative_abs + derivative_rel * derivative.abs()).all()

    return check



class OpLog(TorchDispatchMode):
    """The aten and custom ops run while it is active (forward and backward alike): ``calls`` holds each op's name
    without its overload and its output's shape (None for a non-tensor output)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[int, ...] | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append((func.__name__.split(".")[0], tuple(out.shape) if isinstance(out, torch.Tensor) else None))
        return out

    def names(self, min_numel: int = 0) -> set[str]:
        """The ops that ran, those with a tensor output of at least ``min_numel`` elements when it is given."""
        return {name for name, shape in self.calls
                if not min_numel or (shape is not None and math.prod(shape) >= min_numel)}

    def shapes(self, *names: str) -> list[tuple[int, ...]]:
        """The output shapes of the calls of those ops, in order."""
        return [shape for name, shape in self.calls if name in names and shape is not None]


@pytest.fixture
def op_log() -> OpLog:
    """An :class:`OpLog` to enter around the code whose ops a test checks."""
    return OpLog()
