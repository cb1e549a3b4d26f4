"""Pinned-memory DataLoader path of opengem.data on a CUDA machine."""

import numpy as np
import pytest
import torch

from opengem.data.parquet import make_loader, synthesize_to_parquet

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_pinned_multi_worker_loader_moves_batches_to_the_gpu(tmp_path):
    synthesize_to_parquet(tmp_path, 3_000, "gem-tiny", seed=1, rows_per_file=1_000, row_group_size=256, progress=False)
    loader = make_loader(tmp_path, batch_size=128, num_workers=2, pin_memory=True)
    seen = []
    for batch in loader:
        for tensor in (batch.sparse.values, batch.sequence.values, batch.history_age.values, batch.dense, batch.labels):
            assert tensor.is_pinned()
        on_gpu = batch.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert on_gpu.sequence.values.is_cuda and on_gpu.history_age.offsets.is_cuda
        assert torch.equal(on_gpu.sequence.values.cpu(), batch.sequence.values)
        assert torch.equal(on_gpu.history_age.values.cpu(), batch.history_age.values)
        assert on_gpu.history_age.max_len == batch.history_age.max_len
        seen.append(batch.sample_id.numpy())
    assert np.array_equal(np.sort(np.concatenate(seen)), np.arange(3_000))
