"""GDPA's dK/dV pass (and a fused backward) in Gluon (Hopper, warp-specialized), against the Triton kernels on (a).

Issue 4's sparsity-1.0 backward (1.49-1.65x the compiled padded reference on an H100, bar 2x) needs the backward at
316-482 TFLOP/s; the Triton one runs two passes, dK/dV (four products a tile pair) and dQ (three). This diag asks
the first question of that route: how fast the dK/dV pass runs with a TMA-load worker and the MMAs issued
asynchronously, kernel time against kernel time. Nothing here is wired into ``opengem.ops.gdpa``.

Structure: one program per (key tile of 128 keys of one sample, head); K and V are loaded once; a one-warp worker
TMA-loads the sample's Q and dO tiles (64 or 32 rows) into a ring of stages; the default partition, two warpgroups of
64 keys each, computes per query tile ``S^T = K Q^T`` (both operands in shared memory), ``P^T = phi(s S^T)``, issues
``dV += P^T dO`` (P^T from registers) and ``dP^T = V dO^T`` back to back, then ``dX^T = dP^T * phi'(s S^T)`` and ``dK
+= dX^T Q``, and frees the stage. ``dK = s c sum`` and ``dV = c sum`` with ``c = 1 / max_len`` (``norm="max_len"``),
as the Triton kernel scales them. Query rows past the sample's end are the next sample's (2-D ``[T, H * D]``
descriptors), so the last query tile masks P^T's and dX^T's columns; key rows past the end are not stored.

The ``_fused_dq`` variant also computes dQ in the same programs, the five-product backward that a 2x bar needs (the
Triton op's two passes do seven): each query tile's ``dX^T`` goes to shared memory (it spans both warpgroups' keys),
``dQ^T = K^T dX^T`` runs on the tensor cores and is added into an fp32 ``[T, H, D]`` buffer with relaxed atomics
(not bitwise repeatable, unlike the op), scaled into bf16 after; it is timed against the op's whole backward. How the
adds are issued: by the MMA warps one element an instruction (``_fused_dq``), four (``_red4``, inline
``red.global.add.v4.f32``: session 41 measured 1.15x on the kernel), or by a 4-warp dQ-writer partition
(``_writer``, FlashAttention-3's structure) that takes each step's dQ^T tile from a two-slot shared-memory ring and
adds it four columns an instruction while the MMA warps go on (16 warps: the launch's registers drop to 128 a thread,
the MMA partition gets 216). The ``_2wg`` variants split the MMA warps into a partition a 64-key half, as the
forward's two consumers: they stop meeting at every barrier, and with the writer no longer exchange dX^T (each adds
its own dQ^T partial into its own ring, and the writer sums the two before its adds). The ``_tma`` variants add
dQ as FlashAttention-3 does: the MMA partition stores each step's fp32 dQ tile into a two-slot shared-memory ring
and one thread issues a TMA reduce-add (``cp.reduce.async.bulk.tensor``) of the whole tile, which runs on without any
warp; with ``_2wg`` each key half reduces its own partial (twice the adds in the L2). The ``_pipelined`` variants
(dK and dV, or with ``_tma`` dQ too) issue step i+1's ``S^T`` behind step i's ``dV`` and ``dP^T`` MMAs,
FlashAttention-3's in-warpgroup overlap applied to the backward. The ``_n64`` variants take 64 keys a program in one
warpgroup, two programs an SM (the tile the Triton dK/dV pass picks on (a)): the SM interleaves the two programs'
MMAs and element-wise work, with 232 registers for each MMA warpgroup. The ``_1slot`` variant keeps one fp32 dQ tile
a key half for its TMA reduces instead of two, so 64-row steps in key halves fit (213 KB of shared memory): each step
waits for the previous step's reduce to read the slot.

Self-attention, non-causal, no window, D = 128, bf16, fast_gelu. The kernels are in ``gluon_gdpa_dkdv_kernels``; they
need triton 3.6 (see ``gluon_common``).

    PYTHONPATH=src:. python -m benchmarks.diag.gluon_gdpa_dkdv [--compile-only] [--workloads "a self L=1024"]
"""

from __future__ import annotations

import math
import os

import torch

from benchmarks.common import by_name_prefix, kernel_ms, offsets_of, relative_error, write_results
from benchmarks.diag.gluon_common import SMOKE_LENGTHS, diag_main, healthy_variants, random_heads, tile_schedule
from benchmarks.diag.gluon_gdpa_dkdv_kernels import KEY_TILES, VARIANTS, Variant, compile_only, gluon_gdpa_dkdv
from benchmarks.gdpa import HEAD_DIM, HEADS, workloads  # issue 4's shapes
from opengem.ops import gdpa
from opengem.ops.attention_flops import attention_flops, visible_pairs

