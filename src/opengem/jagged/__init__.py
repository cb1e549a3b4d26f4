"""Jagged (variable-length) batches: the data structure every other layer speaks."""

from opengem.jagged.jagged import Jagged, offsets_from_lengths, validate_offsets
from opengem.jagged.keyed import KeyedJagged

__all__ = ["Jagged", "KeyedJagged", "offsets_from_lengths", "validate_offsets"]
