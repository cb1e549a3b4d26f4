"""Offsets and targets given as strided views (``wide[::2]``), which the attention ops' checks accept, reach the
Triton kernels (interpreter, fp32) as the kernels read them: through bare pointers, so each op copies them to unit
stride. Before that copy the kernels read the views' fill values between the elements as offsets. The embedding op
refuses strided ids and offsets by name instead."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from opengem.ops import embedding_lookup, gdpa, jagged_attention  # noqa: E402
from opengem.ops.checks import unit_stride  # noqa: E402
from tests.ops.test_embedding import MIXED, make_problem  # noqa: E402

LENGTHS = [5, 0, 9, 3]


def strided(t: torch.Tensor, fill: int = 7) -> torch.Tensor:
    """``t``'s values in a view with stride 2 (the elements between them hold ``fill``)."""
    wide = torch.full((2 * t.numel(),), fill, dtype=t.dtype)
    wide[::2] = t
    view = wide[::2]
    assert not view.is_contiguous() and torch.equal(view, t)
    return view


def attention_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(LENGTHS), 2, 16, generator=gen) for _ in range(3))
    return q, k, v, torch.tensor([0, *LENGTHS]).cumsum(0).to(torch.int32)


def test_unit_stride_copies_only_strided_tensors() -> None:
    offsets = torch.arange(5)
    assert unit_stride(offsets) is offsets and unit_stride(None) is None
    copied = unit_stride(strided(offsets))
    assert copied.is_contiguous() and torch.equal(copied, offsets)


@pytest.mark.parametrize("op", ["gdpa", "jagged_attention"])
def test_attention_kernels_take_strided_offsets_and_targets(op: str) -> None:
    q, k, v, offsets = attention_inputs()
    targets = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    longest = max(LENGTHS)

    def run(offsets: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if op == "gdpa":
            return gdpa(q, k, v, offsets, offsets, longest, longest, causal=True, num_targets=targets,
                        backend="triton")  # fmt: skip
        return jagged_attention(q, k, v, offsets, longest, num_targets=targets, backend="triton")

    expected = run(offsets, targets)
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(run(strided(offsets), strided(targets, fill=-1)), expected, rtol=0, atol=0)


def test_gdpa_cross_attention_takes_strided_offsets() -> None:
    q, k, v, offsets = attention_inputs()
    k_offsets = torch.tensor([0, 4, 4, 10, 17], dtype=torch.int32)  # other K/V lengths over the same rows
    run = lambda q_off, k_off: gdpa(q, k, v, q_off, k_off, max(LENGTHS), 7, backend="triton")  # noqa: E731
    torch.testing.assert_close(run(strided(offsets), strided(k_offsets)), run(offsets, k_offsets), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["ids", "offsets"])
def test_the_embedding_op_refuses_strided_ids_and_offsets_by_name(name: str) -> None:
    """The embedding op refuses them instead (its checks read the buffers as they are), naming which."""
    p = make_problem(**MIXED, batch_size=3, max_len=4, seed=5)
    given = {"ids": p.ids, "offsets": p.offsets, name: strided(getattr(p, name), fill=0)}
    with pytest.raises(ValueError, match=f"{name} must be contiguous"):
        embedding_lookup(p.weights, p.layout, given["ids"], given["offsets"])
