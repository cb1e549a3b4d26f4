"""`Jagged`: a batch of variable-length sequences stored without padding.

Sample ``b`` owns rows ``values[offsets[b]:offsets[b + 1]]``. ``max_len`` is a host integer so that
kernels can size their grid without a device synchronization, and a host copy of the offsets is kept
because tile schedules are built on the host (GEM_SPEC section 3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree

from opengem.jagged.host import host_copy, offsets_summary, register_host_copy, to_device
from opengem.validation import is_int

OFFSET_DTYPES = (torch.int32, torch.int64)
_INT32_MAX = 2**31 - 1


def _check_tensor(value: object, name: str) -> None:
    if not isinstance(value, torch.Tensor):  # an AttributeError deep inside had named no argument
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def _check_values(values: object) -> None:
    if not isinstance(values, torch.Tensor) or values.dim() < 1:
        raise ValueError("values must be a tensor with at least one dimension [T, ...]")


def validate_offsets(offsets: torch.Tensor, num_values: int, name: str = "offsets") -> None:
    """Raise ``ValueError`` unless ``offsets`` is a valid ``[B + 1]`` offsets vector for ``num_values`` rows."""
    _check_tensor(offsets, name)
    if not is_int(num_values):  # True had matched offsets [0, 1]
        raise ValueError(f"num_values must be an int, got {num_values!r}")
    if offsets.dtype not in OFFSET_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {offsets.dtype}")
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"{name} must have shape [B + 1] with B >= 0, got {tuple(offsets.shape)}")
    summary = offsets_summary(offsets)
    if summary.first != 0:
        raise ValueError(f"{name}[0] must be 0, got {summary.first}")
    if summary.first_decrease >= 0:
        bad, host = summary.first_decrease, host_copy(offsets)
        raise ValueError(
            f"{name} must be non-decreasing: {name}[{bad + 1}] = {int(host[bad + 1])} "
            f"< {name}[{bad}] = {int(host[bad])}"
        )
    if summary.last != num_values:
        raise ValueError(f"{name}[-1] = {summary.last} must equal the number of values, {num_values}")


def offsets_from_lengths(lengths: torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``[B]`` lengths -> ``[B + 1]`` offsets starting at 0 (with a host mirror when the lengths have one)."""
    _check_tensor(lengths, "lengths")
    if dtype not in OFFSET_DTYPES:  # a float dtype had made float offsets
        raise ValueError(f"dtype must be torch.int32 or torch.int64, got {dtype}")
    if lengths.dtype not in OFFSET_DTYPES or lengths.dim() != 1:  # float lengths were truncated by the cumsum
        raise ValueError(f"lengths must be 1-D int32 or int64, got {lengths.dtype} {tuple(lengths.shape)}")
    host_lengths = host_copy(lengths)
    if bool((host_lengths < 0).any()):
        raise ValueError(f"lengths must be non-negative, got minimum {int(host_lengths.min())}")
    if dtype == torch.int32 and host_lengths.numel() and int(host_lengths.sum()) > _INT32_MAX:  # had wrapped negative
        raise ValueError(
            f"lengths sum to {int(host_lengths.sum())}, more than int32 offsets hold; use dtype=torch.int64"
        )
    offsets = torch.zeros(lengths.numel() + 1, dtype=dtype, device=lengths.device)
    torch.cumsum(lengths, dim=0, out=offsets[1:])
    if lengths.device.type != "cpu":
        register_host_copy(offsets, offsets_from_lengths(host_lengths, dtype))
    return offsets


