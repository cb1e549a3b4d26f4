"""Which GDPA self-attention rows come out wrong on the GPU, and under which loads (session 66).

``tests/gpu/test_offsets_layout_gpu.py`` found NaN and ~1e34 values in the rows of the last (longest, 255-row)
sample of a non-causal SiLU self-attention (lengths 130, 7, 0, 64, 255; H 2, D 128, bf16, pre_scale 1, tuning
off), with contiguous offsets; the CPU interpreter gives the reference. Each case here runs the public op and the
fp32 reference on the same device and reports, per sample, the rows that are not finite and the largest error, and
whether the backward changed the forward's output rows (the test read them after it) or gave non-finite gradients.
Run once per load setting (``OPENGEM_GDPA_TMA=none`` for pointer loads): the setting is read at import.

    PYTHONPATH=src python -m benchmarks.diag.gdpa_tail_rows --out gdpa_tail_rows.json
"""

from __future__ import annotations

import argparse
import json
import math
import os

os.environ.setdefault("OPENGEM_GDPA_TUNE", "0")

import torch  # noqa: E402

from opengem.ops import gdpa  # noqa: E402
from opengem.ops.reference import gdpa as reference  # noqa: E402

CASES = {  # name: (lengths, pre_scale (None: 1 / sqrt(D)), activation, rows of finite padding after q, k, v)
    "failing": ([130, 7, 0, 64, 255], 1.0, "silu", 0),
    "typical_scale": ([130, 7, 0, 64, 255], None, "silu", 0),
    "longest_first": ([255, 130, 7, 0, 64], 1.0, "silu", 0),
    "no_empty_sample": ([130, 7, 64, 255], 1.0, "silu", 0),
    "key_loop_300": ([130, 7, 0, 64, 300], 1.0, "silu", 0),
    "padded_buffers": ([130, 7, 0, 64, 255], 1.0, "silu", 512),
    "fast_gelu": ([130, 7, 0, 64, 255], 1.0, "fast_gelu", 0),
}


def run_case(lengths: list[int], pre_scale: float | None, activation: str, padding: int, device: str) -> dict:
    heads, head_dim = 2, 128
    gen = torch.Generator(device=device).manual_seed(1)
    rows = sum(lengths)
    buffers = [torch.randn(rows + padding, heads, head_dim, generator=gen, device=device).bfloat16()
               for _ in range(3)]  # fmt: skip
    q, k, v = (b[:rows].requires_grad_(True) for b in buffers)
    offsets = torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
    longest = max(lengths)
    scale = 1 / math.sqrt(head_dim) if pre_scale is None else pre_scale
    out = gdpa(q, k, v, offsets, offsets, longest, longest, activation=activation, pre_scale=scale, norm="max_len")
    # the failing test read the output after the backward (through a detached alias): does the backward write into
    # the output's memory (an out-of-bounds write from a neighbouring buffer), or is the forward itself wrong?
    before_backward = out.detach().clone()
    out.backward(torch.ones_like(out))
    changed = ~((out.detach() == before_backward) | (out.detach().isnan() & before_backward.isnan())).all(dim=(1, 2))
    grads_finite = all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v))
    out = before_backward
    want = reference.gdpa(*(t.detach().float() for t in (q, k, v)), offsets, offsets,
                          head_activations=[activation] * heads, pre_scale=scale, out_scale=1.0 / longest)
    samples = []
    for b, length in enumerate(lengths):
        start, end = int(offsets[b]), int(offsets[b + 1])
        got, ref = out[start:end].float(), want[start:end]
        finite = torch.isfinite(got).all(dim=(1, 2))
        bad_rows = (~finite).nonzero().flatten().tolist()
        error = float((got[finite] - ref[finite]).abs().max()) if bool(finite.any()) else math.nan
        samples.append({"sample": b, "length": length, "non_finite_rows": len(bad_rows),
                        "first_bad_rows": bad_rows[:8], "max_abs_error_finite_rows": error,
                        "reference_max": float(ref.abs().max()) if end > start else 0.0})  # fmt: skip
    return {"lengths": lengths, "pre_scale": scale, "activation": activation, "padding_rows": padding,
            "rows_changed_by_backward": int(changed.sum()),
            "first_rows_changed": changed.nonzero().flatten()[:8].tolist(), "grads_finite": grads_finite,
            "ok": int(changed.sum()) == 0 and grads_finite and all(
                s["non_finite_rows"] == 0 and s["max_abs_error_finite_rows"] < 0.05 * max(1, s["reference_max"])
                for s in samples if s["length"]),
            "samples": samples}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    results = {"tma_setting": os.environ.get("OPENGEM_GDPA_TMA", "default"), "cases": {}}
    for name, case in CASES.items():
        try:
            results["cases"][name] = run_case(*case, args.device)
        except Exception as error:  # noqa: BLE001 - one case's failure must not hide the others
            results["cases"][name] = {"error": f"{type(error).__name__}: {error}"}
        print(name, json.dumps({k: v for k, v in results["cases"][name].items() if k != "samples"}), flush=True)
    with open(args.out, "w") as file:
        json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
