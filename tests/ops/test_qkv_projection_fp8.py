"""The QKV projection with FP8 attention's quantization in its epilogue (Triton interpreter, fp32 and fp16)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from opengem.ops.jagged_attention import _problem
from opengem.ops.triton import jagged_attention_fp8 as kernels
from opengem.ops.triton.qkv_projection_fp8 import project_quantize_qkv
from tests.ops.test_jagged_attention import _offsets


@pytest.mark.parametrize("heads, head_dim, model_dim", [(2, 32, 48), (1, 64, 64)])  # 48: a 16-step reduction
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_projection_and_its_blocks_equal_the_linear_then_the_quantize_pass(heads, head_dim, model_dim, dtype,
                                                                          with_bias):  # fmt: skip
    """qkv equals ``F.linear`` (to the summation order), and the FP8 blocks and scales written from it equal, bit
    for bit, what the quantize pass writes from that same qkv: one epilogue, the same numerics."""
    lengths = [37, 0, 1, 64, 33]  # partial, empty, single-row and exact blocks of 32
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(sum(lengths), model_dim, generator=gen).to(dtype)
    weight = (torch.randn(3 * heads * head_dim, model_dim, generator=gen) / model_dim**0.5).to(dtype)
    bias = torch.randn(3 * heads * head_dim, generator=gen).to(dtype) if with_bias else None
    offsets = _offsets(lengths)
    _, pb = _problem(x.view(-1, 1, model_dim), offsets, None, max(lengths), True, 0, -1, 1.0)
    qkv, quantized = project_quantize_qkv(x, weight, bias, heads, pb)
    want = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(qkv.float(), want.view_as(qkv), rtol=tol, atol=tol)
    assert qkv.dtype == dtype and qkv.shape == (sum(lengths), 3, heads, head_dim)
    again = kernels.quantize_qkv(*qkv.unbind(1), pb)
    for got, expected in zip(quantized, again):
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                           expected.view(torch.uint8) if expected.dtype == torch.float8_e4m3fn else expected)


def test_empty_batch_returns_empty_buffers():
    x = torch.zeros(0, 32)
    offsets = _offsets([0, 0])
    _, pb = _problem(x.view(0, 1, 32), offsets, None, 0, True, 0, -1, 1.0)
    qkv, (q8, *_rest) = project_quantize_qkv(x, torch.zeros(3 * 32, 32), None, 1, pb)
    assert qkv.shape == (0, 3, 1, 32) and q8.shape == (1, 0, kernels.BLOCK, 32)


def test_model_dim_off_the_reduction_step_is_refused():
    x = torch.zeros(4, 40)
    _, pb = _problem(x.view(4, 1, 40), _offsets([4]), None, 4, True, 0, -1, 1.0)
    with pytest.raises(ValueError, match="model dim a multiple of 16, got 40"):
        project_quantize_qkv(x, torch.zeros(3 * 32, 40), None, 1, pb)
