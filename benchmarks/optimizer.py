"""The dense optimizer step of a GEM preset's Linear layers: the shadow AdamW (`opengem.ops.adamw`) against the
PyTorch path it replaces.

Parameters: every plain ``nn.Linear`` weight and bias of the preset's GEM model (gem-large: 253 layers, 1.11B
parameters, 99.8% of its dense parameters), fp32, with bf16 shadows and bf16 gradients of the same shapes (random).
Timed in interleaved rounds (`benchmarks.common.interleaved_ms`, median of each):

- ``shadow_adamw``: one `shadow_adamw_update` (reads the bf16 gradients, writes the bf16 shadows): 28 B a parameter;
- ``shadow_adamw_bf16_moments``: the same with bf16 moments, rounded stochastically
  (``shadow_adamw_moments=bf16``): 20 B a parameter;
- ``adamw+casts``: what ``weight_shadows=true shadow_adamw=false`` does around the same update: the bf16 gradients
  cast to fp32 (one multi-tensor copy), ``torch.optim.AdamW(fused=True)``, the shadows refreshed from the parameters
  (one multi-tensor copy): 40 B a parameter;
- ``adamw``: the fused AdamW step alone on fp32 gradients (28 B a parameter: the floor for AdamW's own traffic).

GB/s counts those bytes; ``pct_of_copy`` against a 1 GiB device-to-device copy timed in the same run (read + write).
Correctness in the same run: one update of each from the same state and gradients; the parameters agree within an
ulp-scale tolerance (with bf16 moments: within their rounding, the largest error reported) and every shadow equals its
parameter rounded to bf16. Optimizers count zero FLOPs.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch import nn

from benchmarks.common import bench_ms, interleaved_ms, print_table, relative_error, write_results
from opengem.models.gem import GEM
from opengem.models.presets import GEM_PRESETS
from opengem.ops.adamw import ShadowAdamWTensors, shadow_adamw_update

HYPER = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
BYTES_PER_PARAMETER = {"shadow_adamw": 28, "shadow_adamw_bf16_moments": 20, "adamw+casts": 40, "adamw": 28}


def linear_shapes(preset: str) -> list[torch.Size]:
    """Every plain Linear weight and bias shape of the preset's GEM model (built on the meta device)."""
    config = GEM_PRESETS[preset]
    with torch.device("meta"):
        model = GEM(config.data.feature_specs(), config.data.num_dense, config.model)
    return [p.shape for m in model.modules() if type(m) is nn.Linear for p in m.parameters(recurse=False)]


