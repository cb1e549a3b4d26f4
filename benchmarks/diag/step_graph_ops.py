"""Diagnostic (issue 10): the ops a compiled training step runs, counted per call, on any device, before a GPU run.

gem-large's idle is mostly the few microseconds between consecutive kernels (session 33: 6.27 of 10.21 ms a step of
profiled gaps were under 10 us), so a setting that removes kernels is worth its count. This compiles the model's
regions as ``bench train --compile`` does, but with a backend that keeps AOTAutograd's forward and backward graphs
(aten ops, before Inductor) and counts their ops each time a graph runs, over one step after a first one. Casts of a
graph's inputs (parameters, under autocast) that feed a GEMM, and the GEMMs themselves, stay kernels of their own
after Inductor; pointwise ops may fuse. ``--compare KEY=VALUE ...`` runs the same step with those settings too and
prints both counts and the difference.

    PYTHONPATH=src:. python -m benchmarks.diag.step_graph_ops [--preset gem-small] [--batch-size 8] [--device cpu]
        [--compare weight_shadows=true] [--out benchmarks/results/step_graph_ops_gem-small.json]

On the CPU (bf16 autocast), gem-small with ``weight_shadows=true``: 939 -> 685 forward ops a step (the 230 casts of
parameters feeding a GEMM gone), the backward's 1,277 unchanged (session 33).
"""

from __future__ import annotations

import argparse
import collections
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch._dynamo.backends.common import aot_autograd

from benchmarks.common import environment
from opengem.data.schema import Batch
from opengem.nn.embedding import trust_ids
from opengem.train.bench.step import TrainBenchOptions, bench_config
from opengem.train.compile import compile_regions
from opengem.train.data_stream import train_batches
from opengem.train.trainer import Learner, build_learner

# views of their input and size queries: no kernel after Inductor
VIEWS = frozenset({"aten.view.default", "aten._unsafe_view.default", "aten.t.default", "aten.permute.default",
                   "aten.transpose.int", "aten.slice.Tensor", "aten.unsqueeze.default", "aten.squeeze.dim",
                   "aten.detach.default", "aten.unbind.int", "aten.sym_size.int", "aten.expand.default",
                   "aten.select.int", "aten.alias.default"})  # fmt: skip
GEMMS = frozenset({"aten.mm.default", "aten.addmm.default", "aten.bmm.default"})


def op_name(node: fx.Node) -> str | None:
    """An aten or opengem op's name (casts named by source and target: ``_to_copy[input->bfloat16, to GEMM]``),
    None for other nodes."""
    target = str(node.target)
    if node.op != "call_function" or not (target.startswith("aten.") or target.startswith("opengem.")):
        return None
    if target != "aten._to_copy.default":
        return target
    source = "input" if node.args[0].op == "placeholder" else "computed"
    dtype = str(node.kwargs.get("dtype", "same")).removeprefix("torch.")
    return f"_to_copy[{source}->{dtype}{', to GEMM' if _feeds_gemm(node) else ''}]"


def _feeds_gemm(node: fx.Node) -> bool:
    """Whether the node's value reaches a GEMM through views only."""
    return any(str(user.target) in GEMMS or (str(user.target) in VIEWS and _feeds_gemm(user)) for user in node.users)


