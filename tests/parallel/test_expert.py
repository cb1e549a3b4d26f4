import pytest
import scenarios
import torch
from torch import nn

from opengem.parallel.expert import ExpertParallel, all_gather_along_batch, reduce_scatter_along_batch


@pytest.fixture(scope="module")
def expert_reference():
    experts, x, weights = scenarios.expert_inputs()
    x = x.clone().requires_grad_(True)
    out = sum(expert(x) for expert in experts)
    (out * weights).sum().backward()
    return experts, x, out.detach()


def test_expert_parallel_matches_sum_of_experts(world2, expert_reference):
    experts, x, out = expert_reference
    rows = scenarios.EXPERT_ROWS
    starts = [0, rows[0]]
    for rank, result in enumerate(world2):
        got = result["expert"]
        local = slice(starts[rank], starts[rank] + rows[rank])
        torch.testing.assert_close(got["out"], out[local])
        torch.testing.assert_close(got["x_grad"], x.grad[local])
        assert got["expert_index"] == rank
        # Gradient convention: the group mean (here 2 ranks) of the full-batch gradient.
        reference_grads = dict(experts[rank].named_parameters())
        for name, grad in got["expert_grads"].items():
            torch.testing.assert_close(grad * len(rows), reference_grads[name].grad)


def test_expert_parallel_bytes_match_padded_count(world2):
    # Per call: sizes all-gather (2 ranks x 2 int64), forward all-gather of max(rows) x 2 ranks rows, forward
    # reduce-scatter of the same, and mirrored in backward; fp32, DIM features.
    padded_rows = max(scenarios.EXPERT_ROWS) * 2
    one_buffer = padded_rows * scenarios.DIM * 4
    for result in world2:
        assert result["expert"]["bytes"] == {
            ("expert", "all_gather_sizes"): 2 * 2 * 8,  # each rank's size and layout checksum
            ("expert", "all_gather"): 2 * one_buffer,
            ("expert", "reduce_scatter"): 2 * one_buffer,
        }


def test_expert_parallel_inside_fsdp_counts_bytes(world4):
    # EP 2 x FSDP 2 on 4 ranks, GLOBAL_BATCH / 4 rows per rank, one expert layer, one step.
    rows = scenarios.GLOBAL_BATCH // 4
    one_buffer = rows * 2 * scenarios.DIM * 4
    for result in world4:
        assert result["ep2_fsdp2"]["expert_bytes"] == {
            ("expert", "all_gather_sizes"): 2 * 2 * 8,  # each rank's size and layout checksum
            ("expert", "all_gather"): 2 * one_buffer,
            ("expert", "reduce_scatter"): 2 * one_buffer,
        }


def test_single_rank_expert_parallel_is_the_expert(single_process_group):
    expert = nn.Linear(4, 3)
    layer = ExpertParallel(nn.ModuleList([expert]), single_process_group)
    x = torch.randn(5, 4)
    torch.testing.assert_close(layer(x), expert(x))
    empty = torch.randn(0, 4)
    assert layer(empty).shape == (0, 3)


def test_gather_and_scatter_are_adjoint_on_one_rank(single_process_group):
    x = torch.randn(3, 2, requires_grad=True)
    gathered = all_gather_along_batch(x, single_process_group)
    scattered = reduce_scatter_along_batch(gathered * 2, [3], single_process_group)
    scattered.sum().backward()
    torch.testing.assert_close(scattered, x.detach() * 2)
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))


def test_bad_inputs_raise(single_process_group):
    with pytest.raises(ValueError, match="2 experts for an expert group of 1 ranks"):
        ExpertParallel(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]), single_process_group)
    with pytest.raises(ValueError, match="sizes has 2 entries, the group has 1 ranks"):
        all_gather_along_batch(torch.randn(3, 2), single_process_group, sizes=[3, 3])
    with pytest.raises(ValueError, match=r"x has 3 rows, expected 4 from sizes=\[4\]"):
        all_gather_along_batch(torch.randn(3, 2), single_process_group, sizes=[4])
    with pytest.raises(ValueError, match=r"y has 3 rows, expected 5 from sizes=\[5\]"):
        reduce_scatter_along_batch(torch.randn(3, 2), [5], single_process_group)
