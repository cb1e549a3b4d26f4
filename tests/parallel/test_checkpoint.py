import pytest
import scenarios
import torch

from opengem.parallel.checkpoint import PARTIAL_SUFFIX, load_distributed


def test_checkpoint_saved_on_four_ranks_loads_on_two(world4, world2, checkpoint_dir):
    saved = world4[0]["fsdp4"]["params_at_save"]
    for result in world2:
        loaded = result["resumed"]["loaded"]
        assert loaded.keys() == saved.keys()
        for name, value in saved.items():
            torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)
    assert (checkpoint_dir / ".metadata").is_file()
    assert not checkpoint_dir.with_name(checkpoint_dir.name + PARTIAL_SUFFIX).exists()


def test_resumed_run_continues_the_loss_curve(world4, world2):
    # Optimizer state travels too: the remaining steps reproduce the uninterrupted 4-rank run.
    expected = world4[0]["fsdp4"]["losses"][scenarios.SAVE_AFTER :]
    for result in world2:
        torch.testing.assert_close(torch.tensor(result["resumed"]["losses"]), torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_loading_an_incomplete_checkpoint_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a complete distributed checkpoint"):
        load_distributed({}, tmp_path / "missing")
