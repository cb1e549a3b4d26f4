"""Apply FSDP2 (``fully_shard``) block by block to a plain model: FSDP, HSDP, experts, checkpointing.

``parallelize(model, meshes)`` changes the model in place and returns the list of FSDP units, which
``fsdp_step_bytes`` turns into the analytic bytes each step moves. Order of work:

1. Dense expert modules (``expert_types``) are replaced by ``ExpertParallel`` over the EP group and
   sharded on the mesh of the ranks holding the same expert (``replicate`` x ``expert_shard``).
2. Each block (default: every child of every ``nn.ModuleList``) is optionally wrapped for activation
   checkpointing, then sharded on the dense mesh (``replicate`` x ``shard``; HSDP when replicate > 1).
3. The root is sharded last, picking up the remaining parameters.

Sparse modules (``sparse_types`` or a class/instance attribute ``opengem_sparse = True``, e.g. the
embedding collection with its own fused optimizer) are never wrapped: their parameters are passed as
``ignored_params`` to every ``fully_shard`` call, and blocks are not searched inside them.

Precision: on CUDA, bf16 compute with fp32 gradient reduction (``MixedPrecisionPolicy``); on CPU
(gloo) everything stays fp32. Gradients are averaged over the data-parallel ranks: each rank should
compute the mean loss of its own equal-sized slice of the global batch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from opengem.parallel.collectives import PROCESS_GROUP, CollectivePlan, CommStats
from opengem.parallel.expert import ExpertParallel
from opengem.parallel.mesh import ParallelMeshes
from opengem.validation import is_number

SPARSE_ATTR = "opengem_sparse"
ROOT = "<root>"
BlockSelector = Callable[[str, nn.Module], bool] | Sequence[type[nn.Module]]


@dataclass(frozen=True)
class FSDPUnit:
    """One ``fully_shard`` call: its module path, mesh dims, parameters and resharding."""

    name: str
    mesh: DeviceMesh
    params: tuple[nn.Parameter, ...]
    reshard_after_forward: bool


def is_sparse(module: nn.Module, sparse_types: Sequence[type[nn.Module]] = ()) -> bool:
    """Whether ``parallelize`` leaves ``module`` out (an instance of ``sparse_types`` or marked ``opengem_sparse``)."""
    return isinstance(module, tuple(sparse_types)) or bool(getattr(module, SPARSE_ATTR, False))


def _shard_mesh(mesh: DeviceMesh, replicate_dim: str, shard_dim: str) -> DeviceMesh:
    """2D (replicate, shard) for HSDP; the 1D shard mesh when there is a single replica."""
    if mesh[replicate_dim].size() > 1:
        return mesh[replicate_dim, shard_dim]
    return mesh[shard_dim]


def select_blocks(
    model: nn.Module, blocks: BlockSelector | None, sparse_types: Sequence[type[nn.Module]]
) -> list[tuple[str, nn.Module]]:
    """Blocks in forward-definition order; never the root, never inside sparse modules or other blocks."""
    if blocks is None:
        def chosen(name: str, module: nn.Module) -> bool:
            parent = model.get_submodule(name.rpartition(".")[0]) if name else None
            return isinstance(parent, nn.ModuleList)
    elif callable(blocks) and not isinstance(blocks, Sequence):
        chosen = blocks
    else:
        types = tuple(blocks)
        def chosen(name: str, module: nn.Module) -> bool:
            return isinstance(module, types)
    found: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            if is_sparse(child, sparse_types) or isinstance(child, FSDPModule):  # left out, or already a unit
                continue
            if chosen(name, child):
                found.append((name, child))
            else:
                visit(name, child)

    visit("", model)
    return found


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child_name = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child_name, new)


CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."


def _checkpointed(model: nn.Module, name: str, block: nn.Module) -> nn.Module:
    """Replace ``block`` by an activation-checkpointed wrapper (state-dict names unchanged)."""
    wrapped = checkpoint_wrapper(block)
    _replace(model, name, wrapped)
    return wrapped


def checkpoint_blocks(model: nn.Module, blocks: BlockSelector | None = None) -> list[str]:
    """Activation checkpointing of every block (``select_blocks``) of a plain model, in place, for
    single-process training: each block's activations are recomputed in the backward instead of kept.
    Returns the wrapped blocks' names."""
    selected = select_blocks(model, blocks, ())
    for name, block in selected:
        _checkpointed(model, name, block)
    return [name for name, _ in selected]


