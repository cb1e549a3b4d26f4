"""Multi-GPU training speed per 5D layout, the scaling ratio, and collective bandwidth (issue 11).

    torchrun --nproc-per-node N -m benchmarks.multi_gpu [--quick] [--preset gem-large]
        [--layouts fsdp,hsdp,expert,sparse1d,sparse2d] [--steps S] [--warmup W] [--batch-per-gpu B]
        [--collectives default|copy_engine] [--single-gpu-mfu X] [--max-tuning-steps T] [--curve]
        [--set key=value ...]

1. Every layout trains the preset's GEM model with the distributed trainer's own pieces
   (``opengem.train.distributed.DistributedRun``: model, sparse sharding, FSDP2 / expert parallelism,
   ``DistributedLearner``) on its synthetic stream, ``--warmup`` steps then ``--steps`` timed steps
   (weak scaling: the global batch is ``--batch-per-gpu`` x N); on CUDA the warm-up goes on while the
   attention autotuners still meet new keys or a step is 1.5x slower than the fastest (a compile; up to
   ``--max-tuning-steps`` more, every rank alike), so no tuning or compiling lands in the timed steps. ``--curve`` keeps every step's global-batch loss in the row (no extra
   warm-up then: curves compare step by step; ``benchmarks.multi_gpu_curves`` judges them). Layouts (N ranks):

   - ``fsdp``: dense_shard=N;             ``hsdp``: dense_replicate=2, dense_shard=N/2;
   - ``expert``: expert=2 (gem.num_experts=2): two expert-parallel ranks, each expert FSDP-sharded
     over the other N/2 ranks, the rest of the model over all N;
   - ``sparse1d``: tables sharded over all N ranks (sparse_group=N);
   - ``sparse2d``: TorchRec's 2D: sharded over N/2, replicated twice (sparse_group=N/2, sparse_replicate=2);
   - ``single`` (N == 1 only): the single-process trainer (``LocalRun``), the scaling baseline.

   A layout invalid for N is skipped with the reason printed. Rank 0 records the step time (slowest
   rank), samples/s in total and per GPU, E2E MFU = useful FLOPs (``opengem.train.flops``, summed over
   ranks) / (step time x N x dense BF16 peak), the bytes per collective of one step (``CommStats``)
   and the first step's loss next to the first layout's (same seed and batches: equal up to bf16 noise).
   Scaling ratio = E2E MFU / single-GPU E2E MFU (the ``single`` row when N == 1, else ``--single-gpu-mfu``).
2. For every (mesh dim, collective) a layout moves, its mean message is timed on the same group:
   all-gather, reduce-scatter, all-to-all (and all-reduce), NCCL kernels vs the SM-free copy-engine
   all-gather (``symm_mem_copy_engine``) where ``probe_capabilities`` says it exists. Bandwidth is
   the nccl-tests "algorithm bandwidth": the ``CommStats`` size / time. The NCCL zero-CTA policy is
   per communicator, set before the process group exists: compare it end to end with a second run
   under ``--collectives copy_engine``.
3. On CUDA, what a collective running beside compute costs that compute (issue 11's "how many SMs the
   compute kernels got back"): a bf16 GEMM timed alone and beside 64 MiB all-gathers on a side stream,
   per route (``measure_compute_beside_collectives``); rerun with ``--collectives copy_engine`` for the
   zero-CTA NCCL policy.
4. ``benchmarks/results/multi_gpu.json`` (device count and type, one row per layout and per
   collective) and a table. ``--out`` writes elsewhere (tests).

NVLink multicast stays off (``opengem.parallel.collectives.setup_environment``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import print_table, relative_error, write_results
from opengem.nn.embedding import trust_ids
from opengem.parallel.collectives import (
    PROCESS_GROUP,
    SYMM_MEM_COPY_ENGINE,
    all_gather_single,
    enable_copy_engine_all_gather,
    probe_capabilities,
    reduce_scatter_single,
    select_collectives,
)
from opengem.parallel.fsdp import fsdp_step_bytes
from opengem.parallel.mesh import ParallelConfig, ParallelMeshes, build_meshes, init_distributed, parse_parallel
from opengem.train.bench.timing import WindowTimer, synchronize, time_ms, warm_until_settled
from opengem.train.bench.watch import events_report, host_events
from opengem.train.config import TrainConfig, load_config
from opengem.train.distributed import DistributedRun
from opengem.train.flops import device_peak_flops, train_flops
from opengem.train.trainer import LocalRun

ALL_LAYOUTS = ("fsdp", "hsdp", "expert", "sparse1d", "sparse2d")
EXPERTS = 2
COLLECTIVE_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "NCCL_CTA_POLICY")
QUICK = {"warmup": 2, "steps": 3, "collective_iters": 5}
FULL = {"warmup": 10, "steps": 20, "collective_iters": 20}


@dataclasses.dataclass(frozen=True)
class Layout:
    """A named layout at world size N: the ``--parallel`` text and the config overrides it needs."""

    name: str
    parallel: str | None  # None: the single-process trainer
    overrides: tuple[str, ...] = ()


def layout_for(name: str, world: int) -> Layout:
    """The layout ``name`` on ``world`` ranks; ``ValueError`` with the reason when it does not fit."""
    half = world // 2
    if name == "single":
        if world != 1:
            raise ValueError(f"single is the 1-GPU baseline; this run has {world} ranks")
        return Layout(name, None)
    if name == "fsdp":
        return Layout(name, f"dense_shard={world}")
    if name == "sparse1d":
        return Layout(name, f"sparse_group={world}")
    if world % 2:
        raise ValueError(f"{name} needs an even number of ranks (2 x N/2), got {world}")
    if name == "hsdp":
        return Layout(name, f"dense_replicate=2,dense_shard={half}")
    if name == "expert":
        return Layout(name, f"expert={EXPERTS}", (f"gem.num_experts={EXPERTS}",))
    if name == "sparse2d":
        return Layout(name, f"sparse_group={half},sparse_replicate=2")
    raise ValueError(f"unknown layout {name!r}; choose from {', '.join(('single', *ALL_LAYOUTS))}")


def train_config(preset: str, batch_per_gpu: int | None, world: int, steps: int, device: str,
                 overrides: Sequence[str]) -> TrainConfig:
    """The preset's GEM config for the benchmark: global batch = per-GPU batch x world, no baseline."""
    base = load_config(preset)
    batch = (batch_per_gpu or base.batch_size) * world
    fixed = ["architecture=gem", "baseline=false", f"device={device}", f"batch_size={batch}", f"steps={steps}"]
    return load_config(preset, overrides=[*fixed, *overrides])


