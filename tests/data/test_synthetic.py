import dataclasses

import numpy as np
import pyarrow as pa
import pytest

from opengem.data.layout import DataLayout, decode
from opengem.data.synthetic import (
    BLOCK_SIZE,
    SYNTHETIC_PRESETS,
    SyntheticConfig,
    generate,
    generate_rows,
    oracle_components,
)

TINY = SYNTHETIC_PRESETS["gem-tiny"]


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    positives = labels.sum()
    return float((ranks[labels == 1].sum() - positives * (positives + 1) / 2) / (positives * (len(labels) - positives)))


def test_same_seed_same_rows_other_seed_other_rows():
    assert generate(TINY, 3_000, seed=1).equals(generate(TINY, 3_000, seed=1))
    other = generate(TINY, 3_000, seed=2)
    assert not generate(TINY, 3_000, seed=1).column("hist_item").equals(other.column("hist_item"))


def test_chunked_generation_equals_one_shot():
    total = 2 * BLOCK_SIZE + 900
    one_shot = generate(TINY, total, seed=3)
    bounds = [0, 1_500, 4_200, 4_200, BLOCK_SIZE * 2 + 1, total]  # chunks cross block boundaries, one is empty
    chunks = [generate(TINY, b - a, seed=3, start=a) for a, b in zip(bounds, bounds[1:])]
    assert pa.concat_tables(chunks).combine_chunks().equals(one_shot.combine_chunks())
    assert one_shot.column("sample_id").to_numpy().tolist() == list(range(total))


@pytest.mark.parametrize("preset", sorted(SYNTHETIC_PRESETS))
def test_statistics_of_every_preset(preset):
    config = SYNTHETIC_PRESETS[preset]
    rows = generate_rows(config, 4_096 if preset == "gem-large" else 8_192, seed=0)
    lengths = rows.history_lengths()
    assert lengths.min() >= config.min_history and lengths.max() <= config.max_history
    assert abs(lengths.mean() / config.mean_history_length() - 1) < 0.1
    assert lengths.max() > 4 * lengths.mean()  # heavy tail
    click_rate, conversion_rate = rows.labels.mean(axis=0)
    assert 0.03 <= click_rate <= 0.10, click_rate
    assert 0 < conversion_rate < click_rate
    assert (rows.labels[:, 1] <= rows.labels[:, 0]).all()
    # The stored oracle is calibrated: labels are drawn from it.
    p = rows.oracle[:, 0].astype(np.float64)
    assert abs(click_rate - p.mean()) < 4 * np.sqrt((p * (1 - p)).sum()) / len(p)
    assert (rows.oracle[:, 1] <= rows.oracle[:, 0]).all()
    # Every id is in range and every sequence column has one value per event: decoding validates.
    layout = config.layout(0)
    decode(generate(config, 512, seed=0), layout, "generated")
    ages = np.repeat(rows.timestamp, lengths) - rows.history["hist_timestamp"]
    assert (ages >= 0).all()
    newer = np.diff(ages) <= 0  # stored oldest first: age does not increase within a sample
    inside = np.ones(len(ages) - 1, dtype=bool)
    inside[rows.history_offsets[1:-1] - 1] = False
    assert newer[inside].all()


def test_history_carries_most_of_the_signal():
    num = 20_000
    parts = oracle_components(TINY, num, seed=5)
    labels = generate_rows(TINY, num, seed=5).labels[:, 0]
    oracle_auc = auc(parts["history_term"] + parts["other_term"], labels)
    history_free_auc = auc(parts["other_term"], labels)
    assert parts["history_term"].var() > parts["other_term"].var()
    assert oracle_auc > history_free_auc + 0.1, (oracle_auc, history_free_auc)
    # The affinity is a function of the actual history: shuffling it across samples destroys the gain.
    shuffled = np.random.default_rng(0).permutation(parts["history_term"])
    assert auc(shuffled + parts["other_term"], labels) < oracle_auc - 0.1


def test_user_is_consistent_across_samples():
    rows = generate_rows(dataclasses.replace(TINY, num_users=50), 2_000, seed=0)
    users = rows.categorical["user_id"]
    for column in ("user_age", "user_gender", "user_country"):
        values = rows.categorical[column]
        for user in np.unique(users):
            assert len(np.unique(values[users == user])) == 1


def test_feature_specs_and_layout_round_trip_through_schema():
    specs = TINY.feature_specs()
    kinds = [s.kind for s in specs]
    assert kinds == sorted(kinds, key=lambda k: k == "sequence")  # sparse first, then sequence
    table = generate(TINY, 10, seed=0)
    assert DataLayout.from_schema(table.schema, "t") == TINY.layout(0)
    assert TINY.num_dense == table.schema.field("dense").type.list_size


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="num_items"):
        SyntheticConfig("bad", 10, 33, 32, 64, 4, 1, 8)
    with pytest.raises(ValueError, match="min_history"):
        SyntheticConfig("bad", 10, 32, 32, 64, 4, 9, 8)
    with pytest.raises(ValueError, match="seed must be an int >= 0, got -1"):  # was numpy's "expected non-negative"
        generate(TINY, 10, seed=-1)


@pytest.mark.parametrize(("change", "message"), [
    ({"num_categories": 0}, "num_categories must be >= 1, got 0"),  # was a ZeroDivisionError
    ({"num_users": 0}, "num_users must be >= 1, got 0"),
    ({"interest_share": 1.5}, r"interest_share must be in \[0, 1\], got 1.5"),
    ({"history_span_days": -1.0}, "history_span_days must be a positive number of days, got -1.0"),
    ({"recency_days": 0.0}, "recency_days must be a positive number of days, got 0.0"),
    ({"history_weight": float("nan")}, "history_weight must be finite, got nan"),  # NaN oracle probabilities
])
def test_bad_world_knobs_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(SYNTHETIC_PRESETS["gem-tiny"], **change)
