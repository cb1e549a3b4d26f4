"""The batched reference equals a direct per-sample evaluation of the mask specification."""

import math

import pytest
import torch

from opengem.ops.reference import attention as reference
from opengem.ops.reference.masks import attention_mask, batched_attention_mask


def _per_sample(q, k, v, lengths, causal, num_targets, contextual_len, window):
    outputs, start = [], 0
    group = q.shape[1] // k.shape[1]
    for b, n in enumerate(lengths):
        qb, kb, vb = (x[start : start + n].double().transpose(0, 1) for x in (q, k, v))
        kb, vb = kb.repeat_interleave(group, 0), vb.repeat_interleave(group, 0)
        mask = attention_mask(n, causal=causal, num_targets=int(num_targets[b]), contextual_len=contextual_len,
                              window=window)
        logits = (qb @ kb.transpose(1, 2)) / math.sqrt(q.shape[-1])
        outputs.append((torch.softmax(logits.masked_fill(~mask, -math.inf), -1) @ vb).transpose(0, 1))
        start += n
    return torch.cat(outputs)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("contextual_len, window", [(0, None), (2, None), (0, 3), (1, 2)])
def test_batched_reference_matches_per_sample(causal, contextual_len, window, monkeypatch):
    monkeypatch.setattr(reference, "SCORES_PER_GROUP", 200)  # force several groups
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 0, 1, 9, 3, 7]
    num_targets = torch.tensor([2, 0, 1, 0, 3, 1])
    total = sum(lengths)
    q = torch.randn(total, 4, 8, generator=generator)
    k = torch.randn(total, 2, 8, generator=generator)
    v = torch.randn(total, 2, 8, generator=generator)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    out = reference.jagged_attention(q, k, v, offsets, max(lengths), causal=causal, num_targets=num_targets,
                                     contextual_len=contextual_len, window=window)
    expected = _per_sample(q, k, v, lengths, causal, num_targets, contextual_len, window)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_batched_mask_pads_with_false():
    masks = batched_attention_mask(torch.tensor([3, 1]), 4, causal=True, num_targets=torch.tensor([1, 0]))
    assert torch.equal(masks[0, :3, :3], attention_mask(3, causal=True, num_targets=1))
    assert not masks[0, 3].any() and not masks[0, :, 3].any()
    assert masks[1].sum() == 1


@pytest.mark.parametrize("causal, contextual_len, window", [(True, 0, None), (False, 1, 2), (True, 2, 3)])
def test_written_out_backward_matches_autograd(causal, contextual_len, window, monkeypatch):
    monkeypatch.setattr(reference, "SCORES_PER_GROUP", 300)
    generator = torch.Generator().manual_seed(1)
    lengths = [6, 0, 1, 9, 4]
    num_targets = torch.tensor([2, 0, 1, 1, 0])
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, 8, generator=generator, dtype=torch.float64, requires_grad=True)
               for h in (4, 2, 2))
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    options = dict(causal=causal, num_targets=num_targets, contextual_len=contextual_len, window=window)
    out = reference.jagged_attention(q, k, v, offsets, max(lengths), scale=0.3, **options)
    grad_out = torch.randn_like(out)
    expected = torch.autograd.grad(out, (q, k, v), grad_out)
    written = reference.jagged_attention_backward(grad_out, q.detach(), k.detach(), v.detach(), offsets, scale=0.3,
                                                  **options)
    for got, want in zip(written, expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
