import math

import pytest
import torch

from opengem.train.metrics import calibration, hit_rate_and_ndcg, normalized_entropy, roc_auc


def _brute_force_auc(scores, labels):
    pos = [s for s, y in zip(scores, labels) if y == 1]
    neg = [s for s, y in zip(scores, labels) if y == 0]
    total = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return total / (len(pos) * len(neg))


def test_auc_matches_pairwise_definition_with_ties():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (200,), generator=generator).float()  # many ties
    labels = (torch.rand(200, generator=generator) < 0.3).float()
    assert roc_auc(scores, labels) == pytest.approx(_brute_force_auc(scores.tolist(), labels.tolist()))


def test_ne_of_base_rate_is_one_and_of_oracle_below_one():
    generator = torch.Generator().manual_seed(1)
    p = torch.rand(20000, generator=generator) * 0.2
    labels = (torch.rand(20000, generator=generator) < p).float()
    assert normalized_entropy(torch.full_like(p, float(labels.mean())), labels) == pytest.approx(1.0)
    assert normalized_entropy(p, labels) < 0.97


def test_calibration_and_errors():
    labels = torch.tensor([1.0, 0.0, 0.0, 1.0])
    assert calibration(torch.tensor([0.5, 0.5, 0.25, 0.75]), labels) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="every label is 0"):
        normalized_entropy(torch.tensor([0.1, 0.2]), torch.zeros(2))
    with pytest.raises(ValueError, match="equal-length"):
        roc_auc(torch.zeros(3), torch.zeros(2))
    with pytest.raises(ValueError, match="at least one sample"):
        calibration(torch.zeros(0), torch.zeros(0))


def test_hit_rate_and_ndcg():
    scores = torch.tensor([[0.1, 0.9, 0.5], [0.8, 0.1, 0.3]])
    target = torch.tensor([2, 0])  # ranks 1 and 0
    hr, ndcg = hit_rate_and_ndcg(scores, target, k=1)
    assert hr == pytest.approx(0.5) and ndcg == pytest.approx(0.5)
    hr, ndcg = hit_rate_and_ndcg(scores, target, k=2)
    assert hr == pytest.approx(1.0) and ndcg == pytest.approx((1 / math.log2(3) + 1) / 2)
