"""Expert parallelism for dense experts (every expert sees every sample; the outputs are summed).

With E ranks in an expert group, rank r keeps only expert r. Forward: all-gather the group's
activations along the batch, run the local expert on the whole gathered batch, reduce-scatter (sum)
the outputs so every rank gets, for its own rows, the sum over all experts. Backward mirrors it:
the gradient of an all-gather is a reduce-scatter and vice versa.

Unequal per-rank batch sizes: the sizes are all-gathered first (one tiny collective per call, which also
checks that every rank's activations have one trailing shape and dtype); the
activations are padded to the largest size so that the fixed-size collectives (``all_gather_single``,
``reduce_scatter_single``) apply, and the padding rows are dropped again. The padded buffers are
what travels, and what ``CommStats`` counts.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from torch import nn

from opengem.parallel.collectives import (
    PROCESS_GROUP,
    SYMM_MEM_COPY_ENGINE,
    CommStats,
    all_gather_single,
    enable_copy_engine_all_gather,
    reduce_scatter_single,
)
from opengem.validation import is_int

EXPERT_DIM = "expert"


def gather_batch_sizes(x: torch.Tensor, group: dist.ProcessGroup, stats: CommStats | None = None) -> list[int]:
    """The batch size (``x.shape[0]``) of every rank of ``group``, in group-rank order.

    Each rank also sends a checksum of its ``x``'s trailing shape and dtype, so that ranks passing unlike tensors
    raise ``ValueError`` (every rank, so none waits): the fixed-size collectives had reinterpreted the bytes
    (float32 ones arriving as 1.4e-45) or aborted the process."""
    world = dist.get_world_size(group)
    local = torch.tensor([x.shape[0], _layout_checksum(x)], dtype=torch.int64, device=x.device)
    gathered = torch.empty(world * 2, dtype=torch.int64, device=x.device)
    all_gather_single(gathered, local, group)
    if stats is not None:
        stats.record(EXPERT_DIM, "all_gather_sizes", gathered.numel() * gathered.element_size())
    sizes, checksums = gathered.view(world, 2).t().tolist()
    unlike = [rank for rank, checksum in enumerate(checksums) if checksum != checksums[dist.get_rank(group)]]
    if unlike:
        raise ValueError(f"rank {unlike[0]} of the group passes a tensor of another trailing shape or dtype than "
                         f"rank {dist.get_rank(group)}'s [*, {', '.join(map(str, x.shape[1:]))}] {x.dtype}; every "
                         "rank must pass the same")
    return sizes


def _layout_checksum(x: torch.Tensor) -> int:
    return zlib.crc32(f"{tuple(x.shape[1:])} {x.dtype}".encode())  # the same in every process (hash() of str is not)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x.contiguous()
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


def _all_gather(
    x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup, stats: CommStats | None, route: str
) -> torch.Tensor:
    width = max(sizes)
    padded = _pad_rows(x, width)
    out = padded.new_empty(width * len(sizes), *x.shape[1:])
    all_gather_single(out, padded, group, route)
    if stats is not None:
        stats.record(EXPERT_DIM, "all_gather", out.numel() * out.element_size())
    chunks = out.split(width)
    return torch.cat([chunk[:n] for chunk, n in zip(chunks, sizes)])


def _reduce_scatter(y: torch.Tensor, sizes: list[int], group: dist.ProcessGroup, stats: CommStats | None) -> torch.Tensor:
    width = max(sizes)
    padded = torch.cat([_pad_rows(part, width) for part in y.split(sizes)])
    out = padded.new_empty(width, *y.shape[1:])
    reduce_scatter_single(out, padded, group)
    if stats is not None:
        stats.record(EXPERT_DIM, "reduce_scatter", padded.numel() * padded.element_size())
    rows = sizes[dist.get_rank(group)]
    # A fresh tensor, not a view: callers (FSDP hooks, in-place residual adds) must not alias the buffer.
    return out if rows == width else out[:rows].clone()


class _AllGatherAlongBatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group, stats, route):  # type: ignore[override]
        ctx.sizes, ctx.group, ctx.stats = sizes, group, stats
        return _all_gather(x, sizes, group, stats, route)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _reduce_scatter(grad, ctx.sizes, ctx.group, ctx.stats), None, None, None, None


class _ReduceScatterAlongBatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, sizes, group, stats, route):  # type: ignore[override]
        ctx.sizes, ctx.group, ctx.stats, ctx.route = sizes, group, stats, route
        return _reduce_scatter(y, sizes, group, stats)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _all_gather(grad, ctx.sizes, ctx.group, ctx.stats, ctx.route), None, None, None, None


def _check_sizes(x: torch.Tensor, sizes: list[int], group: dist.ProcessGroup, rows: int, name: str) -> None:
    if len(sizes) != dist.get_world_size(group):
        raise ValueError(f"sizes has {len(sizes)} entries, the group has {dist.get_world_size(group)} ranks")
    if any(not is_int(size) or size < 0 for size in sizes):  # [-1, 3] summed right and failed inside torch's split
        raise ValueError(f"sizes must be ints >= 0, got {sizes}")
    if x.shape[0] != rows:
        raise ValueError(f"{name} has {x.shape[0]} rows, expected {rows} from sizes={sizes}")


def all_gather_along_batch(
    x: torch.Tensor,
    group: dist.ProcessGroup,
    sizes: list[int] | None = None,
    stats: CommStats | None = None,
    route: str = PROCESS_GROUP,
) -> torch.Tensor:
    """Concatenate every rank's ``x`` (rows ``sizes[i]``, any trailing shape) along dim 0, in rank order.

    ``x``: (sizes[rank], ...) -> (sum(sizes), ...), same dtype. ``sizes`` (host ints, identical on all
    ranks) defaults to ``gather_batch_sizes(x, group)``. ``route``: ``PROCESS_GROUP`` (NCCL / gloo) or
    ``SYMM_MEM_COPY_ENGINE`` (CUDA; see ``opengem.parallel.collectives``). Backward: reduce-scatter
    (sum) of the gradient.
    """
    sizes = sizes if sizes is not None else gather_batch_sizes(x, group, stats)
    _check_sizes(x, sizes, group, sizes[dist.get_rank(group)], "x")
    return _AllGatherAlongBatch.apply(x, list(sizes), group, stats, route)


def reduce_scatter_along_batch(
    y: torch.Tensor,
    sizes: list[int],
    group: dist.ProcessGroup,
    stats: CommStats | None = None,
    route: str = PROCESS_GROUP,
) -> torch.Tensor:
    """Sum ``y`` (sum(sizes), ...) over the ranks of ``group``; rank i keeps rows of block i: (sizes[i], ...).

    Backward: all-gather of the gradient (through ``route``).
    """
    _check_sizes(y, sizes, group, sum(sizes), "y")
    return _ReduceScatterAlongBatch.apply(y, list(sizes), group, stats, route)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by ``scale`` in backward."""

    @staticmethod
    def forward(ctx, x, scale):  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad * ctx.scale, None


