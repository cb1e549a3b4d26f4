"""Diagnostic (issue 10): the roofline of every GEMM a compiled training step runs, projected to a GPU batch.

gem-small's GEMMs reduce over d_model = 256, so a [T, 256] x [256, 256] product does 128 FLOPs per byte it must move
at least once, under the ~295 FLOP/byte an H100 needs to be compute-bound at its dense peak (989 TFLOP/s over 3.35
TB/s; ~240 at its ~800 TFLOP/s matmul ceiling). This counts the GEMMs of one compiled step (AOTAutograd's forward and
backward graphs, before Inductor; the attention ops are custom ops, not counted here) with the shapes they ran at, and
for each the time it cannot beat: the larger of its FLOPs at the matmul ceiling and its bytes at the HBM bandwidth,
where the bytes are each operand read once and the output written once (at the operands' dtype: aten's GEMMs take and
return one). Their sum is the floor of the step's GEMM time while each GEMM stays a kernel of its own; only fusing
neighbours (keeping activations on chip across a GEMM chain) goes under it.

The step runs on the CPU at a small batch; the shapes are projected to ``--target-batch``: a size equal to the batch's
sample count scales with the batch, every other symbolic size with the history tokens (``--target-batch`` times the
preset's mean history length, against the CPU batch's own tokens). Sizes fixed by the model do not move.

    PYTHONPATH=src:. python -m benchmarks.diag.gemm_roofline [--preset gem-small] [--batch-size 64]
        [--target-batch 2048] [--matmul-tflops 801] [--hbm-tbs 3.35] [--out benchmarks/results/gemm_roofline.json]
"""

from __future__ import annotations

import argparse
import collections
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import sympy
import torch
from torch import fx

from benchmarks.common import environment
from benchmarks.diag.step_graph_ops import GEMMS, GraphRecorder, compiled_learner
from opengem.models.presets import describe

Shape = tuple[int, ...]


@dataclass(frozen=True)
class GemmRoofline:
    kind: str  # forward / backward
    op: str  # mm / addmm / bmm
    shapes: tuple[Shape, ...]  # the two operands, at the target batch
    shared: tuple[bool, bool]  # bmm: an operand broadcast over the batch (stride 0), read once
    calls: int  # a step
    flops: int  # a call
    bytes: int  # a call: operands read once, output written once
    floor_ms: float  # a step: calls x max(compute, memory)
    bound: str  # "memory" or "compute"


def gemm_cost(op: str, a: Shape, b: Shape, itemsize: int,
              shared: tuple[bool, bool] = (False, False)) -> tuple[int, int]:
    """FLOPs and minimum HBM bytes of ``a @ b`` (``bmm``: batched ``[n, m, k] @ [n, k, p]``, an operand marked
    ``shared`` broadcast over the batch and read once)."""
    if op == "bmm":
        if len(a) != 3 or len(b) != 3 or a[0] != b[0] or a[2] != b[1]:
            raise ValueError(f"bmm operands must be [n, m, k] and [n, k, p], got {a} and {b}")
        n, m, k = a
        p = b[2]
        reads = (1 if shared[0] else n) * m * k + (1 if shared[1] else n) * k * p
        return 2 * n * m * k * p, itemsize * (reads + n * m * p)
    if len(a) != 2 or len(b) != 2 or a[1] != b[0]:
        raise ValueError(f"{op} operands must be [m, k] and [k, n], got {a} and {b}")
    (m, k), n = a, b[1]
    return 2 * m * k * n, itemsize * (m * k + k * n + m * n)


def roofline(op: str, kind: str, shapes: tuple[Shape, Shape], calls: int, itemsize: int, matmul_tflops: float,
             hbm_tbs: float, shared: tuple[bool, bool] = (False, False)) -> GemmRoofline:
    """One GEMM's floor a step at ``matmul_tflops`` (TFLOP/s) and ``hbm_tbs`` (TB/s)."""
    flops, nbytes = gemm_cost(op, *shapes, itemsize, shared)
    compute_s, memory_s = flops / (matmul_tflops * 1e12), nbytes / (hbm_tbs * 1e12)
    return GemmRoofline(kind, op, shapes, shared, calls, flops, nbytes, calls * max(compute_s, memory_s) * 1e3,
                        "memory" if memory_s > compute_s else "compute")


