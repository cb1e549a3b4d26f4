"""`KeyedJagged`: many named sparse features of one batch in one flat id buffer.

Shaped like TorchRec's ``KeyedJaggedTensor``: ``values`` holds the ids of feature 0 for samples
0..B-1, then feature 1, and so on; ``lengths`` is ``[F * B]`` in the same feature-major order; optional
``weights`` (one float per id) travel alongside.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from opengem.jagged.host import host_copy, register_host_copy, to_device
from opengem.jagged.jagged import OFFSET_DTYPES, Jagged, _check_tensor, offsets_from_lengths
from opengem.validation import is_int


@dataclass(frozen=True)
class KeyedJagged:
    keys: tuple[str, ...]
    values: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # TorchRec takes a list of str: a bare str had become one key per character, a set an arbitrary order
        if not isinstance(self.keys, (tuple, list)):
            raise ValueError(f"keys must be a list or tuple of str, got {type(self.keys).__name__} {self.keys!r}")
        for i, key in enumerate(self.keys):
            if not isinstance(key, str):
                raise ValueError(f"keys[{i}] must be a str, got {type(key).__name__} {key!r}")
        object.__setattr__(self, "keys", tuple(self.keys))  # frozen: one hashable, comparable type
        _check_tensor(self.values, "values")
        _check_tensor(self.lengths, "lengths")
        if len(set(self.keys)) != len(self.keys):
            raise ValueError(f"feature keys must be unique, got {list(self.keys)}")
        if self.values.dim() != 1:
            raise ValueError(f"values must be 1-D ids, got shape {tuple(self.values.shape)}")
        if self.lengths.dim() != 1:
            raise ValueError(f"lengths must be 1-D, got shape {tuple(self.lengths.shape)}")
        if self.lengths.dtype not in OFFSET_DTYPES:  # float lengths summed right but made wrong offsets
            raise ValueError(f"lengths must be int32 or int64, got {self.lengths.dtype}")
        if self.keys and self.lengths.numel() % len(self.keys) != 0:
            raise ValueError(
                f"lengths has {self.lengths.numel()} entries, not a multiple of the {len(self.keys)} keys"
            )
        if not self.keys and self.lengths.numel() != 0:
            raise ValueError("lengths must be empty when there are no keys")
        if self.values.device != self.lengths.device:
            raise ValueError(f"values are on {self.values.device} but lengths are on {self.lengths.device}")
        host_lengths = host_copy(self.lengths)
        if self.lengths.numel() and bool((host_lengths < 0).any()):
            raise ValueError("lengths must be non-negative")
        total = int(host_lengths.sum()) if self.lengths.numel() else 0
        if total != self.values.numel():
            raise ValueError(f"lengths sum to {total} but there are {self.values.numel()} values")
        if self.weights is not None:
            _check_tensor(self.weights, "weights")
            if self.weights.shape != self.values.shape:
                raise ValueError(
                    f"weights must match values' shape {tuple(self.values.shape)}, got {tuple(self.weights.shape)}"
                )
            if self.weights.device != self.values.device:
                raise ValueError(f"values are on {self.values.device} but weights are on {self.weights.device}")
            if not self.weights.is_floating_point():  # one float per id; integer weights had been taken as given
                raise ValueError(f"weights must be a floating-point tensor, got {self.weights.dtype}")

    @classmethod
    def _trusted(
        cls, keys: tuple[str, ...], values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None
    ) -> KeyedJagged:
        """Skip validation (and its device sync) for layouts derived from an already valid one."""
        out = object.__new__(cls)
        for name, value in (("keys", keys), ("values", values), ("lengths", lengths), ("weights", weights)):
            object.__setattr__(out, name, value)
        return out

    @classmethod
    def from_dict(cls, features: dict[str, Jagged]) -> KeyedJagged:
        """Build from one ``Jagged`` of 1-D ids per feature; all must have the same batch size."""
        if not isinstance(features, dict):
            raise ValueError(f"features must be a dict of str to Jagged, got {type(features).__name__}")
        keys = tuple(features)
        for key, jagged in features.items():  # name the feature: the joined buffers' errors cannot
            if not isinstance(jagged, Jagged):
                raise ValueError(f"features[{key!r}] must be a Jagged, got {type(jagged).__name__}")
            if jagged.values.dim() != 1:
                raise ValueError(
                    f"features[{key!r}] must hold 1-D ids, got values of shape {tuple(jagged.values.shape)}"
                )
            if jagged.values.device != features[keys[0]].values.device:
                raise ValueError(
                    f"features[{key!r}] is on {jagged.values.device} but features[{keys[0]!r}] is on "
                    f"{features[keys[0]].values.device}"
                )
        if not keys:
            return cls((), torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
        sizes = {k: j.batch_size for k, j in features.items()}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"features have different batch sizes: {sizes}")
        values = torch.cat([features[k].values for k in keys])
        lengths = torch.cat([features[k].lengths().to(torch.int64) for k in keys])
        return cls(keys, values, lengths)

    @property
    def stride(self) -> int:
        """The batch size B."""
        return self.lengths.numel() // len(self.keys) if self.keys else 0

    def lengths_per_key(self) -> list[int]:
        """Total number of ids of each feature, in key order."""
        return host_copy(self.lengths).view(len(self.keys), -1).sum(dim=1).tolist() if self.keys else []

    def offsets(self) -> torch.Tensor:
        """``[F * B + 1]`` offsets over the flat ``values`` buffer."""
        return offsets_from_lengths(self.lengths)

    def __getitem__(self, key: str) -> Jagged:
        return Jagged.from_lengths(self.values[self._value_range(key)], self._lengths_of(key))

    def weights_of(self, key: str) -> Jagged:
        if self.weights is None:
            raise ValueError("this KeyedJagged carries no weights")
        return Jagged.from_lengths(self.weights[self._value_range(key)], self._lengths_of(key))

    def _index(self, key: str) -> int:
        if key not in self.keys:
            raise KeyError(f"no feature {key!r}; features are {list(self.keys)}")
        return self.keys.index(key)

    def _value_range(self, key: str) -> slice:
        index = self._index(key)
        per_key = self.lengths_per_key()
        start = sum(per_key[:index])
        return slice(start, start + per_key[index])

    def _lengths_of(self, key: str) -> torch.Tensor:
        rows = slice(self._index(key) * self.stride, (self._index(key) + 1) * self.stride)
        lengths = self.lengths[rows]
        register_host_copy(lengths, host_copy(self.lengths)[rows])
        return lengths

    def to_dict(self) -> dict[str, Jagged]:
        return {k: self[k] for k in self.keys}

    def split(self, segments: Sequence[int]) -> list[KeyedJagged]:
        """Split into consecutive groups of ``segments[i]`` features each (TorchRec's ``split``)."""
        if not isinstance(segments, Sequence) or not all(is_int(s) for s in segments):  # True had split off 1 key
            raise ValueError(f"segments must be a sequence of ints, got {segments!r}")
        if sum(segments) != len(self.keys) or any(s < 0 for s in segments):
            raise ValueError(f"segments {list(segments)} must be non-negative and sum to {len(self.keys)} keys")
        per_key = self.lengths_per_key()
        host_lengths = host_copy(self.lengths)
        out, key_start, value_start, stride = [], 0, 0, self.stride
        for size in segments:
            count = sum(per_key[key_start : key_start + size])
            weights = None if self.weights is None else self.weights[value_start : value_start + count]
            rows = slice(key_start * stride, (key_start + size) * stride)
            lengths = self.lengths[rows]
            register_host_copy(lengths, host_lengths[rows])
            out.append(
                KeyedJagged._trusted(
                    self.keys[key_start : key_start + size], self.values[value_start : value_start + count], lengths, weights
                )
            )
            key_start += size
            value_start += count
        return out

    @staticmethod
    def concat(parts: Sequence[KeyedJagged]) -> KeyedJagged:
        """Join feature groups of the same batch (the inverse of :meth:`split`)."""
        if not parts:
            raise ValueError("concat needs at least one KeyedJagged")
        for i, part in enumerate(parts):
            if not isinstance(part, KeyedJagged):
                raise ValueError(f"parts[{i}] must be a KeyedJagged, got {type(part).__name__}")
            if part.values.device != parts[0].values.device:  # torch.cat's error named no part
                raise ValueError(f"parts[{i}] is on {part.values.device} but parts[0] is on {parts[0].values.device}")
        keys = [k for p in parts for k in p.keys]
        if len(set(keys)) != len(keys):  # _trusted skips __post_init__: a repeated key had shadowed the second
            repeated = sorted({k for k in keys if keys.count(k) > 1})
            raise ValueError(f"cannot concat KeyedJagged sharing feature keys {repeated}")
        strides = {p.stride for p in parts if p.keys}
        if len(strides) > 1:
            raise ValueError(f"cannot concat KeyedJagged of different batch sizes {sorted(strides)}")
        with_weights = {p.weights is not None for p in parts}
        if len(with_weights) > 1:
            raise ValueError("cannot concat KeyedJagged with and without weights")
        weights = torch.cat([p.weights for p in parts]) if with_weights == {True} else None
        lengths = torch.cat([p.lengths for p in parts])
        register_host_copy(lengths, torch.cat([host_copy(p.lengths) for p in parts]))
        return KeyedJagged._trusted(
            tuple(keys), torch.cat([p.values for p in parts]), lengths, weights
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedJagged:
        """Also keeps the lengths' host copy, so the layout is known on the host without a device sync."""
        host_lengths = host_copy(self.lengths)
        lengths = self.lengths if self.lengths.device == torch.device(device) else to_device(host_lengths, device)
        return KeyedJagged._trusted(
            self.keys,
            self.values.to(device, non_blocking=non_blocking),
            lengths,
            None if self.weights is None else self.weights.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> KeyedJagged:
        return KeyedJagged._trusted(
            self.keys,
            self.values.pin_memory(),
            self.lengths.pin_memory(),
            None if self.weights is None else self.weights.pin_memory(),
        )
