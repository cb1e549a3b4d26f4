"""JFA's dQ from a stored dS: the dK/dV pass writes each visible entry of dS (bf16, as the dQ products take it), and
the dQ pass reads it back, one matrix product a tile pair (``dQ = dS K``) instead of three with the recompute.

Why: the recompute's dQ pass runs ``Q K^T``, ``dO V^T`` and ``dS K``, so the backward costs seven products a tile
pair. Reading dS instead costs 2 bytes a (pair, head) written and read once; at D = 128 that is D FLOPs a byte of
the dQ product, under an H100/H200's ~200 FLOPs a byte, so the pass runs at memory speed. What it takes is memory:
``2 x heads x (stored pairs)`` bytes for the length of the backward, which is why the mode has a budget.

Layout, per head: each ``SMALL``-row query tile of the batch keeps its rows' key range ``[lo, lo + width)`` (the
exact ``key_range`` of the tile, ``lo`` rounded down and ``width`` up to ``_ALIGN``) row-major, tile after tile.
Only visible entries are written and read (masked loads take 0 elsewhere), so no pass zero-fills the buffer.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from opengem.jagged.host import host_copy, to_device
from opengem.ops.triton import jagged_attention as jfa
from opengem.ops.triton.jagged_attention import (
    _INTERPRET,
    _KEY,
    Problem,
    _grid,
    _item,
    _key_tiles,
    _prune,
    _sample,
    _store_column_sums,
    _tile_counts,
    ds_tile,
    key_range_host,
)
from opengem.ops.triton.masks import tile_mask
from opengem.ops.triton.tuning import autotune

_ALIGN = 16  # keys: every stored row starts 32-byte aligned (16-byte vector loads)
_MODES = ("recompute", "stored")


def _mode_from_env() -> str:
    mode = os.environ.get("OPENGEM_JFA_DQ", "recompute")
    if mode not in _MODES:
        raise ValueError(f"OPENGEM_JFA_DQ must be one of {', '.join(_MODES)}, got {mode!r}")
    return mode


# How JFA's backward gets dQ: "recompute" (the default: the dQ pass recomputes P and dS) or "stored" (this module,
# where the stored dS fits ``MAX_STORED_BYTES``; the recompute elsewhere). Benchmarks may reassign both.
DQ_MODE = _mode_from_env()
MAX_STORED_BYTES = int(float(os.environ.get("OPENGEM_JFA_DS_MAX_GB", "8")) * 2**30)


@dataclass(frozen=True)
class StoredDsLayout:
    """Per ``SMALL``-row query tile of the batch (the order of ``Schedule.small_tile_starts``): the first element of
    its rows in one head's buffer (``base``, int64), their first stored key (``key_lo``) and row length
    (``width``, int32); ``per_head`` elements a head."""

    base: torch.Tensor
    key_lo: torch.Tensor
    width: torch.Tensor
    per_head: int


_LAYOUTS: OrderedDict[tuple, StoredDsLayout] = OrderedDict()
_LAYOUT_CACHE_SIZE = 64


def stored_ds_layout(pb: Problem) -> StoredDsLayout:
    """The stored dS layout of ``pb``'s batch and mask, from host mirrors (cached like the schedules)."""
    host_offsets = host_copy(pb.offsets)
    host_targets = None if pb.num_targets is None else host_copy(pb.num_targets)
    key = (host_offsets.numpy().tobytes(), None if host_targets is None else host_targets.numpy().tobytes(), pb.opts,
           str(pb.offsets.device), jfa._SMALL)  # fmt: skip
    if key in _LAYOUTS:
        _LAYOUTS.move_to_end(key)
        return _LAYOUTS[key]
    bounds = host_offsets.to(torch.int64)
    lengths = bounds[1:] - bounds[:-1]
    hist = lengths if host_targets is None else lengths - host_targets.to(torch.int64)
    small = jfa._SMALL  # (read at the call: the tests set the GPU's tile sizes in the interpreter)
    counts, _ = _tile_counts(lengths, small)
    sample = torch.repeat_interleave(torch.arange(lengths.numel()), counts)
    first = torch.cumsum(counts, 0) - counts
    m_start = (torch.arange(int(counts.sum())) - first[sample]) * small
    lo, hi = key_range_host(m_start, lengths[sample], hist[sample], small, pb.opts)
    lo = lo // _ALIGN * _ALIGN
    width = (hi - lo + _ALIGN - 1) // _ALIGN * _ALIGN
    sizes = width * small
    base = torch.cumsum(sizes, 0) - sizes
    device = pb.offsets.device
    layout = StoredDsLayout(to_device(base, device), to_device(lo.to(torch.int32), device),
                            to_device(width.to(torch.int32), device), int(sizes.sum()))  # fmt: skip
    _LAYOUTS[key] = layout
    if len(_LAYOUTS) > _LAYOUT_CACHE_SIZE:
        _LAYOUTS.popitem(last=False)
    return layout


