"""Cutting a stream of row blocks into batches: fixed size, token budget, Base Batch Shuffling.

Every batcher takes an iterator of :class:`RowBlock` and yields RowBlocks; rows keep their order
(except under shuffling, which only permutes) and no row is ever duplicated, nor dropped unless
``drop_last`` asks to drop the stream's last, partial batch. Batches may span block boundaries. Work is
per batch, never per row.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Literal

import numpy as np

from opengem.data.layout import RowBlock

CostKind = Literal["tokens", "squared"]


class _RowQueue:
    """FIFO of rows held as a list of blocks; popping a prefix slices, concatenating only across blocks."""

    def __init__(self) -> None:
        self.blocks: list[RowBlock] = []
        self.num_rows = 0

    def push(self, block: RowBlock) -> None:
        if block.num_rows:
            self.blocks.append(block)
            self.num_rows += block.num_rows

    def lengths(self) -> np.ndarray:
        if not self.blocks:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([b.history_lengths() for b in self.blocks])

    def pop(self, count: int) -> RowBlock:
        parts: list[RowBlock] = []
        remaining = count
        while remaining:
            head = self.blocks[0]
            if head.num_rows <= remaining:
                parts.append(self.blocks.pop(0))
                remaining -= head.num_rows
            else:
                parts.append(head.slice(0, remaining))
                self.blocks[0] = head.slice(remaining, head.num_rows)
                remaining = 0
        self.num_rows -= count
        return RowBlock.concat(parts)


def fixed_size_batches(blocks: Iterable[RowBlock], batch_size: int, drop_last: bool = False) -> Iterator[RowBlock]:
    """Batches of exactly ``batch_size`` rows; the last one may be smaller unless ``drop_last``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    queue = _RowQueue()
    for block in blocks:
        queue.push(block)
        while queue.num_rows >= batch_size:
            yield queue.pop(batch_size)
    if queue.num_rows and not drop_last:
        yield queue.pop(queue.num_rows)


def token_budget_cuts(lengths: np.ndarray, token_budget: int, max_rows: int | None = None) -> list[int]:
    """Greedy batch ends over ``lengths``: a batch takes rows while its history tokens stay within
    ``token_budget`` (and its rows within ``max_rows``); a row longer than the budget forms its own
    batch. Returns the end index of every batch; the last end is ``len(lengths)``."""
    cumulative = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=cumulative[1:])
    ends, start = [], 0
    while start < len(lengths):
        end = int(np.searchsorted(cumulative, cumulative[start] + token_budget, side="right")) - 1
        end = max(end, start + 1)
        if max_rows is not None:
            end = min(end, start + max_rows)
        ends.append(end)
        start = end
    return ends


def token_budget_batches(
    blocks: Iterable[RowBlock], token_budget: int, max_rows: int | None = None, drop_last: bool = False
) -> Iterator[RowBlock]:
    """Batches filled until the sum of history lengths would pass ``token_budget`` (see token_budget_cuts).

    Every batch but the last was closed because its next row did not fit; the last one was closed by the end
    of the stream. ``drop_last`` drops that last batch unless it is full: it holds at least ``token_budget``
    history tokens, or ``max_rows`` rows.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    queue = _RowQueue()
    for block in blocks:
        queue.push(block)
        ends = token_budget_cuts(queue.lengths(), token_budget, max_rows)
        # The last batch stays open: rows from the next block may still fit into it.
        start = 0
        for end in ends[:-1]:
            yield queue.pop(end - start)
            start = end
    if not queue.num_rows:
        return
    sizes = np.diff([0, *token_budget_cuts(queue.lengths(), token_budget, max_rows)])
    for size in sizes[:-1]:
        yield queue.pop(int(size))
    last = queue.pop(int(sizes[-1]))
    full = int(last.history_lengths().sum()) >= token_budget or (max_rows is not None and last.num_rows >= max_rows)
    if full or not drop_last:
        yield last


def batch_costs(block: RowBlock, cost: CostKind) -> float:
    lengths = block.history_lengths().astype(np.float64)
    return float((lengths**2).sum() if cost == "squared" else lengths.sum())


def base_batch_shuffling(
    blocks: Iterable[RowBlock],
    batch_size: int,
    sub_batch_size: int = 128,
    window_batches: int = 8,
    cost: CostKind = "tokens",
    drop_last: bool = False,
) -> Iterator[RowBlock]:
    """Base Batch Shuffling (GEM_SPEC section 7).

    The stream is cut into sub-batches of ``sub_batch_size`` rows. Each window of ``window_batches``
    batches' worth of sub-batches is sorted by cost (sum of history lengths, or of squared lengths for
    attention-heavy models) and dealt heavy/light in snake order (0, 1, .., n-1, n-1, .., 0, ...), so
    the batches of a window carry about the same cost. Each batch holds ``batch_size`` rows (the
    last window may give smaller ones); every row appears exactly once. With ``drop_last`` every batch holds
    exactly ``batch_size`` rows: the stream's last rows that do not fill one (a partial sub-batch and the
    sub-batches of the last window beyond a multiple of ``batch_size / sub_batch_size``) are dropped.
    """
    if sub_batch_size < 1 or batch_size % sub_batch_size:
        raise ValueError(f"batch_size {batch_size} must be a positive multiple of sub_batch_size {sub_batch_size}")
    if window_batches < 1:
        raise ValueError(f"window_batches must be >= 1, got {window_batches}")
    if cost not in ("tokens", "squared"):
        raise ValueError(f"cost must be 'tokens' or 'squared', got {cost!r}")
    per_batch = batch_size // sub_batch_size
    window: list[RowBlock] = []
    for sub_batch in fixed_size_batches(blocks, sub_batch_size, drop_last):
        window.append(sub_batch)
        if len(window) == per_batch * window_batches:
            yield from _deal(window, per_batch, cost)
            window = []
    if drop_last:
        del window[len(window) // per_batch * per_batch :]  # the stream's tail, in stream order
    if window:
        yield from _deal(window, per_batch, cost)


def _deal(sub_batches: list[RowBlock], per_batch: int, cost: CostKind) -> Iterator[RowBlock]:
    num_batches = -(-len(sub_batches) // per_batch)
    order = sorted(range(len(sub_batches)), key=lambda i: -batch_costs(sub_batches[i], cost))
    lanes = np.concatenate([np.arange(num_batches), np.arange(num_batches)[::-1]])
    members: list[list[RowBlock]] = [[] for _ in range(num_batches)]
    for rank, index in enumerate(order):
        members[int(lanes[rank % len(lanes)])].append(sub_batches[index])
    for parts in members:
        yield RowBlock.concat(parts)


def shuffled_rows(blocks: Iterable[RowBlock], buffer_rows: int, rng: np.random.Generator) -> Iterator[RowBlock]:
    """Windowed shuffle: gather blocks until at least ``buffer_rows`` rows, emit them permuted."""
    queue = _RowQueue()
    for block in blocks:
        queue.push(block)
        if queue.num_rows >= buffer_rows:
            yield _permuted(queue.pop(queue.num_rows), rng)
    if queue.num_rows:
        yield _permuted(queue.pop(queue.num_rows), rng)


def _permuted(block: RowBlock, rng: np.random.Generator) -> RowBlock:
    return block.take(rng.permutation(block.num_rows))
