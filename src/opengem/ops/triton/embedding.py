"""Triton kernels of the fused embedding lookup and its in-backward optimizer update.

Layout and optimizer definitions: `opengem.ops.embedding`. Same signatures as the reference in
`opengem.ops.reference.embedding`; no autograd here.

Forward: one program per (bag, block of BLOCK_D columns). It gathers BLOCK_N rows at a time (tuned) as a
[BLOCK_N, BLOCK_D] tile (many independent row loads in flight, contiguous vectorized columns), and either
sums them in fp32 (pooled) or writes each row out (sequence features). A table of half or a quarter of the
launch's widest dim takes 2 or 4 times the rows per step; each step's ids are loaded one step ahead.

Backward: the host sorts the batch's (global row, contribution) pairs by row with torch ops, without a
device sync. Each program takes ROWS consecutive sorted positions as a [ROWS, BLOCK_D] tile; the first
position of each run of equal rows owns the row: it sums the run's gradient contributions in fp32, then
applies the optimizer to the whole row (row-wise state needs the mean of g**2 over the row). Tiles of
several rows keep many independent loads in flight (most runs are 1 or 2 long).

Hot rows (a feature with a handful of categories read by every history token, popular items) make runs
of 100k contributions; summed by one lane, they kept a few programs looping for tens of milliseconds. So
no lane sums more than SEGMENT contributions: a run's owner sums its first SEGMENT itself, and every later
SEGMENT-long piece of a long run is summed by pass 1 (``_segment_sum_kernel``, one lane per piece) into an
fp32 partial row; the owner then adds its run's partial rows, one per SEGMENT contributions, before the
update. A lane's serial work drops from L to at most SEGMENT + L / SEGMENT loads (100k -> ~1.6k at 64).
Everything is a fixed-order sum (no float atomics): results are deterministic. The pieces are found with
torch ops (cumsum, searchsorted), sized by the host bound N // SEGMENT on their number.

Loops over runtime bounds are ``while`` loops: Triton 3.6's interpreter cannot take a loaded scalar as a
``range`` bound with NumPy >= 2.3 (its scalars are 1-element arrays); compiled code is the same.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from opengem.ops.reference.embedding import (
    DIM,
    EMBEDDING_ROUNDING_SEED,
    META_COLUMNS,
    OPT_ROWWISE_ADAGRAD,
    OPT_ROWWISE_ADAM,
    OPT_SGD,
    OUT_OFFSET,
    POOL_MEAN,
    POOL_NONE,
    POOLING,
    ROW_OFFSET,
    WEIGHT_OFFSET,
)
from opengem.ops.triton.rounding import element_counters, step_key, store_rounded_bf16
from opengem.ops.triton.tuning import autotune

DENSE_GRAD = 3  # "optimizer" code of the unfused path: write the aggregated row gradient out
SEGMENT = 64  # most gradient contributions one program lane sums serially (longer runs are split)


def _new_output(numel: int, like: torch.Tensor) -> torch.Tensor:
    """Uninitialized output; NaN-filled when tests set OPENGEM_POISON_OUTPUTS=1 (every element must be written)."""
    if os.environ.get("OPENGEM_POISON_OUTPUTS") == "1":
        return torch.full((numel,), float("nan"), dtype=like.dtype, device=like.device)
    return torch.empty(numel, dtype=like.dtype, device=like.device)


@triton.jit
def _id_rows(ids, positions, last):
    """The rows named at ``positions`` (0 past ``last``), as int64 for the row offsets."""
    return tl.load(ids + positions, mask=positions < last, other=0).to(tl.int64)


@triton.jit
def _lookup_bag(
    weights, ids, out, weight_start, dim, pooling, out_start, first, last, feature_first, sample, column_block,
    ALIGN: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    """One bag as [ROWS, COLS] row tiles: summed in fp32 (pooled) or each row copied out (sequence features).
    Each step's ids are loaded one step ahead of its rows, so a step waits on one memory latency, not two."""
    columns = column_block * COLS + tl.arange(0, COLS)
    column_mask = columns < dim
    positions = first + tl.arange(0, ROWS)
    rows = _id_rows(ids, positions, last)
    start = first
    total = tl.zeros([COLS], dtype=tl.float32)
    while start < last:
        next_rows = _id_rows(ids, positions + ROWS, last)
        mask = (positions < last)[:, None] & column_mask[None, :]
        row_starts = tl.multiple_of(weight_start + rows * dim, ALIGN)  # vectorized row loads
        tile = tl.load(weights + row_starts[:, None] + columns[None, :], mask=mask, other=0.0)
        if pooling == 2:  # POOL_NONE: each row to its own output row
            out_rows = tl.multiple_of(out_start + (positions - feature_first) * dim, ALIGN)
            tl.store(out + out_rows[:, None] + columns[None, :], tile, mask=mask)
        else:
            total += tl.sum(tile.to(tl.float32), axis=0)
        positions += ROWS
        start += ROWS
        rows = next_rows
    if pooling != 2:
        if pooling == 1:  # POOL_MEAN; an empty bag stays 0
            total = total / tl.maximum(last - first, 1).to(tl.float32)
        out_row = tl.multiple_of(out_start + sample * dim, ALIGN)
        tl.store(out + out_row + columns, total.to(out.dtype.element_ty), mask=column_mask)


