"""Fused embedding lookup + in-backward row-wise Adagrad against PyTorch's sparse embedding stack.

Workload (issue 8): 20 tables of 1M to 10M rows (log-spaced), dims 64 to 256, pooling factors 1 to 100
(bag lengths uniform on [0, 2L]), plus sequence features (pooling "none") with power-law lengths in
[1, 512], B = 16384. Ids follow a power law over the rows (pdf ~ rank^-1.1: a few popular rows take a
large share), and a hot-row feature like GEM's event type (8 categories, one id per history token of the
last sequence feature: runs of tens of thousands of equal rows in the backward's sorted index) is
included. ``--quick`` (< 90 s cold): 5 pooled tables, one sequence table of 1M x 128 and the event
table, B = 4096, no ``torch.compile`` peer. ``--uniform-ids`` draws ids uniformly (the old workload).
fp32 weights throughout.

Timed side by side (CUDA events, median), ours first, then the peers (each in try/except, time-capped):
- ``opengem op``: the fused lookup alone on a prepared layout (the kernel figure), forward and
  forward + backward + row-wise Adagrad update;
- ``opengem module``: ``EmbeddingCollection(validate_ids=False)`` on a KeyedJagged moved with ``.to``
  (no device sync in the step), host work included; ``opengem module +validate``: the same with the
  default id check (one sync per forward);
- ``reference eager``: the PyTorch reference (lookup + fused update);
- ``EmbeddingBag+Adagrad`` / ``EmbeddingBag+SparseAdam``: one ``nn.EmbeddingBag(mode="sum",
  sparse=True)`` per pooled table, ``nn.Embedding(sparse=True)`` per sequence table, ``torch.optim``;
- ``reference compiled`` (full run only, last): the reference under ``torch.compile(dynamic=True)``.

GB/s counts rows read (ids x dim x 4 B) plus outputs written, against the measured device-to-device copy
bandwidth (one 1 GiB copy: read + write). Embeddings count zero FLOPs (GEM_SPEC section 8), so no MFU.
Every phase and every measurement prints one line as it finishes, and the results JSON (``embedding.json``
for ``--quick``, ``embedding_full.json`` for the full run) is rewritten after each, so a run cut short keeps
what it measured.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from benchmarks.common import bench_ms, print_table, relative_error, write_results
from opengem.jagged import Jagged, KeyedJagged, offsets_from_lengths
from opengem.nn.embedding import EmbeddingCollection, EmbeddingOptimizer, EmbeddingTableConfig
from opengem.ops.embedding import FusedUpdate, LookupLayout, embedding_lookup
from opengem.ops.reference import embedding as reference
from opengem.ops.triton import embedding as lookup_kernels

DEVICE = "cuda"
DIMS = (64, 128, 96, 256, 64)
LR = 0.01
PEER_SLOW_CALL_S = 0.25  # a peer call slower than this is reported from one timed call, not benchmarked
COLUMNS = ["impl", "forward_ms", "forward_GBps", "pct_of_copy", "step_ms", "step_speedup_of_opengem", "error"]
ID_EXPONENT = 1.1  # popularity of rows: pdf ~ rank^-1.1
EVENT_TABLE = EmbeddingTableConfig("event_table", 8, 64, ("event",), pooling="none")  # one id per history token


@dataclass
class Workload:
    tables: list[EmbeddingTableConfig]
    pooling_factor: dict[str, int]  # mean bag length of each pooled feature
    batch_size: int
    power_law_ids: bool = True
    token_of: str = "seq0"  # the event feature has one id per token of this sequence feature


def workload(quick: bool, power_law_ids: bool) -> Workload:
    if quick:
        factors = (1, 4, 16, 50, 100)
        tables = [EmbeddingTableConfig(f"table{i}", 1_000_000, 128, (f"f{i}",)) for i in range(len(factors))]
        tables += [EmbeddingTableConfig("seq_table0", 1_000_000, 128, ("seq0",), pooling="none"), EVENT_TABLE]
        return Workload(tables, {f"f{i}": factor for i, factor in enumerate(factors)}, 4096, power_law_ids)
    count, max_rows = 20, 10_000_000
    tables, pooling = [], {}
    for i in range(count):
        rows = round(1_000_000 * (max_rows / 1_000_000) ** (i / (count - 1)))
        tables.append(EmbeddingTableConfig(f"table{i}", rows, DIMS[i % len(DIMS)], (f"f{i}",)))
        pooling[f"f{i}"] = round(100 ** (((i * 7) % count) / (count - 1)))  # decoupled from the table size
    for j in range(2):
        tables.append(EmbeddingTableConfig(f"seq_table{j}", max_rows // 2, (128, 64)[j], (f"seq{j}",), pooling="none"))
    return Workload([*tables, EVENT_TABLE], pooling, 16384, power_law_ids, token_of="seq1")


def power_law(count: int, low: int, high: int, generator: torch.Generator, exponent: float = 1.5) -> torch.Tensor:
    """``count`` lengths with pdf ~ x^-exponent on [low, high] (benchmarks.common.power_law_lengths, vectorized)."""
    a = 1.0 - exponent
    u = torch.rand(count, generator=generator, dtype=torch.float64)
    return ((low**a + u * (high**a - low**a)) ** (1.0 / a)).floor().clamp(low, high).long()


def make_batch(w: Workload, device: str, seed: int) -> KeyedJagged:
    """Moved with ``KeyedJagged.to``: the device batch carries the host mirror of its lengths."""
    g = torch.Generator().manual_seed(seed)
    keys, lengths, ids = [], [], []
    for table in w.tables:
        (feature,) = table.feature_names
        if table is EVENT_TABLE and w.token_of in keys:
            feature_lengths = lengths[keys.index(w.token_of)]
        elif table.pooling == "none":
            feature_lengths = power_law(w.batch_size, 1, 512, g)
        else:
            feature_lengths = torch.randint(0, 2 * w.pooling_factor[feature] + 1, (w.batch_size,), generator=g)
        keys.append(feature)
        lengths.append(feature_lengths)
        count = int(feature_lengths.sum())
        if w.power_law_ids:
            ids.append(power_law(count, 1, table.num_embeddings, g, ID_EXPONENT) - 1)
        else:
            ids.append(torch.randint(0, table.num_embeddings, (count,), generator=g))
    return KeyedJagged(tuple(keys), torch.cat(ids), torch.cat(lengths)).to(device)


def forward_bytes(w: Workload, batch: KeyedJagged) -> int:
    """Bytes a forward moves at least: every id's row read (fp32), every output row written."""
    per_key = batch.lengths_per_key()
    rows_read = sum(n * t.embedding_dim * 4 for t, n in zip(w.tables, per_key))
    outputs = sum((n if t.pooling == "none" else batch.stride) * t.embedding_dim * 4 for t, n in zip(w.tables, per_key))
    return rows_read + outputs


