"""Jagged (variable-length) batches: the data structure every other layer speaks."""

from opengem.jagged.host import host_copy, register_host_copy, to_device
from opengem.jagged.jagged import Jagged, offsets_from_lengths, uniform_offsets, validate_offsets
from opengem.jagged.keyed import KeyedJagged

__all__ = [
    "Jagged",
    "KeyedJagged",
    "host_copy",
    "offsets_from_lengths",
    "register_host_copy",
    "to_device",
    "uniform_offsets",
    "validate_offsets",
]
