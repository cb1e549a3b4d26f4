"""FP8 attention accuracy by recipe (issue 12), on the CPU: which scales, rotation and P / V handling buy what.

Each recipe is emulated exactly like :mod:`opengem.ops.reference.attention_fp8` (blocks of 128 rows per sample
and head, online softmax over key blocks of 128, P as ``rne(p * 256)``) with one knob changed, on workload
(a)-like batches (power-law lengths 100..4096, about 6k tokens, causal, H = 2, D = 128, bf16 inputs) of three
kinds: N(0, 1); ``outliers``: 4 channels of Q, K and V 10x the others (real Q and K have a few such
channels), logits with std ~17; ``outliers_rms1``: the same rescaled to unit mean square, logits std ~4.
Error: relative (fp64 norms) against the fp32 softmax attention of the same bf16 inputs; "bf16 kernel"
emulates the bf16 kernel (P rounded to bf16, output to bf16). The shipped recipe's row is checked against the
real emulation in the same run. Results: ``docs/fp8_attention.md``.

Run: ``PYTHONPATH=src python -m benchmarks.attention_fp8_recipes`` (about a minute on one core).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from benchmarks.common import offsets_of, power_law_lengths, print_table, relative_error, write_results
from opengem.ops.reference.attention import jagged_attention as reference
from opengem.ops.reference.attention_fp8 import (
    E4M3_MAX,
    LOG2E,
    MIN_AMAX,
    P_SCALE,
    jagged_attention_fp8,
    rotation,
)

BLOCK, HEADS, HEAD_DIM = 128, 2, 128
KINDS = ("normal", "outliers", "outliers_rms1")


@dataclass(frozen=True)
class Recipe:
    """``qk`` / ``v``: "none" (unquantized), "block" (one scale per 128 rows x D), "row" (per row), "channel"
    (per block and channel), "block2" (two-term E4M3 split: x ~ q(x) + q(x - q(x)), three MMAs for Q K^T);
    ``rotation``: Hadamard block size (0: none); ``p``: "fp8" (rne(p * 256)), "bf16", "none";
    ``sum_quantized``: normalize by the sum of the quantized P instead of the fp32 one."""

    name: str
    qk: str = "block"
    v: str = "block"
    rotation: int = 0
    p: str = "fp8"
    sum_quantized: bool = False
    out_bf16: bool = True


SHIPPED = "fp8: block scales, Hadamard 128 (shipped)"
RECIPES = [
    Recipe("bf16 kernel", qk="none", v="none", p="bf16"),
    Recipe("fp8: block scales (before)"),
    Recipe("fp8: row scales for Q and K", qk="row"),
    Recipe("fp8: row Q/K, V per block and channel", qk="row", v="channel"),
    Recipe(SHIPPED, rotation=128),
    Recipe("fp8: row scales, Hadamard 128", qk="row", rotation=128),
    Recipe("fp8: block scales, Hadamard 64", rotation=64),
    Recipe("fp8: block scales, Hadamard 32", rotation=32),
    Recipe("fp8: Hadamard 128, sum of quantized P", rotation=128, sum_quantized=True),
    Recipe("fp8 Q K^T + Hadamard, bf16 P V", v="none", rotation=128, p="bf16"),
    Recipe("only Q, K quantized (block)", v="none", p="none", out_bf16=False),
    Recipe("only Q, K quantized (block, Hadamard)", v="none", p="none", rotation=128, out_bf16=False),
    Recipe("only V quantized (block)", qk="none", p="none", out_bf16=False),
    Recipe("only P quantized", qk="none", v="none", out_bf16=False),
    Recipe("two-term fp8 Q K^T (3 MMAs) + Hadamard, bf16 P V", qk="block2", v="none", rotation=128, p="bf16"),
]


def quantized(x: torch.Tensor, mode: str) -> torch.Tensor:
    """Dequantized E4M3 ``x [H, L, D]`` (L a multiple of BLOCK) with the scale granularity ``mode``."""
    if mode == "none":
        return x
    if mode == "block2":
        high = quantized(x, "block")
        return high + quantized(x - high, "block")
    blocks = x.reshape(x.shape[0], -1, BLOCK, x.shape[-1])
    dims = {"block": (-1, -2), "row": (-1,), "channel": (-2,)}[mode]
    amax = blocks.abs().amax(dims, keepdim=True).clamp_min(MIN_AMAX)
    data = (blocks * (E4M3_MAX / amax)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (data.float() * (amax / E4M3_MAX)).reshape(x.shape)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """One causal sample ``[H, L, D]`` fp32 (bf16 values, zero-padded to a multiple of BLOCK) by ``recipe``."""
    n = recipe.rotation or 1
    if recipe.rotation:
        r = torch.block_diag(*[rotation(n)] * (HEAD_DIM // n))
        q, k = q @ r, k @ r
    q, k, v = quantized(q, recipe.qk), quantized(k, recipe.qk), quantized(v, recipe.v)
    length = q.shape[1]
    logits = (q @ k.transpose(-1, -2)) * (LOG2E / math.sqrt(HEAD_DIM) / n)
    logits = logits.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf"))
    row_max = torch.full(logits.shape[:-1], -1.0e30)
    row_sum = torch.zeros_like(row_max)
    acc = torch.zeros(*logits.shape[:-1], HEAD_DIM)
    for start in range(0, length, BLOCK):
        s = logits[..., start : start + BLOCK]
        new_max = torch.maximum(row_max, s.amax(-1))
        p = torch.exp2(s - new_max[..., None])
        alpha = torch.exp2(row_max - new_max)
        if recipe.p == "fp8":
            pq = (p * P_SCALE).to(torch.float8_e4m3fn).float() / P_SCALE
        else:
            pq = p.bfloat16().float() if recipe.p == "bf16" else p
        row_sum = row_sum * alpha + (pq if recipe.sum_quantized else p).sum(-1)
        acc = acc * alpha[..., None] + pq @ v[:, start : start + BLOCK]
        row_max = new_max
    out = acc / row_sum[..., None]
    return out.bfloat16().float() if recipe.out_bf16 else out


def batch(kind: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Jagged bf16 ``q, k, v [T, H, D]`` and ``lengths`` of one input kind."""
    gen = torch.Generator().manual_seed(seed)
    lengths = power_law_lengths(6000, 100, 4096, gen)
    q, k, v = (torch.randn(int(lengths.sum()), HEADS, HEAD_DIM, generator=gen) for _ in range(3))
    if kind != "normal":
        channels = torch.randperm(HEAD_DIM, generator=gen)[:4]
        for x in (q, k, v):
            x[..., channels] *= 10
            if kind == "outliers_rms1":
                x /= x.pow(2).mean().sqrt()
    return q.bfloat16(), k.bfloat16(), v.bfloat16(), lengths


