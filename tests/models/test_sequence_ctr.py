"""The sequence CTR model's construction checks (the model itself trains in tests/train)."""

import dataclasses

import pytest

from opengem.data.synthetic import SYNTHETIC_PRESETS
from opengem.models.sequence_ctr import SequenceCTRConfig, SequenceCTRModel

DATA = SYNTHETIC_PRESETS["gem-tiny"]


@pytest.mark.parametrize(("change", "message"), [
    ({"mlp_dims": ()}, r"mlp_dims must be one or more sizes >= 1, got \(\)"),  # was an IndexError
    ({"mlp_dims": (32, 0)}, r"mlp_dims must be one or more sizes >= 1, got \(32, 0\)"),
    ({"history": "gru"}, "history must be attention, mean or none, got 'gru'"),
    ({"candidate_feature": "hist_item"}, "candidate_feature 'hist_item' is not a sparse feature"),
])
def test_bad_configs_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        SequenceCTRModel(DATA.feature_specs(), DATA.num_dense, dataclasses.replace(SequenceCTRConfig(), **change))


def test_one_mlp_size_is_enough():
    model = SequenceCTRModel(DATA.feature_specs(), DATA.num_dense, SequenceCTRConfig(mlp_dims=(16,)))
    assert model.heads["click"].in_features == 16


@pytest.mark.parametrize(("change", "message"), [
    ({"dropout": 2.0}, r"dropout must be in \[0, 1\), got 2.0"),
    ({"dropout": float("nan")}, r"dropout must be in \[0, 1\), got nan"),
    ({"num_heads": 0}, "num_heads must be >= 1, got 0"),
    ({"num_heads": 3}, "num_heads=3 must divide d_model=64 with history='attention'"),
])
def test_bad_settings_are_refused_by_the_config(change, message):
    # refused when the config is made, before any model is built
    with pytest.raises(ValueError, match=message):
        SequenceCTRConfig(**change)
    assert SequenceCTRConfig(history="mean", num_heads=3).num_heads == 3  # no heads without attention
