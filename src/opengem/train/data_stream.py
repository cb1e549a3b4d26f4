"""Where training batches come from: the synthetic generator streamed on the fly, or Parquet files.

The synthetic stream is a pure function of (seed, sample index): batch ``s`` holds samples
``[s * B, (s + 1) * B)``, so a resumed run sees exactly the batches it would have seen, and the
held-out set lives at a far index range the stream never reaches.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from opengem.data.parquet import batches_from_table, make_loader
from opengem.data.schema import Batch
from opengem.data.synthetic import SYNTHETIC_PRESETS, generate
from opengem.train.config import TrainConfig

HOLDOUT_START = 1 << 40  # first sample index of the held-out set


class SyntheticBatches(IterableDataset):
    """Endless batches of fresh synthetic samples; DataLoader workers take every W-th batch in turn."""

    def __init__(self, config: TrainConfig, start_step: int) -> None:
        self.data = SYNTHETIC_PRESETS[config.data_preset]
        self.batch_size = config.batch_size
        self.seed = config.seed
        self.start_step = start_step

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        step = self.start_step + worker
        while True:
            table = generate(self.data, self.batch_size, self.seed, start=step * self.batch_size)
            yield from batches_from_table(table, self.batch_size)
            step += workers


def train_batches(config: TrainConfig, start_step: int) -> Iterator[Batch]:
    if config.data_dir:
        loader = make_loader(config.data_dir, batch_size=config.batch_size, num_workers=config.num_workers,
                             pin_memory=torch.cuda.is_available())
        batches = iter(loader)
        for _ in range(start_step):  # exact resume: skip what the run already consumed
            next(batches)
        return batches
    dataset = SyntheticBatches(config, start_step)
    loader = DataLoader(
        dataset,
        batch_size=None,
        num_workers=config.num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=config.num_workers > 0,
    )
    return iter(loader)


def eval_batches(config: TrainConfig) -> list[Batch]:
    data = SYNTHETIC_PRESETS[config.data_preset]
    table = generate(data, config.eval_samples, config.seed, start=HOLDOUT_START)
    return list(batches_from_table(table, config.batch_size))
