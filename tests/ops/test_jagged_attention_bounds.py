"""JFA kernels at the GPU's tile sizes (64 / 128) in the interpreter, with every memory access audited.

The other interpreter tests use tiles of 16 / 32, and the GPU tests only each kernel's default config; the
autotuner may pick any curated config, including the ones that read the 64-row schedule. Here each
config family runs against the reference while every load and store the kernels issue (mask applied) is
checked to stay inside one of the launch's tensors.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
import torch
import triton.runtime.interpreter as interpreter

from opengem.ops.jagged_attention import jagged_attention
from opengem.ops.triton import jagged_attention as kernels

# (fwd, dkdv, dq) as (BLOCK_M, BLOCK_N): the GPU defaults, then the other tile shapes of the curated lists
TILE_SETS = {
    "defaults": ((128, 64), (64, 128), (128, 64)),
    "small_schedule": ((64, 64), (64, 64), (64, 64)),
    "large_square": ((128, 128), (64, 128), (128, 128)),
}
MASKS = {
    "causal": dict(causal=True),
    "causal_window": dict(causal=True, window=70),
    "full_window": dict(causal=False, window=45),
    "all_options": dict(causal=True, window=90, contextual_len=20, targets=True),
}
# the last sample is the longest and ends off every tile border: tiles past T read only under a mask
LENGTHS = [1, 0, 200, 64, 129, 63, 601]


class _Audit:
    """Every address a kernel touches (where its mask is set) must lie inside one argument tensor."""

    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []
        self.accesses = 0

    def check(self, ptrs: np.ndarray, mask: np.ndarray, itemsize: int) -> None:
        addresses = ptrs[np.broadcast_to(mask, ptrs.shape)].astype(np.uint64)
        if addresses.size == 0:
            return
        low, high = int(addresses.min()), int(addresses.max()) + itemsize
        inside = any(start <= low and high <= end for start, end in self.ranges)
        assert inside, f"access [{low:#x}, {high:#x}) leaves every tensor of the launch"
        self.accesses += 1


@pytest.fixture
def audit(monkeypatch):
    state = _Audit()
    init_args = interpreter.GridExecutor._init_args_hst

    def init_args_recording(self, args_dev, kwargs):
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        state.ranges = [
            (t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
            for t in (*args_hst, *kwargs_hst.values())
            if isinstance(t, torch.Tensor)
        ]
        return args_hst, kwargs_hst

    load, store = interpreter.InterpreterBuilder.create_masked_load, interpreter.InterpreterBuilder.create_masked_store

    def audited_load(self, ptrs, mask, other, *args, **kwargs):  # TMA descriptor loads come here too
        state.check(ptrs.data, mask.data, np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize)
        return load(self, ptrs, mask, other, *args, **kwargs)

    def audited_store(self, ptrs, value, mask, *args, **kwargs):
        state.check(ptrs.data, mask.data, value.data.itemsize)
        return store(self, ptrs, value, mask, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "_init_args_hst", init_args_recording)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", audited_load)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_store", audited_store)
    return state


def _use_tiles(monkeypatch, tiles) -> None:
    """Schedules for 64 / 128 and one config per kernel, as on the GPU (no tuning in the interpreter)."""
    monkeypatch.setattr(kernels, "_TILES", (64, 128))
    monkeypatch.setattr(kernels, "_SMALL", 64)
    monkeypatch.setattr(kernels, "_LARGE", 128)
    monkeypatch.setattr(kernels, "_SCHEDULES", type(kernels._SCHEDULES)())
    for (name, kernel), (m, n) in zip(kernels.KERNELS.items(), tiles):
        monkeypatch.setattr(kernel, "configs", [kernels.tile_config(name, m, n, 1, 1)])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("tile_set", list(TILE_SETS))
def test_gpu_tile_sizes_match_reference_and_stay_in_bounds(monkeypatch, audit, tile_set, mask):
    _use_tiles(monkeypatch, TILE_SETS[tile_set])
    gen = torch.Generator().manual_seed(7)
    total = sum(LENGTHS)
    q, dout = (torch.randn(total, 2, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(total, 1, 16, generator=gen) for _ in range(2))
    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    kwargs = {key: value for key, value in MASKS[mask].items() if key != "targets"}
    if MASKS[mask].get("targets"):
        kwargs["num_targets"] = torch.tensor([min(n, 1 + n // 8) for n in LENGTHS])
    results = []
    for backend in ("triton", "reference"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = jagged_attention(*leaves, offsets, max(LENGTHS), backend=backend, **kwargs)
        results.append([out.detach(), *torch.autograd.grad(out, leaves, dout)])
    assert audit.accesses > 0
    for name, got, want in zip(("out", "dq", "dk", "dv"), *results):
        assert _rel(got, want) < 1e-5, name
