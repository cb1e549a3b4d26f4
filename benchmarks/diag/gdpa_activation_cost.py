"""What GDPA's activation costs its kernels: issue 4's (b) K/V 256 forward runs at 363-387 TFLOP/s against a bar of
400, and on sm_90 fast_gelu adds 7 SASS instructions per score to the forward (resident K/V tile, 64 rows: 1,728
instructions a thread against 832 with identity; silu with the tanh approximation 1,344; compiled on the CPU,
session 24). If identity runs much faster than fast_gelu, the activation's element-wise work sits on the kernel's
critical path and cheaper math (packed 16-bit, fewer clamps) is the lever; if not, the tensor-core pipeline is.

For (b) K/V 256 and (a) L512 s1.0 and each activation: forward and backward milliseconds over a 20 ms window after
1 s idle (full clock, as the tuner times) and the forward over 100 ms (the benchmark's window), with TFLOP/s of the
20 ms figures (useful FLOPs, GEM_SPEC section 8: the same for every activation).

``PYTHONPATH=src:. python -m benchmarks.diag.gdpa_activation_cost``; writes
``benchmarks/results/gdpa_activation_cost.json``.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from benchmarks.common import rested_ms, write_results
from benchmarks.gdpa import HEAD_DIM, HEADS, _ours, _tensors, workloads
from opengem.ops.attention_flops import attention_flops, visible_pairs

NAMES = ("b cross Q<=2048 KV=256", "a self L=512 s=1.0")
ACTIVATIONS = ("identity", "relu", "fast_gelu", "silu", "gelu_tanh")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--activations", default=",".join(ACTIVATIONS), type=lambda text: text.split(","))
    activations = parser.parse_args().activations
    rows = []
    for w in (w for w in workloads(quick=False) if w.name in NAMES):
        t = _tensors(w, "cuda")
        fwd_flops, bwd_flops = attention_flops(visible_pairs(w.q_lengths, w.k_lengths, masked=False), HEADS, HEAD_DIM)
        for activation in activations:
            forward = _ours(dataclasses.replace(w, activation=activation), t)
            out = forward()
            grad = torch.randn_like(out)
            leaves = (t["q"], t["k"], t["v"])
            backward = lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True)  # noqa: E731
            backward()
            with torch.no_grad():
                fwd20, fwd100 = rested_ms(forward, 20), rested_ms(forward, 100)
            bwd20 = rested_ms(backward, 20)
            row = {"workload": w.name, "activation": activation, "fwd_ms_rep20": fwd20, "fwd_ms_rep100": fwd100,
                   "bwd_ms_rep20": bwd20, "fwd_tflops_rep20": fwd_flops / fwd20 / 1e9,
                   "bwd_tflops_rep20": bwd_flops / bwd20 / 1e9}
            rows.append(row)
            print(row, flush=True)
            write_results("gdpa_activation_cost", rows)  # each row at once: a call cut short keeps what finished


if __name__ == "__main__":
    main()