def _size_bindings(graph: fx.Graph) -> list[tuple[int, int | None, sympy.Symbol]]:
    """(placeholder index, dim or None for a SymInt input, symbol) for every plain-symbol size of the inputs."""
    bindings = []
    for index, node in enumerate(n for n in graph.nodes if n.op == "placeholder"):
        value = node.meta.get("val")
        if isinstance(value, torch.SymInt) and isinstance(value.node.expr, sympy.Symbol):
            bindings.append((index, None, value.node.expr))
        elif isinstance(value, torch.Tensor):
            bindings += [(index, d, s.node.expr) for d, s in enumerate(value.shape)
                         if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol)]  # fmt: skip
    return bindings


def _evaluate(size: Any, values: Mapping[sympy.Symbol, int]) -> int:
    return int(size.node.expr.xreplace(values)) if isinstance(size, torch.SymInt) else int(size)


@dataclass(frozen=True)
class Projection:
    batch: int  # the recorded batch's samples
    tokens: int  # and history tokens
    target_batch: int
    target_tokens: float

    def sizes(self, values: Mapping[sympy.Symbol, int]) -> dict[sympy.Symbol, int]:
        """Each size symbol's value at the target batch: one equal to the batch's sample count scales with the batch,
        every other with the history tokens."""
        return {sym: round(v * self.target_batch / self.batch) if v == self.batch
                else round(v * self.target_tokens / self.tokens) for sym, v in values.items()}  # fmt: skip


class GemmShapes(GraphRecorder):
    """The GEMMs of each compiled graph as each run met them while ``recording``: per run, the graph kind, its GEMMs
    (op, symbolic operands) and the values of its size symbols."""

    def __init__(self) -> None:
        super().__init__()
        self.runs: list[tuple[str, list[tuple[str, list[Any]]], dict[sympy.Symbol, int]]] = []

    def analyze(self, graph_module: fx.GraphModule) -> tuple[list, list[tuple[str, list[Any]]]]:
        """The graph's size bindings and its GEMMs (op, symbolic operands)."""
        gemms = [(str(n.target).split(".")[1], [a.meta["val"] for a in n.args if isinstance(a, fx.Node)][-2:])
                 for n in graph_module.graph.nodes if str(n.target) in GEMMS]  # fmt: skip
        return _size_bindings(graph_module.graph), gemms

    def record(self, kind: str, analysis: tuple[list, list[tuple[str, list[Any]]]], args: Sequence[Any]) -> None:
        bindings, gemms = analysis
        values = {sym: int(args[i] if d is None else args[i].shape[d]) for i, d, sym in bindings}
        self.runs.append((kind, gemms, values))

    def rooflines(self, projection: Projection, matmul_tflops: float, hbm_tbs: float) -> list[GemmRoofline]:
        """Every recorded GEMM at the projection's target batch, the same shapes merged, largest floor first."""
        calls: collections.Counter = collections.Counter()
        for kind, gemms, values in self.runs:
            target = projection.sizes(values)
            for op, operands in gemms:
                shapes = tuple(tuple(_evaluate(s, target) for s in t.shape) for t in operands)
                shared = tuple(op == "bmm" and t.stride()[0] == 0 for t in operands)
                calls[(kind, op, shapes, shared, operands[0].dtype.itemsize)] += 1
        rows = [roofline(op, kind, shapes, n, itemsize, matmul_tflops, hbm_tbs, shared)
                for (kind, op, shapes, shared, itemsize), n in calls.items()]  # fmt: skip
        return sorted(rows, key=lambda r: -r.floor_ms)


