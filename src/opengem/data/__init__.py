"""Data: the synthetic ads generator, Parquet storage, validation and batching into `Batch` objects."""

from opengem.data.layout import DataError, DataLayout
from opengem.data.parquet import (
    ParquetDataset,
    batches_from_table,
    make_loader,
    synthesize_to_parquet,
    validate_files,
)
from opengem.data.schema import TASKS, Batch, FeatureSpec
from opengem.data.synthetic import SYNTHETIC_PRESETS, SyntheticConfig, generate, generate_rows, oracle_components

__all__ = [
    "TASKS",
    "SYNTHETIC_PRESETS",
    "Batch",
    "DataError",
    "DataLayout",
    "FeatureSpec",
    "ParquetDataset",
    "SyntheticConfig",
    "batches_from_table",
    "generate",
    "generate_rows",
    "make_loader",
    "oracle_components",
    "synthesize_to_parquet",
    "validate_files",
]
