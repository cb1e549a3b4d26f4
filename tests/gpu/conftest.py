"""GPU tests check results, not speed: one kernel configuration each (no autotuning), unless a test asks.

Autotuning compiles every candidate configuration of every JFA, GDPA and FP8 GEMM variant a test touches
and times each; on a fresh machine (cold Triton cache) the training tests spent minutes there (session 3:
two of them did not finish in 190 s). Tests of the autotuner itself delete these variables.
"""

import os

import pytest

NO_AUTOTUNE = {"OPENGEM_JFA_AUTOTUNE": "0", "OPENGEM_GDPA_TUNE": "0", "OPENGEM_FP8_AUTOTUNE": "0"}


@pytest.fixture(autouse=True)
def _one_config_per_kernel(monkeypatch):
    for name, value in NO_AUTOTUNE.items():
        if name not in os.environ:
            monkeypatch.setenv(name, value)