def record_step(preset: str, batch_size: int, device: str, overrides: Sequence[str]) -> tuple[GemmShapes, int, int]:
    """The GEMMs of one compiled forward and backward (after a first that compiles), with that batch's samples and
    history tokens. The optimizer runs no GEMM and is left out, with its state: gem-large's would not fit a 24 GB
    machine beside the model."""
    shapes = GemmShapes()
    learner, stream, torch_device = compiled_learner(preset, batch_size, device, overrides, shapes.backend())
    learner.model.train()
    for recording in (False, True):
        batch = next(stream)
        if recording and batch.num_history_tokens() == 0:
            raise ValueError(f"the recorded {preset} batch has no history tokens: no token count to project from")
        shapes.recording = recording
        learner.loss(batch.to(torch_device))[0].backward()
        learner.model.zero_grad(set_to_none=True)
    shapes.recording = False
    return shapes, batch.batch_size(), batch.num_history_tokens()


def totals(rows: Sequence[GemmRoofline], matmul_tflops: float) -> dict[str, float]:
    """A step's GEMM FLOPs and bytes, its floor, the compute-only time and the memory-bound GEMMs' share of it."""
    flops = sum(r.calls * r.flops for r in rows)
    floor = sum(r.floor_ms for r in rows)
    return {"tflop": flops / 1e12, "gb": sum(r.calls * r.bytes for r in rows) / 1e9, "floor_ms": floor,
            "compute_only_ms": flops / (matmul_tflops * 1e12) * 1e3,
            "memory_bound_share": sum(r.floor_ms for r in rows if r.bound == "memory") / floor if floor else 0.0}


def format_rows(rows: Sequence[GemmRoofline], total: Mapping[str, float]) -> str:
    lines = [f"GEMMs a step: {total['tflop']:.2f} TFLOP, {total['gb']:.1f} GB moved at least; floor "
             f"{total['floor_ms']:.1f} ms (compute alone {total['compute_only_ms']:.1f} ms; memory-bound GEMMs "
             f"{100 * total['memory_bound_share']:.0f}% of the floor)",
             "   ms  calls  bound    kind      op     shapes"]
    lines += [f"{r.floor_ms:6.2f} {r.calls:5d}  {r.bound:7s}  {r.kind:8s}  {r.op:5s}  {' x '.join(map(str, r.shapes))}"
              for r in rows]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gem-small")
    parser.add_argument("--batch-size", type=int, default=64, help="the batch the CPU step runs")
    parser.add_argument("--target-batch", type=int, default=2048, help="the GPU batch the shapes are projected to")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--matmul-tflops", type=float, default=801.0,
                        help="the matmul ceiling (default: bench train's on an H100, session 37)")
    parser.add_argument("--hbm-tbs", type=float, default=3.35, help="HBM bandwidth (default: the H100's datasheet)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    for name, value in (("--batch-size", args.batch_size), ("--target-batch", args.target_batch),
                        ("--matmul-tflops", args.matmul_tflops), ("--hbm-tbs", args.hbm_tbs)):  # fmt: skip
        if value <= 0:
            parser.error(f"{name} must be positive, got {value}")
    shapes, batch, tokens = record_step(args.preset, args.batch_size, args.device, args.set)
    target_tokens = args.target_batch * describe(args.preset).mean_history_length
    rows = shapes.rooflines(Projection(batch, tokens, args.target_batch, target_tokens), args.matmul_tflops,
                            args.hbm_tbs)
    total = totals(rows, args.matmul_tflops)
    print(format_rows(rows, total))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"benchmark": "gemm_roofline", "environment": environment(), "preset": args.preset,
                   "cpu_batch": args.batch_size, "target_batch": args.target_batch, "overrides": args.set,
                   "matmul_tflops": args.matmul_tflops, "hbm_tbs": args.hbm_tbs, "totals": total,
                   "gemms": [asdict(r) for r in rows]}  # fmt: skip
        args.out.write_text(json.dumps(payload, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