def random_parameters(
    shapes: list[torch.Size], device: str, seed: int = 0,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """fp32 parameters (scale 0.02) and bf16 gradients (scale 1e-3) of ``shapes``, from one seeded generator."""
    generator = torch.Generator(device=device).manual_seed(seed)
    params = [torch.randn(s, device=device, generator=generator) * 0.02 for s in shapes]
    return params, [torch.randn(s, device=device, generator=generator).bfloat16() * 1e-3 for s in shapes]


def shadow_adamw_state(params: list[torch.Tensor], moments: torch.dtype) -> ShadowAdamWTensors:
    """The shadow AdamW's state around ``params`` at step 0: zero moments in ``moments``, bf16 shadows, zero
    counters."""
    return ShadowAdamWTensors(params, [torch.zeros_like(p, dtype=moments) for p in params],
                              [torch.zeros_like(p, dtype=moments) for p in params], [p.bfloat16() for p in params],
                              [torch.zeros((), device=p.device) for p in params])


class Setup:
    """fp32 parameters, moments, bf16 shadows and gradients for the shadow AdamW, a copy of the parameters with bf16
    moments for it, and a copy with fp32 gradients under ``torch.optim.AdamW(fused=True)``."""

    def __init__(self, shapes: list[torch.Size], device: str, seed: int = 0) -> None:
        self.params, self.grads = random_parameters(shapes, device, seed)
        self.tensors = shadow_adamw_state(self.params, torch.float32)
        self.narrow = shadow_adamw_state([p.clone() for p in self.params], torch.bfloat16)
        self.peer = [p.clone().requires_grad_() for p in self.params]
        self.peer_shadows = [p.bfloat16() for p in self.params]
        for p in self.peer:
            p.grad = torch.empty_like(p)
        self.fused_adamw = torch.optim.AdamW(self.peer, lr=HYPER["lr"], betas=HYPER["betas"], eps=HYPER["eps"],
                                             weight_decay=HYPER["weight_decay"], fused=True)

    def shadow_adamw(self) -> None:
        shadow_adamw_update(self.tensors, self.grads, **HYPER)

    def shadow_adamw_bf16_moments(self) -> None:
        shadow_adamw_update(self.narrow, self.grads, **HYPER)

    def adamw_with_casts(self) -> None:
        grads = [p.grad for p in self.peer]
        torch._foreach_copy_(grads, self.grads)
        self.fused_adamw.step()
        torch._foreach_copy_(self.peer_shadows, self.peer)

    def adamw(self) -> None:
        self.fused_adamw.step()


def check_one_update(shapes: list[torch.Size], device: str) -> dict[str, float]:
    """One update of each path from the same state: the largest relative error of a parameter against AdamW's, and
    whether every shadow is its parameter rounded."""
    setup = Setup(shapes, device, seed=1)
    setup.shadow_adamw()
    setup.shadow_adamw_bf16_moments()
    setup.adamw_with_casts()
    worst = max(relative_error(p, q.detach()) for p, q in zip(setup.params, setup.peer))
    narrow = max(relative_error(p, q.detach()) for p, q in zip(setup.narrow.params, setup.peer))
    rounded = all(torch.equal(s, p.bfloat16()) for state in (setup.tensors, setup.narrow)
                  for s, p in zip(state.shadows, state.params))
    return {"max_param_rel_error": worst, "bf16_moments_max_param_rel_error": narrow, "shadows_rounded": rounded}


def copy_bandwidth_gbps(device: str) -> float:
    """GB/s of a 1 GiB device-to-device copy (bytes read plus written)."""
    source = torch.empty(2**28, device=device)
    target = torch.empty_like(source)
    return 2 * source.numel() * 4 / bench_ms(lambda: target.copy_(source)) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gem-large", choices=sorted(GEM_PRESETS))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    device = "cuda"
    shapes = linear_shapes(args.preset)
    numel = sum(s.numel() for s in shapes)
    print(f"{args.preset}: {len(shapes)} tensors, {numel / 1e9:.3f}B parameters")
    check = check_one_update(shapes, device)
    print(f"check: {check}")
    torch.cuda.empty_cache()
    setup = Setup(shapes, device)
    copy_gbps = copy_bandwidth_gbps(device)
    times = interleaved_ms({"shadow_adamw": setup.shadow_adamw,
                            "shadow_adamw_bf16_moments": setup.shadow_adamw_bf16_moments,
                            "adamw+casts": setup.adamw_with_casts, "adamw": setup.adamw}, rounds=args.rounds)
    rows = []
    for name, each in times.items():
        ms = statistics.median(each)
        gbps = BYTES_PER_PARAMETER[name] * numel / ms / 1e6
        rows.append({"impl": name, "ms": ms, "ms_each_round": each, "GBps": gbps, "pct_of_copy": 100 * gbps / copy_gbps,
                     "bytes_per_parameter": BYTES_PER_PARAMETER[name]})
    base = next(r["ms"] for r in rows if r["impl"] == "adamw+casts")
    for row in rows:
        row["speedup_vs_adamw_casts"] = base / row["ms"]
    print_table(rows, ["impl", "ms", "GBps", "pct_of_copy", "bytes_per_parameter", "speedup_vs_adamw_casts"])
    path = write_results(f"optimizer_{args.preset}", rows, {"preset": args.preset, "parameters": numel,
                                                            "tensors": len(shapes), "copy_GBps": copy_gbps,
                                                            "check": check})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