def stored_ds_bytes(pb: Problem, q: torch.Tensor) -> int:
    """Bytes the stored dS of one backward takes (q's dtype, all query heads)."""
    return stored_ds_layout(pb).per_head * q.shape[1] * q.element_size()


def use_stored_ds(pb: Problem, q: torch.Tensor) -> bool:
    """Whether this backward takes dQ from a stored dS: the mode says so and the buffer fits the budget."""
    return DQ_MODE == "stored" and stored_ds_bytes(pb, q) <= MAX_STORED_BYTES


# ----------------------------------------------------------------------------------------------- kernels


@triton.jit
def _delta_kernel(
    O, DO, Delta, total_tokens, stride_ot, stride_oh, stride_dot, stride_doh,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """``delta = rowsum(dO * O)`` ``[H, T]`` fp32 (what the recompute's dQ pass writes for the dK/dV pass)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    h = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = rows < total_tokens
    o = tl.load(O + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], mask=ok[:, None], other=0.0)
    do = tl.load(DO + rows[:, None] * stride_dot + h * stride_doh + offs_d[None, :], mask=ok[:, None], other=0.0)
    tl.store(Delta + h * total_tokens + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=ok)


@triton.jit
def _dq_tiles(
    dq, DS, DsBase, DsLo, DsWidth, tile0, K, n_lo, n_hi, offs_m, offs_d, row_ok, stride_kt, seq_len, hist_len,
    contextual_len, window,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_CONTEXT: tl.constexpr, SMALL: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    for n_start in range(n_lo, n_hi, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        ds_ptrs, in_range = ds_tile(DS, DsBase, DsLo, DsWidth, tile0, offs_m, row_ok, n_start, BLOCK_N, SMALL, False)
        ds = tl.load(ds_ptrs, mask=in_range, other=0.0)
        k_ptrs = K + offs_n[:, None] * stride_kt + offs_d[None, :]
        if MASKED:  # only visible entries were surely written: the others in the range are dropped
            visible = tile_mask(offs_m, offs_n, seq_len, hist_len, contextual_len, window, CAUSAL, HAS_WINDOW, HAS_CONTEXT)
            ds = tl.where(visible, ds, 0.0)
            k = tl.load(k_ptrs, mask=offs_n[:, None] < seq_len, other=0.0)
        else:
            k = tl.load(k_ptrs)
        dq = tl.dot(ds, k, dq, input_precision=PRECISION)
    return dq


# (BLOCK_M, BLOCK_N, num_warps, num_stages): one product a tile pair on operands streamed from memory, so deep
# pipelines. sm_90 (Triton 3.6, D 128, bf16): 128 x 64 at 8 warps and 4 stages 211 / 242 registers (full / causal)
# without spills, 128 KB of shared memory; 128 x 64 at 4 warps spills 216 B causal, 64 x 128 at 4 warps 136-288 B
# (not kept). Not yet timed on a GPU.
_DQ = [(128, 64, 8, 4), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 4), (64, 64, 4, 3)]

def _configs() -> list[triton.Config]:
    if _INTERPRET:
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=1, num_stages=1)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in _DQ]


@autotune(configs=_configs(), key=_KEY, prune_configs_by={"early_config_prune": _prune})
@triton.jit(do_not_specialize=["contextual_len", "window", "heads", "ds_per_head"])
def _dq_from_ds_kernel(
    K, DS, DsBase, DsLo, DsWidth, DQ, offsets, num_targets, sched_small, sched_large, Sums, tile_starts,
    stride_kt, stride_kh, stride_dqt, stride_dqh, ds_per_head, heads, scale, contextual_len, window, LEN_BUCKET,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_CONTEXT: tl.constexpr, HAS_TARGETS: tl.constexpr, SMALL: tl.constexpr, PRECISION: tl.constexpr,
    COLUMN_SUMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dQ of one query tile from the stored dS; with ``COLUMN_SUMS``, also its column sum (part 0 of ``Sums``)."""
    b, m_start, h = _item(sched_small, sched_large, heads, BLOCK_M, SMALL)
    start, seq_len, hist_len = _sample(offsets, num_targets, b, HAS_TARGETS)
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < seq_len
    tile0 = tl.load(tile_starts + b)
    DSh = DS + tl.multiple_of(h.to(tl.int64) * ds_per_head, 16)  # (per_head: whole rows of 16 keys)
    Kh = K + start * stride_kt + (h // GROUP) * stride_kh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    lo, f_lo, f_hi, hi = _key_tiles(m_start, seq_len, hist_len, contextual_len, window, BLOCK_M, BLOCK_N, CAUSAL, HAS_WINDOW, HAS_CONTEXT)  # fmt: skip
    dq = _dq_tiles(dq, DSh, DsBase, DsLo, DsWidth, tile0, Kh, lo, f_lo, offs_m, offs_d, row_ok, stride_kt, seq_len,
                   hist_len, contextual_len, window, BLOCK_N, True, CAUSAL, HAS_WINDOW, HAS_CONTEXT, SMALL, PRECISION)
    dq = _dq_tiles(dq, DSh, DsBase, DsLo, DsWidth, tile0, Kh, f_lo, f_hi, offs_m, offs_d, row_ok, stride_kt, seq_len,
                   hist_len, contextual_len, window, BLOCK_N, False, CAUSAL, HAS_WINDOW, HAS_CONTEXT, SMALL, PRECISION)
    dq = _dq_tiles(dq, DSh, DsBase, DsLo, DsWidth, tile0, Kh, f_hi, hi, offs_m, offs_d, row_ok, stride_kt, seq_len,
                   hist_len, contextual_len, window, BLOCK_N, True, CAUSAL, HAS_WINDOW, HAS_CONTEXT, SMALL, PRECISION)
    dq = dq * scale
    tl.store(DQ + (start + offs_m[:, None]) * stride_dqt + h * stride_dqh + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])  # fmt: skip
    if COLUMN_SUMS:
        _store_column_sums(Sums, tile_starts, b, m_start, seq_len, 0, h, heads, dq, row_ok[:, None], offs_d, BLOCK_M, SMALL, HEAD_DIM)  # fmt: skip


# ------------------------------------------------------------------------------------------- launchers


def write_delta(out: torch.Tensor, dout: torch.Tensor, delta: torch.Tensor) -> None:
    """``delta [H, T]`` fp32 from ``out``, ``dout`` ``[T, H, D]`` (unit last strides)."""
    total, heads, head_dim = out.shape
    block = 16 if _INTERPRET else 64
    _delta_kernel[(triton.cdiv(total, block), heads)](
        out, dout, delta, total, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1),
        HEAD_DIM=head_dim, BLOCK=block,
    )  # fmt: skip


