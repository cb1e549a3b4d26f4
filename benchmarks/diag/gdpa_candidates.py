"""GDPA's tuning candidates one at a time, on each load path, against the fp32 reference: which (pass,
candidate, loads) is wrong, on which lengths and masks. Session 10's GPU tests found wrong results from
some TMA candidates (``test_every_tuning_candidate``): masked tiles with BLOCK_N = D (128 x 128 at D 128; 128 x 64
and 64 x 64 at D 64), which ``tma_tile_safe`` now keeps on pointer loads. The diag runs them anyway (the
filter bypassed), at D 128 masked and not and at D 64 masked.

Run on a GPU: ``PYTHONPATH=src:. python -m benchmarks.diag.gdpa_candidates``; writes
``benchmarks/results/gdpa_candidates.json`` (one row per case: relative errors of out, dq, dk, dv).
"""

from __future__ import annotations

import os

os.environ["OPENGEM_GDPA_TUNE"] = "0"  # the first candidate that runs: the one forced below

import itertools  # noqa: E402
import math  # noqa: E402
from dataclasses import replace  # noqa: E402

import torch  # noqa: E402

from benchmarks.common import relative_error, write_results  # noqa: E402
from opengem.ops.activations import ACTIVATIONS  # noqa: E402
from opengem.ops.reference import gdpa as reference  # noqa: E402
from opengem.ops.triton import gdpa as triton_gdpa  # noqa: E402

LENGTH_SETS = {
    "test": [256, 1, 0, 129, 85],  # test_every_tuning_candidate's, max 256
    "test700": [700, 1, 0, 129, 233],
    "aligned": [256, 128, 256, 64],
    "no_tiny": [256, 129, 85, 200],
}
# a pointer-load candidate every pass accepts: the other passes run it while one pass is under test
_SAFE = {"_FWD": triton_gdpa.Config(64, 64, 4, 3), "_DKDV": triton_gdpa.Config(64, 64, 4, 2),
         "_DQ": triton_gdpa.Config(64, 64, 4, 2)}  # pointer loads: TMA_PASSES names only the pass under test


def _run(lengths: list[int], masked: bool, dim: int, seed: int = 0) -> dict[str, float]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows, heads = sum(lengths), 4
    q, k, v = (torch.randn(rows, heads, dim, generator=gen, device="cuda").bfloat16() for _ in range(3))
    offsets = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
    targets = torch.tensor([min(7, n) for n in lengths], device="cuda", dtype=torch.int32) if masked else None
    act = ACTIVATIONS.index("silu")
    max_len = max(lengths)
    args = triton_gdpa.GdpaArgs((act,) * heads, 1 / math.sqrt(dim), 1 / max_len, masked, 0, None, False,
                                max_len, max_len)
    out = triton_gdpa.gdpa_forward(q, k, v, offsets, offsets, targets, args)
    grad_out = torch.randn(out.shape, generator=gen, device="cuda").bfloat16()
    dq, dk, dv = triton_gdpa.gdpa_backward(grad_out, q, k, v, offsets, offsets, targets, args)
    kwargs = {"head_activations": ["silu"] * heads, "pre_scale": 1 / math.sqrt(dim), "out_scale": 1 / max_len,
              "causal": masked, "num_targets": targets}
    qf, kf, vf = q.float(), k.float(), v.float()
    ref = reference.gdpa(qf, kf, vf, offsets, offsets, **kwargs)
    grads = reference.gdpa_backward(grad_out.float(), qf, kf, vf, offsets, offsets, **kwargs)
    errors = {"out": relative_error(out, ref)}
    return errors | {f"d{n}": relative_error(g, r) for n, g, r in zip("qkv", (dq, dk, dv), grads)}


def main() -> None:
    rows = []
    passes = {"_FWD": "fwd", "_FWD_RESIDENT": "fwd", "_DKDV": "dkdv", "_DQ": "dq"}
    original = {name: getattr(triton_gdpa, name) for name in (*passes, "tma_tile_safe")}
    triton_gdpa.tma_tile_safe = lambda *args: True  # measure the excluded tiles too
    cases = [(128, True), (128, False), (64, True)]  # (head dim, masked)
    for name, pass_name in passes.items():
        for candidate, pointer, (set_name, lengths), (dim, masked) in itertools.product(
                original[name], (False, True), LENGTH_SETS.items(), cases):
            if name == "_FWD_RESIDENT" and max(lengths) > triton_gdpa.SHORT_KV_MAX:
                continue
            for other, safe in _SAFE.items():
                setattr(triton_gdpa, other, (safe,))
            triton_gdpa._FWD_RESIDENT = ()
            setattr(triton_gdpa, name, (candidate,))
            triton_gdpa.TMA_PASSES = frozenset() if pointer else frozenset({pass_name})
            row = {"list": name, "candidate": triton_gdpa._label(replace(candidate, pointer_loads=pointer)),
                   "lengths": set_name, "masked": masked, "head_dim": dim}
            try:
                row |= _run(lengths, masked, dim)
                bad = [k for k in ("out", "dq", "dk", "dv") if not row[k] < 2e-2]
            except Exception as exc:  # noqa: BLE001 (a candidate that does not compile or fit: say so, go on)
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                bad = ["error"]
            rows.append(row)
            print(row | {"bad": bad}, flush=True)
    for name, value in original.items():
        setattr(triton_gdpa, name, value)
    print(write_results("gdpa_candidates", rows, {"bound": 2e-2}))


if __name__ == "__main__":
    main()
