"""BlockAttention backward: every autotuner config forced alone, rotary off / in-sequence positions / time
gaps, on the sparsity workload (B 1152, Lmax 2000, H 4, D 128, bf16, block 64). Shows what each config
costs, beside what the autotuner picks in ``benchmarks.block_attention``: in particular whether a config
capped in registers (more programs per SM) beats the uncapped ones.

Run on a GPU: ``PYTHONPATH=src:. python -m benchmarks.diag.block_attention_configs``; writes
``benchmarks/results/block_attention_configs.json``.
"""

from __future__ import annotations

import torch

from benchmarks.block_attention import BLOCK_SIZE, HEAD_DIM, HEADS, Results, _op, _timed, make_batch, workloads
from benchmarks.common import write_results
from opengem.ops.triton import block_attention as kernels

MODES = ((0, "off"), (1, "pos"), (2, "given"), (3, "time"))


class ConfigResults(Results):
    def write(self) -> None:  # its own file, not block_attention.json
        write_results("block_attention_configs", self.rows, extra={"heads": HEADS, "head_dim": HEAD_DIM})


def main() -> None:
    results = ConfigResults(quick=False)
    name, lengths = workloads(quick=True)[0]
    b = make_batch(name, lengths)
    kernel = kernels._block_attention_bwd
    every = list(kernel.configs)
    try:
        for config in every:
            label = f"bwd_w{config.num_warps}" + (f"_max{config.maxnreg}" if config.maxnreg else "")
            label += "_shared" if config.kwargs.get("SHARE_BACK") else ""
            label += "_late_v" if config.kwargs.get("LATE_V") else ""
            kernel.configs = [config]  # one config: Triton runs it without timing candidates
            kernel.cache.clear()
            for mode, mode_name in MODES:
                if config.kwargs.get("SHARE_BACK") and not kernels.share_back_applies(1, mode):
                    continue  # the same code as without sharing
                values = b.rotary_values(mode)
                _timed(results, b, f"{label}_{mode_name}",
                       lambda mode=mode, values=values: _op(b.q, b.k, b.v, b.offsets, BLOCK_SIZE, mode, values),
                       (b.q, b.k, b.v), b.grad)
                torch.cuda.synchronize()
    finally:
        kernel.configs = every
        kernel.cache.clear()
    for r in results.rows:
        if r.get("direction") == "bwd":
            print(f"{r['method']:<24} {r['ms']:.3f} ms ({r['timing']})")


if __name__ == "__main__":
    main()