def _any_rank(flag: bool, device: torch.device) -> bool:
    return bool(_reduce(float(flag), dist.ReduceOp.MAX, device))


def _reduce(value: float, op: dist.ReduceOp, device: torch.device) -> float:
    if not dist.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return float(tensor.item())


def _message_sizes(run: LocalRun | DistributedRun) -> dict[tuple[str, str], tuple[int, int]]:
    """(mesh dim, collective) -> (bytes of the last step, calls). FSDP's bytes are analytic
    (``fsdp_step_bytes``): per unit one call per collective it issues, the all-gather twice when the
    unit reshards after forward (gathered again in backward)."""
    if not isinstance(run, DistributedRun):
        return {}
    stats = run.learners["model"].stats
    sizes = {key: (stats.bytes[key], stats.calls[key]) for key in stats.bytes} if stats is not None else {}
    calls: dict[tuple[str, str], int] = {}
    for unit in run.fsdp_units:
        for key in fsdp_step_bytes([unit], param_bytes=1, reduce_bytes=1):
            calls[key] = calls.get(key, 0) + (2 if key[1] == "all_gather" and unit.reshard_after_forward else 1)
    for key, nbytes in run.fsdp_bytes.items():
        old_bytes, old_calls = sizes.get(key, (0, 0))
        sizes[key] = (old_bytes + nbytes, old_calls + calls[key])
    return sizes


