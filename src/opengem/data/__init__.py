"""Data: the synthetic ads generator, Parquet storage, validation and batching into `Batch` objects."""
