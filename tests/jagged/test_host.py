"""Host mirrors: the layout of device tensors known on the host without a device sync.

The CPU has no second device, so "device" tensors here live on the meta device: reading one back to the
host raises, which makes any unintended sync visible.
"""

import gc

import pytest
import torch

from opengem.jagged import Jagged, KeyedJagged, host_copy, offsets_from_lengths, register_host_copy, uniform_offsets
from opengem.jagged.host import _MIRRORS


def test_cpu_tensors_are_their_own_mirror():
    t = torch.tensor([0, 2, 5])
    assert host_copy(t) is t


def test_registered_mirror_is_returned_without_reading_the_device():
    device = torch.empty(3, dtype=torch.int64, device="meta")
    host = torch.tensor([0, 2, 5])
    register_host_copy(device, host)
    assert host_copy(device) is host


def test_known_host_copy_never_reads_the_device():
    from opengem.jagged.host import known_host_copy

    cpu = torch.tensor([0, 2, 5])
    assert known_host_copy(cpu) is cpu
    device = torch.empty(3, dtype=torch.int64, device="meta")
    assert known_host_copy(device) is None  # no mirror: None, where host_copy would read (here: raise)
    host = torch.tensor([0, 2, 5])
    register_host_copy(device, host)
    assert known_host_copy(device) is host
    device.add_(1)
    assert known_host_copy(device) is None  # stale after an in-place change


def test_in_place_change_invalidates_the_mirror():
    device = torch.empty(3, dtype=torch.int64, device="meta")
    register_host_copy(device, torch.tensor([0, 2, 5]))
    device.add_(1)  # the mirror is stale now: host_copy must read the tensor (impossible on meta)
    with pytest.raises(NotImplementedError):
        host_copy(device)


def test_mirror_dies_with_its_tensor():
    device = torch.empty(3, dtype=torch.int64, device="meta")
    register_host_copy(device, torch.tensor([0, 2, 5]))
    key = id(device)
    del device
    gc.collect()
    assert key not in _MIRRORS


def test_jagged_and_derived_offsets_carry_mirrors():
    host = torch.tensor([0, 2, 5])
    jagged = Jagged(torch.empty(5, 4, device="meta"), torch.empty(3, dtype=torch.int64, device="meta"), host, 3)
    assert torch.equal(host_copy(jagged.offsets), host)
    offsets = uniform_offsets(3, 4, torch.device("meta"))
    assert host_copy(offsets).tolist() == [0, 4, 8, 12]


def test_offsets_from_mirrored_lengths_have_a_mirror():
    lengths = torch.empty(3, dtype=torch.int64, device="meta")
    register_host_copy(lengths, torch.tensor([2, 0, 3]))
    assert host_copy(offsets_from_lengths(lengths)).tolist() == [0, 2, 2, 5]
    register_host_copy(lengths, torch.tensor([2, -1, 3]))
    with pytest.raises(ValueError, match="non-negative"):
        offsets_from_lengths(lengths)


def test_keyed_jagged_split_and_concat_keep_mirrors():
    host_lengths = torch.tensor([1, 2, 0, 3])  # two features, batch 2
    features = KeyedJagged._trusted(("a", "b"), torch.empty(6, dtype=torch.int64, device="meta"),
                                    torch.empty(4, dtype=torch.int64, device="meta"), None)
    register_host_copy(features.lengths, host_lengths)
    assert features.lengths_per_key() == [3, 3]
    first, second = features.split([1, 1])
    assert host_copy(second.lengths).tolist() == [0, 3]
    joined = KeyedJagged.concat([second, first])
    assert host_copy(joined.lengths).tolist() == [0, 3, 1, 2]
    assert host_copy(joined["a"].offsets).tolist() == [0, 1, 3]


def test_jagged_is_a_pytree_node():
    """FSDP2 finds a block's output tensors (for its backward hooks) by flattening the output."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    jagged = Jagged.from_lengths(torch.randn(5, 2, requires_grad=True), torch.tensor([2, 3]))
    leaves, spec = tree_flatten((jagged, 1))
    assert leaves[0] is jagged.values and leaves[1] is jagged.offsets
    rebuilt = tree_unflatten([leaves[0] * 2, *leaves[1:]], spec)[0]
    assert torch.equal(rebuilt.values, jagged.values * 2) and rebuilt.max_len == 3
    # a map to non-tensors rebuilds the node too (torch 2.11's checkpoint maps every leaf to None)
    from torch.utils._pytree import tree_map

    assert tree_map(lambda leaf: None, jagged).values is None


def test_to_device_registers_the_mirror():
    from opengem.jagged import to_device

    host = torch.tensor([0, 3, 7])
    moved = to_device(host, torch.device("meta"))  # pinning is only for CUDA targets
    assert moved.device.type == "meta" and host_copy(moved) is host
    assert to_device(host, torch.device("cpu")) is host


def test_offsets_summary_is_computed_once_per_mirrored_tensor_and_version():
    from opengem.jagged.host import offsets_summary

    device = torch.empty(4, dtype=torch.int64, device="meta")
    register_host_copy(device, torch.tensor([0, 2, 5, 4]))
    summary = offsets_summary(device)
    assert summary.lengths.tolist() == [2, 3, -1] and (summary.first, summary.last) == (0, 4)
    assert summary.first_decrease == 2 and summary.longest == 3
    assert offsets_summary(device) is summary  # cached with the mirror
    with pytest.raises(ValueError):
        summary.lengths[0] = 7  # shared by every reader: read-only
    register_host_copy(device, torch.tensor([0, 1, 1, 9]))  # a new mirror: a new summary
    assert offsets_summary(device).longest == 8
    cpu = torch.tensor([0, 3, 3])
    assert offsets_summary(cpu).longest == 3
    cpu[2] = 10  # changed in place: CPU tensors are summarized on every call
    assert offsets_summary(cpu).longest == 7 and offsets_summary(torch.tensor([0])).longest == 0


def test_mirrors_must_be_cpu_tensors_of_the_device_tensors_shape():
    from opengem.jagged import to_device

    device = torch.empty(3, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match=r"host_tensor must be a tensor of device_tensor's shape \(3,\), got \(2,\)"):
        register_host_copy(device, torch.tensor([0, 2]))  # had been read as a two-entry layout
    with pytest.raises(ValueError, match="host_tensor must be a CPU tensor, got list"):
        to_device([0, 2, 5], torch.device("meta"))


def test_from_lengths_moves_host_lengths_with_a_mirror():
    """Host lengths for device values: the offsets are read from the mirror (on meta, a read would raise)."""
    jagged = Jagged.from_lengths(torch.empty(5, device="meta"), torch.tensor([2, 3]))
    assert jagged.offsets.device.type == "meta" and jagged.offsets_host.tolist() == [0, 2, 5]
