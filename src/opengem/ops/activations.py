"""The pointwise activations of GDPA: one id per activation, its value and its derivative (fp32 PyTorch).

The ids index the same table in :mod:`opengem.ops.triton.activations`, so a kernel and the reference
agree by construction. Definitions:

* ``identity``: ``x``.
* ``gelu``: ``x * Phi(x)`` with the exact (erf) normal CDF.
* ``gelu_tanh``: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``.
* ``fast_gelu``: ``x * g(u)`` with ``u = clamp(x / 1.88, -1, 1)`` and the cubic gate
  ``g(u) = 0.5 + 0.75 u - 0.25 u^3`` (smoothstep): a C1 piecewise polynomial, no transcendental, with
  GELU's slope 1/sqrt(2 pi) at 0 (``0.75 / 1.88``); exactly ``relu`` for ``|x| >= 1.88``; within 0.07 of
  ``gelu`` everywhere.
* ``relu``: ``max(x, 0)``; ``relu2``: ``max(x, 0)^2``; ``leaky_relu``: ``x`` if ``x > 0`` else ``0.01 x``.
* ``silu``: ``x * sigmoid(x)``; ``hardswish``: ``x * clamp(x + 3, 0, 6) / 6`` (derivative as torch's).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

ACTIVATIONS: tuple[str, ...] = (
    "identity",
    "gelu",
    "gelu_tanh",
    "fast_gelu",
    "relu",
    "relu2",
    "leaky_relu",
    "silu",
    "hardswish",
)
FAST_GELU_RADIUS = 1.88
LEAKY_RELU_SLOPE = 0.01
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_TANH_CUBIC = 0.044715


def activation_id(name: str) -> int:
    """The table index of activation ``name``; ``ValueError`` listing the choices otherwise."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; expected one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS.index(name)


def _fast_gelu(x: torch.Tensor) -> torch.Tensor:
    u = torch.clamp(x / FAST_GELU_RADIUS, -1.0, 1.0)
    return x * (0.5 + 0.75 * u - 0.25 * u**3)


def _fast_gelu_grad(x: torch.Tensor) -> torch.Tensor:
    u = torch.clamp(x / FAST_GELU_RADIUS, -1.0, 1.0)
    return (0.5 + 0.75 * u - 0.25 * u**3) + x * (0.75 / FAST_GELU_RADIUS) * (1.0 - u * u)


def _gelu_grad(x: torch.Tensor) -> torch.Tensor:
    cdf = 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))
    return cdf + x * torch.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _gelu_tanh_grad(x: torch.Tensor) -> torch.Tensor:
    t = torch.tanh(_SQRT_2_OVER_PI * (x + _TANH_CUBIC * x**3))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _TANH_CUBIC * x * x)


def _silu_grad(x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


def _hardswish_grad(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x < -3.0, 0.0, torch.where(x <= 3.0, x / 3.0 + 0.5, 1.0))


_VALUE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "identity": lambda x: x,
    "gelu": lambda x: torch.nn.functional.gelu(x),
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "fast_gelu": _fast_gelu,
    "relu": torch.relu,
    "relu2": lambda x: torch.relu(x) ** 2,
    "leaky_relu": lambda x: torch.nn.functional.leaky_relu(x, LEAKY_RELU_SLOPE),
    "silu": torch.nn.functional.silu,
    "hardswish": torch.nn.functional.hardswish,
}
_GRAD: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "identity": torch.ones_like,
    "gelu": _gelu_grad,
    "gelu_tanh": _gelu_tanh_grad,
    "fast_gelu": _fast_gelu_grad,
    "relu": lambda x: (x > 0).to(x.dtype),
    "relu2": lambda x: 2.0 * torch.relu(x),
    "leaky_relu": lambda x: torch.where(x > 0, torch.ones_like(x), torch.full_like(x, LEAKY_RELU_SLOPE)),
    "silu": _silu_grad,
    "hardswish": _hardswish_grad,
}


def activation_value(name: str, x: torch.Tensor) -> torch.Tensor:
    """``phi(x)`` for activation ``name`` (differentiable through autograd)."""
    if name not in _VALUE:  # a KeyError had named neither the argument nor the choices
        activation_id(name)
    return _VALUE[name](x)


def activation_grad(name: str, x: torch.Tensor) -> torch.Tensor:
    """``phi'(x)`` in closed form (what the kernels compute; tested against autograd of the value)."""
    if name not in _GRAD:
        activation_id(name)
    return _GRAD[name](x)
