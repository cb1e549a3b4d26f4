"""Benchmark of opengem.parallel: what FSDP2 wrapping and activation checkpointing cost per training step.

    python -m benchmarks.parallel [--quick]                         # one GPU (world size 1)
    torchrun --nproc-per-node N -m benchmarks.parallel [--quick]   # N GPUs: FSDP over N, plus EP collectives

Each shape trains a stack of pre-norm MLP blocks and one dense-experts layer (bf16) three ways, side
by side: ``plain`` (no parallel code, bf16 autocast), ``fsdp`` (``parallelize``: FSDP2 per block, bf16
compute / fp32 reduction) and ``fsdp_ac`` (plus activation checkpointing). Correctness: the first
step's loss of each variant against ``plain`` (relative error; bf16 parameters vs autocast differ by
bf16 rounding). With N > 1 ranks it also times the expert-parallel all-gather of activations through
each available route (process group; symmetric-memory copy engine) and the reduce-scatter.

FLOPs (GEM_SPEC section 8): GEMMs only, 2*M*N*K forward and twice that backward, so a step is
6 * tokens * (GEMM weights) per rank; recomputation counts zero. MFU: against 989 TFLOP/s per GPU.
Timing: median via ``benchmarks.common.bench_ms`` at world size 1; with N ranks a fixed number of
iterations (do_bench chooses its repetition count per rank, which would desynchronize collectives).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.common import H100_BF16_PEAK_TFLOPS, bench_ms, print_table, relative_error, write_results
from opengem.parallel import (
    CommStats,
    ParallelConfig,
    ParallelMeshes,
    init_distributed,
    parallelize,
    probe_capabilities,
    select_collectives,
)
from opengem.parallel.collectives import enable_copy_engine_all_gather
from opengem.parallel.collectives import PROCESS_GROUP, SYMM_MEM_COPY_ENGINE
from opengem.parallel.expert import all_gather_along_batch, reduce_scatter_along_batch

QUICK_SHAPES = [(1024, 4, 8192)]  # (model dim, blocks, tokens per rank)
FULL_SHAPES = [(1024, 4, 8192), (1024, 8, 16384), (2048, 8, 16384)]
EXPERTS = 2


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class DenseExperts(nn.Module):
    def __init__(self, dim: int, count: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(Block(dim) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(expert(x) for expert in self.experts)


class Stack(nn.Module):
    def __init__(self, dim: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.experts = DenseExperts(dim, EXPERTS)
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.experts(x))


def gemm_weights(model: nn.Module) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def build(variant: str, dim: int, blocks: int, meshes: ParallelMeshes) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Stack(dim, blocks).cuda()
    if variant != "plain":
        config = dataclasses.replace(meshes.config, activation_checkpointing=variant == "fsdp_ac")
        parallelize(model, dataclasses.replace(meshes, config=config), expert_types=(DenseExperts,))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)


def step_fn(variant: str, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor):
    def step() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=variant == "plain"):
            out = model(x)
        loss = nn.functional.mse_loss(out.float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def time_ms(fn: Callable[[], object], world: int, iters: int = 10) -> float:
    if world == 1:
        return bench_ms(fn)
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def bench_steps(shapes: list[tuple[int, int, int]], meshes: ParallelMeshes, world: int) -> list[dict]:
    rows = []
    for dim, blocks, tokens in shapes:
        generator = torch.Generator(device="cuda").manual_seed(dist.get_rank())
        x = torch.randn(tokens, dim, device="cuda", generator=generator)
        y = torch.randn(tokens, 1, device="cuda", generator=generator)
        reference_loss = None
        for variant in ("plain", "fsdp", "fsdp_ac"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            model, opt = build(variant, dim, blocks, meshes)
            flops = 6 * tokens * gemm_weights(model)  # DTensor numel is the global size
            step = step_fn(variant, model, opt, x, y)
            first_loss = step()
            reference_loss = first_loss if reference_loss is None else reference_loss
            ms = time_ms(step, world)
            tflops = flops / ms / 1e9
            rows.append({
                "bench": "step", "variant": variant, "dim": dim, "blocks": blocks, "tokens_per_rank": tokens,
                "world": world, "ms": ms, "tflops_per_gpu": tflops, "mfu": tflops / H100_BF16_PEAK_TFLOPS,
                "loss_rel_err": relative_error(first_loss.reshape(1), reference_loss.reshape(1)),
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            })
            del model, opt, step
    return rows


def bench_expert_collectives(shapes: list[tuple[int, int, int]], world: int, group: dist.ProcessGroup) -> list[dict]:
    plan = select_collectives("copy_engine", probe_capabilities("nccl"))
    routes = [PROCESS_GROUP] + ([SYMM_MEM_COPY_ENGINE] if plan.expert_all_gather == SYMM_MEM_COPY_ENGINE else [])
    rows = []
    for dim, _, tokens in shapes:
        x = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16)
        sizes = [tokens] * world
        for route in routes:
            if route == SYMM_MEM_COPY_ENGINE:
                enable_copy_engine_all_gather(group)
            gathered = all_gather_along_batch(x, group, sizes, route=route)
            torch.testing.assert_close(gathered[dist.get_rank(group) * tokens :][:tokens], x)
            stats = CommStats()
            all_gather_along_batch(x, group, sizes, stats, route)
            nbytes = stats.total()
            ms = time_ms(lambda: all_gather_along_batch(x, group, sizes, route=route), world)
            rows.append({"bench": "ep_all_gather", "variant": route, "dim": dim, "tokens_per_rank": tokens,
                         "world": world, "ms": ms, "gb_per_s": nbytes / ms / 1e6})
        y = torch.randn(tokens * world, dim, device="cuda", dtype=torch.bfloat16)
        ms = time_ms(lambda: reduce_scatter_along_batch(y, sizes, group), world)
        rows.append({"bench": "ep_reduce_scatter", "variant": PROCESS_GROUP, "dim": dim, "tokens_per_rank": tokens,
                     "world": world, "ms": ms, "gb_per_s": y.numel() * y.element_size() / ms / 1e6})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one representative shape (< 90 s)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.parallel needs CUDA")
    meshes = init_distributed(ParallelConfig())
    world = dist.get_world_size()
    shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    rows = bench_steps(shapes, meshes, world)
    if world > 1:
        rows += bench_expert_collectives(shapes, world, meshes.dense.get_group("shard"))
    if dist.get_rank() == 0:
        print(f"MFU convention: GEMM FLOPs only (6 * tokens * weights per step), peak {H100_BF16_PEAK_TFLOPS} TFLOP/s per GPU")
        print_table(rows, ["bench", "variant", "dim", "blocks", "tokens_per_rank", "world", "ms", "tflops_per_gpu",
                           "mfu", "gb_per_s", "loss_rel_err", "peak_gib"])
        path = write_results("parallel", rows, {"collectives_env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_CTA_POLICY")}})
        print(f"wrote {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