def measure_layout(layout: Layout, config: TrainConfig, warmup: int, steps: int, collectives: str,
                   curve: bool = False, max_tuning_steps: int = 0,
                   ) -> tuple[dict[str, Any], dict[tuple[str, str], tuple[int, int]], ParallelConfig | None]:
    """Train ``warmup`` (+ up to ``max_tuning_steps`` until the warm-up settles) + ``steps`` steps
    of ``layout``; its row (rank 0's view), message sizes and layout. ``curve``: the row also holds every
    step's global-batch loss (read once at the end: no sync per step)."""
    if layout.parallel is None:
        run: LocalRun | DistributedRun = LocalRun(config)
    else:
        run = DistributedRun(config, dataclasses.replace(parse_parallel(layout.parallel), collectives=collectives))
    try:
        learner, device = run.learners["model"], run.device
        trust_ids(learner.model)  # synthetic ids: no id check (a host sync) per step
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        stream = run.batches(0)
        first = learner.step(next(stream).to(device, non_blocking=True))
        losses = [first]
        first_loss = float(first)
        tuning_steps = warm_until_settled(lambda: losses.append(learner.step(next(stream).to(device, non_blocking=True))),
                                          max(0, warmup - 1), max_tuning_steps, agree=lambda changed: _any_rank(changed, device),
                                          sync=lambda: synchronize(device))
        synchronize(device)
        if dist.is_initialized():
            dist.barrier()
        lengths, timer, events_before = [], WindowTimer(device), host_events()
        timer.start()
        for _ in range(steps):
            batch = next(stream)
            lengths.append(batch.history_age.lengths_host())
            loss = learner.step(batch.to(device, non_blocking=True))
            losses.append(loss)
            timer.lap()
        elapsed = _reduce(timer.stop(), dist.ReduceOp.MAX, device)  # the step ends when the slowest rank does
        # this rank's; any count > 0: seconds of host work (tuning, compiling, collecting) in the timed steps
        while_timed, laps_ms = events_report(events_before), timer.laps_ms()
        stream = None  # drops the stream (and its loader workers) before the next layout
        world = dist.get_world_size() if dist.is_initialized() else 1
        flops = _reduce(float(sum(train_flops(learner.model, n).train for n in lengths)), dist.ReduceOp.SUM, device)
        peak_gib = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        row = {
            "layout": layout.name, "parallel": layout.parallel or "single process", "world": world,
            "model_overrides": list(layout.overrides),
            "collectives": collectives if layout.parallel else "none", "batch_per_gpu": config.batch_size // world,
            "step_ms": 1e3 * elapsed / steps, "samples_per_s": steps * config.batch_size / elapsed,
            "samples_per_s_per_gpu": steps * config.batch_size / elapsed / world,
            "flops_per_s": flops / elapsed, "first_loss": first_loss, "last_loss": float(loss),
            "peak_memory_gib": _reduce(peak_gib, dist.ReduceOp.MAX, device) if peak_gib is not None else None,
            "comm_bytes_per_step": run.step_bytes(), "tuning_steps": tuning_steps,
            "host_events_while_timed": while_timed,
            "step_ms_each": laps_ms,  # this rank's; a stall (tuning, a compile) shows as an outlier
            "step_ms_median": statistics.median(laps_ms),
        }
        if curve:
            row["losses"] = torch.stack([value.detach().float() for value in losses]).tolist()
        return row, _message_sizes(run), getattr(run, "layout", None)
    finally:
        run.close()


def _group_of(dim: str, meshes: ParallelMeshes) -> dist.ProcessGroup | None:
    """This rank's process group of mesh dimension ``dim`` (``world``: all ranks); None when it has one rank."""
    if dim == "world":
        return dist.group.WORLD if dist.get_world_size() > 1 else None
    for mesh in (meshes.dense, meshes.expert, meshes.sparse):
        if mesh is not None and dim in (mesh.mesh_dim_names or ()):
            return mesh.get_group(dim) if mesh.size(mesh.mesh_dim_names.index(dim)) > 1 else None
    raise ValueError(f"no mesh dimension {dim!r} in the layout {meshes.config}")


def _kind(collective: str) -> str | None:
    for kind in ("all_gather", "reduce_scatter", "all_to_all", "all_reduce"):
        if collective.startswith(kind) and not collective.endswith("_sizes"):
            return kind
    return None


def _collective(kind: str, route: str, nbytes: int, group: dist.ProcessGroup,
                device: torch.device, dtype: torch.dtype) -> Callable[[], None]:
    """One collective whose ``CommStats`` size is ``nbytes`` (rounded to whole elements per rank)."""
    ranks = dist.get_world_size(group)
    per_rank = max(1, math.ceil(nbytes / dtype.itemsize / ranks))
    full = torch.randn(per_rank * ranks, device=device).to(dtype)
    part = torch.randn(per_rank, device=device).to(dtype)
    if kind == "all_gather":
        if route == SYMM_MEM_COPY_ENGINE:
            enable_copy_engine_all_gather(group)
        return lambda: all_gather_single(full, part, group, route)
    if kind == "reduce_scatter":
        return lambda: reduce_scatter_single(part, full, group)
    if kind == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full, group=group)
    return lambda: dist.all_reduce(full, group=group)