def own_params(prefix: str, module: nn.Module, taken: set[str]) -> dict[str, nn.Parameter]:
    """Parameters of ``module`` not yet owned by an inner unit, by checkpoint-wrapper-free qualified name.

    By name, not identity: ``fully_shard`` replaces each parameter by a new (DTensor) parameter.
    """
    owned = {}
    for name, param in module.named_parameters():
        qualified = f"{prefix}.{name}" if prefix else name
        qualified = qualified.replace(CHECKPOINT_PREFIX, "")
        if qualified not in taken:
            owned[qualified] = param
    return owned


def parallelize(
    model: nn.Module,
    meshes: ParallelMeshes,
    *,
    blocks: BlockSelector | None = None,
    sparse_types: Sequence[type[nn.Module]] = (),
    expert_types: Sequence[type[nn.Module]] = (),
    plan: CollectivePlan | None = None,
    stats: CommStats | None = None,
) -> list[FSDPUnit]:
    """Shard ``model`` in place (FSDP2 per block on ``meshes.dense``); return the FSDP units in order.

    ``blocks``: a predicate ``(qualified_name, module) -> bool`` or a list of module types choosing
    the FSDP units (and activation-checkpoint regions); default every child of every ``nn.ModuleList``.
    ``expert_types``: modules holding their experts in an ``experts`` ``nn.ModuleList`` whose forward
    is the sum of the experts' outputs; with ``config.expert > 1`` they become ``ExpertParallel``.
    ``plan``: the collective route (``select_collectives``); a zero-CTA plan with FSDP symmetric
    memory support makes FSDP allocate its all-gather buffers in symmetric memory; the plan's
    ``expert_all_gather`` route is used by the expert-parallel modules.
    ``stats``: where the expert-parallel collectives record their bytes (FSDP's are analytic:
    ``fsdp_step_bytes(units, ...)``).
    The model must already be on the mesh's device type (``model.to("cuda")`` for NCCL).
    """
    config = meshes.config
    route = plan.expert_all_gather if plan is not None else PROCESS_GROUP
    sparse_params = {p for m in model.modules() if is_sparse(m, sparse_types) for p in m.parameters()}
    on_cuda = meshes.device_type == "cuda"
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if on_cuda else MixedPrecisionPolicy()
    units: list[FSDPUnit] = []
    taken = {name for name, p in own_params("", model, set()).items() if p in sparse_params}  # never sharded

    def shard(name: str, module: nn.Module, mesh: DeviceMesh, reshard: bool) -> None:
        params = own_params(name, module, taken)
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=mixed, ignored_params=sparse_params)
        units.append(FSDPUnit(name or ROOT, mesh, tuple(params.values()), reshard))
        taken.update(params)

    if config.expert > 1:
        if meshes.expert is None:
            raise ValueError("config.expert > 1 but meshes.expert is None; build the meshes with build_meshes")
        expert_modules = [(n, m) for n, m in model.named_modules() if isinstance(m, tuple(expert_types))]
        if not expert_modules:  # every rank would have kept every expert, the layout saying otherwise
            raise ValueError(f"config.expert={config.expert} but the model has no module of expert_types="
                             f"{tuple(t.__name__ for t in expert_types)}; pass the model's experts module type")
        expert_mesh = _shard_mesh(meshes.expert, "replicate", "expert_shard")
        for name, module in expert_modules:
            parallel = ExpertParallel(module.experts, meshes.expert.get_group("expert"), stats, route)
            _replace(model, name, parallel)
            shard(name, parallel, expert_mesh, config.reshard_after_forward)

    dense_mesh = _shard_mesh(meshes.dense, "replicate", "shard")
    selected = select_blocks(model, blocks, sparse_types)
    fsdp_blocks: list[FSDPModule] = []
    for index, (name, block) in enumerate(selected):
        if config.activation_checkpointing:
            block = _checkpointed(model, name, block)
        # The last block is not resharded: backward needs it first, right after forward.
        shard(name, block, dense_mesh, config.reshard_after_forward and index < len(selected) - 1)
        fsdp_blocks.append(block)
    # The root is not resharded after forward: backward would all-gather it again right away.
    shard("", model, dense_mesh, False)
    _set_prefetch(fsdp_blocks, config.prefetch)
    if plan is not None and plan.fsdp_symm_mem:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_symm_mem_for_comm()
    return units


