"""Triton helpers of stochastic rounding to bf16, bit for bit the specification in `opengem.ops.reference.rounding`
(uint32 arithmetic: the hash's products wrap at 32 bits)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mix32(x):
    """``lowbias32`` on uint32 (`opengem.ops.reference.rounding.mix32`)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def rounding_key(seed, step, tensor):
    """`opengem.ops.reference.rounding.rounding_key` of scalars (any integer or integral float type)."""
    inner = mix32(tensor.to(tl.uint32)) ^ step.to(tl.uint32)
    return mix32(mix32(inner) ^ seed.to(tl.uint32))


@triton.jit
def step_key(seed, step):
    """`opengem.ops.reference.rounding.step_key`: ``rounding_key(seed, step, 0)``, whose hash of tensor 0 is 0."""
    return mix32(mix32(step.to(tl.uint32)) ^ seed.to(tl.uint32))


@triton.jit
def element_counters(index):
    """`opengem.ops.reference.rounding.element_counters` of int64 indices."""
    return index.to(tl.uint32) ^ mix32((index >> 32).to(tl.uint32))


@triton.jit
def store_rounded_bf16(pointer, x, counters, key, mask):
    """fp32 ``x`` stored as bf16, rounded stochastically by 16 bits of the hash of ``counters ^ key`` (uint32)."""
    store_bf16_rounded_by(pointer, x, mix32(counters ^ key) & 0xFFFF, mask)


@triton.jit
def store_bf16_rounded_by(pointer, x, bits, mask):
    """fp32 ``x`` stored as bf16, rounded stochastically by ``bits`` (uint32 in [0, 2 ** 16))."""
    pattern = (x.to(tl.uint32, bitcast=True) + bits) & 0xFFFF0000
    tl.store(pointer, pattern.to(tl.float32, bitcast=True).to(tl.bfloat16), mask=mask)  # exact: the low half is 0
