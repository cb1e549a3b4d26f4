"""HSTU / SASRec sequential recommenders: the HSTU layer against its formula, causality, jagged batching,
gradients and the sampled softmax loss (CPU reference attention)."""

import math

import pytest
import torch
import torch.nn.functional as F

from opengem.models.hstu import HSTULayer, SequentialModelConfig, SequentialRecommender

NUM_ITEMS = 30


def model(architecture: str, **overrides) -> SequentialRecommender:
    torch.manual_seed(0)
    settings = {"num_items": NUM_ITEMS, "dim": 16, "num_heads": 2, "max_len": 12, "dropout": 0.0, **overrides}
    config = SequentialModelConfig(architecture=architecture, **settings)
    return SequentialRecommender(config).eval()


def batch(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
    items = torch.randint(1, NUM_ITEMS + 1, (sum(lengths),))
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return items, offsets, max(lengths)


def test_hstu_layer_matches_the_formula() -> None:
    """Y = X + W2(LN(SiLU(alpha Q K^T) / N * causal V) * U), with U, V, Q, K = split(SiLU(W1 LN(X)))."""
    torch.manual_seed(1)
    layer, heads, length, n = HSTULayer(8, 2, dropout=0.0), 2, 5, 7
    x = torch.randn(length, 8)
    u, v, q, k = F.silu(layer.uvqk(layer.input_norm(x))).chunk(4, dim=-1)
    q, k, v = (t.view(length, heads, 4).transpose(0, 1) for t in (q, k, v))
    weights = F.silu(q @ k.transpose(1, 2) / math.sqrt(4)) / n * torch.ones(length, length).tril()
    a = (weights @ v).transpose(0, 1).reshape(length, 8)
    expected = x + layer.output(layer.attention_norm(a) * u)
    got = layer(x, torch.tensor([0, length]), n)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("architecture", ["hstu", "sasrec"])
def test_shapes_causality_and_batch_independence(architecture: str) -> None:
    m = model(architecture)
    items, offsets, max_len = batch([4, 0, 1, 7])
    states = m(items, offsets, max_len)
    assert states.shape == (12, 16)
    torch.testing.assert_close(states.norm(dim=-1), torch.ones(12))
    # each sample alone (max_len is the same: HSTU divides by it) gives the same states
    alone = m(items[5:], torch.tensor([0, 7]), max_len)
    torch.testing.assert_close(states[5:], alone, rtol=1e-5, atol=1e-5)
    # changing the last item of the last sample leaves its earlier states unchanged (causal)
    changed = items.clone()
    changed[-1] = changed[-1] % NUM_ITEMS + 1
    after = m(changed, offsets, max_len)
    torch.testing.assert_close(after[:-1], states[:-1])
    assert not torch.allclose(after[-1], states[-1])
    scores = m.scores(states)
    assert scores.shape == (12, NUM_ITEMS + 1)


@pytest.mark.parametrize("architecture", ["hstu", "sasrec"])
def test_every_parameter_gets_a_gradient(architecture: str) -> None:
    m = model(architecture).train()
    items, offsets, max_len = batch([5, 3])
    targets = torch.randint(1, NUM_ITEMS + 1, items.shape)
    loss = m.sampled_softmax_loss(m(items, offsets, max_len), targets, m.sample_negatives(targets, 4, 6))
    loss.backward()
    assert torch.isfinite(loss)
    for name, parameter in m.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
    assert m.item_embedding.weight.grad[0].abs().sum() == 0  # padding row stays untouched


def test_sampled_softmax_loss() -> None:
    m = model("hstu")
    targets = torch.tensor([3, 7])
    states = m.item_vectors(targets)  # a state equal to its target's vector: the best possible score
    negatives = torch.tensor([1, 2, 3, 9])
    loss = m.sampled_softmax_loss(states, targets, negatives)
    # by hand: row 0 must not count negative 3 (its own positive)
    rows = []
    for r in range(2):
        candidates = torch.cat([targets[r : r + 1], negatives[negatives != targets[r]]])
        rows.append(F.cross_entropy((states[r] @ m.item_vectors(candidates).T / 0.05)[None], torch.tensor([0])))
    torch.testing.assert_close(loss, torch.stack(rows).mean())
    # only accidental hits as negatives: nothing to push against
    assert m.sampled_softmax_loss(states[:1], targets[:1], torch.tensor([3, 3])) == 0
    # a random state does worse than the perfect one
    assert m.sampled_softmax_loss(F.normalize(torch.randn(2, 16), dim=-1), targets, negatives) > loss


def test_negatives_come_from_the_batch_and_the_catalogue() -> None:
    m = model("sasrec")
    torch.manual_seed(3)
    negatives = m.sample_negatives(torch.tensor([5, 5, 6]), in_batch=50, uniform=200)
    assert set(negatives[:50].tolist()) <= {5, 6}
    assert negatives[50:].min() >= 1 and negatives[50:].max() <= NUM_ITEMS
    assert len(set(negatives[50:].tolist())) > 20


def test_bad_configs_and_inputs() -> None:
    with pytest.raises(ValueError, match="architecture must be one of"):
        model("gru")
    with pytest.raises(ValueError, match="divisible by num_heads"):
        model("hstu", num_heads=3)
    m = model("hstu")
    items, offsets, _ = batch([13])
    with pytest.raises(ValueError, match="max_len 13 exceeds the model's max_len 12"):
        m(items, offsets, 13)
    items, offsets, longest = batch([5, 3])
    for bad_id, position in ((NUM_ITEMS + 1, 4), (0, 0), (-2, 6)):  # was a bare IndexError of nn.Embedding
        bad = items.clone()
        bad[position] = bad_id
        with pytest.raises(ValueError, match=rf"items must be ids in \[1, {NUM_ITEMS}\], got {bad_id} at position "
                                             rf"{position}"):
            m(bad, offsets, longest)
    with pytest.raises(ValueError, match=r"offsets must be non-decreasing: offsets\[2\] = 4 < offsets\[1\] = 5"):
        m(items, torch.tensor([0, 5, 4, 8]), longest)
    with pytest.raises(ValueError, match=r"offsets\[-1\] = 7 must equal the number of values, 8"):
        m(items, torch.tensor([0, 5, 7]), longest)
    with pytest.raises(ValueError, match="items must be 1-D int32/int64 ids, got torch.float32"):
        m(items.float(), offsets, longest)


@pytest.mark.parametrize(("change", "message"), [
    ({"dropout": 1.0}, r"dropout must be in \[0, 1\), got 1.0"),
    ({"dropout": -0.1}, r"dropout must be in \[0, 1\), got -0.1"),
    ({"num_heads": 0}, "num_heads must be >= 1, got 0"),
    ({"num_heads": 3}, "num_heads=3 must divide dim=64"),
])
def test_bad_settings_are_refused_by_the_config(change, message) -> None:
    with pytest.raises(ValueError, match=message):
        SequentialModelConfig(**change)
