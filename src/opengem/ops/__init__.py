"""One public function per operation; CUDA tensors run Triton kernels, CPU tensors the reference."""

from opengem.ops.reference.attention import jagged_attention

__all__ = ["jagged_attention"]