class GraphRecorder:
    """A compile backend (AOTAutograd; the graphs run as traced) that analyzes each compiled graph once, with
    :meth:`analyze`, and hands that analysis and the run's inputs to :meth:`record` each time the graph runs while
    ``recording``."""

    def __init__(self) -> None:
        self.recording = False

    def analyze(self, graph_module: fx.GraphModule) -> Any:
        raise NotImplementedError

    def record(self, kind: str, analysis: Any, args: Sequence[Any]) -> None:
        raise NotImplementedError

    def compiler(self, kind: str) -> Callable[[fx.GraphModule, Sequence[Any]], Callable[..., Any]]:
        def compile_graph(graph_module: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
            analysis = self.analyze(graph_module)

            def run(*args: Any) -> Any:
                if self.recording:
                    self.record(kind, analysis, args)
                return graph_module(*args)

            return run

        return compile_graph

    def backend(self) -> Callable[..., Any]:
        return aot_autograd(fw_compiler=self.compiler("forward"), bw_compiler=self.compiler("backward"))


class Counts(GraphRecorder):
    """Ops a step by graph kind (``forward`` / ``backward``), added each time a compiled graph runs while
    ``recording``."""

    def __init__(self) -> None:
        super().__init__()
        self.per_step = {"forward": collections.Counter(), "backward": collections.Counter()}

    def analyze(self, graph_module: fx.GraphModule) -> collections.Counter:
        return collections.Counter(name for node in graph_module.graph.nodes if (name := op_name(node)))

    def record(self, kind: str, analysis: collections.Counter, args: Sequence[Any]) -> None:
        self.per_step[kind].update(analysis)


def summary(counts: collections.Counter) -> dict[str, Any]:
    """Totals without the views, the GEMMs and casts apart, and every op by count."""
    ops = {name: n for name, n in counts.most_common() if name not in VIEWS}
    return {"ops": sum(ops.values()), "gemms": sum(n for name, n in ops.items() if name in GEMMS),
            "casts": sum(n for name, n in ops.items() if name.startswith("_to_copy")), "by_op": ops}


def compiled_learner(preset: str, batch_size: int, device: str, overrides: Sequence[str],
                     backend: Callable[..., Any]) -> tuple[Learner, Iterator[Batch], torch.device]:
    """The benchmark's learner (bf16, the bf16 sequence stream, ``overrides`` on top) with its regions compiled by
    ``backend``, its batch stream and its device."""
    # compile=False: the learner is built uncompiled, and ``backend`` compiles its regions below
    options = TrainBenchOptions(preset=preset, compile=False, batch_size=batch_size, device=device,
                                precision="bf16", overrides=("gem.sequence_dtype=compute", *overrides))  # fmt: skip
    config, torch_device, _ = bench_config(options)
    # fresh compiles: a process that compiled other models of these classes before (a test run) would otherwise count
    # against dynamo's recompile limit on the shared forward code
    torch._dynamo.reset()
    torch.manual_seed(config.seed)
    learner = build_learner(config, config.model.history, torch_device)
    trust_ids(learner.model)
    compile_regions(learner.model, backend=backend)
    return learner, train_batches(config, start_step=0), torch_device


def count_step(preset: str, batch_size: int, device: str, overrides: Sequence[str]) -> dict[str, Any]:
    """One step's ops (after a first step that compiles) with ``overrides`` on top of the benchmark's settings."""
    counts = Counts()
    learner, stream, torch_device = compiled_learner(preset, batch_size, device, overrides, counts.backend())
    learner.step(next(stream).to(torch_device))
    counts.recording = True
    learner.step(next(stream).to(torch_device))
    return {"overrides": list(overrides), **{kind: summary(c) for kind, c in counts.per_step.items()}}


def format_runs(runs: list[dict[str, Any]]) -> str:
    """Each graph kind's total a run, then every op's count a run side by side, the ops whose count differs marked."""
    lines = []
    for kind in ("forward", "backward"):
        header = " / ".join(f"{run[kind]['ops']} ({', '.join(run['overrides']) or 'as set'})" for run in runs)
        lines.append(f"{kind} ops a step, views excluded: {header}")
        names = list(dict.fromkeys(name for run in runs for name in run[kind]["by_op"]))
        for name in names:
            values = [run[kind]["by_op"].get(name, 0) for run in runs]
            changed = "  <- changed" if len(set(values)) > 1 else ""
            lines.append(f"  {' / '.join(f'{v:5d}' for v in values)}  {name}{changed}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gem-small")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="small is enough: a graph's ops do not grow with the batch")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a setting for every run")
    parser.add_argument("--compare", nargs="+", default=[], metavar="KEY=VALUE", help="a second run with these")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    variants = [args.set] + ([args.set + args.compare] if args.compare else [])
    runs = [count_step(args.preset, args.batch_size, args.device, overrides) for overrides in variants]
    print(format_runs(runs))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"benchmark": "step_graph_ops", "environment": environment(), "preset": args.preset,
                   "batch_size": args.batch_size, "runs": runs}  # fmt: skip
        args.out.write_text(json.dumps(payload, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