def longest_run(batch: KeyedJagged) -> int:
    """The most lookups of one row of one table in the batch (the longest run of the backward's sorted index)."""
    per_key = batch.lengths_per_key()
    starts = [sum(per_key[:i]) for i in range(len(per_key))]
    runs = [torch.unique(batch.values[s : s + n], return_counts=True)[1].max() for s, n in zip(starts, per_key) if n]
    return int(torch.stack(runs).max()) if runs else 0


def values_of(x: torch.Tensor | Jagged) -> torch.Tensor:
    return x.values if isinstance(x, Jagged) else x


class Report:
    """Rows and run facts, printed line by line and rewritten to the results JSON after each change."""

    def __init__(self, quick: bool, uniform_ids: bool = False) -> None:
        # the uniform-id run gets its own file: it must not overwrite the power-law run it is compared with
        self.family = ("embedding" if quick else "embedding_full") + ("_uniform" if uniform_ids else "")
        self.rows: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {"quick": quick}
        self.forward_bytes = 0
        self.copy_gbs = float("nan")
        self.ours_step_ms = float("nan")

    def fact(self, message: str, **facts: Any) -> None:
        self.extra.update(facts)
        print(message, flush=True)
        write_results(self.family, self.rows, self.extra)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.fact(f"[phase] {name}: {time.perf_counter() - start:.1f} s")

    def measured(self, name: str, forward_ms: float, step_ms: float, **more: Any) -> None:
        gbs = self.forward_bytes / forward_ms / 1e6
        row = {"impl": name, "forward_ms": forward_ms, "forward_GBps": gbs, "pct_of_copy": 100 * gbs / self.copy_gbs}
        row["step_ms"] = step_ms
        if self.ours_step_ms == self.ours_step_ms:  # known (not NaN) once our module's step is measured
            row["step_speedup_of_opengem"] = step_ms / self.ours_step_ms
        row.update(more)
        self._add(row)

    def failed(self, name: str, error: BaseException | str) -> None:
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self._add({"impl": name, "error": text[:300]})

    def _add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        cells = (f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
        print("[row] " + "  ".join(cells), flush=True)
        write_results(self.family, self.rows, self.extra)


def timed_call_s(fn: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def peer_ms(fn: Callable[[], Any]) -> tuple[float, float]:
    """(median ms, first call s) of a peer, bounded in time: lazy setup / compile happens in the first call;
    a second call slower than PEER_SLOW_CALL_S is reported as is (a short do_bench still costs ~7 calls)."""
    first_s = timed_call_s(fn)
    second_s = timed_call_s(fn)
    if second_s > PEER_SLOW_CALL_S:
        return 1e3 * second_s, first_s
    ms = bench_ms(fn, warmup_ms=5, rep_ms=30)
    torch.cuda.synchronize()
    return ms, first_s


def copy_bandwidth_gbs() -> float:
    """One large device-to-device copy (1 GiB read + 1 GiB written), timed with do_bench."""
    src = torch.ones(1 << 28, device=DEVICE)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    torch.cuda.synchronize()
    return 2 * src.numel() * 4 / ms / 1e6


@dataclass
class Ours:
    """Our collection on the GPU plus the batch's prepared layout (shared by the op and the reference peers)."""

    ec: EmbeddingCollection
    layout: LookupLayout
    offsets: torch.Tensor
    weights: torch.Tensor
    grad_flat: torch.Tensor

    @classmethod
    def build(cls, w: Workload, batch: KeyedJagged) -> Ours:
        ec = EmbeddingCollection(w.tables, EmbeddingOptimizer("rowwise_adagrad", lr=LR), device=DEVICE, validate_ids=False)
        sizes = [t.num_embeddings * t.embedding_dim for t in ec.tables]
        tables = [
            (sum(sizes[:i]), sum(t.num_embeddings for t in ec.tables[:i]), t.num_embeddings, t.embedding_dim)
            for i, t in enumerate(ec.tables)
        ]
        pooling = [t.pooling for t in ec.tables]
        layout = LookupLayout.build(tables, list(range(len(tables))), pooling, batch.lengths_per_key(), batch.stride, DEVICE)
        (weights,) = ec.fused_parameters()
        grad_flat = torch.randn(layout.out_numel, device=DEVICE)
        return cls(ec, layout, offsets_from_lengths(batch.lengths), weights, grad_flat)

    def reference_args(self, batch: KeyedJagged) -> tuple[tuple, tuple]:
        """(lookup arguments, fused-update arguments after grad_out) of `opengem.ops.reference.embedding`."""
        meta = (self.layout.feature_meta, batch.values, self.offsets, batch.stride)
        state = (self.ec.row_state_float32, self.ec.elem_state_float32, self.ec.step_float32)
        hyper = (reference.OPT_ROWWISE_ADAGRAD, LR, 1e-8, 0.9, 0.999, 0.0)
        return (self.weights, *meta, self.layout.out_numel), (self.weights, *state, *meta, *hyper)


def run_ours(ours: Ours, batch: KeyedJagged, report: Report) -> None:
    ec, layout, weights, offsets, grad_flat = ours.ec, ours.layout, ours.weights, ours.offsets, ours.grad_flat
    update = FusedUpdate(
        "rowwise_adagrad", ec.row_state_float32, ec.elem_state_float32, ec.step_float32,
        torch.zeros(0, device=DEVICE, requires_grad=True), lr=LR,
    )  # fmt: skip

    def op_forward() -> torch.Tensor:
        with torch.no_grad():
            return embedding_lookup(weights, layout, batch.values, offsets)

    def op_step() -> None:
        embedding_lookup(weights, layout, batch.values, offsets, update).backward(grad_flat)

    with report.phase("first calls of our op (Triton compiles)"):
        out = op_forward()
        op_step()
        torch.cuda.synchronize()
    with report.phase("forward check against the reference"):
        lookup_args, _ = ours.reference_args(batch)
        with torch.no_grad():
            out = op_forward()
            error = relative_error(out, reference.embedding_lookup(*lookup_args))
        del out
        report.fact(f"forward relative error {error:.2e}", forward_relative_error=error)

    grads = dict(zip(batch.keys, layout.split_outputs(grad_flat)))  # tables and batch share the feature order

    def module_forward() -> None:
        with torch.no_grad():
            ec(batch)

    def module_step() -> None:
        out = ec(batch)
        torch.autograd.backward([values_of(out[k]) for k in batch.keys], [grads[k] for k in batch.keys])

    cases = (
        ("opengem op", op_forward, op_step, False),
        ("opengem module", module_forward, module_step, False),
        ("opengem module +validate", module_forward, module_step, True),
    )
    for name, forward, step, validate_ids in cases:
        ec.validate_ids = validate_ids
        forward_ms = bench_ms(forward)
        torch.cuda.synchronize()
        step_ms = bench_ms(step)
        torch.cuda.synchronize()
        if name == "opengem module":  # the figure the peers' steps are compared with (host work included)
            report.ours_step_ms = step_ms
        report.measured(name, forward_ms, step_ms)
    ec.validate_ids = False
    picks = {str(key): str(config) for key, config in lookup_kernels._lookup_kernel.cache.items()}
    report.fact(f"[tuning] lookup tile per key: {picks}", lookup_tuning=picks)


def run_reference(ours: Ours, batch: KeyedJagged, report: Report, compiled: bool) -> None:
    name = "reference compiled" if compiled else "reference eager"
    lookup_fn, update_fn = reference.embedding_lookup, reference.embedding_fused_update_
    if compiled:
        lookup_fn, update_fn = torch.compile(lookup_fn, dynamic=True), torch.compile(update_fn, dynamic=True)
    lookup_args, update_args = ours.reference_args(batch)

    def step() -> None:
        lookup_fn(*lookup_args)
        update_fn(ours.grad_flat, *update_args)

    try:
        forward_ms, forward_first_s = peer_ms(lambda: lookup_fn(*lookup_args))
        step_ms, step_first_s = peer_ms(step)
        report.measured(name, forward_ms, step_ms, first_calls_s=round(forward_first_s + step_first_s, 1))
    except Exception as error:  # a peer that fails is reported, not fatal
        report.failed(name, error)


def run_embedding_bag(w: Workload, batch: KeyedJagged, report: Report) -> None:
    per_key = batch.lengths_per_key()
    starts = [sum(per_key[:i]) for i in range(len(per_key))]
    lengths = batch.lengths.view(len(batch.keys), -1)
    inputs = [(batch.values[s : s + n], offsets_from_lengths(lengths[i])) for i, (s, n) in enumerate(zip(starts, per_key))]
    modules = [
        nn.Embedding(t.num_embeddings, t.embedding_dim, sparse=True, device=DEVICE)
        if t.pooling == "none"
        else nn.EmbeddingBag(t.num_embeddings, t.embedding_dim, mode="sum", sparse=True, include_last_offset=True, device=DEVICE)
        for t in w.tables
    ]

    def forward() -> list[torch.Tensor]:
        return [m(ids) if isinstance(m, nn.Embedding) else m(ids, offsets) for m, (ids, offsets) in zip(modules, inputs)]

    def forward_no_grad() -> None:
        with torch.no_grad():
            forward()

    with torch.no_grad():
        grads = [torch.randn_like(o) for o in forward()]
    table_bytes = sum(p.numel() * 4 for m in modules for p in m.parameters())
    for name, make_optimizer, state_copies in (
        ("EmbeddingBag+Adagrad", lambda p: torch.optim.Adagrad(p, lr=LR, foreach=False), 1),
        ("EmbeddingBag+SparseAdam", lambda p: torch.optim.SparseAdam(p, lr=LR), 2),
    ):
        free, _ = torch.cuda.mem_get_info()
        if free < state_copies * table_bytes * 1.1:
            report.failed(name, f"skipped: needs {state_copies * table_bytes / 1e9:.0f} GB of optimizer state")
            continue
        try:
            optimizer = make_optimizer([p for m in modules for p in m.parameters()])

            def step(optimizer=optimizer) -> None:
                torch.autograd.backward(forward(), grads)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            forward_ms, _ = peer_ms(forward_no_grad)
            step_ms, first_s = peer_ms(step)
            report.measured(name, forward_ms, step_ms, first_calls_s=round(first_s, 1))
        except Exception as error:
            report.failed(name, error)
        optimizer = step = None  # the closure holds the optimizer state too
        gc.collect()
        torch.cuda.empty_cache()


def update_correctness(w: Workload) -> dict[str, float]:
    """One fused step on small copies of the first tables, GPU (Triton) against CPU (reference)."""
    small = Workload(
        [
            t if t is EVENT_TABLE else EmbeddingTableConfig(t.name, 20_000, t.embedding_dim, t.feature_names, t.pooling)
            for t in w.tables[:3] + w.tables[-2:]
        ],
        w.pooling_factor,
        256,
        w.power_law_ids,
        w.token_of,
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
    parser.add_argument("--quick", action="store_true", help="6 tables + events, B = 4096, no compiled peer")
    parser.add_argument("--skip-compile", action="store_true", help="leave out the torch.compile peer of the full run")
    parser.add_argument("--uniform-ids", action="store_true", help="ids uniform over the rows instead of a power law")
    args = parser.parse_args()
    report = Report(args.quick, args.uniform_ids)
    w = workload(args.quick, power_law_ids=not args.uniform_ids)
    report.fact(
        f"embedding benchmark ({'quick' if args.quick else 'full'}): {len(w.tables)} tables, B = {w.batch_size}",
        batch_size=w.batch_size,
        tables=[(t.name, t.num_embeddings, t.embedding_dim, t.pooling) for t in w.tables],
        pooling_factors=w.pooling_factor,
    )
    with report.phase("batch generation"):
        batch = make_batch(w, DEVICE, seed=0)
    per_key = batch.lengths_per_key()
    report.forward_bytes = forward_bytes(w, batch)
    run = longest_run(batch)
    report.fact(
        f"{sum(per_key)} ids, {report.forward_bytes / 1e9:.3f} GB per forward, longest run of one row {run}",
        num_ids=sum(per_key), forward_bytes=report.forward_bytes, longest_run=run, power_law_ids=w.power_law_ids,
    )  # fmt: skip
    with report.phase("copy bandwidth"):
        report.copy_gbs = copy_bandwidth_gbs()
        report.fact(f"device-to-device copy bandwidth {report.copy_gbs:.0f} GB/s", copy_GBps=report.copy_gbs)
    with report.phase("table creation and layout"):
        ours = Ours.build(w, batch)
        torch.cuda.synchronize()
    run_ours(ours, batch, report)
    with report.phase("update check (small tables, 3 optimizers)"):
        errors = update_correctness(w)
        report.fact(" ".join(f"{k}={v:.2e}" for k, v in errors.items()), **errors)
    with report.phase("reference eager"):
        run_reference(ours, batch, report, compiled=False)
    del ours
    gc.collect()
    torch.cuda.empty_cache()
    with report.phase("EmbeddingBag peers"):
        run_embedding_bag(w, batch, report)
    gc.collect()
    torch.cuda.empty_cache()
    if not args.quick and not args.skip_compile:
        with report.phase("reference compiled"):  # last: compiled peers are the riskiest
            ours = Ours.build(w, batch)
            run_reference(ours, batch, report, compiled=True)
    print_table(report.rows, COLUMNS)


if __name__ == "__main__":
    main()
