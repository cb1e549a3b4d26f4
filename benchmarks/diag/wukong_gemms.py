"""Diagnostic (issue 10): the Wukong layer's token-mixing GEMMs at the GEM presets' shapes, forward + backward.

gem-small's profiled step spent ~10 ms in cuBLAS's unaligned ``cutlass_75_..._align1`` kernels (58 calls each of
three, session 16): the token counts (39, 67) make rows of an odd number of bf16 elements. Variants, each on the
same layer and input in interleaved rounds, eager and compiled:

* ``plain``: the formulation before session 16 (LCB and residual as two ``nn.Linear`` on ``x^T``);
* ``token_padded``: sessions 16-33: LCB and residual as one product, and ``Y^T X`` another, both on ``x`` zero-padded
  to a multiple of 8 tokens (a transposed, padded copy of ``x`` each);
* ``shared``: the layer as it is (session 34): all three token mixings as one batched GEMM with a batch-shared,
  column-major left operand, ``x`` as it is.

Per variant: milliseconds, its output's and input gradient's relative difference from ``plain`` (same bf16
inputs), and the kernels with the most device time.

    PYTHONPATH=src:. python -m benchmarks.diag.wukong_gemms [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import environment, interleaved_ms, kernel_ms, paired_speedup, relative_error
from opengem.models.presets import GEM_PRESETS
from opengem.nn.wukong import WukongLayer

BATCHES = {"gem-small": 2048, "gem-large": 512}


def preset_layer(preset: str) -> WukongLayer:
    """A Wukong expert of ``preset``'s first GEM layer, as the model builds it."""
    from opengem.models.gem import GEM

    spec = GEM_PRESETS[preset]
    with torch.device("meta"):
        model = GEM(spec.data.feature_specs(), spec.data.num_dense, spec.model)
    template = next(m for m in model.modules() if isinstance(m, WukongLayer))
    hidden = template.fm_mlp[0].out_features
    layer = WukongLayer(template.fm_projection.shape[0], template.dim, template.fm_tokens, template.lc.out_features,
                        template.fm_projection.shape[1], hidden)  # fmt: skip
    return layer.cuda().to(torch.bfloat16)


def plain_forward(layer: WukongLayer, x: torch.Tensor) -> torch.Tensor:
    batch = x.shape[0]
    compressed = torch.einsum("bnd,nk->bdk", x, layer.fm_projection)
    fm = layer.fm_mlp(layer.fm_norm(torch.bmm(x, compressed).flatten(1))).view(batch, layer.fm_tokens, layer.dim)
    lc = layer.lc(x.transpose(1, 2)).transpose(1, 2)
    residual = layer.residual(x.transpose(1, 2)).transpose(1, 2)
    return layer.norm(torch.cat([fm, lc], dim=1) + residual)


def token_padded_forward(layer: WukongLayer, x: torch.Tensor) -> torch.Tensor:
    batch, tokens = x.shape[0], x.shape[1]
    padding = -tokens % 8
    mixing = F.pad(torch.cat([layer.lc.weight, layer.residual.weight]), (0, padding))  # [lc + out, n + padding]
    aligned = F.pad(x, (0, 0, 0, padding))
    compressed = torch.einsum("bnd,nk->bdk", aligned, F.pad(layer.fm_projection, (0, 0, 0, padding)))
    fm = layer.fm_mlp(layer.fm_norm(torch.bmm(x, compressed).flatten(1))).view(batch, layer.fm_tokens, layer.dim)
    mixed = torch.matmul(mixing, aligned)
    lc_tokens = layer.lc.out_features
    return layer.norm(torch.cat([fm, mixed[:, :lc_tokens]], dim=1) + mixed[:, lc_tokens:])


def variants(layer: WukongLayer) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    return {"plain": lambda x: plain_forward(layer, x), "token_padded": lambda x: token_padded_forward(layer, x),
            "shared": layer}  # fmt: skip


def measure(preset: str) -> dict:
    torch.manual_seed(0)
    layer = preset_layer(preset)
    tokens = layer.fm_projection.shape[0]
    x = torch.randn(BATCHES[preset], tokens, layer.dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(BATCHES[preset], layer.fm_tokens + layer.lc.out_features, layer.dim, device="cuda",
                       dtype=torch.bfloat16)  # fmt: skip
    rows = {"preset": preset, "batch": BATCHES[preset], "tokens": tokens, "dim": layer.dim, "modes": {}}
    for mode in ("eager", "compiled"):
        steps, outputs = {}, {}
        for name, forward in variants(layer).items():
            fn = torch.compile(forward, dynamic=False) if mode == "compiled" else forward

            def step(fn=fn) -> tuple[torch.Tensor, torch.Tensor]:
                x.grad = None
                out = fn(x)
                out.backward(grad)
                return out, x.grad

            outputs[name] = [t.detach().clone() for t in step()]
            steps[name] = step
        times = interleaved_ms(steps, rounds=5)
        result = {}
        for name, step in steps.items():
            kernels = kernel_ms(step)
            result[name] = {
                "ms": min(times[name]),
                "speedup_vs_plain": paired_speedup(times["plain"], times[name]),
                "speedup_vs_token_padded": paired_speedup(times["token_padded"], times[name]),
                "kernel_ms": sum(kernels.values()),  # device time alone: the layer's launches may pace a call
                "distinct_kernels": len(kernels),
                "out_vs_plain": relative_error(outputs[name][0], outputs["plain"][0]),
                "grad_x_vs_plain": relative_error(outputs[name][1], outputs["plain"][1]),
                "kernels": dict(list(kernels.items())[:8]),
            }
        rows["modes"][mode] = result
        print(json.dumps({mode: {n: {k: v for k, v in r.items() if k != "kernels"} for n, r in result.items()}}),
              flush=True)  # fmt: skip
        for name, r in result.items():
            print(f"  {preset} {mode} {name}: " + "; ".join(f"{k[:50]} {v:.3f}" for k, v in r["kernels"].items()))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    payload, path = {"environment": environment(), "rows": []}, Path(args.out) / "wukong_gemms.json"
    for preset in BATCHES:  # written after each preset: a run cut short keeps what finished
        payload["rows"].append(measure(preset))
        path.write_text(json.dumps(payload, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