# the op peer is the Triton forward (the Gluon one is a variant); read at call time, so set after the imports
os.environ.setdefault("OPENGEM_GDPA_GLUON", "off")


def _triton_grads(q, k, v, dout, offsets, max_len: int, scale: float) -> tuple[torch.Tensor, ...]:
    """The op's ``(dQ, dK, dV)`` (both Triton passes)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = gdpa(q, k, v, offsets, offsets, max_len, max_len, activation="fast_gelu", pre_scale=scale, norm="max_len")
    out.backward(dout)
    return q.grad, k.grad, v.grad


def _problem(lengths: torch.Tensor, seed: int) -> dict:
    q, k, v, dout = random_heads(lengths, 4, seed)
    return dict(q=q, k=k, v=v, dout=dout, offsets=offsets_of(lengths, "cuda"), max_len=int(lengths.max()),
                scale=1 / math.sqrt(HEAD_DIM),
                schedules={keys: tile_schedule(lengths, keys, "cuda") for keys in KEY_TILES})


def _gluon(p: dict, variant: Variant, poison: bool = False) -> tuple[torch.Tensor | None, ...]:
    return gluon_gdpa_dkdv(p["q"], p["k"], p["v"], p["dout"], p["schedules"][variant.block_n], p["max_len"], p["scale"],
                           variant, poison)


def _errors(p: dict, variants) -> dict[str, float]:
    want = _triton_grads(p["q"], p["k"], p["v"], p["dout"], p["offsets"], p["max_len"], p["scale"])
    errors = {}
    for variant in variants:
        for name, got, ref in zip(("dq", "dk", "dv"), _gluon(p, variant, poison=True), want):
            if got is not None:
                errors[f"{variant.name}_{name}_vs_triton"] = relative_error(got, ref)
    return errors


def smoke(variant: Variant) -> float:
    errors = _errors(_problem(torch.tensor(SMOKE_LENGTHS), seed=2), [variant])
    return max(errors.values())


def run(args, chosen: list[Variant]) -> list[dict[str, object]]:
    """Every chosen variant that passes its smoke call against the Triton backward's kernels on workload (a)
    (``args.workloads``: name prefixes), device time from the profiler."""
    variants, failed = healthy_variants("benchmarks.diag.gluon_gdpa_dkdv", chosen)
    rows: list[dict[str, object]] = [{"workload": "smoke (lengths 1..300)",
                                      "failed": {v.name: failed.get(v.name) for v in chosen}}]
    print(rows[0], flush=True)
    print(write_results("gluon_gdpa_dkdv", rows), flush=True)
    for w in by_name_prefix([w for w in workloads(False) if w.name.startswith("a ")], args.workloads, "--workloads"):
        if not variants:
            break
        p = _problem(w.q_lengths, seed=1)
        triton_kernels = kernel_ms(lambda: _triton_grads(p["q"], p["k"], p["v"], p["dout"], p["offsets"], p["max_len"],
                                                         p["scale"]))
        triton_dkdv = sum(ms for name, ms in triton_kernels.items() if "dkdv" in name)
        triton_backward = sum(ms for name, ms in triton_kernels.items() if "gdpa_bwd" in name)
        forward_flops, backward_flops = attention_flops(visible_pairs(w.q_lengths, w.k_lengths), HEADS, HEAD_DIM)
        pass_flops = 2 * forward_flops  # dK/dV's four products a visible pair against the forward's two
        row = {"workload": w.name, **_errors(p, variants), "triton_dkdv_ms": triton_dkdv,
               "triton_dkdv_tflops": pass_flops / triton_dkdv / 1e9, "triton_backward_ms": triton_backward,
               "triton_backward_tflops": backward_flops / triton_backward / 1e9, "triton_kernels_ms": triton_kernels}
        for variant in variants:
            with torch.no_grad():
                kernels = kernel_ms(lambda: _gluon(p, variant))
            name = variant.name
            if variant.fused_dq:  # against the whole Triton backward; its zero fill and dQ cast included
                ms = sum(kernels.values())
                row |= {f"{name}_ms": ms, f"{name}_kernels_ms": kernels,
                        f"{name}_tflops": backward_flops / ms / 1e9, f"{name}_x_triton_backward": triton_backward / ms}
            else:
                ms = sum(t for kernel, t in kernels.items() if "gluon_gdpa_dkdv" in kernel)
                row |= {f"{name}_ms": ms, f"{name}_tflops": pass_flops / ms / 1e9,
                        f"{name}_x_triton": triton_dkdv / ms}
        print(row, flush=True)
        rows.append(row)
        print(write_results("gluon_gdpa_dkdv", rows), flush=True)  # a hang later keeps the rows so far
    return rows


def main() -> None:
    diag_main(__doc__, VARIANTS, smoke, compile_only, run)


if __name__ == "__main__":
    main()
