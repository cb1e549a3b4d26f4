"""Stochastic rounding of bf16 tables' updated rows: the Triton kernel (interpreter) rounds with the reference's
bits (the module-level behaviour: tests/nn/test_embedding_rounding.py)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # noqa: E402  (as tests/ops/test_embedding.py: before Triton loads)

import pytest  # noqa: E402
import torch  # noqa: E402

from opengem.ops.reference import embedding as reference  # noqa: E402
from tests.ops.test_embedding import KINDS, MIXED, kernels, make_problem  # noqa: E402


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
