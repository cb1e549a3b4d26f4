"""Type and range checks of settings and arguments, with one wording for every layer.

It imports nothing of opengem, so every package may use it (below ``jagged`` in DESIGN.md's layer picture)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

import torch


def is_int(value: Any) -> bool:
    """An integer (Python's, numpy's, or a size Dynamo traces as a symbol), not a bool: ``True`` is an ``int`` to
    ``isinstance``, never a count here."""
    return isinstance(value, (numbers.Integral, torch.SymInt)) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A real number (int or float, Python's or numpy's), not a bool, and not a string that would convert."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_positive_finite(value: Any) -> bool:
    """A number above 0 and below infinity (NaN is neither)."""
    return is_number(value) and 0 < value < math.inf


def require_at_least(settings: Any, names: Iterable[str], low: int) -> None:
    """Raise ``ValueError("<name> must be >= <low>, got <value>")`` for the first of ``names`` under ``low`` (NaN
    fails too)."""
    for name in names:
        value = getattr(settings, name)
        if not value >= low:
            raise ValueError(f"{name} must be >= {low}, got {value}")


def require_positive(settings: Any, names: Iterable[str]) -> None:
    """Raise ``ValueError("<name> must be > 0, got <value>")`` for the first of ``names`` not above 0 (NaN too)."""
    for name in names:
        value = getattr(settings, name)
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")


def require_fraction(settings: Any, names: Iterable[str]) -> None:
    """Raise ``ValueError("<name> must be in [0, 1], got <value>")`` for the first of ``names`` outside [0, 1] (NaN
    too)."""
    for name in names:
        value = getattr(settings, name)
        if not 0 <= value <= 1:
            raise ValueError(f"{name} must be in [0, 1], got {value}")


def require_finite(settings: Any, names: Iterable[str]) -> None:
    """Raise ``ValueError("<name> must be finite, got <value>")`` for the first of ``names`` that is inf or NaN (an
    infinite rate or decay turns the weights to NaN)."""
    for name in names:
        value = getattr(settings, name)
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value}")


def require_heads_divide(settings: Any, width: str, when: str = "") -> None:
    """``settings.num_heads`` >= 1 and dividing ``settings.<width>`` (each attention head reads width / num_heads
    features). Messages start with the field's name, so a config file's error can name its section
    (``model.num_heads=3 must divide ...``); ``when`` says under which setting the split applies."""
    require_at_least(settings, ("num_heads",), 1)
    heads, size = settings.num_heads, getattr(settings, width)
    if size % heads:
        raise ValueError(f"num_heads={heads} must divide {width}={size}{when} (each head reads {width} / num_heads "
                         f"features: {width} must be divisible by num_heads)")


# seeds below 2**32: the range numpy's legacy seeding and the AdamW rounding seed take; far below the synthetic data's
# hash (seed * 1_000_003 in 64 bits), which overflows past about 2**44
SEED_LIMIT = 2**32


def require_seed(settings: Any) -> None:
    """``settings.seed`` in [0, 2**32): numpy's default_rng refuses negatives, naming no setting."""
    if not 0 <= settings.seed < SEED_LIMIT:
        raise ValueError(f"seed must be in [0, 2**32), got {settings.seed}")


def check_optional_positive_finite(**values: float | None) -> None:
    """Raise ``ValueError("<name> must be positive, got <value>")``, or ``"... must be finite ..."`` for infinity, for
    the first given value (None: not given) that is not a positive finite number (NaN fails as not positive)."""
    for name, value in values.items():
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")
        if value is not None and not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value}")


def check_run_name(name: str) -> None:
    """A run's folder name under ``out_dir``: one path component, so a run never writes (or resumes) elsewhere
    (``../other`` had written beside ``out_dir``)."""
    if name in (".", "..") or "/" in name or "\\" in name:
        raise ValueError(f"name must be one folder name under out_dir (no '/', '\\', '.' or '..'), got {name!r}")
