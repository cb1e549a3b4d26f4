"""The shadow AdamW kernel on the GPU in bf16 (its shadows rounded to nearest even, as ``Tensor.to`` rounds) against
``torch.optim.AdamW(fused=True)`` on the widened gradients: `tests/ops/test_adamw.py`'s check; with bf16 moments
against the reference's stochastic rounding (`tests/ops/test_adamw_moments.py`)."""

import pytest
import torch

from tests.ops.test_adamw import run_against_adamw
from tests.ops.test_adamw_moments import compare_kernel_with_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", [{}, {"skip_at": 1}, {"absent": 1}, {"misaligned": True}])
def test_kernel_steps_as_fused_adamw(half, case):
    run_against_adamw("cuda", half, "auto", **case)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_kernel_rounds_bf16_moments_as_the_reference(half):
    compare_kernel_with_reference(half, "cuda")