def _set_prefetch(blocks: list[FSDPModule], depth: int) -> None:
    """All-gather the next ``depth`` blocks during forward and the previous ``depth`` during backward."""
    if depth == 0:
        return
    for index, block in enumerate(blocks):
        following = blocks[index + 1 : index + 1 + depth]
        preceding = blocks[max(0, index - depth) : index][::-1]
        if following:
            block.set_modules_to_forward_prefetch(following)
        if preceding:
            block.set_modules_to_backward_prefetch(preceding)


def data_parallel_loss(loss_sum: torch.Tensor, count: int | torch.Tensor) -> torch.Tensor:
    """The local loss to backpropagate when ranks hold different numbers of samples (or tokens).

    ``loss_sum``: this rank's summed loss over its ``count`` samples. FSDP averages gradients over
    the ranks, so backpropagating ``loss_sum * world / global_count`` gives every parameter the
    gradient of the global mean loss (a plain per-rank mean would overweight the smaller batches).
    Costs one scalar all-reduce (of ``count``) over the default group.
    """
    if loss_sum.dim() != 0:
        raise ValueError(f"loss_sum must be a scalar (this rank's summed loss), got shape {tuple(loss_sum.shape)}")
    on_host = not isinstance(count, torch.Tensor) or count.device.type == "cpu"  # a device count: no sync to check
    if not isinstance(count, torch.Tensor) and not is_number(count):  # True had counted 1 sample, "3" failed deep
        raise ValueError(f"count must be a number or a tensor of samples, got {count!r}")
    if isinstance(count, torch.Tensor) and count.dim() != 0:
        raise ValueError(f"count must be a scalar, got shape {tuple(count.shape)}")
    if on_host and not (float(count) >= 0 and float(count).is_integer()):  # a negative one had flipped the loss
        raise ValueError(f"count must be a whole number of samples >= 0, got {count}")
    total = torch.as_tensor(count, dtype=torch.float64, device=loss_sum.device).clone()
    dist.all_reduce(total)
    global_count = total.item()  # one read (a device sync on CUDA), not one for the check and one for the scale
    if global_count == 0:
        raise ValueError("data_parallel_loss: the global sample count is 0 (every rank has an empty batch)")
    return loss_sum * (dist.get_world_size() / global_count)