def _time_collective(fn: Callable[[], None], iters: int, device: torch.device) -> float:
    """Mean seconds per call over ``iters`` calls after 2 warm-up calls, the slowest rank's."""
    for _ in range(2):
        fn()
    synchronize(device)
    dist.barrier()
    timer = WindowTimer(device)
    timer.start()
    for _ in range(iters):
        fn()
    return _reduce(timer.stop(), dist.ReduceOp.MAX, device) / iters


def agreed_sizes(sizes: dict[tuple[str, str], tuple[int, int]],
                 device: torch.device) -> dict[tuple[str, str], tuple[int, int]]:
    """The same (dim, collective) -> (bytes, calls) on every rank: the union of the keys, the largest
    bytes and calls over the ranks (an all-to-all's bytes differ per rank; every rank must then issue
    the same collectives with the same sizes)."""
    everyone: list[list[tuple[str, str]]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, sorted(sizes))
    keys = sorted({tuple(key) for keys in everyone for key in keys})
    counts = torch.tensor([sizes.get(k, (0, 0)) for k in keys], dtype=torch.float64, device=device).reshape(-1, 2)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    return {k: (int(b), int(c)) for k, (b, c) in zip(keys, counts.tolist())}


def measure_collectives(layout_name: str, layout: ParallelConfig, sizes: dict[tuple[str, str], tuple[int, int]],
                        iters: int, device: torch.device, min_bytes: int) -> list[dict[str, Any]]:
    """Bandwidth of every (dim, collective) of the layout at its mean message size, per available route;
    messages under ``min_bytes`` (sizes, loss totals: latency, not bandwidth) are left out.

    Every rank walks the same list with the same sizes (``agreed_sizes``), on the layout's meshes.
    """
    caps = probe_capabilities(dist.get_backend())
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    meshes = build_meshes(layout)
    rows = []
    for (dim, collective), (nbytes, calls) in agreed_sizes(sizes, device).items():
        kind, message = _kind(collective), nbytes // max(1, calls)
        if kind is None or message < min_bytes:
            continue
        group = _group_of(dim, meshes)
        if group is None:
            continue
        routes = [PROCESS_GROUP]
        if kind == "all_gather" and caps.symm_mem_all_gather and device.type == "cuda":
            routes.append(SYMM_MEM_COPY_ENGINE)
        for route in routes:
            seconds = _time_collective(_collective(kind, route, message, group, device, dtype), iters, device)
            rows.append({
                "layout": layout_name, "dim": dim, "collective": collective, "kind": kind,
                "route": "nccl" if route == PROCESS_GROUP and caps.backend == "nccl" else route,
                "ranks": dist.get_world_size(group), "message_bytes": message, "calls_per_step": calls,
                "us": 1e6 * seconds, "gb_per_s": message / seconds / 1e9,
            })
    return rows


GEMM_SIZE = 8192  # the compute that collectives run beside: a square bf16 GEMM, long enough to time
CONTENTION_BYTES = 64 << 20  # the all-gather message run beside it


