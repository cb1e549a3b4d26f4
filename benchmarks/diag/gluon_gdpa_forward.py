"""A warp-specialized GDPA forward in Gluon (Hopper), against the Triton kernel and JFA on issue 4's workload (a).

Issue 4's forward bar against JFA (>= 1.1x) fails on the sparsity-0.5 rows at L >= 512 (1.02-1.10x, H100, session
40), and every route past the Triton kernels' ceilings names warp specialization, which Triton 3.6's ``tl.range``
does not build on Hopper. This is the first kernel on that route: GDPA's forward has no row statistics (``O = c *
sum_j phi(s * q k_j) v_j``), so it is the simplest attention loop to move. Its persistent form won on every (a) row
(session 43) and is now the op's (``opengem.ops.gluon.gdpa_forward``, opt-in): the ``persistent`` variants here launch
that kernel, the one-item variants build on its consumer loop.

Structure: one program per (query tile of one sample, head), or with ``persistent`` one program an SM looping over them;
a one-warp worker partition TMA-loads the sample's K and V tiles into a ring of shared-memory stages (``ready`` /
``empty`` mbarriers per tile); two warpgroups of 64 query rows each run ``S = Q K^T`` on the tensor cores, ``P =
phi(S)`` in registers (fast_gelu's smoothstep form, as ``opengem.ops.triton.activations``), hand P to ``O += P V`` from
registers and free the buffers, overlapping inside a warpgroup as FlashAttention-3 does (tile j+1's ``S`` issued before
tile j's ``P V``). With ``consumers=1`` the two warpgroups are one 8-warp partition and meet at every barrier arrive
(session 40's form); with ``consumers=2`` each is its own partition, drifts from the other and frees a K buffer as soon
as its ``S`` retires; ``pingpong`` makes the two take turns issuing their MMAs. The ``_m64`` variants take 64 query rows
a program in one 4-warp consumer, two programs an SM (the Triton forward's own pick on (a) at L <= 1024 is 64 rows and 4
warps, several programs an SM), so the SM interleaves two programs' MMAs and activations. Q, K and V are read through
2-D ``[T, H * D]`` descriptors: key rows past a sample's end belong to the next sample (or read as zeros past T), so the
last key tile masks P's columns; query rows past the end are not stored.

Self-attention only (``q_offsets == k_offsets``), non-causal, no window, D = 128, bf16, ``norm="max_len"``. The
kernels are in ``gluon_gdpa_forward_kernels``; they need triton 3.6 (the GPU image's; 3.9's Gluon API rejects them).
``--compile-only`` builds them for sm_90 without a GPU and prints their SASS resources (run it under a triton 3.6
install); on a GPU this checks the output against the Triton op and the fp32 reference, then times every variant, the
Triton op and JFA interleaved on (a), rewriting ``benchmarks/results/gluon_gdpa_forward.json`` after each workload.

    PYTHONPATH=src:. python -m benchmarks.diag.gluon_gdpa_forward [--compile-only] [--workloads "a self L=1024"]
"""

from __future__ import annotations

import math
import os
from functools import partial

import torch

from benchmarks.common import (bench_ms, by_name_prefix, interleaved_ms, offsets_of, paired_speedup, relative_error,
                               write_results)
from benchmarks.diag.gluon_common import SMOKE_LENGTHS, diag_main, healthy_variants, random_heads
from benchmarks.diag.gluon_gdpa_forward_kernels import VARIANTS, Variant, compile_only, gluon_gdpa_forward, schedule_for
from benchmarks.gdpa import BATCH, HEAD_DIM, HEADS, workloads  # issue 4's shapes
from opengem.ops import gdpa, jagged_attention
from opengem.ops.attention_flops import attention_flops, visible_pairs

# the op peer is the Triton forward (the Gluon one is a variant); read at call time, so set after the imports
os.environ.setdefault("OPENGEM_GDPA_GLUON", "off")


