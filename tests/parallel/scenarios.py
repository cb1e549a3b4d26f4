"""Models, data and per-rank training scenarios shared by the distributed tests (runs inside the workers).

Every scenario builds the same model from the same seed on every rank, gives each rank its
contiguous slice of one global batch (equal, or uneven with ``data_parallel_loss``), and returns what
the single-process reference is compared with.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from opengem.parallel import (
    CommStats,
    ExpertParallel,
    ModelOptimizerState,
    ParallelMeshes,
    build_meshes,
    clip_grad_norm_,
    data_parallel_loss,
    fsdp_step_bytes,
    load_distributed,
    parallelize,
    parse_parallel,
    save_distributed,
)

IN_DIM, DIM, HIDDEN, OUT_DIM, VOCAB = 6, 10, 14, 3, 7
GLOBAL_BATCH, STEPS, SAVE_AFTER, LR = 8, 5, 3, 1e-2
MAX_GRAD_NORM = 1.0  # below the gradient norms of the first steps: clipping changes the result


class Experts(nn.Module):
    """Dense experts: every expert sees every sample, outputs summed."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM)) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(expert(x) for expert in self.experts)


class Table(nn.Embedding):
    """Stands in for the embedding collection: sparse, managed outside FSDP (frozen here)."""

    opengem_sparse = True


class Block(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))
        self.experts = Experts(experts) if experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.mlp(h)
        return x + self.experts(h) if self.experts is not None else x


class TinyModel(nn.Module):
    """in_proj -> blocks -> head, plus a sparse table added to the input (odd sizes exercise FSDP padding)."""

    def __init__(self, blocks: int = 3, experts: int = 0) -> None:
        super().__init__()
        self.table = Table(VOCAB, DIM)
        self.table.weight.requires_grad_(False)
        self.in_proj = nn.Linear(IN_DIM, DIM)
        self.blocks = nn.ModuleList(Block(experts if i == 1 else 0) for i in range(blocks))
        self.head = nn.Linear(DIM, OUT_DIM)
        self.head.bias.requires_grad_(False)  # a frozen dense parameter: all-gathered, never reduced

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = self.in_proj(x) + self.table(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def make_model(experts: int = 0) -> TinyModel:
    torch.manual_seed(0)
    return TinyModel(experts=experts)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    x = torch.randn(GLOBAL_BATCH, IN_DIM, generator=generator)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH,), generator=generator)
    y = torch.randn(GLOBAL_BATCH, OUT_DIM, generator=generator)
    return x, ids, y


UNEVEN_2 = (0, 3, GLOBAL_BATCH)  # row boundaries of an uneven 2-rank split


def local_slice(tensors: tuple[torch.Tensor, ...], rank: int, world: int, uneven: bool = False) -> tuple[torch.Tensor, ...]:
    """This rank's rows of the global batch: equal contiguous slices, or the UNEVEN_2 split."""
    if uneven:
        start, stop = UNEVEN_2[rank], UNEVEN_2[rank + 1]
    else:
        start, stop = rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world
    return tuple(t[start:stop] for t in tensors)


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)


def forward_backward(
    model: nn.Module, step: int, rank: int, world: int, uneven: bool = False
) -> tuple[torch.Tensor, int]:
    """Backpropagate the loss of this rank's slice of the batch of ``step``; return (local mean loss, rows).

    Uneven slices backpropagate ``data_parallel_loss`` so that the gradient is the global mean's.
    """
    x, ids, y = local_slice(batch(step), rank, world, uneven)
    rows = x.shape[0]
    if uneven:
        loss_sum = nn.functional.mse_loss(model(x, ids), y, reduction="sum") / OUT_DIM
        data_parallel_loss(loss_sum, rows).backward()
        return loss_sum.detach() / rows, rows
    loss = nn.functional.mse_loss(model(x, ids), y)
    loss.backward()
    return loss.detach(), rows


def clip_and_step(model: nn.Module, opt: torch.optim.Optimizer) -> float:
    """Clip to MAX_GRAD_NORM (global norm across ranks when distributed), AdamW step; returns the norm."""
    if dist.is_initialized():
        norm = clip_grad_norm_(model, MAX_GRAD_NORM)
    else:
        norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], MAX_GRAD_NORM)
    opt.step()
    opt.zero_grad()
    return norm.item()


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, world: int) -> tuple[torch.Tensor, float]:
    loss, _ = forward_backward(model, step, rank, world)
    return loss, clip_and_step(model, opt)