def measure_compute_beside_collectives(device: torch.device, reps: int = 10) -> list[dict[str, Any]]:
    """How much GEMM throughput an all-gather running beside it takes, per available route: the GEMM timed
    alone, then while all-gathers of ``CONTENTION_BYTES`` on the world group run on a side stream (enough
    of them to cover the GEMMs). ``sms_lost``: the throughput lost as SMs of this device (NCCL kernels
    occupy SMs; the copy-engine route and NCCL's zero-CTA policy should leave them to the GEMM). CUDA only."""
    if device.type != "cuda" or dist.get_world_size() < 2:
        return []
    caps = probe_capabilities(dist.get_backend())
    routes = [PROCESS_GROUP, *([SYMM_MEM_COPY_ENGINE] if caps.symm_mem_all_gather else [])]
    a, b = (torch.randn(GEMM_SIZE, GEMM_SIZE, device=device, dtype=torch.bfloat16) for _ in range(2))
    gemm_s = _reduce(time_ms(lambda: a @ b, device, warmup=3, repeats=reps) / 1e3, dist.ReduceOp.MAX, device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    side, rows = torch.cuda.Stream(device), []
    for route in routes:
        gather = _collective("all_gather", route, CONTENTION_BYTES, dist.group.WORLD, device, torch.bfloat16)
        gather_s = _time_collective(gather, 5, device)
        calls = math.ceil(1.5 * reps * gemm_s / gather_s)  # the same on every rank: both times are reduced
        synchronize(device)
        dist.barrier()
        with torch.cuda.stream(side):
            for _ in range(calls):
                gather()
        timer = WindowTimer(device)
        timer.start()
        for _ in range(reps):
            a @ b
        beside_s = _reduce(timer.stop(), dist.ReduceOp.MAX, device) / reps
        synchronize(device)
        kept = gemm_s / beside_s
        rows.append({
            "route": "nccl" if route == PROCESS_GROUP else route, "nccl_cta_policy": os.environ.get("NCCL_CTA_POLICY"),
            "gemm_alone_ms": 1e3 * gemm_s, "gemm_beside_ms": 1e3 * beside_s, "throughput_kept": kept,
            "sms": sms, "sms_lost": max(0.0, 1 - kept) * sms, "all_gather_ms": 1e3 * gather_s,
        })
    return rows


def _free_memory(device: torch.device) -> None:
    """Release the last layout: its memory, and its compiled regions (every layout compiles new modules
    with the same code; without a reset they pile up in dynamo's per-code cache until it falls back to eager)."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK['warmup']} warm-up + {QUICK['steps']} timed steps, no compile")
    parser.add_argument("--preset", default="gem-large")
    parser.add_argument("--layouts", default=",".join(ALL_LAYOUTS), help="comma-separated; 'single' is added at N == 1")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per layout")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--max-tuning-steps", type=int, default=20,
                        help="after --warmup, up to this many more steps while the autotuners meet new keys or a "
                             "step compiles (0 with --curve)")
    parser.add_argument("--batch-per-gpu", type=int, default=None, help="default: the preset's batch size")
    parser.add_argument("--collectives", choices=("default", "copy_engine"), default="default")
    parser.add_argument("--single-gpu-mfu", type=float, default=None, help="E2E MFU of the 1-GPU run (a fraction)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense BF16 peak per device (CPU runs, unknown GPUs)")
    parser.add_argument("--min-message-kib", type=float, default=64.0,
                        help="time only collectives whose mean message is at least this large")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="TrainConfig key=value")
    parser.add_argument("--curve", action="store_true",
                        help="keep every step's loss in the rows (benchmarks.multi_gpu_curves compares them)")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/multi_gpu.json")
    args = parser.parse_args(argv)
    for name in ("steps", "warmup", "batch_per_gpu"):
        if getattr(args, name) is not None and getattr(args, name) < (0 if name == "warmup" else 1):
            parser.error(f"--{name.replace('_', '-')} must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    budget = QUICK if args.quick else FULL
    warmup = budget["warmup"] if args.warmup is None else args.warmup
    steps = budget["steps"] if args.steps is None else args.steps
    overrides = [*(["compile=false"] if args.quick else []), *args.overrides]
    on_cuda = args.device != "cpu" and torch.cuda.is_available()
    owns_process_group = not dist.is_initialized()  # a test's gloo session already has one
    backend = "nccl" if on_cuda else "gloo"
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")  # with NCCL's and torch's multicast (setup_environment)
    init_distributed(ParallelConfig(collectives=args.collectives), backend=backend)
    world, is_main = dist.get_world_size(), dist.get_rank() == 0
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    names = [n.strip() for n in args.layouts.split(",") if n.strip()]
    if world == 1 and "single" not in names:
        names.insert(0, "single")
    peak = device_peak_flops(torch.cuda.get_device_name(device), "bf16", args.peak_tflops) if on_cuda else (
        None if args.peak_tflops is None else args.peak_tflops * 1e12)
    layout_rows: list[dict[str, Any]] = []
    collective_rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    payload = {"device_count": world, "device_type": torch.cuda.get_device_name(device) if on_cuda else "cpu",
               "preset": args.preset, "warmup": warmup, "steps": steps, "peak_tflops": None if peak is None else peak / 1e12,
               "collective_rows": collective_rows,
               "collective_plan": select_collectives(args.collectives, probe_capabilities(backend)).reason,
               "collectives_env": {k: os.environ.get(k) for k in COLLECTIVE_ENV}}
    for name in names:
        try:
            layout = layout_for(name, world)
        except ValueError as reason:
            skipped[name] = str(reason)
            if is_main:
                print(f"skip {name}: {reason}")
            continue
        # curves compare step by step (same steps everywhere); the CPU runs no autotuner
        tuning = args.max_tuning_steps if on_cuda and not args.curve else 0
        config = train_config(args.preset, args.batch_per_gpu, world, warmup + tuning + steps, args.device,
                              [*layout.overrides, *overrides])
        row, sizes, resolved = measure_layout(layout, config, warmup, steps, args.collectives, args.curve, tuning)
        row["e2e_mfu"] = None if peak is None else row["flops_per_s"] / (world * peak)
        if resolved is not None and world > 1:
            collective_rows += measure_collectives(name, resolved, sizes, budget["collective_iters"], device,
                                                   int(args.min_message_kib * 1024))
        layout_rows.append(row)
        _free_memory(device)
        _add_scaling(layout_rows, args.single_gpu_mfu)
        if is_main:  # after every layout: a run stopped by a time limit keeps what finished
            print(f"{name}: {row['step_ms']:.1f} ms/step, {row['samples_per_s_per_gpu']:.0f} samples/s/GPU, "
                  f"E2E MFU {row['e2e_mfu']}, scaling {row['scaling_ratio']}, {row['peak_memory_gib']} GiB", flush=True)
            _write(layout_rows, {**payload, "skipped": skipped}, args.out)
    payload["compute_beside_collectives"] = measure_compute_beside_collectives(device) if layout_rows else []
    if is_main:
        _report(layout_rows, collective_rows, {**payload, "skipped": skipped}, args.out)
    dist.barrier()
    if owns_process_group:
        dist.destroy_process_group()
    return {"rows": layout_rows, **payload, "skipped": skipped}


def _add_scaling(rows: list[dict[str, Any]], single_gpu_mfu: float | None) -> None:
    """Scaling ratio against the ``single`` row (N == 1) or ``--single-gpu-mfu``; the first-step loss of
    every layout against the first layout's with the same model (same seed, same global batches)."""
    baseline = next((r["e2e_mfu"] for r in rows if r["layout"] == "single"), single_gpu_mfu)
    for row in rows:
        row["scaling_ratio"] = None if baseline is None or row["e2e_mfu"] is None else row["e2e_mfu"] / baseline
        reference = next(r for r in rows if r["model_overrides"] == row["model_overrides"])
        row["loss_reference"] = reference["layout"]
        row["first_loss_rel_err"] = relative_error(torch.tensor([row["first_loss"]]),
                                                   torch.tensor([reference["first_loss"]]))


def _report(rows: list[dict[str, Any]], collective_rows: list[dict[str, Any]], payload: dict[str, Any],
            out: Path | None) -> None:
    print(f"{payload['preset']} on {payload['device_count']} x {payload['device_type']}: "
          f"{payload['warmup']} warm-up + {payload['steps']} timed steps per layout; collectives: "
          f"{payload['collective_plan']}")
    print_table(rows, ["layout", "parallel", "collectives", "batch_per_gpu", "step_ms", "samples_per_s",
                       "samples_per_s_per_gpu", "e2e_mfu", "scaling_ratio", "loss_reference", "first_loss_rel_err", "peak_memory_gib"])
    if collective_rows:
        print()
        print_table(collective_rows, ["layout", "dim", "collective", "route", "ranks", "message_bytes", "us", "gb_per_s"])
    if payload.get("compute_beside_collectives"):
        print()
        print_table(payload["compute_beside_collectives"],
                    ["route", "gemm_alone_ms", "gemm_beside_ms", "throughput_kept", "sms", "sms_lost"])
    print(f"wrote {_write(rows, payload, out)}")


def _write(rows: list[dict[str, Any]], payload: dict[str, Any], out: Path | None) -> Path:
    if out is None:
        return write_results("multi_gpu", rows, payload)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"family": "multi_gpu", "rows": rows, **payload}, indent=2))
    return out


if __name__ == "__main__":
    main()
