"""Models: plain nn.Modules with no parallelism inside, plus size presets."""

from opengem.models.gem import GEM, GEMConfig
from opengem.models.hstu import SequentialModelConfig, SequentialRecommender
from opengem.models.presets import GEM_PRESETS, describe, gem_flops
from opengem.models.sequence_ctr import SequenceCTRConfig, SequenceCTRModel

__all__ = [
    "GEM",
    "GEM_PRESETS",
    "GEMConfig",
    "SequenceCTRConfig",
    "SequenceCTRModel",
    "SequentialModelConfig",
    "SequentialRecommender",
    "describe",
    "gem_flops",
]
