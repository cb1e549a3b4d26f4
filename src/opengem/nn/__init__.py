"""Modules built from ops."""

from opengem.nn.embedding import EmbeddingCollection, EmbeddingOptimizer, EmbeddingTableConfig, trust_ids
from opengem.nn.layers import MLP, JaggedTransformerLayer
from opengem.nn.low_precision import (
    NAMED_RECIPES,
    LowPrecisionLinear,
    LowPrecisionRecipe,
    convert_to_low_precision,
    default_filter,
)
from opengem.nn.low_precision_mlp import LowPrecisionMLP, fuse_low_precision_mlps
from opengem.nn.numerics import NumericsMonitor, convert_with_precision, select_precision
from opengem.nn.wukong import DenseExperts, WukongLayer

__all__ = [
    "MLP",
    "NAMED_RECIPES",
    "DenseExperts",
    "EmbeddingCollection",
    "EmbeddingOptimizer",
    "EmbeddingTableConfig",
    "JaggedTransformerLayer",
    "LowPrecisionLinear",
    "LowPrecisionMLP",
    "LowPrecisionRecipe",
    "NumericsMonitor",
    "WukongLayer",
    "convert_to_low_precision",
    "convert_with_precision",
    "default_filter",
    "fuse_low_precision_mlps",
    "select_precision",
    "trust_ids",
]
