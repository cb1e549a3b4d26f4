"""Fused embedding lookup + in-backward row-wise Adagrad against PyTorch's sparse embedding stack.

Workload (issue 8): 20 tables of 1M to 10M rows (log-spaced), dims 64 to 256, pooling factors 1 to 100
(bag lengths uniform on [0, 2L], ids uniform over the rows), plus sequence features (pooling "none")
with power-law lengths in [1, 512]. ``--quick``: 6 tables of 1M to 4M rows, one sequence feature.
fp32 weights throughout (the peers' common ground).

Timed side by side (CUDA events, median):
- ``opengem op``: the fused lookup alone on a prepared layout (the kernel figure), forward and
  forward + backward + row-wise Adagrad update;
- ``opengem module``: ``EmbeddingCollection(validate_ids=False)`` on a KeyedJagged, host work included;
- ``EmbeddingBag+Adagrad`` / ``EmbeddingBag+SparseAdam``: one ``nn.EmbeddingBag(mode="sum",
  sparse=True)`` per pooled table, ``nn.Embedding(sparse=True)`` per sequence table, ``torch.optim``;
- ``reference eager`` / ``reference compiled``: the PyTorch reference (lookup + fused update), eager
  and under ``torch.compile(dynamic=True)`` (compile time reported separately).

GB/s counts rows read (ids x dim x 4 B) plus outputs written, and is compared with the measured
device-to-device copy bandwidth (read + write of a 2 GiB buffer). Embeddings count zero FLOPs
(GEM_SPEC section 8), so no MFU is printed. Correctness against the reference runs in the same process.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from benchmarks.common import bench_ms, print_table, relative_error, write_results
from opengem.jagged import Jagged, KeyedJagged, offsets_from_lengths
from opengem.nn.embedding import EmbeddingCollection, EmbeddingOptimizer, EmbeddingTableConfig
from opengem.ops.embedding import FusedUpdate, LookupLayout, embedding_lookup
from opengem.ops.reference import embedding as reference

DEVICE = "cuda"
DIMS = (64, 128, 96, 256, 64)
LR = 0.01


@dataclass
class Workload:
    tables: list[EmbeddingTableConfig]
    pooling_factor: dict[str, int]  # mean bag length of each pooled feature
    batch_size: int


def workload(quick: bool) -> Workload:
    count, max_rows, batch_size, sequences = (6, 4_000_000, 8192, 1) if quick else (20, 10_000_000, 16384, 2)
    tables, pooling = [], {}
    for i in range(count):
        position = i / (count - 1)
        rows = round(1_000_000 * (max_rows / 1_000_000) ** position)
        factor = round(100 ** (((i * 7) % count) / (count - 1)))  # decoupled from the table size
        tables.append(EmbeddingTableConfig(f"table{i}", rows, DIMS[i % len(DIMS)], (f"f{i}",)))
        pooling[f"f{i}"] = factor
    for j in range(sequences):
        tables.append(EmbeddingTableConfig(f"seq_table{j}", max_rows // 2, (128, 64)[j % 2], (f"seq{j}",), pooling="none"))
    return Workload(tables, pooling, batch_size)


def power_law(count: int, low: int, high: int, generator: torch.Generator, exponent: float = 1.5) -> torch.Tensor:
    """``count`` lengths with pdf ~ x^-exponent on [low, high] (benchmarks.common.power_law_lengths, vectorized)."""
    a = 1.0 - exponent
    u = torch.rand(count, generator=generator, dtype=torch.float64)
    return ((low**a + u * (high**a - low**a)) ** (1.0 / a)).floor().clamp(low, high).long()


def make_batch(w: Workload, device: str, seed: int) -> KeyedJagged:
    g = torch.Generator().manual_seed(seed)
    keys, lengths, ids = [], [], []
    for table in w.tables:
        (feature,) = table.feature_names
        if table.pooling == "none":
            feature_lengths = power_law(w.batch_size, 1, 512, g)
        else:
            feature_lengths = torch.randint(0, 2 * w.pooling_factor[feature] + 1, (w.batch_size,), generator=g)
        keys.append(feature)
        lengths.append(feature_lengths)
        ids.append(torch.randint(0, table.num_embeddings, (int(feature_lengths.sum()),), generator=g))
    return KeyedJagged(tuple(keys), torch.cat(ids), torch.cat(lengths)).to(device)


def values_of(x: torch.Tensor | Jagged) -> torch.Tensor:
    return x.values if isinstance(x, Jagged) else x


def copy_bandwidth_gbs() -> float:
    src = torch.empty(1 << 29, device=DEVICE)  # 2 GiB
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / ms / 1e6


def layout_of(ec: EmbeddingCollection, batch: KeyedJagged) -> LookupLayout:
    sizes = [t.num_embeddings * t.embedding_dim for t in ec.tables]
    weight_offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    row_offsets = [sum(t.num_embeddings for t in ec.tables[:i]) for i in range(len(sizes))]
    tables = [(wo, ro, t.num_embeddings, t.embedding_dim) for wo, ro, t in zip(weight_offsets, row_offsets, ec.tables)]
    return LookupLayout.build(
        tables, list(range(len(ec.tables))), [t.pooling for t in ec.tables], batch.lengths_per_key(), batch.stride, DEVICE
    )


def run_opengem(w: Workload, batch: KeyedJagged, rows: list[dict], record: Callable, compile_reference: bool) -> dict[str, float]:
    ec = EmbeddingCollection(w.tables, EmbeddingOptimizer("rowwise_adagrad", lr=LR), device=DEVICE, validate_ids=False)
    layout = layout_of(ec, batch)
    offsets = offsets_from_lengths(batch.lengths)
    (weights,) = ec.fused_parameters()
    grad_flat = torch.randn(layout.out_numel, device=DEVICE)
    with torch.no_grad():
        out = embedding_lookup(weights, layout, batch.values, offsets)
        ref = reference.embedding_lookup(weights, layout.feature_meta, batch.values, offsets, batch.stride, layout.out_numel)
        forward_error = relative_error(out, ref)
    del out, ref
    update = FusedUpdate(
        "rowwise_adagrad", ec.row_state_float32, ec.elem_state_float32, ec.step_float32,
        torch.zeros(0, device=DEVICE, requires_grad=True), lr=LR,
    )  # fmt: skip

    def op_forward() -> None:
        with torch.no_grad():
            embedding_lookup(weights, layout, batch.values, offsets)

    def op_step() -> None:
        embedding_lookup(weights, layout, batch.values, offsets, update).backward(grad_flat)

    grads = dict(zip(batch.keys, layout.split_outputs(grad_flat)))  # tables and batch share the feature order

    def module_forward() -> None:
        with torch.no_grad():
            ec(batch)

    def module_step() -> None:
        out = ec(batch)
        torch.autograd.backward([values_of(out[k]) for k in batch.keys], [grads[k] for k in batch.keys])

    times = {}
    for name, forward, step in (("opengem op", op_forward, op_step), ("opengem module", module_forward, module_step)):
        times[name] = record(name, bench_ms(forward), bench_ms(step))

    # the PyTorch reference on the same buffers, eager and compiled
    meta = (layout.feature_meta, batch.values, offsets, batch.stride)
    hyper = (reference.OPT_ROWWISE_ADAGRAD, LR, 1e-8, 0.9, 0.999, 0.0)
    state = (ec.row_state_float32, ec.elem_state_float32, ec.step_float32)
    peers = [("reference eager", reference.embedding_lookup, reference.embedding_fused_update_)]
    if compile_reference:
        compiled = (
            torch.compile(reference.embedding_lookup, dynamic=True),
            torch.compile(reference.embedding_fused_update_, dynamic=True),
        )
        peers.append(("reference compiled", *compiled))
    for name, lookup_fn, update_fn in peers:
        try:
            start = time.perf_counter()
            lookup_fn(weights, *meta, layout.out_numel)
            update_fn(grad_flat, weights, *state, *meta, *hyper)
            torch.cuda.synchronize()
            first_call_s = time.perf_counter() - start

            def ref_step(lookup_fn=lookup_fn, update_fn=update_fn) -> None:
                lookup_fn(weights, *meta, layout.out_numel)
                update_fn(grad_flat, weights, *state, *meta, *hyper)

            record(name, bench_ms(lambda lookup_fn=lookup_fn: lookup_fn(weights, *meta, layout.out_numel)), bench_ms(ref_step))
            rows[-1]["first_call_s"] = round(first_call_s, 1)
        except Exception as error:  # a peer that fails is reported, not fatal
            rows.append({"impl": name, "error": f"{type(error).__name__}: {error}"[:200]})
    del ec, weights, update
    return {"forward_relative_error": forward_error, **{f"{k}_step_ms": v for k, v in times.items()}}


def run_embedding_bag(w: Workload, batch: KeyedJagged, rows: list[dict], record: Callable) -> None:
    per_key = batch.lengths_per_key()
    starts = [sum(per_key[:i]) for i in range(len(per_key))]
    lengths = batch.lengths.view(len(batch.keys), -1)
    inputs = [
        (batch.values[s : s + n], offsets_from_lengths(lengths[i])) for i, (s, n) in enumerate(zip(starts, per_key))
    ]
    modules = [
        nn.Embedding(t.num_embeddings, t.embedding_dim, sparse=True, device=DEVICE)
        if t.pooling == "none"
        else nn.EmbeddingBag(t.num_embeddings, t.embedding_dim, mode="sum", sparse=True, include_last_offset=True, device=DEVICE)
        for t in w.tables
    ]

    def forward() -> list[torch.Tensor]:
        return [m(ids) if isinstance(m, nn.Embedding) else m(ids, offsets) for m, (ids, offsets) in zip(modules, inputs)]

    with torch.no_grad():
        grads = [torch.randn_like(o) for o in forward()]
    table_bytes = sum(p.numel() * 4 for m in modules for p in m.parameters())
    for name, make_optimizer, state_copies in (
        ("EmbeddingBag+Adagrad", lambda p: torch.optim.Adagrad(p, lr=LR, foreach=False), 1),
        ("EmbeddingBag+SparseAdam", lambda p: torch.optim.SparseAdam(p, lr=LR), 2),
    ):
        free, _ = torch.cuda.mem_get_info()
        if free < state_copies * table_bytes * 1.1:
            rows.append({"impl": name, "error": f"skipped: needs {state_copies * table_bytes / 1e9:.0f} GB of state"})
            continue
        optimizer = make_optimizer([p for m in modules for p in m.parameters()])

        def step(optimizer=optimizer) -> None:
            torch.autograd.backward(forward(), grads)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        with torch.no_grad():
            forward_ms = bench_ms(forward)
        record(name, forward_ms, bench_ms(step))
        del optimizer, step  # the closure holds the optimizer state too
        gc.collect()
        torch.cuda.empty_cache()


def update_correctness(w: Workload) -> dict[str, float]:
    """One fused step on small copies of the first tables, GPU (Triton) against CPU (reference)."""
    small = Workload(
        [
            EmbeddingTableConfig(t.name, 20_000, t.embedding_dim, t.feature_names, t.pooling)
            for t in w.tables[:3] + w.tables[-1:]
        ],
        w.pooling_factor,
        256,
    )
    errors = {}
    for kind in ("rowwise_adagrad", "sgd", "rowwise_adam"):
        cpu = EmbeddingCollection(small.tables, EmbeddingOptimizer(kind, lr=LR))
        gpu = EmbeddingCollection(small.tables, EmbeddingOptimizer(kind, lr=LR), device=DEVICE)
        gpu.load_state_dict(cpu.state_dict())
        initial = cpu.state_dict()["weights_float32"].clone()
        batch = make_batch(small, "cpu", seed=1)
        for ec, device in ((cpu, "cpu"), (gpu, DEVICE)):
            out = ec(batch.to(device))
            sum((values_of(v) * torch.linspace(-1, 1, values_of(v).shape[1], device=device)).sum() for v in out.values()).backward()
        # error of the update itself (the weights barely move, so compare what moved)
        moved_gpu = gpu.state_dict()["weights_float32"].cpu() - initial
        moved_cpu = cpu.state_dict()["weights_float32"] - initial
        errors[f"update_{kind}_relative_error"] = relative_error(moved_gpu, moved_cpu)
        if kind != "sgd":
            errors[f"state_{kind}_relative_error"] = relative_error(
                gpu.state_dict()["row_state_float32"].cpu(), cpu.state_dict()["row_state_float32"]
            )
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 tables of 1M-4M rows, B = 8192 (< 90 s)")
    parser.add_argument("--skip-compile", action="store_true", help="leave out the torch.compile peer (compile time)")
    args = parser.parse_args()
    w = workload(args.quick)
    batch = make_batch(w, DEVICE, seed=0)
    copy_gbs = copy_bandwidth_gbs()
    dims = {t.feature_names[0]: t.embedding_dim for t in w.tables}
    per_key = batch.lengths_per_key()
    rows_read = sum(n * dims[k] * 4 for k, n in zip(batch.keys, per_key))
    outputs = sum((n if t.pooling == "none" else batch.stride) * t.embedding_dim * 4 for t, n in zip(w.tables, per_key))
    forward_bytes = rows_read + outputs
    rows: list[dict] = []

    def record(name: str, forward_ms: float, step_ms: float) -> float:
        gbs = forward_bytes / forward_ms / 1e6
        rows.append(
            {"impl": name, "forward_ms": forward_ms, "forward_GBps": gbs, "pct_of_copy": 100 * gbs / copy_gbs, "step_ms": step_ms}
        )
        return step_ms

    summary = run_opengem(w, batch, rows, record, compile_reference=not args.skip_compile)
    gc.collect()
    torch.cuda.empty_cache()
    run_embedding_bag(w, batch, rows, record)
    ours = summary["opengem module_step_ms"]
    for row in rows:
        if "step_ms" in row:
            row["step_speedup_of_opengem"] = row["step_ms"] / ours
    summary.update(update_correctness(w))
    print(
        f"{len(w.tables)} tables, B = {w.batch_size}, {sum(per_key)} ids, {forward_bytes / 1e9:.2f} GB per forward; "
        f"copy bandwidth {copy_gbs:.0f} GB/s; forward relative error {summary['forward_relative_error']:.2e}"
    )
    print_table(rows, ["impl", "forward_ms", "forward_GBps", "pct_of_copy", "step_ms", "step_speedup_of_opengem", "error"])
    print({k: v for k, v in summary.items() if "error" in k})
    path = write_results(
        "embedding",
        rows,
        {
            "quick": args.quick,
            "copy_GBps": copy_gbs,
            "forward_bytes": forward_bytes,
            "num_ids": sum(per_key),
            "batch_size": w.batch_size,
            "tables": [(t.name, t.num_embeddings, t.embedding_dim, t.pooling) for t in w.tables],
            "pooling_factors": w.pooling_factor,
            **summary,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
