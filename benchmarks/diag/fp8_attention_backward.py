"""How far each backward of the FP8 JFA forward lands from the fp32 gradient (CPU, fp64 algebra, ~20 s).

One causal sample per row of the table, H = 2, D = 128, bf16-rounded N(0, 1) inputs, or with 4 of Q's and K's
channels 10x the others (``outliers``: logits with std ~17, as trained Q and K carry). The FP8 forward is the
emulation's (:mod:`opengem.ops.reference.attention_fp8`): rotated, block-quantized Q and K, block-quantized V, P
in E4M3 per key block. Its output and its log-sum-exp (of its logits) feed the backwards, each written out in
flash-attention form (``dS = P * (dO V^T - rowsum(dO * O))``):

- ``forward_only``: P recomputed from the bf16 Q and K against the FP8 log-sum-exp (what the op did before
  session 17): P's rows do not sum to one (``p_row_sum_error``);
- ``straight_through``: P, dP and the GEMMs on the operands the forward multiplied (the op's backward now);
- ``exact_lse``: bf16 P with an exact log-sum-exp, ``rowsum(dO * O)`` from the FP8 output (what a bf16
  log-sum-exp pass would buy).

Errors: ``|g - g_fp32| / |g_fp32|`` for dQ, dK, dV. Run: ``PYTHONPATH=src python -m
benchmarks.diag.fp8_attention_backward``; writes ``benchmarks/results/fp8_attention_backward.json``.
"""

from __future__ import annotations

import math

import torch

from benchmarks.common import print_table, write_results
from opengem.ops.reference.attention_fp8 import (
    jagged_attention_fp8,
    rotation_size,
    straight_through_operands,
    unrotate_gradient,
)

HEADS, HEAD_DIM, BLOCK = 2, 128, 128
COLUMNS = ["inputs", "length", "backward", "dq_err", "dk_err", "dv_err", "p_row_sum_error", "forward_err"]


def _flash_backward(dout, logits, lse, out, q, k, v, mask, scale):
    p = torch.exp(logits - lse[..., None]).masked_fill(~mask, 0)
    ds = p * (dout @ v.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True))
    row_sum_error = float((p.sum(-1) - 1).abs().mean())
    return (ds @ k * scale, ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ dout), row_sum_error


def measure(length: int, outliers: bool, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(length, HEADS, HEAD_DIM, generator=gen) for _ in range(3))
    if outliers:
        for x in (q, k):
            x[..., :4] *= 10
    q, k, v = (x.bfloat16().float() for x in (q, k, v))
    scale, n = HEAD_DIM**-0.5, rotation_size(HEAD_DIM)
    mask = torch.ones(length, length, dtype=torch.bool).tril()
    qh, kh, vh = (x.permute(1, 0, 2).double().requires_grad_() for x in (q, k, v))
    dout = torch.randn(HEADS, length, HEAD_DIM, generator=gen, dtype=torch.float64)
    logits = (qh @ kh.transpose(-1, -2)) * scale
    exact = torch.softmax(logits.masked_fill(~mask, -math.inf), -1) @ vh
    true = torch.autograd.grad(exact, (qh, kh, vh), dout)
    qh, kh, vh, logits, exact = qh.detach(), kh.detach(), vh.detach(), logits.detach(), exact.detach()
    # the FP8 forward: its output (rounded to bf16, as the kernel stores it) and its log-sum-exp, that of its
    # logits over the operands it multiplies (its running sums add the unquantized p)
    offsets = torch.tensor([0, length])
    qd, kd, vd = (x.permute(1, 0, 2).double() for x in straight_through_operands(q, k, v, offsets, BLOCK))
    out = jagged_attention_fp8(q, k, v, offsets, block=BLOCK).bfloat16().permute(1, 0, 2).double()
    fp8_logits = (qd @ kd.transpose(-1, -2)) * scale / n
    lse = torch.logsumexp(fp8_logits.masked_fill(~mask, -math.inf), -1)
    exact_lse = torch.logsumexp(logits.masked_fill(~mask, -math.inf), -1)
    variants = {
        "forward_only": (logits, lse, qh, kh, vh, scale),
        "straight_through": (fp8_logits, lse, qd, kd, vd, scale / n),
        "exact_lse": (logits, exact_lse, qh, kh, vh, scale),
    }
    rows = []
    for name, (used_logits, used_lse, qu, ku, vu, used_scale) in variants.items():
        (dq, dk, dv), row_sum_error = _flash_backward(dout, used_logits, used_lse, out, qu, ku, vu, mask, used_scale)
        if name == "straight_through":  # gradients of the rotated operands: back through R (R R^T = n I)
            dq, dk = (unrotate_gradient(g).double() for g in (dq, dk))
        errors = [float((g - t).norm() / t.norm()) for g, t in zip((dq, dk, dv), true)]
        rows.append({"inputs": "outliers" if outliers else "normal", "length": length, "backward": name,
                     "dq_err": errors[0], "dk_err": errors[1], "dv_err": errors[2], "p_row_sum_error": row_sum_error,
                     "forward_err": float((out - exact).norm() / exact.norm())})  # fmt: skip
    return rows


def main() -> None:
    rows = [row for outliers in (False, True) for length in (256, 1024) for row in measure(length, outliers)]
    print_table(rows, COLUMNS)
    print(write_results("fp8_attention_backward", rows, {"heads": HEADS, "head_dim": HEAD_DIM}))


if __name__ == "__main__":
    main()