def _padded_numel(param: nn.Parameter, shards: int) -> int:
    """FSDP2 pads dim 0 of every parameter to a multiple of the shard count before sharding it."""
    dim0 = param.shape[0] if param.dim() > 0 else 1
    rest = param.numel() // dim0 if dim0 else 0
    return -(-dim0 // shards) * shards * rest


def fsdp_step_bytes(units: Sequence[FSDPUnit], param_bytes: int, reduce_bytes: int) -> dict[tuple[str, str], int]:
    """Analytic bytes one rank moves per training step (forward + backward) through FSDP.

    Per unit with shard count S over padded parameter elements P (``CommStats`` convention):
    all-gather P * param_bytes in forward and again in backward when resharded after forward,
    reduce-scatter P' * reduce_bytes and, with replicas, all-reduce of the shard, P' / S * reduce_bytes,
    where P' counts only trainable parameters (frozen ones get no gradient); nothing over a shard
    dimension of size 1. Keys: (mesh dim,
    collective). ``param_bytes`` is 2 under the CUDA bf16 policy and 4 in fp32 (CPU); ``reduce_bytes`` 4.
    Expert-parallel activations are counted at run time instead (``ExpertParallel(stats=...)``).
    """
    counts: dict[tuple[str, str], int] = {}

    def add(key: tuple[str, str], nbytes: int) -> None:
        counts[key] = counts.get(key, 0) + nbytes

    for unit in units:
        if not unit.params:
            continue
        names = unit.mesh.mesh_dim_names or ()
        shard_dim, shards = names[-1], unit.mesh.size(-1)
        padded = sum(_padded_numel(p, shards) for p in unit.params)
        trained = sum(_padded_numel(p, shards) for p in unit.params if p.requires_grad)
        gathers = 2 if unit.reshard_after_forward else 1
        if shards > 1:  # FSDP issues no all-gather / reduce-scatter over a single shard
            add((shard_dim, "all_gather"), gathers * padded * param_bytes)
            if trained:
                add((shard_dim, "reduce_scatter"), trained * reduce_bytes)
        if trained and unit.mesh.ndim == 2:
                add((names[0], "all_reduce"), trained // shards * reduce_bytes)
    return counts


def clip_grad_norm_(
    model: nn.Module, max_norm: float, sparse_types: Sequence[type[nn.Module]] = ()
) -> torch.Tensor:
    """Clip the dense gradients of a ``parallelize``d model to a global L2 norm of ``max_norm``.

    Same result as ``torch.nn.utils.clip_grad_norm_`` on the unsharded single-process model (sparse
    modules excluded: they have their own optimizer). Needed because the gradients live on several
    meshes: each DTensor's local shards are summed over its sharded mesh dimensions (replicas hold
    copies), and the experts of an ``ExpertParallel`` layer, different on each rank of its group, are
    summed over that group. Returns the total norm (a plain 0-dim tensor, identical on every rank).
    """
    # a negative one had flipped the gradients' sign, NaN made them NaN, True clipped to 1, "1.0" failed deep
    if not is_number(max_norm) or not max_norm >= 0:
        raise ValueError(f"max_norm must be a number >= 0, got {max_norm!r}")
    expert_params = {id(p): m.group for m in model.modules() if isinstance(m, ExpertParallel) for p in m.parameters()}
    sparse_params = {id(p) for m in model.modules() if is_sparse(m, sparse_types) for p in m.parameters()}
    grads = []
    # Sum of squares per tuple of groups to sum over: one all-reduce per group and bucket.
    buckets: dict[tuple[dist.ProcessGroup, ...], list[torch.Tensor]] = defaultdict(list)
    for param in model.parameters():
        if param.grad is None or id(param) in sparse_params:
            continue
        grad = param.grad
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        groups = []
        if isinstance(grad, DTensor):
            groups += [grad.device_mesh.get_group(dim) for dim, p in enumerate(grad.placements) if p.is_shard()]
        if id(param) in expert_params:
            groups.append(expert_params[id(param)])
        buckets[tuple(groups)].append(local.float().pow(2).sum())
        grads.append(local)
    if not grads:
        return torch.zeros(())
    total_square = 0.0
    for groups, squares in buckets.items():
        square = torch.stack(squares).sum()
        for group in groups:
            dist.all_reduce(square, group=group)
        total_square = total_square + square
    total = torch.as_tensor(total_square).sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for local in grads:
        local.mul_(scale.to(local.dtype))
    return total
