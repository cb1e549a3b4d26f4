"""Tile loads of jagged ``[T, H, D]`` tensors through ragged TMA descriptors (``triton.tools.ragged_tma``),
shared by the JFA and GDPA kernels.

One 5-D descriptor per tensor; a program reads rows ``[row, row + BLOCK)`` of one head of one sample, and
the hardware's bounds check returns zeros past the sample's end, as the masked pointer loads' ``other=0``
do, without address math or masks in the program. Where a tensor cannot be described (unaligned base or
strides, a broadcast stride of 0, pre-Hopper GPUs) the kernels take their masked pointer loads instead.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.tools.ragged_tma import load_ragged
from triton.tools.tensor_descriptor import TensorDescriptor

RAGGED_ROWS_LIMIT = 2**30  # create_ragged_descriptor's row bound
_RAGGED_MAX_INT = 0x7FFF0000  # its two leading dimensions' extent


@triton.jit
def ragged_tile(desc, start, seq_len, row, head, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Rows ``[row, row + BLOCK)`` of one head of the sample ``[start, start + seq_len)``, ``[BLOCK, HEAD_DIM]``:
    rows past the sample read as zeros."""
    return tl.reshape(load_ragged(desc, start.to(tl.int32), seq_len, [row, head, 0]), [BLOCK, HEAD_DIM])


@functools.lru_cache(maxsize=None)
def _tma_device(device: torch.device) -> bool:
    """sm_90+ (asked once per device: every launch checks its tensors), or the interpreter."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    return interpret or (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9)


def tma_ok(t: torch.Tensor) -> bool:
    """TMA needs a 16-byte aligned base and positive row / head strides that are multiples of 16 bytes
    (sm_90+, or the interpreter); broadcast (stride 0) gradients take the pointer loads."""
    if t.dim() != 3 or not _tma_device(t.device):
        return False
    size = t.element_size()
    rows, heads, unit = t.stride()
    return (
        t.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and unit == 1
        and t.data_ptr() % 16 == 0
        and rows > 0 and heads > 0 and rows * size % 16 == 0 and heads * size % 16 == 0
        and t.shape[2] * size % 16 == 0
        and 0 < t.shape[0] <= RAGGED_ROWS_LIMIT
    )


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy where its last dim is strided: the kernels' loads (pointer and TMA alike) take
    unit stride along the head dim, any stride along tokens and heads (packed QKV views pass as they are)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def tma_passes(setting: str, passes: tuple[str, ...], variable: str) -> frozenset[str]:
    """The passes an environment setting (``variable``: ``none`` or a comma-separated subset of ``passes``)
    lets load through TMA descriptors."""
    chosen = frozenset() if setting == "none" else frozenset(p.strip() for p in setting.split(",") if p.strip())
    if not chosen <= set(passes):
        raise ValueError(f"{variable} must be 'none' or a comma-separated subset of {passes}, got {setting!r}")
    return chosen


def ragged_descriptor(t: torch.Tensor, block_rows: int = 16) -> TensorDescriptor:
    """The descriptor of ``t [T, H, D]`` read in ``[block_rows, 1 head, D]`` boxes (see :func:`set_block_rows`):
    the fields of ``create_ragged_descriptor(t, [block_rows, 1, D])`` (a test checks they agree), set without
    re-running its checks, which :func:`tma_ok` made already (they cost a launch's three descriptors ~30 us)."""
    rows, heads, unit = t.stride()
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(
        base=t,
        shape=[_RAGGED_MAX_INT, _RAGGED_MAX_INT, RAGGED_ROWS_LIMIT, t.shape[1], t.shape[2]],
        strides=[2**34 - rows, rows, rows, heads, unit],
        block_shape=[1, 1, block_rows, 1, t.shape[2]],
        padding="zero",
    )
    return desc


def set_block_rows(desc, block_rows: int) -> None:
    """Resizes a descriptor's box to ``block_rows`` rows (an autotuner's pre-hook does, per config); a plain
    tensor passed in its place (the pointer-load path) is left alone."""
    if isinstance(desc, TensorDescriptor):
        desc.block_shape = [1, 1, block_rows, 1, desc.block_shape[-1]]