def errors(kind: str) -> dict[str, float]:
    q, k, v, lengths = batch(kind)
    offsets = offsets_of(lengths, "cpu")
    want = reference(q.float(), k.float(), v.float(), offsets, int(lengths.max()))
    result = {}
    for recipe in RECIPES:
        pieces = []
        for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            padded = -(-(end - start) // BLOCK) * BLOCK
            pad = (0, 0, 0, 0, 0, padded - end + start)  # zero rows up to a whole block
            sample = [torch.nn.functional.pad(x[start:end].float(), pad).transpose(0, 1) for x in (q, k, v)]
            out = attend(*sample, recipe)
            pieces.append(out.transpose(0, 1)[: end - start])
        result[recipe.name] = relative_error(torch.cat(pieces), want)
    shipped = relative_error(jagged_attention_fp8(q, k, v, offsets, block=BLOCK), want)
    assert abs(shipped / result[SHIPPED] - 1) < 0.02, (shipped, result[SHIPPED])  # this study emulates the op
    return result


def main() -> None:
    torch.set_num_threads(1)
    by_kind = {kind: errors(kind) for kind in KINDS}
    rows = []
    for recipe in RECIPES:
        row = {"recipe": recipe.name}
        for kind in KINDS:
            row[kind] = by_kind[kind][recipe.name]
            row[f"{kind}_x_bf16"] = by_kind[kind][recipe.name] / by_kind[kind]["bf16 kernel"]
        rows.append(row)
    columns = ["recipe", *(c for kind in KINDS for c in (kind, f"{kind}_x_bf16"))]
    print_table(rows, columns)
    write_results("attention_fp8_recipes", rows, {"block": BLOCK, "heads": HEADS, "head_dim": HEAD_DIM})


if __name__ == "__main__":
    main()
