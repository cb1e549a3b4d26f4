"""Diagnostic (issue 10): GEM's two GDPA layers at gem-large's shapes, on its power-law batch and on a balanced one.

gem-large b512 spends ~21 ms a step in GDPA (session 28's profile): the PFFN's cross-attention (every sequence
token against its sample's ``m`` summary tokens) and the seed pooling (``num_seeds`` broadcast queries over each
sample's tokens), forward and backward, 12 layers. Their bytes at the copy's rate come to about half of that. A
program of the per-sample passes (PFFN dK/dV, pooling forward, broadcast dQ chunks) walks one sample's tokens,
and the longest sample of a gem-large batch holds ~5% of them: if those passes wait on their longest programs, the
same token count in equal-length samples runs them much faster. Per layer and batch: the op's forward and backward
milliseconds and each kernel's device time.

``--bias``: instead, on the power-law batches only, each layer's backward with its projection bias's gradient taken
two ways in one run: ``sum``, a column sum of the projected input's gradient after the op's backward (what autograd
of a plain ``nn.Linear`` adds: one fp32 reduction over ``[T, H * D]`` or ``[T, 2 * H * D]``), and ``kernels``, from
the op's own backward kernels (``projection_bias``, what GEM's layers do since session 31).

``--query-chunks``: instead, on the power-law batches only, the PFFN with its dK/dV pass's long samples split into
chunks of query rows (``OPENGEM_GDPA_QUERY_CHUNKS=1``, the default) and without (``=0``), in one run.

``--work-order``: instead, on the power-law batches only, both layers with GDPA's tiles ordered by rows x keys
(``OPENGEM_GDPA_WORK_ORDER=work``) and by keys (``keys``, the default since session 46), twice each, alternating.
Read the kernels' device time: the host-timed forward and backward spread up to 1.8x between repeats (H100, session
47), while the kernel sums agree within 0.5%. Session 47 found ``keys`` 0.96-0.99x ``work`` here (these layers' keys
or seeds are alike for every sample, so ``keys`` had only ties), then 0.997-1.002x with ties to the longer sample.

    PYTHONPATH=src:. python -m benchmarks.diag.gdpa_gem_layers [--batches 2] [--bias | --query-chunks | --work-order]
        [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import bench_ms, environment, kernel_ms, offsets_of
from opengem.models.presets import GEM_PRESETS
from opengem.ops.gdpa import gdpa, gdpa_packed_kv
from opengem.ops.triton import gdpa as triton_gdpa
from opengem.train.bench.step import TrainBenchOptions, bench_config
from opengem.train.data_stream import train_batches

PRESET = "gem-large"


def gem_large_lengths(batches: int) -> list[torch.Tensor]:
    """Sequence lengths (CLS tokens + history) of the first batches bench train runs on gem-large b512."""
    config, _, _ = bench_config(TrainBenchOptions(preset=PRESET, batch_size=512, device="cpu", num_workers=0))
    stream = train_batches(config, start_step=0)
    num_cls = GEM_PRESETS[PRESET].model.num_cls
    return [torch.as_tensor(next(stream).history_age.lengths_host()).long() + num_cls for _ in range(batches)]


def balanced(lengths: torch.Tensor) -> torch.Tensor:
    """The same token count over the same number of samples, lengths differing by at most one."""
    batch, tokens = lengths.numel(), int(lengths.sum())
    return torch.full((batch,), tokens // batch, dtype=torch.long) + (torch.arange(batch) < tokens % batch).long()


def layer_inputs(layer: str, lengths: torch.Tensor, device: str, bias: str = "none") -> tuple[Any, list[torch.Tensor]]:
    """``(call, leaves)``: the GDPA call of ``layer`` as gem-large's model makes it, on random bf16 inputs; the
    projected input (q for the PFFN, kv for the pooling) is ``leaves[0]``, and with ``bias="kernels"`` the op also
    takes a ``projection_bias`` leaf (the last)."""
    model = GEM_PRESETS[PRESET].model
    heads, head_dim = model.num_heads, model.d_model // model.num_heads
    batch, tokens, max_len = lengths.numel(), int(lengths.sum()), int(lengths.max())
    offsets = offsets_of(lengths, device)
    scale = head_dim**-0.5

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=torch.bfloat16).requires_grad_()

    if layer == "pffn":
        m = model.num_summary_tokens
        q, k, v = leaf(tokens, heads, head_dim), leaf(batch * m, heads, head_dim), leaf(batch * m, heads, head_dim)
        k_offsets = offsets_of(torch.full((batch,), m), device)
        q_bias = leaf(heads * head_dim) if bias == "kernels" else None
        return (lambda: gdpa(q, k, v, offsets, k_offsets, max_len, m, activation=model.attention_activation,
                             pre_scale=scale, post_scale=1.0 / m, projection_bias=q_bias)), \
            [q, k, v] + ([q_bias] if q_bias is not None else [])  # fmt: skip
    seeds, kv = leaf(model.num_seeds, heads, head_dim), leaf(tokens, 2, heads, head_dim)
    kv_bias = leaf(2 * heads * head_dim) if bias == "kernels" else None
    return (lambda: gdpa_packed_kv(seeds, kv, None, offsets, model.num_seeds, max_len, broadcast_q=True,
                                   activation=model.attention_activation, pre_scale=scale,
                                   projection_bias=kv_bias)), \
        [kv, seeds] + ([kv_bias] if kv_bias is not None else [])  # fmt: skip


def measure(layer: str, lengths: torch.Tensor, device: str, bias: str = "none") -> dict[str, Any]:
    """Forward and backward milliseconds and the kernels' device time; ``bias="sum"`` adds a plain Linear's bias
    gradient (the projected input's gradient summed by column in fp32) to the backward."""
    call, leaves = layer_inputs(layer, lengths, device, "kernels" if bias == "kernels" else "none")
    projected = leaves[0]

    def bias_sum() -> None:
        if bias == "sum":
            projected.grad.reshape(projected.shape[0], -1).sum(0, dtype=torch.float32)
    out = call()
    grad = torch.randn_like(out)

    def clear_grads() -> None:
        # else each backward adds into the leaves' grads, an element-wise kernel the model does not run (the
        # `vectorized_` kernel of session 30's runs, 0.19-0.37 ms)
        for t in leaves:
            t.grad = None

    def backward() -> None:
        clear_grads()
        torch.autograd.backward(out, grad, retain_graph=True)
        bias_sum()

    def both() -> None:
        clear_grads()
        torch.autograd.backward(call(), grad)
        bias_sum()

    backward()  # tunes the backward's keys
    return {"tokens": int(lengths.sum()), "max_len": int(lengths.max()),
            "forward_ms": bench_ms(call), "backward_ms": bench_ms(backward),
            "kernels_ms": {name: round(ms, 4) for name, ms in kernel_ms(both).items()}}  # fmt: skip


def _cases(args: argparse.Namespace, lengths: torch.Tensor) -> list[tuple[str, torch.Tensor, str, str, dict]]:
    """One batch's rows by mode: (lengths' shape, lengths, layer, bias gradient, the environment settings the row
    runs under; the caller's for the others)."""
    if args.bias:
        return [("power_law", lengths, layer, bias, {})
                for layer in ("pffn", "pooling") for bias in ("sum", "kernels")]  # fmt: skip
    if args.query_chunks:
        return [("power_law", lengths, "pffn", "none", {"OPENGEM_GDPA_QUERY_CHUNKS": chunks}) for chunks in ("0", "1")]
    if args.work_order:
        return [("power_law", lengths, layer, "none", {"OPENGEM_GDPA_WORK_ORDER": order})
                for layer in ("pffn", "pooling") for order in ("work", "keys") * 2]  # fmt: skip
    return [(shape, batch_lengths, layer, "none", {})
            for shape, batch_lengths in (("power_law", lengths), ("balanced", balanced(lengths)))
            for layer in ("pffn", "pooling")]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=2, help="gem-large batches measured (each also balanced)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--bias", action="store_true", help="the projection bias's gradient two ways (module doc)")
    mode.add_argument("--query-chunks", action="store_true", help="PFFN dK/dV with and without query chunks")
    mode.add_argument("--work-order", action="store_true", help="both layers in both tile orders (module doc)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gdpa_gem_layers times the Triton GDPA kernels: it needs a CUDA device")
    rows = []
    for index, lengths in enumerate(gem_large_lengths(args.batches)):
        for shape, batch_lengths, layer, bias, settings in _cases(args, lengths):
            os.environ.update(settings)  # read by the op at every call
            row = {"batch": index, "lengths": shape, "layer": layer, "bias_gradient": bias,
                   "query_chunks": triton_gdpa.query_chunks_enabled(), "work_order": triton_gdpa.work_order_setting(),
                   **measure(layer, batch_lengths, "cuda", bias)}
            rows.append(row)
            top = ", ".join(f"{name[:28]} {ms:.3f}" for name, ms in list(row["kernels_ms"].items())[:5])
            print(f"batch {index} {shape:9s} {layer:7s} bias {bias:7s} chunks {row['query_chunks']:d} "
                  f"order {row['work_order']} "
                  f"T {row['tokens']} max {row['max_len']}: forward {row['forward_ms']:.3f} ms, backward "
                  f"{row['backward_ms']:.3f} ms, kernels {sum(row['kernels_ms'].values()):.3f} ms | {top}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "bias" if args.bias else "query_chunks" if args.query_chunks else "work_order" if args.work_order else None
    path = args.out / (f"gdpa_gem_layers_{name}.json" if name else "gdpa_gem_layers.json")
    tuning = triton_gdpa.tuning_report()  # every candidate's time on these shapes, in this run
    for entry in tuning:
        if entry["pass"] == "dq" and not entry["broadcast_q"]:
            timed = ", ".join(f"{label} {ms:.3f}" for label, ms in entry["candidates"].items() if ms is not None)
            print(f"dq candidates (bucket_q {entry['bucket_q']}, fill {entry['fill']}): pick {entry['pick']} | {timed}")
    payload = {"benchmark": "gdpa_gem_layers", "environment": environment(), "rows": rows, "tuning": tuning}
    path.write_text(json.dumps(payload, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