class ExpertParallel(nn.Module):
    """Run one expert of ``experts`` per rank of ``group``; forward returns sum_e expert_e(x) for the local rows.

    ``experts``: an ``nn.ModuleList`` (or any indexable sequence of modules) with exactly
    ``group.size()`` experts, each mapping (N, ...) -> (N, ...) row-wise. Rank r keeps
    ``experts[r]`` (as ``self.experts["r"]``, so that its parameter names are those of the plain
    model) and drops the others; build every rank's experts from the same seed.

    Gradient convention: the local expert's gradient is the *mean* over the group's ranks of the
    gradients of their local losses (not the sum), exactly like a data-parallel gradient. So data
    parallelism over the ranks holding the same expert (FSDP's mean reduction) yields the gradient of
    the mean loss over all ranks, as for the dense parameters. Input gradients are exact.
    ``route`` picks the all-gather implementation (``opengem.parallel.collectives``).
    """

    def __init__(
        self,
        experts: nn.ModuleList,
        group: dist.ProcessGroup,
        stats: CommStats | None = None,
        route: str = PROCESS_GROUP,
    ) -> None:
        super().__init__()
        world = dist.get_world_size(group)
        if len(experts) != world:
            raise ValueError(f"ExpertParallel: {len(experts)} experts for an expert group of {world} ranks; expected equal")
        self.group = group
        self.stats = stats
        self.route = route
        if route == SYMM_MEM_COPY_ENGINE:
            enable_copy_engine_all_gather(group)
        self.expert_index = dist.get_rank(group)
        # Registered under its index, so parameter names match the unparallelized model's
        # (``experts.<r>.*``): checkpoints move between expert-parallel and plain layouts.
        self.experts = nn.ModuleDict({str(self.expert_index): experts[self.expert_index]})

    @property
    def expert(self) -> nn.Module:
        """The expert this rank runs."""
        return self.experts[str(self.expert_index)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        world = dist.get_world_size(self.group)
        sizes = gather_batch_sizes(x, self.group, self.stats)
        gathered = all_gather_along_batch(x, self.group, sizes, self.stats, self.route)
        # Input gradient scaled by E then output gradient by 1/E: input gradients unchanged, the
        # expert's parameter gradient divided by E (the group mean described in the class docstring).
        out = self.expert(_ScaleGrad.apply(gathered, float(world)))
        out = _ScaleGrad.apply(out, 1.0 / world)
        return reduce_scatter_along_batch(out, sizes, self.group, self.stats, self.route)
