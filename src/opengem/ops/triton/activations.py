"""GDPA activations as Triton jit functions, selected by the id of :mod:`opengem.ops.activations`.

``act`` may be a ``tl.constexpr`` (one activation for all heads: the branch folds at compile time) or a
runtime int32 scalar (per-head activations: a uniform branch per tile). Formulas and constants are
documented in :mod:`opengem.ops.activations`; ids: 0 identity, 1 gelu, 2 gelu_tanh, 3 fast_gelu, 4 relu,
5 relu2, 6 leaky_relu, 7 silu, 8 hardswish.

``FAST`` (compiled 16-bit kernels only: the interpreter has no inline PTX) takes silu's sigmoid and gelu_tanh's
tanh from the GPU's one-instruction ``tanh.approx.f32`` (relative error <= 2^-10.987, PTX ISA) instead of an
exponential and a reciprocal: 1 special-function op per element instead of 2, and no range checks. The
sigmoid's error is then <= 2.5e-4 absolute, below a bf16 rounding (3.9e-3 relative) of the weights it feeds.
``FAST`` also computes fast_gelu as a smoothstep of one saturating FMA (the same function, fp32 rounding apart).
"""

import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    # 2 sigmoid(2x) - 1: saturates cleanly to +-1 for large |x|
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def _tanh_approx(x):
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _fma_sat(a, b, c):
    """``a * b + c`` clamped to [0, 1] by the instruction's saturation (one FFMA.SAT; NaN becomes 0)."""
    return tl.inline_asm_elementwise("fma.rn.sat.f32 $0, $1, $2, $3;", "=f,f,f,f", [a, b, c], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _fast_gelu_smoothstep(x):
    """fast_gelu and its derivative from ``v = (u + 1) / 2 = sat(x / 3.76 + 1/2)``: the gate is smoothstep
    ``v^2 (3 - 2 v)`` and the derivative ``4 gate - 3 v`` (both exact rewrites of the cubic in ``u``, the clamp
    included: v is 0 or 1 outside the radius). sm_90 SASS against the cubic in ``u`` with its two-sided clamp: 3
    instructions a score fewer in each backward pass, 2 in the forward (3 with the pre-scale folded in:
    :func:`scaled_activation_value`); fast_gelu had taken 14% of the forward's time and 30% of the backward's over
    identity (issue 4's (a) L512 s1.0, H200, session 24)."""
    v = _fma_sat(x, 0.5 / 1.88, 0.5)
    gate = v * v * (3.0 - 2.0 * v)
    return x * gate, 4.0 * gate - 3.0 * v


@triton.jit
def activation_value_and_grad(x, act, FAST: tl.constexpr = False):
    """``(phi(x), phi'(x))`` in fp32 for activation id ``act``."""
    if act == 0:
        y = x
        dy = tl.full(x.shape, 1.0, tl.float32)
    elif act == 1:
        cdf = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476))
        y = x * cdf
        dy = cdf + x * tl.exp(-0.5 * x * x) * 0.3989422804014327
    elif act == 2:
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        if FAST:
            t = _tanh_approx(inner)
        else:
            t = _tanh(inner)
        y = 0.5 * x * (1.0 + t)
        dy = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * x * x)
    elif act == 3:
        if FAST:
            y, dy = _fast_gelu_smoothstep(x)
        else:
            u = tl.minimum(tl.maximum(x * (1.0 / 1.88), -1.0), 1.0)
            gate = 0.5 + u * (0.75 - 0.25 * u * u)
            y = x * gate
            dy = gate + x * (0.75 / 1.88) * (1.0 - u * u)
    elif act == 4:
        y = tl.maximum(x, 0.0)
        dy = tl.where(x > 0, 1.0, 0.0)
    elif act == 5:
        r = tl.maximum(x, 0.0)
        y = r * r
        dy = 2.0 * r
    elif act == 6:
        y = tl.where(x > 0, x, 0.01 * x)
        dy = tl.where(x > 0, 1.0, 0.01)
    elif act == 7:
        if FAST:  # sigmoid(x) = (1 + tanh(x / 2)) / 2
            s = 0.5 + 0.5 * _tanh_approx(0.5 * x)
        else:
            s = 1.0 / (1.0 + tl.exp(-x))
        y = x * s
        dy = s * (1.0 + x * (1.0 - s))
    else:
        y = x * tl.minimum(tl.maximum(x + 3.0, 0.0), 6.0) * (1.0 / 6.0)
        dy = tl.where(x < -3.0, 0.0, tl.where(x <= 3.0, x * (1.0 / 3.0) + 0.5, 1.0))
    return y, dy


@triton.jit
def scaled_activation_value(s, scale, act, FAST: tl.constexpr = False):
    """``phi(scale * s)`` in fp32; with ``FAST`` fast_gelu takes ``scale`` into its constants (one multiply a score
    fewer: ``scale * s * gate = s * v^2 (3 scale - 2 scale v)``)."""
    if FAST:
        if act == 3:
            v = _fma_sat(s, scale * (0.5 / 1.88), 0.5)
            y = s * (v * v * (3.0 * scale - (2.0 * scale) * v))
        else:
            y = activation_value(s * scale, act, FAST)
    else:
        y = activation_value(s * scale, act, FAST)
    return y


@triton.jit
def activation_value(x, act, FAST: tl.constexpr = False):
    """``phi(x)`` in fp32 (the forward needs no derivative; unused results are removed by the compiler)."""
    if act == 0:  # identity apart: its derivative's ``tl.full`` has no layout in a Gluon kernel, which calls this
        y = x
    else:
        y, _ = activation_value_and_grad(x, act, FAST)
    return y