def uniform_offsets(batch: int, length: int, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``[B + 1]`` offsets of B sequences of ``length`` rows each, made on ``device`` with a host mirror."""
    if not torch.compiler.is_compiling():  # Dynamo may trace batch as a symbol; eager callers are checked
        if not is_int(batch) or not is_int(length):  # True had made one sequence, 1.5 float offsets
            raise ValueError(f"batch and length must be ints, got {batch!r} and {length!r}")
        if dtype not in OFFSET_DTYPES:
            raise ValueError(f"dtype must be torch.int32 or torch.int64, got {dtype}")
        if dtype == torch.int32 and batch * length > _INT32_MAX:  # had wrapped negative
            raise ValueError(f"batch * length = {batch * length} overflows int32 offsets; use dtype=torch.int64")
    if batch < 0 or length < 0:
        raise ValueError(f"batch and length must be >= 0, got {batch} and {length}")
    offsets = torch.arange(batch + 1, device=device, dtype=dtype) * length
    register_host_copy(offsets, torch.arange(batch + 1, dtype=dtype) * length)
    return offsets


@dataclass(frozen=True)
class Jagged:
    """Jagged batch: ``values [T, ...]``, ``offsets [B + 1]`` and the host integer ``max_len``.

    ``offsets_host`` is a CPU copy of ``offsets`` (equal to it when ``offsets`` already is on the CPU).
    Build with :meth:`from_lengths`, :meth:`from_offsets` or :meth:`from_padded`, which validate.
    """

    values: torch.Tensor
    offsets: torch.Tensor
    offsets_host: torch.Tensor
    max_len: int

    def __post_init__(self) -> None:
        # pytree maps may rebuild a Jagged around non-tensor leaves (torch 2.11's checkpoint maps every
        # leaf to None to find devices): only a real layout is registered
        if isinstance(self.offsets, torch.Tensor) and isinstance(self.offsets_host, torch.Tensor):
            register_host_copy(self.offsets, self.offsets_host)  # ops read the layout without a device sync

    @classmethod
    def from_offsets(cls, values: torch.Tensor, offsets: torch.Tensor) -> Jagged:
        _check_values(values)
        validate_offsets(offsets, values.shape[0])
        if offsets.device != values.device:
            raise ValueError(f"values are on {values.device} but offsets are on {offsets.device}")
        host = host_copy(offsets)
        max_len = int((host[1:] - host[:-1]).max()) if host.numel() > 1 else 0
        return cls(values, offsets, host, max_len)

    @classmethod
    def from_lengths(cls, values: torch.Tensor, lengths: torch.Tensor) -> Jagged:
        _check_values(values)
        _check_tensor(lengths, "lengths")
        # host lengths reach the device through to_device, so their offsets get a mirror (no sync to read them)
        moved = to_device(lengths, values.device) if lengths.device.type == "cpu" else lengths.to(values.device)
        offsets = offsets_from_lengths(moved)
        total = int(host_copy(offsets)[-1])
        if total != values.shape[0]:  # from_offsets' "offsets[-1]" would name an argument the caller never passed
            raise ValueError(f"lengths sum to {total} but values have {values.shape[0]} rows")
        return cls.from_offsets(values, offsets)

    @classmethod
    def from_padded(cls, padded: torch.Tensor, lengths: torch.Tensor) -> Jagged:
        """``padded [B, N, ...]`` and ``lengths [B]`` (each <= N) -> jagged, dropping the padding."""
        _check_tensor(padded, "padded")
        _check_tensor(lengths, "lengths")
        if padded.dim() < 2:
            raise ValueError(f"padded must have shape [B, N, ...], got {tuple(padded.shape)}")
        if lengths.shape != (padded.shape[0],):
            raise ValueError(f"lengths must have shape [{padded.shape[0]}], got {tuple(lengths.shape)}")
        if lengths.numel() and int(lengths.max()) > padded.shape[1]:
            raise ValueError(f"a length {int(lengths.max())} exceeds the padded size {padded.shape[1]}")
        lengths = lengths.to(padded.device)
        positions = torch.arange(padded.shape[1], device=padded.device)
        keep = positions[None, :] < lengths[:, None]
        return cls.from_lengths(padded[keep], lengths)

    @property
    def batch_size(self) -> int:
        return self.offsets.numel() - 1

    @property
    def num_values(self) -> int:
        return self.values.shape[0]

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def lengths_host(self) -> torch.Tensor:
        return self.offsets_host[1:] - self.offsets_host[:-1]

    def to_padded(self, pad_value: float = 0.0, max_len: int | None = None) -> torch.Tensor:
        """``[B, max_len, ...]`` with ``pad_value`` after each sequence."""
        size = self._padded_size(max_len)
        out = self.values.new_full((self.batch_size, size, *self.values.shape[1:]), pad_value)
        out[self.padding_mask(size)] = self.values
        return out

    def _padded_size(self, max_len: int | None) -> int:
        if max_len is None:
            return self.max_len
        if not is_int(max_len):  # True had padded to 1
            raise ValueError(f"max_len must be an int or None, got {max_len!r}")
        if max_len < self.max_len:  # a shorter mask or padding would drop the tail of the longest sequences
            raise ValueError(f"max_len {max_len} is shorter than the longest sequence, {self.max_len}")
        return max_len

    def padding_mask(self, max_len: int | None = None) -> torch.Tensor:
        """Bool ``[B, max_len]``: True where a position holds a real value."""
        size = self._padded_size(max_len)
        positions = torch.arange(size, device=self.offsets.device)
        return positions[None, :] < self.lengths()[:, None]

    def sample_ids(self) -> torch.Tensor:
        """``[T]`` index of the sample that owns each row."""
        return torch.repeat_interleave(
            torch.arange(self.batch_size, device=self.offsets.device), self.lengths(), output_size=self.num_values
        )

    def with_values(self, values: torch.Tensor) -> Jagged:
        """Same layout, new values (e.g. the output of a per-token module)."""
        _check_values(values)
        if values.device != self.offsets.device:  # had built a Jagged whose values and offsets live apart
            raise ValueError(f"new values are on {values.device} but the offsets are on {self.offsets.device}")
        if values.shape[0] != self.num_values:
            raise ValueError(f"new values have {values.shape[0]} rows, the layout has {self.num_values}")
        return Jagged(values, self.offsets, self.offsets_host, self.max_len)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Jagged:
        offsets = self.offsets if self.offsets.device == torch.device(device) else to_device(self.offsets_host, device)
        return Jagged(self.values.to(device, non_blocking=non_blocking), offsets, self.offsets_host, self.max_len)

    def pin_memory(self) -> Jagged:
        return Jagged(self.values.pin_memory(), self.offsets.pin_memory(), self.offsets_host, self.max_len)

    def split(self) -> list[torch.Tensor]:
        """One tensor per sample (views into ``values``)."""
        bounds = self.offsets_host.tolist()
        return [self.values[bounds[b] : bounds[b + 1]] for b in range(self.batch_size)]


# A pytree node, so that code walking a module's outputs for tensors (FSDP2's backward hooks, torch.compile)
# sees the values of a Jagged returned by a block; max_len is static context.
torch.utils._pytree.register_pytree_node(
    Jagged,
    lambda j: ([j.values, j.offsets, j.offsets_host], j.max_len),
    lambda children, max_len: Jagged(*children, max_len),
    serialized_type_name="opengem.jagged.Jagged",
)
