"""Stochastic rounding of bf16 tables' updated rows (``EmbeddingOptimizer.stochastic_rounding``, on by default, as
fbgemm rounds half-precision tables): updates under half a bf16 ulp move a row in expectation, where rounding to
nearest drops them; the Triton kernel (interpreter) rounds with the reference's bits."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # noqa: E402  (as tests/ops/test_embedding.py: before Triton loads)

import pytest  # noqa: E402
import torch  # noqa: E402

from opengem.jagged import KeyedJagged  # noqa: E402
from opengem.nn.embedding import EmbeddingCollection, EmbeddingOptimizer, EmbeddingTableConfig  # noqa: E402
from opengem.ops.reference import embedding as reference  # noqa: E402
from tests.ops.test_embedding import KINDS, MIXED, kernels, make_problem  # noqa: E402


def _row_after_small_steps(stochastic_rounding: bool, steps: int = 100) -> torch.Tensor:
    """Row 1 of a bf16 table of ones after ``steps`` SGD steps of lr 1e-4 on a gradient of ones: each step asks
    for -1e-4, under half the bf16 ulp below 1.0 (2 ** -9)."""
    table = EmbeddingTableConfig("t", 4, 256, ("f",), dtype=torch.bfloat16)
    optimizer = EmbeddingOptimizer("sgd", lr=1e-4, stochastic_rounding=stochastic_rounding)
    collection = EmbeddingCollection([table], optimizer)
    collection.weights_bfloat16.fill_(1.0)
    for _ in range(steps):
        collection(KeyedJagged(("f",), torch.tensor([1]), torch.tensor([1])))["f"].float().sum().backward()
    return collection.embedding_weight("t")[1].float()


def test_updates_under_half_an_ulp_move_a_bf16_row_only_when_rounded_stochastically():
    assert torch.equal(_row_after_small_steps(False), torch.ones(256))  # rounded to nearest: every update lost
    row = _row_after_small_steps(True)
    # 100 x -1e-4 = -0.01 in expectation; the rounding's spread over 256 columns: ~4e-4
    assert row.mean().item() == pytest.approx(0.99, abs=2e-3)
    assert len(row.unique()) > 1  # each column's own draws


def _bf16_update(module, kind: str, steps: int = 2, **options) -> torch.Tensor:
    p = make_problem(**MIXED, batch_size=5, max_len=12, seed=5)
    weights = p.weights.to(torch.bfloat16)
    grad_out = torch.randn(p.layout.out_numel, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(0)
    row_state = torch.rand(p.total_rows, generator=g) if kind != "sgd" else torch.zeros(0)
    elem_state = torch.randn(weights.numel(), generator=g) * 0.1 if kind == "rowwise_adam" else torch.zeros(0)
    step = torch.tensor([3])
    extra = (p.layout.max_dim, p.layout.dim_align) if module is kernels else ()
    for _ in range(steps):
        module.embedding_fused_update_(
            grad_out, weights, row_state, elem_state, step, p.layout.feature_meta, p.ids, p.offsets,
            p.layout.batch_size, *extra, KINDS[kind], 0.05, 1e-6, 0.8, 0.9, 0.01, **options,
        )  # fmt: skip
    return weights


@pytest.mark.parametrize("kind", list(KINDS))
def test_kernel_rounds_bf16_rows_with_the_references_bits(kind: str):
    """The same rounding bits (keyed by the step, counted by the element): the rows agree but where the fp32 row
    before rounding differs by an ulp of its terms and that carries (one bf16 ulp); rounding to nearest differs."""
    want = _bf16_update(reference, kind, stochastic_rounding=True)
    got = _bf16_update(kernels, kind, stochastic_rounding=True)
    ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert int(ulps.max()) <= 1 and int((ulps > 0).sum()) <= max(1, want.numel() // 500), int((ulps > 0).sum())
    nearest = _bf16_update(reference, kind)
    assert not torch.equal(nearest, want)  # the option changes the rounding
