"""What a training batch is: feature specifications, tasks and the `Batch` the model consumes."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch

from opengem.jagged import Jagged, KeyedJagged, host_copy

FeatureKind = Literal["categorical", "multi_hot", "sequence"]
FEATURE_KINDS: tuple[str, ...] = ("categorical", "multi_hot", "sequence")

TASKS = ("click", "conversion")


@dataclass(frozen=True)
class FeatureSpec:
    """One sparse feature: ``categorical`` (one id per sample), ``multi_hot`` (0..k ids per sample) or
    ``sequence`` (one id per history event). Valid ids are ``0 .. num_embeddings - 1``."""

    name: str
    kind: FeatureKind
    num_embeddings: int

    def __post_init__(self) -> None:
        if self.kind not in FEATURE_KINDS:
            raise ValueError(f"feature {self.name!r}: kind must be one of {FEATURE_KINDS}, got {self.kind!r}")
        if self.num_embeddings < 1:
            raise ValueError(f"feature {self.name!r}: num_embeddings must be >= 1, got {self.num_embeddings}")


@dataclass
class Batch:
    """One training batch of B ad impressions.

    - ``sparse``: non-sequence features, keys in spec order; categorical ones have length 1 per sample,
      multi-hot ones 0..k. Values are int64 ids.
    - ``sequence``: history features (one id per event); every key has the same per-sample lengths.
    - ``history_age``: float32 ``[T]`` seconds between each history event and the impression (>= 0),
      with the same offsets as the history features. Events are stored oldest first.
    - ``dense``: float32 ``[B, num_dense]``.
    - ``labels``: float32 ``[B, len(TASKS)]`` (click, conversion); conversion = 1 only if click = 1.
    - ``oracle``: float32 ``[B, len(TASKS)]`` ground-truth probabilities the labels were drawn from
      (the conversion column is the unconditional P(click and conversion)).
    - ``sample_id``: int64 ``[B]`` global index of each sample in its data set (for bookkeeping and tests).
    """

    sparse: KeyedJagged
    sequence: KeyedJagged
    history_age: Jagged
    dense: torch.Tensor
    labels: torch.Tensor
    oracle: torch.Tensor
    sample_id: torch.Tensor | None = None

    def batch_size(self) -> int:
        return int(self.labels.shape[0])

    def check_model_input(self, num_dense: int) -> None:
        """Raise ``ValueError`` unless a model built for ``num_dense`` dense features can read this batch: at least
        one sample (an empty batch failed deep in a reshape), ``dense`` of ``[B, num_dense]``, and history features and
        ``history_age`` of the same lengths."""
        if self.dense.dim() != 2 or self.dense.shape[1] != num_dense:
            raise ValueError(f"batch.dense must be [B, {num_dense}] (the model's dense features), "
                             f"got {tuple(self.dense.shape)}")
        if self.dense.shape[0] == 0:
            raise ValueError("the batch is empty (B = 0): a model's forward needs at least one sample")
        self._check_history_lengths()

    def _check_history_lengths(self) -> None:
        """Every history feature and ``history_age`` must give each sample the same number of events (a short
        ``history_age`` had failed deep in the model as a size mismatch). Reads host copies, as the embedding
        lookup does: no device sync where the batch came through ``to``."""
        ages = self.history_age.lengths_host()
        per_key = host_copy(self.sequence.lengths).view(len(self.sequence.keys), -1) if self.sequence.keys else ()
        for key, lengths in zip(self.sequence.keys, per_key):
            if lengths.shape != ages.shape:
                raise ValueError(f"history feature {key!r} has {lengths.numel()} samples, history_age {ages.numel()}")
            differ = torch.nonzero(lengths != ages)
            if differ.numel():
                sample = int(differ[0])
                raise ValueError(f"sample {sample}: history feature {key!r} has {int(lengths[sample])} events but "
                                 f"history_age has {int(ages[sample])}")

    def num_history_tokens(self) -> int:
        return int(self.history_age.num_values)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return replace(
            self,
            sparse=self.sparse.to(device, non_blocking=non_blocking),
            sequence=self.sequence.to(device, non_blocking=non_blocking),
            history_age=self.history_age.to(device, non_blocking=non_blocking),
            dense=move(self.dense),
            labels=move(self.labels),
            oracle=move(self.oracle),
            sample_id=move(self.sample_id),
        )

    def pin_memory(self) -> Batch:
        """Page-locked copy, so that ``to(cuda, non_blocking=True)`` overlaps with compute.
        The DataLoader's pin-memory thread calls this (it pins any object with a ``pin_memory`` method)."""
        return replace(
            self,
            sparse=self.sparse.pin_memory(),
            sequence=self.sequence.pin_memory(),
            history_age=self.history_age.pin_memory(),
            dense=self.dense.pin_memory(),
            labels=self.labels.pin_memory(),
            oracle=self.oracle.pin_memory(),
            sample_id=None if self.sample_id is None else self.sample_id.pin_memory(),
        )