def _errors(q, k, v, lengths: torch.Tensor, max_len: int, scale: float, variants,
            samples: int = 32) -> dict[str, float]:
    """Both kernels against the fp32 reference on the first ``samples`` samples (the reference is slow)."""
    sub = lengths[:samples]
    rows = int(sub.sum())
    q, k, v = q[:rows].contiguous(), k[:rows].contiguous(), v[:rows].contiguous()
    offsets = offsets_of(sub, q.device)
    options = dict(activation="fast_gelu", pre_scale=scale, norm=float(max_len))
    want = gdpa(q.float(), k.float(), v.float(), offsets, offsets, max_len, max_len, backend="reference", **options)
    triton_out = gdpa(q, k, v, offsets, offsets, max_len, max_len, backend="triton", **options)
    return {"triton_vs_fp32": relative_error(triton_out, want)} | {
        f"{variant.name}_vs_fp32": relative_error(
            gluon_gdpa_forward(q, k, v, schedule_for(variant, sub), max_len, scale, variant, poison=True), want)
        for variant in variants}


def smoke(variant: Variant) -> float:
    """One variant on a small jagged batch (single, partial and several key tiles) against the Triton op: the
    relative error. :func:`healthy_variants` runs it in a child process, so a hang costs a timeout. A persistent
    variant runs as 3 programs, so each loops over many work items (the ring carried from item to item)."""
    lengths = torch.tensor(SMOKE_LENGTHS)
    q, k, v = random_heads(lengths, 3, seed=2)
    offsets, max_len, scale = offsets_of(lengths, "cuda"), int(lengths.max()), 1 / math.sqrt(HEAD_DIM)
    want = gdpa(q, k, v, offsets, offsets, max_len, max_len, activation="fast_gelu", pre_scale=scale, norm="max_len")
    got = gluon_gdpa_forward(q, k, v, schedule_for(variant, lengths), max_len, scale, variant, programs=3,
                             poison=True)
    return relative_error(got, want)


def run(args, chosen: list[Variant]) -> list[dict[str, object]]:
    """Every chosen variant that passes its smoke call, the Triton op and JFA, timed interleaved on workload (a)
    (``args.workloads``: name prefixes; ``args.rounds`` rounds)."""
    variants, failed = healthy_variants("benchmarks.diag.gluon_gdpa_forward", chosen)
    rows: list[dict[str, object]] = []
    if failed:
        rows.append({"workload": "smoke (lengths 1..300)", "failed": failed})
        print(write_results("gluon_gdpa_forward", rows), flush=True)
    if not variants:
        return rows
    for w in by_name_prefix([w for w in workloads(False) if w.name.startswith("a ")], args.workloads, "--workloads"):
        q, k, v = random_heads(w.q_lengths, 3, seed=1)
        offsets, max_len = offsets_of(w.q_lengths, "cuda"), int(w.q_lengths.max())
        scale = 1 / math.sqrt(HEAD_DIM)
        schedules = {variant.name: schedule_for(variant, w.q_lengths) for variant in variants}
        fns = {
            "triton": lambda: gdpa(q, k, v, offsets, offsets, max_len, max_len, activation="fast_gelu",
                                   pre_scale=scale, norm="max_len"),
            "jfa": lambda: jagged_attention(q, k, v, offsets, max_len, causal=False, scale=scale),
        } | {variant.name: partial(gluon_gdpa_forward, q, k, v, schedules[variant.name], max_len, scale, variant)
             for variant in variants}
        with torch.no_grad():
            errors = _errors(q, k, v, w.q_lengths, max_len, scale, variants)
            want = fns["triton"]()
            errors |= {f"{name}_vs_triton": relative_error(fn(), want) for name, fn in fns.items() if "gluon" in name}
            fns["jfa"]()  # its tuner runs here, not inside a timed round
            times = interleaved_ms(fns, rounds=args.rounds, bench=bench_ms)
        flops, _ = attention_flops(visible_pairs(w.q_lengths, w.k_lengths), HEADS, HEAD_DIM)
        row = {"workload": w.name, "batch": BATCH, **errors,
               **{f"{name}_ms": min(t) for name, t in times.items()},
               **{f"{name}_tflops": flops / min(t) / 1e9 for name, t in times.items()},
               "triton_x_jfa": paired_speedup(times["jfa"], times["triton"])}
        for name in (n for n in fns if "gluon" in n):
            row[f"{name}_x_triton"] = paired_speedup(times["triton"], times[name])
            row[f"{name}_x_jfa"] = paired_speedup(times["jfa"], times[name])
        print(row, flush=True)
        rows.append(row)
        print(write_results("gluon_gdpa_forward", rows), flush=True)  # a hang later keeps the rows so far
    return rows


def main() -> None:
    diag_main(__doc__, VARIANTS, smoke, compile_only, run,
              configure=lambda parser: parser.add_argument("--rounds", type=int, default=5))


if __name__ == "__main__":
    main()
