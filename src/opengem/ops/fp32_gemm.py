"""A GEMM of low-precision operands whose fp32 sums are written as fp32 (no bf16 rounding of the product)."""

from __future__ import annotations

import torch


def fp32_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with fp32 sums written as fp32. bf16 / fp16 operands on CUDA: one GEMM with an fp32 output (``mm``'s
    ``out_dtype``, which torch 2.11's fake tensors and Inductor know); fp32 operands, or elsewhere: the same products
    of the exactly widened operands (CPU kernels have no ``out_dtype``)."""
    if a.dtype == b.dtype == torch.float32 or not a.is_cuda:
        return torch.mm(a.float(), b.float())
    return torch.mm(a, b, out_dtype=torch.float32)
