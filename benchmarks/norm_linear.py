"""Benchmark: ``opengem.ops.norm_linear`` against LayerNorm + Linear, the pre-norm block of GEM's sequence layers.

Workload: the residual stream ``h [T, K]`` (fp32 as gem-small's, or bf16 as gem-large's benchmark setting) read
twice, by the norm into a projection ``[K, N]`` and as the residual, under bf16 autocast; the backward gets a
gradient for both (``dy`` for the projection, ``d_res`` for the residual). Shapes: gem-small b2048's tokens
(T = 437,449, the count Inductor's log gave in session 38) at d_model 256 into its QKV (768) and its FFN / PFFN
query (256), and gem-large's d_model 512 into its QKV (1536) at 262,144 tokens.

Variants, interleaved in rounds on the same inputs: ``eager`` (``F.linear(F.layer_norm(h))``), ``compiled``
(the same under ``torch.compile``: Inductor's fused norm + cast kernel, cuBLAS, and in the backward its fused norm
backward + residual add: the strongest peer a user has), ``fused`` (this op with ``pass_through=True``) and
``fused_compiled`` (the op inside ``torch.compile``, as the model runs it). Correctness in the same run: ``y`` and
the input, weight and norm-weight gradients against an fp64 evaluation of the same composition.

Also ``min_bytes``: what each formulation must move at least (fused: ``h`` read once, ``y`` written once forward;
unfused: the normalized rows written and read again), and the fused forward's bandwidth against the run's copy.

    PYTHONPATH=src:. python -m benchmarks.norm_linear [--shapes 437449x256x768,...] [--stream fp32,bf16]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import bench_ms, environment, int_tuples, interleaved_ms, kernel_ms, paired_speedup, relative_error
from opengem.ops.norm_linear import norm_linear

SHAPES = "437449x256x768,437449x256x256,262144x512x1536"
STREAMS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def unfused(h: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor):
    """The composition as the GEM layers wrote it: ``(h as the residual reads it, linear(layer_norm(h)))``."""
    return h.view_as(h), F.linear(F.layer_norm(h, (h.shape[-1],), gamma, beta), weight, bias)


def fused(h: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor):
    return norm_linear(h, gamma, beta, weight, bias, pass_through=True)


def ffn_unfused(h, gamma, beta, w1, b1, w2, b2):
    """A GEM sequence layer's feed-forward sublayer (``h + MLP(LayerNorm(h))``, GELU between)."""
    return h + F.linear(F.gelu(F.linear(F.layer_norm(h, (h.shape[-1],), gamma, beta), w1, b1)), w2, b2)


def ffn_fused(h, gamma, beta, w1, b1, w2, b2):
    residual, y = norm_linear(h, gamma, beta, w1, b1, pass_through=True)
    return residual + F.linear(F.gelu(y), w2, b2)


def min_bytes(tokens: int, k: int, n: int, stream_bytes: int, fused_op: bool) -> dict[str, int]:
    """Bytes each pass must move with 2-byte GEMM operands (weights ignored: they are L2-resident)."""
    if fused_op:
        forward = tokens * (k * stream_bytes + n * 2)
        # dy, h, d_res read; dx and the normalized rows written; the weight-gradient GEMM reads dy and those rows
        backward = tokens * (n * 2 + 3 * k * stream_bytes + k * 2 + n * 2 + k * 2)
    else:
        forward = tokens * (k * stream_bytes + k * 2 + k * 2 + n * 2)
        # dx_hat's GEMM reads dy, writes dx_hat; the norm backward reads h, dx_hat, d_res, writes dx and the rows
        backward = tokens * (n * 2 + k * 2 + k * stream_bytes + k * 2 + 2 * k * stream_bytes + k * 2 + n * 2 + k * 2)
    return {"forward": forward, "backward": backward}


def measure(tokens: int, k: int, n: int, stream: str, device: str, rounds: int) -> dict:
    torch.manual_seed(0)
    dtype = STREAMS[stream]
    h = torch.randn(tokens, k, device=device, dtype=dtype).mul_(3).add_(0.5).requires_grad_()
    gamma = (1 + 0.1 * torch.randn(k, device=device)).requires_grad_()
    beta = (0.1 * torch.randn(k, device=device)).requires_grad_()
    weight = (torch.randn(n, k, device=device) / k**0.5).requires_grad_()
    bias = (0.1 * torch.randn(n, device=device)).requires_grad_()
    dy = torch.randn(tokens, n, device=device, dtype=torch.bfloat16)
    d_res = torch.randn(tokens, k, device=device, dtype=dtype)
    leaves = (h, gamma, beta, weight, bias)
    variants: dict[str, Callable] = {"eager": unfused, "compiled": torch.compile(unfused, dynamic=False),
                                     "fused": fused, "fused_compiled": torch.compile(fused, dynamic=False)}

    def forward(fn: Callable) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        def run() -> tuple[torch.Tensor, torch.Tensor]:
            with torch.autocast(device, dtype=torch.bfloat16):
                return fn(*leaves)
        return run

    def step(fn: Callable) -> Callable[[], tuple[torch.Tensor, ...]]:
        def run() -> tuple[torch.Tensor, ...]:
            residual, y = forward(fn)()
            grads = torch.autograd.grad((residual, y), leaves, (d_res, dy))
            return (y.detach(), *grads)
        return run

    reference = _fp64_reference(leaves, dy, d_res)
    row: dict = {"tokens": tokens, "k": k, "n": n, "stream": stream, "variants": {}}
    outputs = {name: step(fn)() for name, fn in variants.items()}
    for name, got in outputs.items():
        row["variants"][name] = {f"{label}_error": relative_error(g, r) for label, g, r in
                                 zip(("y", "dh", "dgamma", "dbeta", "dweight", "dbias"), got, reference)}  # fmt: skip
    if device != "cuda":
        return row
    forward_ms = interleaved_ms({name: forward(fn) for name, fn in variants.items()}, rounds=rounds)
    step_ms = interleaved_ms({name: step(fn) for name, fn in variants.items()}, rounds=rounds)
    stream_bytes = h.element_size()
    for name in variants:
        result = row["variants"][name]
        result["forward_ms"], result["step_ms"] = min(forward_ms[name]), min(step_ms[name])
        result["forward_speedup_vs_compiled"] = paired_speedup(forward_ms["compiled"], forward_ms[name])
        result["step_speedup_vs_compiled"] = paired_speedup(step_ms["compiled"], step_ms[name])
        result["step_kernels_ms"] = dict(list(kernel_ms(step(variants[name])).items())[:8])
        result["min_bytes"] = min_bytes(tokens, k, n, stream_bytes, name.startswith("fused"))
    row["ffn_block"] = _ffn_block(leaves, device, rounds)
    from opengem.ops.triton.norm_linear import picked_tiles  # noqa: PLC0415 (CUDA runs only)

    row["picked_tiles"] = picked_tiles()
    copy = torch.empty_like(h)
    copy_ms = bench_ms(lambda: copy.copy_(h))
    row["copy_gb_per_s"] = 2 * h.numel() * stream_bytes / copy_ms / 1e6
    row["fused_forward_gb_per_s"] = row["variants"]["fused"]["min_bytes"]["forward"] / row["variants"]["fused"][
        "forward_ms"] / 1e6  # fmt: skip
    return row


