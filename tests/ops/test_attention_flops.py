"""The attention ops' FLOP formulas on tensors without data: the compiler's activation memory budget runs them on
fake tensors to rank what to recompute (a gem-tiny compile with a budget of 0.5 failed on reading fake offsets)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

import opengem.ops  # noqa: F401  (registers the ops and their formulas)
from opengem.ops.attention_flops import visible_pairs
from opengem.ops.block_attention import block_pairs

HEADS, HEAD_DIM = 2, 16
LENGTHS = [5, 0, 9, 3]


def _inputs(tokens: int) -> tuple[torch.Tensor, ...]:
    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    return tuple(torch.randn(tokens, HEADS, HEAD_DIM) for _ in range(3)) + (offsets,)


def _flops(call, fake: bool) -> int:
    """The FLOPs counted for ``call(*_inputs)`` on real tensors or on their fake copies."""
    inputs = _inputs(sum(LENGTHS))
    with FlopCounterMode(display=False) as counter:
        if fake:
            with FakeTensorMode(allow_non_fake_inputs=False) as mode:
                call(*(mode.from_tensor(t) for t in inputs))
        else:
            call(*inputs)
    return counter.get_total_flops()


def test_fake_offsets_give_the_bound_of_every_query_seeing_max_len_keys_and_real_ones_the_count():
    tokens, max_len, per_pair = sum(LENGTHS), max(LENGTHS), 4 * HEADS * HEAD_DIM
    lengths = torch.tensor(LENGTHS)
    ops = torch.ops.opengem

    def jfa(q, k, v, offsets):
        ops.jagged_attention_fwd(q, k, v, offsets, None, max_len, False, 0, -1, 0.25, False)

    def gdpa(q, k, v, offsets, broadcast_q=False):
        q = q[:3] if broadcast_q else q
        ops.gdpa_fwd(q, k, v, offsets, offsets, None, max_len, max_len, [0], 1.0, 1.0, False, 0, -1, broadcast_q,
                     False)

    def block(q, k, v, offsets):
        ops.block_attention_fwd(q, k, v, offsets, 4, 0.25, "silu", 0, None, 10000.0, 1.0, "reference")

    assert _flops(jfa, fake=True) == per_pair * tokens * max_len
    assert _flops(jfa, fake=False) == per_pair * visible_pairs(lengths, lengths, masked=True)
    assert _flops(gdpa, fake=True) == per_pair * tokens * max_len
    assert _flops(gdpa, fake=False) == per_pair * int((lengths * lengths).sum())
    broadcast = lambda *inputs: gdpa(*inputs, broadcast_q=True)  # noqa: E731
    assert _flops(broadcast, fake=True) == per_pair * 3 * len(LENGTHS) * max_len  # 3 seeds for each sample
    assert _flops(broadcast, fake=False) == per_pair * 3 * tokens
    assert _flops(block, fake=True) == per_pair * tokens * 4
    offsets = torch.tensor([0, *lengths.cumsum(0).tolist()])
    assert _flops(block, fake=False) == per_pair * block_pairs(offsets, 4)
