import pytest
import scenarios
import torch

from opengem.parallel.checkpoint import PARTIAL_SUFFIX, load_distributed


def assert_params_equal(loaded, saved):
    assert loaded.keys() == saved.keys()
    for name, value in saved.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)


def test_checkpoint_saved_on_four_ranks_loads_on_two(world4, world2, checkpoint_root):
    for result in world2:
        assert_params_equal(result["resumed"]["loaded"], world4[0]["fsdp4"]["params_at_save"])
    directory = checkpoint_root / "fsdp4"
    assert (directory / ".metadata").is_file()
    assert not directory.with_name(directory.name + PARTIAL_SUFFIX).exists()


def test_expert_parallel_checkpoint_loads_without_expert_parallelism(world4, world2):
    # Saved by EP 2 x FSDP 2 (each rank holds one expert), loaded by FSDP 2 holding every expert.
    saved = {}
    for result in world4:
        saved.update(result["ep2_fsdp2"]["params_at_save"])
    for result in world2:
        assert_params_equal(result["resumed_experts"]["loaded"], saved)
    expected = world4[0]["ep2_fsdp2"]["losses"][scenarios.SAVE_AFTER :]
    for result in world2:
        torch.testing.assert_close(
            torch.tensor(result["resumed_experts"]["losses"]), torch.tensor(expected), rtol=1e-5, atol=1e-6
        )


def test_resumed_run_continues_the_loss_curve(world4, world2):
    # Optimizer state travels too: the remaining steps reproduce the uninterrupted 4-rank run.
    expected = world4[0]["fsdp4"]["losses"][scenarios.SAVE_AFTER :]
    for result in world2:
        torch.testing.assert_close(torch.tensor(result["resumed"]["losses"]), torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_loading_an_incomplete_checkpoint_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a complete distributed checkpoint"):
        load_distributed({}, tmp_path / "missing")
