"""One public function per operation; CUDA tensors run Triton kernels, CPU tensors the reference."""

from opengem.ops.block_attention import Rotary, block_attention, block_attention_from_hidden
from opengem.ops.embedding import FusedUpdate, LookupLayout, check_ids, embedding_lookup
from opengem.ops.fp8_gemm import (
    RECIPES,
    QuantizedOperand,
    dequantize_operand,
    fp8_matmul,
    hadamard_rotate,
    quantize_gelu,
    quantize_gelu_with_column_sums,
    quantize_operand,
    quantize_operand_with_column_sums,
    quantize_operand_with_transpose,
    scaled_gemm,
)
from opengem.ops.gdpa import gdpa, gdpa_packed_kv, hstu_attention
from opengem.ops.mx import MXTensor, mx_dequantize, mx_quantize
from opengem.ops.jagged_attention import attention_pairs, jagged_attention, jagged_attention_packed

__all__ = [
    "RECIPES",
    "Rotary",
    "FusedUpdate",
    "LookupLayout",
    "MXTensor",
    "QuantizedOperand",
    "check_ids",
    "dequantize_operand",
    "embedding_lookup",
    "fp8_matmul",
    "gdpa",
    "gdpa_packed_kv",
    "hadamard_rotate",
    "hstu_attention",
    "attention_pairs",
    "block_attention",
    "block_attention_from_hidden",
    "jagged_attention",
    "jagged_attention_packed",
    "mx_dequantize",
    "mx_quantize",
    "quantize_gelu",
    "quantize_gelu_with_column_sums",
    "quantize_operand",
    "quantize_operand_with_column_sums",
    "quantize_operand_with_transpose",
    "scaled_gemm",
]