# (BLOCK_N, num_warps): rows per step of a bag at the full BLOCK_D width. One warp per program won by far in
# session 11 (8 x 1 on issue 8's quick workload, 4 x 1 on the full one: 0.142 / 0.991 ms, against 0.235 /
# 2.378 ms at 4 warps): the per-step sum needs no cross-warp reduction (shared memory and a barrier every
# step), and up to 28 bags are in flight per SM. Timed by the autotuner on the GPU; the backward's kernels
# update the table in place, so a tuner could not re-run them.
_LOOKUP_TILES = ((4, 1), (8, 1), (16, 1), (8, 2), (16, 2))


def _lookup_configs() -> list[triton.Config]:
    if os.environ.get("TRITON_INTERPRET") == "1":  # one config: Triton's autotuner times even a lone survivor
        return [triton.Config({"BLOCK_N": 8}, num_warps=1)]
    return [triton.Config({"BLOCK_N": n}, num_warps=w) for n, w in _LOOKUP_TILES]


@autotune(configs=_lookup_configs(), key=["BLOCK_D", "ALIGN"])
@triton.jit
def _lookup_kernel(
    weights, meta, ids, offsets, out, batch_size,
    META_COLS: tl.constexpr, ALIGN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    bag = tl.program_id(0)
    column_block = tl.program_id(1)
    feature = bag // batch_size
    sample = bag % batch_size
    row_meta = meta + feature * META_COLS
    dim = tl.load(row_meta + 1)
    # programs past a narrower table's last column do nothing (no early return: plain structured control flow)
    if column_block * BLOCK_D < dim:
        weight_start = tl.load(row_meta + 0)
        pooling = tl.load(row_meta + 2)
        out_start = tl.load(row_meta + 3)
        first = tl.load(offsets + bag).to(tl.int64)
        last = tl.load(offsets + bag + 1).to(tl.int64)
        feature_first = tl.load(offsets + feature * batch_size).to(tl.int64)
        # A table narrower than the launch's widest one gets a narrower, taller tile of as many elements: the
        # same registers, every lane loading (a dim-64 table under BLOCK_D 256 masked 3 lanes in 4 before).
        if dim > BLOCK_D // 2:
            _lookup_bag(weights, ids, out, weight_start, dim, pooling, out_start, first, last, feature_first, sample,
                        column_block, ALIGN, BLOCK_N, BLOCK_D)  # fmt: skip
        elif dim > BLOCK_D // 4:
            _lookup_bag(weights, ids, out, weight_start, dim, pooling, out_start, first, last, feature_first, sample,
                        0, ALIGN, 2 * BLOCK_N, BLOCK_D // 2)  # fmt: skip
        else:
            _lookup_bag(weights, ids, out, weight_start, dim, pooling, out_start, first, last, feature_first, sample,
                        0, ALIGN, 4 * BLOCK_N, BLOCK_D // 4)  # fmt: skip


@triton.jit
def _add_contributions(
    acc, grad_out, grad_starts, grad_scales, first, count, row_mask, columns, ALIGN: tl.constexpr, UNROLL: tl.constexpr
):  # fmt: skip
    """acc [ROWS, BLOCK_D] + each lane's ``count`` gradient rows listed at sorted positions ``first, first + 1, ...``
    (scaled by 1/bag length for mean pooling), UNROLL per lane per iteration so that their loads are in flight
    together."""
    longest = tl.max(count, axis=0)
    done = 0
    while done < longest:
        for k in tl.static_range(UNROLL):
            active = (done + k) < count
            source = tl.multiple_of(tl.load(grad_starts + first + done + k, mask=active, other=0), ALIGN)
            scale = tl.load(grad_scales + first + done + k, mask=active, other=0.0)
            tile = tl.load(grad_out + source[:, None] + columns[None, :], mask=active[:, None] & row_mask, other=0.0)
            acc += tile.to(tl.float32) * scale[:, None]
        done += UNROLL
    return acc


@triton.jit(do_not_specialize=["num_slots"])  # sizes change every batch: no recompiles on their divisibility
def _segment_sum_kernel(
    grad_out, partials, segment_starts, run_ends, grad_starts, grad_scales, dims, num_slots,
    SEGMENT: tl.constexpr, ALIGN: tl.constexpr, ROWS: tl.constexpr, UNROLL: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    # Pass 1: lane s sums piece s (the SEGMENT contributions from sorted position segment_starts[s] on, cut
    # at the end of the run) into partials[s]; slots past the real number of pieces hold start -1.
    slots = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    first = tl.load(segment_starts + slots, mask=slots < num_slots, other=-1)
    live = first >= 0
    count = tl.where(live, tl.minimum(tl.load(run_ends + first, mask=live, other=0) - first, SEGMENT), 0)
    dim = tl.load(dims + first, mask=live, other=0)
    columns = tl.arange(0, BLOCK_D)
    row_mask = live[:, None] & (columns[None, :] < dim[:, None])
    total = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    total = _add_contributions(total, grad_out, grad_starts, grad_scales, first, count, row_mask, columns, ALIGN, UNROLL)
    tl.store(partials + slots[:, None] * BLOCK_D + columns[None, :], total, mask=row_mask)


@triton.jit(do_not_specialize=["num_positions", "rounding_seed"])
def _aggregate_update_kernel(
    grad_out, partials, weights, row_state, elem_state, corrections, skip, step,
    sorted_keys, run_ends, pieces_before, grad_starts, grad_scales, weight_starts, dims, num_positions,
    lr, eps, beta1, beta2, weight_decay, one_minus_beta1, one_minus_beta2, rounding_seed,
    OPTIMIZER: tl.constexpr, SEGMENT: tl.constexpr, ALIGN: tl.constexpr, ROWS: tl.constexpr, UNROLL: tl.constexpr,
    BLOCK_D: tl.constexpr, STOCHASTIC: tl.constexpr,
):  # fmt: skip
    # ROWS consecutive positions of the sorted index; a position that starts a run of equal rows owns
    # that row (runs are contiguous after sorting), the others are masked out.
    positions = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    in_range = positions < num_positions
    keys = tl.load(sorted_keys + positions, mask=in_range, other=-1)
    previous = tl.load(sorted_keys + positions - 1, mask=in_range & (positions > 0), other=-1)
    first = keys != previous  # keys >= 0, so position 0 is a start and out-of-range lanes are not
    first = first & (tl.load(skip + positions * 0) == 0)  # a skipped step (non-finite loss) writes nothing
    run_length = tl.where(first, tl.load(run_ends + positions, mask=first, other=0) - positions, 0)
    dim = tl.load(dims + positions, mask=first, other=0)
    weight_start = tl.multiple_of(tl.load(weight_starts + positions, mask=first, other=0), ALIGN)
    columns = tl.arange(0, BLOCK_D)
    row_mask = first[:, None] & (columns[None, :] < dim[:, None])
    # 1. sum each row's gradient: its first SEGMENT contributions, then the partial sums of the run's
    #    later pieces (pass 1 numbered them consecutively from pieces_before[position] on)
    grad = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    direct = tl.minimum(run_length, SEGMENT)
    grad = _add_contributions(grad, grad_out, grad_starts, grad_scales, positions, direct, row_mask, columns, ALIGN, UNROLL)
    pieces = tl.where(first, (run_length - 1) // SEGMENT, 0)  # ceil(run_length / SEGMENT) - 1
    piece_base = tl.load(pieces_before + positions, mask=first, other=0)
    longest = tl.max(pieces, axis=0)
    done = 0
    while done < longest:
        for k in tl.static_range(UNROLL):
            active = (done + k) < pieces
            slot = piece_base + done + k
            grad += tl.load(partials + slot[:, None] * BLOCK_D + columns[None, :], mask=active[:, None] & row_mask, other=0.0)
        done += UNROLL
    row_ptrs = weights + weight_start[:, None] + columns[None, :]
    if OPTIMIZER == 3:  # DENSE_GRAD: write each row's plain gradient
        tl.store(row_ptrs, grad.to(weights.dtype.element_ty), mask=row_mask)
    else:
        # 2. one optimizer step per row (L2 weight decay folded into the gradient)
        w = tl.load(row_ptrs, mask=row_mask, other=0.0).to(tl.float32)
        grad = grad + weight_decay * w
        mean_square = tl.sum(grad * grad, axis=1) / tl.maximum(dim, 1).to(tl.float32)  # masked columns are 0
        if OPTIMIZER == 0:  # SGD
            w = w - lr * grad
        elif OPTIMIZER == 1:  # row-wise Adagrad: one accumulator per row
            state = tl.load(row_state + keys, mask=first, other=0.0) + mean_square
            tl.store(row_state + keys, state, mask=first)
            w = w - lr * grad / (tl.sqrt(state)[:, None] + eps)
        else:  # row-wise Adam: per-element first moment, per-row second moment, bias-corrected
            moment_ptrs = elem_state + weight_start[:, None] + columns[None, :]
            m = beta1 * tl.load(moment_ptrs, mask=row_mask, other=0.0) + one_minus_beta1 * grad
            v = beta2 * tl.load(row_state + keys, mask=first, other=0.0) + one_minus_beta2 * mean_square
            tl.store(moment_ptrs, m, mask=row_mask)
            tl.store(row_state + keys, v, mask=first)
            m_hat = m / tl.load(corrections + 0)
            v_hat = v / tl.load(corrections + 1)
            w = w - lr * m_hat / (tl.sqrt(v_hat)[:, None] + eps)
        if STOCHASTIC:  # bf16 tables: the reference's bits, keyed by the step, counted by the flat element index
            counters = element_counters(weight_start[:, None] + columns[None, :])
            store_rounded_bf16(row_ptrs, w, counters, step_key(rounding_seed, tl.load(step)), row_mask)
        else:
            tl.store(row_ptrs, w.to(weights.dtype.element_ty), mask=row_mask)


def embedding_lookup(
    weights: torch.Tensor, feature_meta: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, batch_size: int,
    out_numel: int, max_dim: int, dim_align: int, config: dict | None = None,
) -> torch.Tensor:
    """``config``: launch with these ``BLOCK_N`` and ``num_warps`` instead of the autotuner's pick (tests, diag)."""
    out = _new_output(out_numel, weights)
    bags = feature_meta.shape[0] * batch_size
    if bags == 0 or out_numel == 0:
        return out
    block_d = min(triton.next_power_of_2(max_dim), 256)  # one column block for dims <= 256
    launcher = _lookup_kernel if config is None else _lookup_kernel.fn
    launcher[(bags, triton.cdiv(max_dim, block_d))](
        weights, feature_meta, ids, offsets, out, batch_size,
        META_COLS=META_COLUMNS, ALIGN=dim_align, BLOCK_D=block_d, **(config or {}),
    )  # fmt: skip
    return out


def lookup_configs() -> list[dict]:
    """Every tuning candidate of the forward as a ``config`` of :func:`embedding_lookup`."""
    return [{"BLOCK_N": n, "num_warps": w} for n, w in _LOOKUP_TILES]


def _sorted_contributions(
    feature_meta: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, batch_size: int
) -> dict[str, torch.Tensor]:
    """Each id's global row, gradient source and scale, sorted by row (torch ops, no device sync)."""
    num_ids = ids.numel()
    num_features = feature_meta.shape[0]
    offsets = offsets.long()
    bag_of_id = torch.repeat_interleave(
        torch.arange(num_features * batch_size, device=ids.device), offsets[1:] - offsets[:-1], output_size=num_ids
    )
    feature = bag_of_id // batch_size
    meta = feature_meta[feature]  # [N, 6]
    dim = meta[:, DIM]
    pooled = meta[:, POOLING] != POOL_NONE
    position_in_feature = torch.arange(num_ids, device=ids.device) - offsets[feature * batch_size]
    grad_row = torch.where(pooled, bag_of_id - feature * batch_size, position_in_feature)
    lengths = (offsets[bag_of_id + 1] - offsets[bag_of_id]).clamp(min=1)
    scale = torch.where(meta[:, POOLING] == POOL_MEAN, 1.0 / lengths.float(), torch.ones_like(lengths, dtype=torch.float32))
    keys = meta[:, ROW_OFFSET] + ids.long()
    sorted_keys, order = torch.sort(keys, stable=True)
    return {
        "sorted_keys": sorted_keys,
        "run_starts": torch.searchsorted(sorted_keys, sorted_keys),
        "run_ends": torch.searchsorted(sorted_keys, sorted_keys, right=True),
        "grad_starts": (meta[:, OUT_OFFSET] + grad_row * dim)[order],
        "grad_scales": scale[order],
        "weight_starts": (meta[:, WEIGHT_OFFSET] + ids.long() * dim)[order],
        "dims": dim[order],
    }


def _pieces(run_starts: torch.Tensor, segment: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The later pieces of long runs: a piece starts at every multiple of ``segment`` past a run's start.

    Returns (pieces_before [N]: how many pieces start before each position, so a run's pieces are numbered
    from pieces_before[run start] on; piece_starts [N // segment]: each piece's first position, -1 past the
    real number of pieces, which N // segment bounds since every piece follows ``segment`` positions of its
    run). Torch ops only: no device sync.
    """
    num_positions = run_starts.numel()
    into_run = torch.arange(num_positions, device=run_starts.device) - run_starts
    starts_piece = ((into_run >= segment) & (into_run % segment == 0)).long()
    through = torch.cumsum(starts_piece, 0)
    slots = torch.arange(num_positions // segment, device=run_starts.device)
    piece_starts = torch.searchsorted(through, slots, right=True)  # first position with more than s piece starts
    return through - starts_piece, torch.where(piece_starts < num_positions, piece_starts, -1)


def _aggregate_update(
    grad_out: torch.Tensor,
    target: torch.Tensor,
    row_state: torch.Tensor,
    elem_state: torch.Tensor,
    corrections: torch.Tensor,
    skip: torch.Tensor,
    feature_meta: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    batch_size: int,
    max_dim: int,
    dim_align: int,
    optimizer: int,
    hyper: tuple[float, float, float, float, float],
    segment: int,
    step: torch.Tensor | None = None,
) -> None:
    """``step`` (the optimizer's counter, after this step's increment): given for a bf16 ``target``, its rows are
    stored rounded stochastically, keyed by it (`opengem.ops.reference.embedding`)."""
    if ids.numel() == 0:
        return
    if segment < 1:
        raise ValueError(f"segment must be >= 1, got {segment}")
    parts = _sorted_contributions(feature_meta, ids, offsets, batch_size)
    pieces_before, piece_starts = _pieces(parts["run_starts"], segment)
    block_d = triton.next_power_of_2(max_dim)
    rows = max(1, min(16, 4096 // block_d))  # a [ROWS, BLOCK_D] fp32 tile of at most 16 KiB
    sizes = {"SEGMENT": segment, "ALIGN": dim_align, "ROWS": rows, "UNROLL": 4, "BLOCK_D": block_d}
    sizes["num_warps"] = 8 if rows * block_d >= 2048 else 4
    contributions = (parts["grad_starts"], parts["grad_scales"])
    partials = _new_output(piece_starts.numel() * block_d, grad_out.new_empty(0, dtype=torch.float32))
    if piece_starts.numel():
        _segment_sum_kernel[(triton.cdiv(piece_starts.numel(), rows),)](
            grad_out, partials, piece_starts, parts["run_ends"], *contributions, parts["dims"], piece_starts.numel(), **sizes
        )  # fmt: skip
    _aggregate_update_kernel[(triton.cdiv(ids.numel(), rows),)](
        grad_out, partials, target, row_state, elem_state, corrections, skip, skip if step is None else step,
        parts["sorted_keys"], parts["run_ends"], pieces_before, *contributions,
        parts["weight_starts"], parts["dims"], ids.numel(), *hyper,
        1.0 - hyper[2], 1.0 - hyper[3],  # in float64 here: 1 - 0.999 computed in fp32 is off by 1.3e-5
        EMBEDDING_ROUNDING_SEED, OPTIMIZER=optimizer, STOCHASTIC=step is not None, **sizes,
    )  # fmt: skip


def embedding_dense_grad(
    grad_out: torch.Tensor,
    weights: torch.Tensor,
    feature_meta: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    batch_size: int,
    max_dim: int,
    dim_align: int,
    segment: int = SEGMENT,
) -> torch.Tensor:
    grad = torch.zeros_like(weights)
    empty = torch.empty(0, device=weights.device)
    no_skip = torch.zeros(1, device=weights.device)
    _aggregate_update(
        grad_out, grad, empty, empty, empty, no_skip, feature_meta, ids, offsets, batch_size, max_dim, dim_align,
        DENSE_GRAD, (0.0, 0.0, 0.0, 0.0, 0.0), segment,
    )  # fmt: skip
    return grad


def embedding_fused_update_(
    grad_out: torch.Tensor,
    weights: torch.Tensor,
    row_state: torch.Tensor,
    elem_state: torch.Tensor,
    step: torch.Tensor,
    feature_meta: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    batch_size: int,
    max_dim: int,
    dim_align: int,
    optimizer: int,
    lr: float,
    eps: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    segment: int = SEGMENT,
    skip: torch.Tensor | None = None,
    stochastic_rounding: bool = False,
) -> None:
    """``skip`` (``[1]`` on the device, optional): when nonzero the step leaves every table, state and the
    step count untouched; read by the kernel, so a non-finite loss skips the update without a host sync.
    ``stochastic_rounding``: bf16 tables store their updated rows rounded stochastically (the reference's bits)."""
    if optimizer not in (OPT_SGD, OPT_ROWWISE_ADAGRAD, OPT_ROWWISE_ADAM):
        raise ValueError(f"unknown optimizer code {optimizer}")
    skip = torch.zeros(1, device=weights.device) if skip is None else skip
    step += (skip == 0).to(step.dtype)
    corrections = torch.empty(0, device=weights.device)
    if optimizer == OPT_ROWWISE_ADAM:
        # bias corrections 1 - beta**t from the step count on the device: no sync, and no tensor made from
        # host values (a copy from pageable memory would wait for the queued GPU work)
        t = step.double()
        corrections = torch.cat([1 - torch.pow(beta1, t), 1 - torch.pow(beta2, t)]).float()
    _aggregate_update(
        grad_out, weights, row_state, elem_state, corrections, skip, feature_meta, ids, offsets, batch_size, max_dim,
        dim_align, optimizer, (lr, eps, beta1, beta2, weight_decay), segment,
        step if stochastic_rounding and weights.dtype == torch.bfloat16 else None,
    )  # fmt: skip
