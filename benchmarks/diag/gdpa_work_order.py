"""GDPA's tile order A/B: ``OPENGEM_GDPA_WORK_ORDER=work`` (tiles by rows x keys) against ``keys`` (by keys, JFA's
order) on issue 4's (a) rows, the op's forward and forward+backward timed interleaved in one run.

Why: at sparsity 0.5 every sample ends in a partial query tile, and ordering by rows x keys runs it long after the
sample's full tiles, so it reads the sample's K/V from HBM again; at L512 s0.5 the forward must move ~1.2 GB (Q, K,
V, O; an estimate) in ~0.7 ms, so those reads may cost. JFA keeps a sample's tiles adjacent, and GDPA's lead over it
shrinks at s0.5 (session 45: 1.12-1.18x at s1.0, 0.92-1.10x at s0.5). At s1.0 both orders list the same tiles: the
control row.
Each row checks that both orders give bitwise the same output and gradients (only the program a tile runs in moves).
Where the Gluon forward runs (sm_90, triton 3.6) it is timed in both orders too, through the op's launch as the
Triton forward is (``OPENGEM_GDPA_GLUON=only``): the same-run comparison of the two kernels that session 45's tuning
gave (0.84-0.99x) and the Gluon diag's (1.00-1.14x, against the whole op call) disagree on.

    PYTHONPATH=src:. python -m benchmarks.diag.gdpa_work_order [--workloads "a self L=512 s=0.5"] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch

from benchmarks.common import bench_ms, by_name_prefix, interleaved_ms, paired_speedup, relative_error, write_results
from benchmarks.gdpa import _ours, _tensors, workloads
from opengem.ops import gluon
from opengem.ops.attention_flops import attention_flops, visible_pairs
from opengem.ops.triton.gdpa import WORK_ORDERS

DEFAULT_ROWS = ["a self L=256 s=0.5", "a self L=512 s=0.5", "a self L=1024 s=0.5", "a self L=2048 s=0.5",
                "a self L=512 s=1.0"]
DEVICE = "cuda"


def _with_settings(fn: Callable[[], object], order: str, gluon_setting: str = "off") -> Callable[[], object]:
    """``fn`` with the op's tile order and Gluon setting for its launches (the op reads both once a call)."""
    def call() -> object:
        os.environ["OPENGEM_GDPA_WORK_ORDER"] = order
        os.environ["OPENGEM_GDPA_GLUON"] = gluon_setting
        return fn()
    return call


def run(names: list[str], rounds: int) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for w in by_name_prefix([w for w in workloads(False) if w.name.startswith("a ")], names, "--workloads"):
        t = _tensors(w, DEVICE)  # the benchmark's own inputs and call (same seed, same options)
        call, leaves = _ours(w, t), [t["q"], t["k"], t["v"]]
        grad = torch.randn_like(leaves[0])

        def forward() -> torch.Tensor:
            with torch.no_grad():
                return call()

        def forward_backward() -> tuple[torch.Tensor, ...]:
            out = call()
            return (out, *torch.autograd.grad(out, leaves, grad))

        results = {order: _with_settings(forward_backward, order)() for order in WORK_ORDERS}  # tuned under "work"
        same = all(torch.equal(a, b) for a, b in zip(*results.values()))
        fns = {f"{kind}_{order}": _with_settings(fn, order) for kind, fn in (("fwd", forward),
                                                                            ("fwdbwd", forward_backward))
               for order in WORK_ORDERS}
        row: dict[str, object] = {"workload": w.name, "bitwise_equal": same}
        if gluon.available(leaves[0].device):
            fns |= {f"gluon_fwd_{order}": _with_settings(forward, order, "only") for order in WORK_ORDERS}
            gluon_outs = [fns[f"gluon_fwd_{order}"]() for order in WORK_ORDERS]
            row |= {"gluon_bitwise_equal": torch.equal(*gluon_outs),
                    "gluon_vs_triton": relative_error(gluon_outs[0], results["work"][0].detach())}
        times = interleaved_ms(fns, rounds=rounds, bench=bench_ms)
        heads, head_dim = leaves[0].shape[1:]
        flops, _ = attention_flops(visible_pairs(w.q_lengths, w.k_lengths), heads, head_dim)
        row |= {**{f"{name}_ms": min(round_ms) for name, round_ms in times.items()},
                "fwd_tflops_work": flops / min(times["fwd_work"]) / 1e9,
                "fwd_keys_x_work": paired_speedup(times["fwd_work"], times["fwd_keys"]),
                "fwdbwd_keys_x_work": paired_speedup(times["fwdbwd_work"], times["fwdbwd_keys"])}
        for order in WORK_ORDERS if "gluon_fwd_work" in times else ():
            row[f"gluon_x_triton_{order}"] = paired_speedup(times[f"fwd_{order}"], times[f"gluon_fwd_{order}"])
        print(row, flush=True)
        rows.append(row)
        print(write_results("gdpa_work_order", rows), flush=True)  # a cut-short call keeps the rows so far
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", type=lambda s: [p.strip() for p in s.split(",")], default=DEFAULT_ROWS,
                        help="comma-separated name prefixes of (a) rows")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    run(args.workloads, args.rounds)


if __name__ == "__main__":
    main()
