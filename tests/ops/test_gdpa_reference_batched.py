"""The GDPA reference's batched path for unmasked attention (cross, broadcast-Q) against a per-sample loop."""

import pytest
import torch

from opengem.ops.activations import activation_value
from opengem.ops.reference import gdpa as reference

ACTIVATIONS = ["silu", "gelu", "relu2", "hardswish"]


def _per_sample(q, k, v, q_offsets, k_offsets, pre_scale, out_scale, broadcast_q):
    """``out_scale * sum_j phi_h(pre_scale q . k_j) v_j`` sample by sample, with autograd."""
    group = q.shape[1] // k.shape[1]
    outputs = []
    for b in range(k_offsets.numel() - 1):
        kb = k[k_offsets[b] : k_offsets[b + 1]].repeat_interleave(group, 1).transpose(0, 1)
        vb = v[k_offsets[b] : k_offsets[b + 1]].repeat_interleave(group, 1).transpose(0, 1)
        qb = (q if broadcast_q else q[q_offsets[b] : q_offsets[b + 1]]).transpose(0, 1)
        scores = pre_scale * qb @ kb.transpose(1, 2)
        weights = torch.stack([activation_value(a, scores[h]) for h, a in enumerate(ACTIVATIONS)])
        outputs.append(out_scale * (weights @ vb).transpose(0, 1))
    return torch.cat(outputs)


def _offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


@pytest.mark.parametrize("broadcast_q", [False, True])
@pytest.mark.parametrize("chunk_budget", [1 << 22, 64])  # one chunk, or one sample per chunk
def test_batched_unmasked_path_matches_per_sample(monkeypatch, broadcast_q, chunk_budget):
    monkeypatch.setattr(reference, "_SCORES_PER_CHUNK", chunk_budget)
    torch.manual_seed(0)
    q_lengths, k_lengths = [5, 0, 9, 1, 3], [4, 4, 0, 1, 7]
    q = torch.randn(3 if broadcast_q else sum(q_lengths), 4, 8)
    k, v = torch.randn(sum(k_lengths), 2, 8), torch.randn(sum(k_lengths), 2, 8)
    q_offsets = None if broadcast_q else _offsets(q_lengths)
    k_offsets = _offsets(k_lengths)
    kwargs = dict(head_activations=ACTIVATIONS, pre_scale=0.7, out_scale=0.4, broadcast_q=broadcast_q)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want = _per_sample(*leaves, q_offsets, k_offsets, 0.7, 0.4, broadcast_q)
    got = reference.gdpa(q, k, v, q_offsets, k_offsets, **kwargs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    grad_out = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, leaves, grad_out)
    got_grads = reference.gdpa_backward(grad_out, q, k, v, q_offsets, k_offsets, **kwargs)
    for name, g, w in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=name)
