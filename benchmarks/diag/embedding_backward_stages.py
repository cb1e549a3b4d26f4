"""Where the embedding step's backward and update spend their time (issue 8's full workload: 24-25 ms of the
26.4 ms op step after a 1.15 ms forward, session 11).

On the benchmark's collection and batch (`benchmarks.embedding`), timed alone: the forward; the host-free
preparation of the sorted contributions (`_sorted_contributions`: bag of each id, global rows, one
stable sort of the row keys, the run bounds by two searchsorted, five gathers); the same plus the long runs'
pieces (`_pieces`); the whole fused row-wise Adagrad update; the op's forward + backward + update step. Then
one step under the profiler: GPU time per kernel name, the top 25. Ids power-law (the benchmark's), then
uniform.

Run on a GPU: ``PYTHONPATH=src:. python -m benchmarks.diag.embedding_backward_stages [--quick]``; writes
``benchmarks/results/embedding_backward_stages.json`` after every workload.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import bench_ms, kernel_ms, write_results
from benchmarks.embedding import DEVICE, LR, Ours, make_batch, workload
from opengem.ops.embedding import FusedUpdate, embedding_lookup
from opengem.ops.triton import embedding as kernels


def _measure(quick: bool, power_law: bool) -> dict:
    """Every stage's milliseconds and the step's top kernels on one workload (its tensors freed on return)."""
    w = workload(quick, power_law_ids=power_law)
    batch = make_batch(w, DEVICE, seed=0)
    ours = Ours.build(w, batch)
    ec, layout, weights, offsets, grad = ours.ec, ours.layout, ours.weights, ours.offsets, ours.grad_flat
    ids, meta = batch.values, layout.feature_meta
    update = FusedUpdate("rowwise_adagrad", ec.row_state_float32, ec.elem_state_float32, ec.step_float32,
                         torch.zeros(0, device=DEVICE, requires_grad=True), lr=LR)

    def forward() -> None:
        with torch.no_grad():
            embedding_lookup(weights, layout, ids, offsets)

    def sort() -> None:
        kernels._sorted_contributions(meta, ids, offsets, layout.batch_size)

    def sort_and_pieces() -> None:
        parts = kernels._sorted_contributions(meta, ids, offsets, layout.batch_size)
        kernels._pieces(parts["run_starts"], kernels.SEGMENT)

    def fused_update() -> None:
        with torch.no_grad():
            kernels.embedding_fused_update_(
                grad, weights, ec.row_state_float32, ec.elem_state_float32, ec.step_float32, meta, ids, offsets,
                layout.batch_size, layout.max_dim, layout.dim_align, kernels.OPT_ROWWISE_ADAGRAD, LR, 1e-8,
                0.9, 0.999, 0.0)  # fmt: skip

    def op_step() -> None:
        embedding_lookup(weights, layout, ids, offsets, update).backward(grad)

    row: dict = {"ids": "power law" if power_law else "uniform", "num_ids": ids.numel(), "max_dim": layout.max_dim}
    for name, run in (("forward", forward), ("sorted_contributions", sort),
                      ("sorted_contributions+pieces", sort_and_pieces), ("fused_update", fused_update),
                      ("op_step", op_step)):
        row[f"{name}_ms"] = bench_ms(run)
        print(row["ids"], name, f"{row[f'{name}_ms']:.3f} ms", flush=True)
    row["op_step_kernel_ms"] = dict(list(kernel_ms(op_step, calls=3, name_width=100).items())[:25])
    for key, ms in row["op_step_kernel_ms"].items():
        print(f"  {ms:9.3f}  {key}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="issue 8's quick workload instead of the full one")
    args = parser.parse_args()
    rows: list[dict] = []
    for power_law in (True, False):
        rows.append(_measure(args.quick, power_law))
        write_results("embedding_backward_stages", rows)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
