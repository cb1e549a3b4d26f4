"""Pointwise attention activations ``phi`` and their derivatives for the BlockAttention kernels.

The integer codes index :data:`ACTIVATION_CODES`; the formulas match
:data:`opengem.ops.reference.block_attention.POINTWISE` (leaky slope 0.01, fast_gelu = x sigmoid(1.702 x)).
Everything is fp32 and built from exp/log/erf so it also runs in the Triton interpreter.
"""

import triton
import triton.language as tl

ACTIVATION_CODES = {
    "softmax": 0,
    "identity": 1,
    "relu": 2,
    "relu2": 3,
    "leaky_relu": 4,
    "silu": 5,
    "fast_gelu": 6,
    "gelu": 7,
    "gelu_tanh": 8,
    "hardswish": 9,
}

_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_INV_SQRT_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh_gelu_inner(x):
    """``tanh(sqrt(2/pi) (x + 0.044715 x^3))`` as ``2 sigmoid(2u) - 1`` (no tanh in the interpreter)."""
    u = _SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
    return 2.0 * _sigmoid(2.0 * u) - 1.0


@triton.jit
def activation(x, ACT: tl.constexpr):
    """``phi(x)`` for a pointwise activation code (not softmax)."""
    if ACT == 1:
        y = x
    elif ACT == 2:
        y = tl.maximum(x, 0.0)
    elif ACT == 3:
        r = tl.maximum(x, 0.0)
        y = r * r
    elif ACT == 4:
        y = tl.where(x > 0, x, 0.01 * x)
    elif ACT == 5:
        y = x * _sigmoid(x)
    elif ACT == 6:
        y = x * _sigmoid(1.702 * x)
    elif ACT == 7:
        y = 0.5 * x * (1.0 + tl.erf(x * _INV_SQRT_2))
    elif ACT == 8:
        y = 0.5 * x * (1.0 + _tanh_gelu_inner(x))
    else:
        y = x * tl.minimum(tl.maximum(x + 3.0, 0.0), 6.0) / 6.0
    return y


@triton.jit
def activation_grad(x, ACT: tl.constexpr):
    """``phi'(x)`` for a pointwise activation code (not softmax)."""
    if ACT == 1:
        g = tl.full(x.shape, 1.0, tl.float32)
    elif ACT == 2:
        g = tl.where(x > 0, 1.0, 0.0)
    elif ACT == 3:
        g = 2.0 * tl.maximum(x, 0.0)
    elif ACT == 4:
        g = tl.where(x > 0, 1.0, 0.01)
    elif ACT == 5:
        s = _sigmoid(x)
        g = s * (1.0 + x * (1.0 - s))
    elif ACT == 6:
        s = _sigmoid(1.702 * x)
        g = s + 1.702 * x * s * (1.0 - s)
    elif ACT == 7:
        g = 0.5 * (1.0 + tl.erf(x * _INV_SQRT_2)) + x * _INV_SQRT_2PI * tl.exp(-0.5 * x * x)
    elif ACT == 8:
        t = _tanh_gelu_inner(x)
        g = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x)
    else:
        g = tl.where(x < -3.0, 0.0, tl.where(x > 3.0, 1.0, (2.0 * x + 3.0) / 6.0))
    return g