def reference_run(experts: int = 0) -> dict[str, Any]:
    """Single process, whole global batch: losses, gradient norms and final parameters."""
    model = make_model(experts)
    opt = optimizer(model)
    losses, norms = zip(*(train_step(model, opt, step, 0, 1) for step in range(STEPS)))
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"losses": [loss.item() for loss in losses], "norms": list(norms), "params": params}


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded parameters under the plain model's names (an expert-parallel rank holds only its expert)."""
    out = {}
    for name, p in model.named_parameters():
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.replace("_checkpoint_wrapped_module.", "")] = value.detach().clone()
    return out


def global_mean(loss: torch.Tensor, rows: int) -> float:
    """The global batch's mean loss from each rank's local mean over ``rows`` rows."""
    totals = torch.stack([loss * rows, loss.new_tensor(float(rows))])
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


@contextmanager
def recorded_collectives(meshes: ParallelMeshes) -> Iterator[CommStats]:
    """Count the bytes of the real c10d collectives (outermost call only), keyed by mesh dimension."""
    names = {}  # groups with the same ranks are shared between meshes: the dense name wins
    for mesh in (meshes.expert, meshes.dense):
        if mesh is not None:
            for dim in mesh.mesh_dim_names:
                names[mesh.get_group(dim).group_name] = dim
    stats = CommStats()
    depth = [0]  # nesting: a deprecated alias calling the new collective counts once
    originals = {}

    def wrap(op_name: str, collective: str, tensor_arg: str):
        original = getattr(dist, op_name)
        signature = inspect.signature(original)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                bound = signature.bind(*args, **kwargs).arguments
                group = bound.get("group")
                tensor = bound[tensor_arg]
                dim = names.get(group.group_name, "other") if group is not None else "world"
                stats.record(dim, collective, tensor.numel() * tensor.element_size())
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1

        originals[op_name] = original
        setattr(dist, op_name, recorded)

    for op_name, collective, tensor_arg in (
        ("all_gather_single", "all_gather", "output_tensor"),
        ("all_gather_into_tensor", "all_gather", "output_tensor"),
        ("reduce_scatter_single", "reduce_scatter", "input"),
        ("reduce_scatter_tensor", "reduce_scatter", "input"),
        ("all_reduce", "all_reduce", "tensor"),
    ):
        if hasattr(dist, op_name):
            wrap(op_name, collective, tensor_arg)
    try:
        yield stats
    finally:
        for op_name, original in originals.items():
            setattr(dist, op_name, original)


def train_distributed(
    spec: str,
    experts: int = 0,
    save_dir: str | None = None,
    measure_step: int | None = None,
    uneven: bool = False,
) -> dict[str, Any]:
    """5 AdamW steps under ``spec``; optional checkpoint after step ``SAVE_AFTER`` and byte measurement."""
    rank, world = dist.get_rank(), dist.get_world_size()
    meshes = build_meshes(parse_parallel(spec))
    model = make_model(experts)
    expert_stats = CommStats()
    units = parallelize(model, meshes, expert_types=(Experts,), stats=expert_stats)
    opt = optimizer(model)
    result: dict[str, Any] = {"losses": [], "norms": [], "table_is_plain": type(model.table.weight) is nn.Parameter}
    for step in range(STEPS):
        if step == measure_step:
            expert_stats.reset()
            with recorded_collectives(meshes) as measured:
                loss, rows = forward_backward(model, step, rank, world)
            result["measured"] = dict(measured.bytes)
            result["analytic"] = fsdp_step_bytes(units, param_bytes=4, reduce_bytes=4)
            result["expert_bytes"] = dict(expert_stats.bytes)
        else:
            loss, rows = forward_backward(model, step, rank, world, uneven)
        result["norms"].append(clip_and_step(model, opt))
        result["losses"].append(global_mean(loss, rows))
        if save_dir is not None and step + 1 == SAVE_AFTER:
            save_distributed({"train": ModelOptimizerState(model, opt)}, save_dir)
            result["params_at_save"] = full_params(model)
    result["params"] = full_params(model)
    return result


