"""Shared small data sets for the data tests (gem-tiny, a few thousand rows: fast on 2 cores)."""

from pathlib import Path

import pyarrow as pa
import pytest

from opengem.data.parquet import synthesize_to_parquet
from opengem.data.synthetic import SYNTHETIC_PRESETS, generate

TINY = SYNTHETIC_PRESETS["gem-tiny"]
NUM_ROWS = 5_000
SEED = 7


@pytest.fixture(scope="session")
def tiny_table() -> pa.Table:
    return generate(TINY, NUM_ROWS, SEED)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """NUM_ROWS gem-tiny rows in 3 files of row groups of 512 rows (10 row groups, the last ones partial)."""
    out = tmp_path_factory.mktemp("tiny")
    synthesize_to_parquet(out, NUM_ROWS, "gem-tiny", seed=SEED, rows_per_file=2_000, row_group_size=512, progress=False)
    return out