def new_stored_ds(pb: Problem, q: torch.Tensor) -> tuple[torch.Tensor, StoredDsLayout]:
    """An unfilled stored dS buffer (q's dtype, ``[H, per_head]``) and its layout."""
    layout = stored_ds_layout(pb)
    return torch.empty((q.shape[1], layout.per_head), dtype=q.dtype, device=q.device), layout


def dq_from_stored_ds(
    ds: torch.Tensor, layout: StoredDsLayout, k: torch.Tensor, dq: torch.Tensor, pb: Problem, sums: torch.Tensor,
    column_sums: bool, constexprs: dict,
) -> None:
    """Write ``dq`` (and, with ``column_sums``, part 0 of ``sums``) from the dS the dK/dV pass stored."""
    heads = dq.shape[1]
    items = pb.sched.query_tiles
    _dq_from_ds_kernel[_grid(items, heads, "BLOCK_M")](
        k, ds, layout.base, layout.key_lo, layout.width, dq, pb.offsets, pb.targets_arg(), items[jfa._SMALL],
        items[jfa._LARGE], sums, pb.sched.small_tile_starts, k.stride(0), k.stride(1), dq.stride(0), dq.stride(1),
        layout.per_head, heads, pb.scale, **pb.runtime(), **constexprs, COLUMN_SUMS=column_sums,
    )  # fmt: skip
