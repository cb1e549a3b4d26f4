"""Range checks of settings objects (their dataclasses' ``__post_init__``), with one wording for every layer.

It imports nothing of opengem, so every package may use it (below ``jagged`` in DESIGN.md's layer picture)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


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
