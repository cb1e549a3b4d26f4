"""Stochastic rounding of bf16 tables' updated rows (``EmbeddingOptimizer.stochastic_rounding``, on by default, as
fbgemm rounds half-precision tables): updates under half a bf16 ulp move a row in expectation, where rounding to
nearest drops them. No Triton here: the GPU test imports the helper (tests/gpu/test_embedding_gpu.py)."""

import pytest
import torch

from opengem.jagged import KeyedJagged
from opengem.nn.embedding import EmbeddingCollection, EmbeddingOptimizer, EmbeddingTableConfig


def row_after_small_steps(stochastic_rounding: bool, steps: int = 100, device: str = "cpu") -> torch.Tensor:
    """Row 1 of a bf16 table of ones after ``steps`` SGD steps of lr 1e-4 on a gradient of ones: each step asks
    for -1e-4, under half the bf16 ulp below 1.0 (2 ** -9)."""
    table = EmbeddingTableConfig("t", 4, 256, ("f",), dtype=torch.bfloat16)
    optimizer = EmbeddingOptimizer("sgd", lr=1e-4, stochastic_rounding=stochastic_rounding)
    collection = EmbeddingCollection([table], optimizer, device=device)
    collection.weights_bfloat16.fill_(1.0)
    batch = KeyedJagged(("f",), torch.tensor([1]), torch.tensor([1])).to(device)
    for _ in range(steps):
        collection(batch)["f"].float().sum().backward()
    return collection.embedding_weight("t")[1].float().cpu()


def test_updates_under_half_an_ulp_move_a_bf16_row_only_when_rounded_stochastically():
    assert torch.equal(row_after_small_steps(False), torch.ones(256))  # rounded to nearest: every update lost
    row = row_after_small_steps(True)
    # 100 x -1e-4 = -0.01 in expectation; the rounding's spread over 256 columns: ~4e-4
    assert row.mean().item() == pytest.approx(0.99, abs=2e-3)
    assert len(row.unique()) > 1  # each column's own draws