def resume_distributed(spec: str, load_dir: str, experts: int = 0) -> dict[str, Any]:
    """Load the checkpoint into a fresh model under ``spec`` and run the remaining steps."""
    rank, world = dist.get_rank(), dist.get_world_size()
    meshes = build_meshes(parse_parallel(spec))
    model = make_model(experts)
    with torch.no_grad():  # make sure loading, not the shared seed, sets the parameters
        for p in model.parameters():
            if p.requires_grad:
                p.zero_()
    parallelize(model, meshes, expert_types=(Experts,))
    opt = optimizer(model)
    load_distributed({"train": ModelOptimizerState(model, opt)}, load_dir)
    loaded = full_params(model)
    rows = GLOBAL_BATCH // world
    losses = [global_mean(train_step(model, opt, step, rank, world)[0], rows) for step in range(SAVE_AFTER, STEPS)]
    return {"loaded": loaded, "losses": losses}


EXPERT_ROWS = (3, 5)  # unequal per-rank batch sizes for the 2-rank expert test


def expert_inputs() -> tuple[nn.ModuleList, torch.Tensor, torch.Tensor]:
    """Two experts, the concatenated inputs of both ranks, and fixed output weights for the loss."""
    experts = make_model(experts=2).blocks[1].experts.experts
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(sum(EXPERT_ROWS), DIM, generator=generator)
    weights = torch.randn(sum(EXPERT_ROWS), DIM, generator=generator)
    return experts, x, weights


def expert_parallel_run() -> dict[str, Any]:
    """ExpertParallel over all ranks on unequal slices; loss = sum over all rows of out * weights."""
    rank = dist.get_rank()
    experts, x, weights = expert_inputs()
    start = sum(EXPERT_ROWS[:rank])
    rows = slice(start, start + EXPERT_ROWS[rank])
    local_x = x[rows].clone().requires_grad_(True)
    stats = CommStats()
    layer = ExpertParallel(experts, dist.group.WORLD, stats)
    out = layer(local_x)
    (out * weights[rows]).sum().backward()
    return {
        "out": out.detach(),
        "x_grad": local_x.grad,
        "expert_index": layer.expert_index,
        "expert_grads": {name: p.grad for name, p in layer.expert.named_parameters()},
        "bytes": dict(stats.bytes),
    }


LAYOUT_4 = "dense_replicate=2,dense_shard=2,expert=2,sparse_group=2,sparse_replicate=2"


def mesh_groups(spec: str) -> dict[str, list[int]]:
    """The global ranks of this rank's group along every named dimension of every mesh."""
    meshes = build_meshes(parse_parallel(spec))
    groups = {}
    for side, mesh in (("dense", meshes.dense), ("expert", meshes.expert), ("sparse", meshes.sparse)):
        for dim in mesh.mesh_dim_names:
            groups[f"{side}.{dim}"] = sorted(dist.get_process_group_ranks(mesh.get_group(dim)))
    groups["device_type"] = meshes.device_type
    return groups


def session_world4(checkpoint_root: str) -> dict[str, Any]:
    return {
        "layout": mesh_groups(LAYOUT_4),
        "fsdp4": train_distributed("dense_shard=4", save_dir=f"{checkpoint_root}/fsdp4", measure_step=1),
        "hsdp2x2": train_distributed("dense_replicate=2,dense_shard=2", measure_step=1),
        "ep2_fsdp2": train_distributed(
            "dense_shard=4,expert=2", experts=2, save_dir=f"{checkpoint_root}/ep2_fsdp2", measure_step=1
        ),
    }


def session_world2(checkpoint_root: str) -> dict[str, Any]:
    return {
        "replicate_only": train_distributed("dense_replicate=2,dense_shard=1", measure_step=1),
        "uneven": train_distributed("dense_shard=2", uneven=True),
        "ep2_no_shard_ac": train_distributed(
            "dense_shard=2,expert=2,activation_checkpointing=1", experts=2, measure_step=1
        ),
        "fsdp2_ac": train_distributed("dense_shard=2,activation_checkpointing=1,prefetch=2,reshard_after_forward=0"),
        "expert": expert_parallel_run(),
        "resumed": resume_distributed("dense_shard=2", f"{checkpoint_root}/fsdp4"),
        # expert-parallel checkpoint (each expert saved by its own ranks) into a layout without EP
        "resumed_experts": resume_distributed("dense_shard=2", f"{checkpoint_root}/ep2_fsdp2", experts=2),
    }