def _ffn_block(leaves: tuple[torch.Tensor, ...], device: str, rounds: int) -> dict:
    """The feed-forward sublayer ``h + MLP(LayerNorm(h))`` with its first GEMM ``[K, N]``, compiled whole, against
    the same with this op (``norm_linear``'s pass-through as the residual): the residual add and the norm backward
    fused by Inductor in the peer, as in the model."""
    h, gamma, beta, w1, b1 = leaves
    g = torch.Generator(device=device).manual_seed(1)
    w2 = (torch.randn(h.shape[1], w1.shape[0], device=device, generator=g) / w1.shape[0] ** 0.5).requires_grad_()
    b2 = torch.zeros(h.shape[1], device=device, requires_grad=True)
    params = (h, gamma, beta, w1, b1, w2, b2)
    d_out = torch.randn_like(h)
    blocks = {"compiled": torch.compile(ffn_unfused, dynamic=False), "fused_compiled": torch.compile(ffn_fused,
                                                                                                      dynamic=False)}

    def step(fn: Callable) -> Callable[[], tuple[torch.Tensor, ...]]:
        def run() -> tuple[torch.Tensor, ...]:
            with torch.autocast(device, dtype=torch.bfloat16):
                out = fn(*params)
            return (out.detach(), *torch.autograd.grad(out, params, d_out))
        return run

    outputs = {name: step(fn)() for name, fn in blocks.items()}
    times = interleaved_ms({name: step(fn) for name, fn in blocks.items()}, rounds=rounds)
    result = {"step_ms": {name: min(t) for name, t in times.items()},
              "step_speedup_vs_compiled": paired_speedup(times["compiled"], times["fused_compiled"]),
              "difference_vs_compiled": {label: relative_error(a, b) for label, a, b in
                                         zip(("out", "dh", "dgamma", "dbeta", "dw1", "db1", "dw2", "db2"),
                                             outputs["fused_compiled"], outputs["compiled"])}}  # fmt: skip
    result["step_kernels_ms"] = {name: dict(list(kernel_ms(step(fn)).items())[:8]) for name, fn in blocks.items()}
    return result


def _fp64_reference(leaves: tuple[torch.Tensor, ...], dy: torch.Tensor, d_res: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``y`` and the leaves' gradients of the composition in fp64 (the weight at its bf16 rounding, as autocast
    uses it)."""
    h, gamma, beta, weight, bias = (t.detach().double().requires_grad_() for t in leaves)
    w16, b16 = weight.to(torch.bfloat16).double(), bias.to(torch.bfloat16).double()
    y = F.linear(F.layer_norm(h, (h.shape[-1],), gamma, beta), w16, b16)
    grads = torch.autograd.grad((h.view_as(h), y), (h, gamma, beta, w16, b16), (d_res.double(), dy.double()))
    return (y.detach(), *grads)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=SHAPES, help="TOKENSxKxN,...")
    parser.add_argument("--stream", default="fp32,bf16", help="the residual stream's dtypes: fp32, bf16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/norm_linear.json")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    payload: dict = {"environment": environment(), "rows": []}
    for tokens, k, n in int_tuples(args.shapes, 3, "437449x256x768"):
        for stream in args.stream.split(","):
            if stream not in STREAMS:
                raise SystemExit(f"--stream: {stream!r} is not one of {sorted(STREAMS)}")
            row = measure(tokens, k, n, stream, device, args.rounds)
            payload["rows"].append(row)
            print(json.dumps({key: value for key, value in row.items() if key != "variants"}), flush=True)
            for name, result in row["variants"].items():
                print(f"  {name}: " + "; ".join(f"{key} {value:.4g}" for key, value in result.items()
                                               if isinstance(value, float)), flush=True)  # fmt: skip
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(payload, indent=1))  # after each row: a cut run keeps what finished


if __name__ == "__main__":
    main()
