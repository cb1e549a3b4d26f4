"""The training allocator settings: applied before or after CUDA starts, never over the user's own."""

import os

import pytest
import torch

from opengem.train import cuda_allocator
from opengem.train.cuda_allocator import TRAINING_ALLOCATOR_SETTINGS, configure_cuda_allocator


@pytest.fixture
def no_user_settings(monkeypatch):
    for name in cuda_allocator.USER_SETTINGS_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_before_cuda_starts_the_settings_go_into_the_variable_the_allocator_reads(no_user_settings, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert configure_cuda_allocator() == TRAINING_ALLOCATOR_SETTINGS
    assert os.environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"


def test_after_cuda_started_the_running_allocator_gets_them(no_user_settings, monkeypatch):
    applied = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", applied.append)
    assert configure_cuda_allocator("expandable_segments:True,max_split_size_mb:512") is not None
    assert applied == ["expandable_segments:True,max_split_size_mb:512"]
    assert "PYTORCH_ALLOC_CONF" not in os.environ


@pytest.mark.parametrize("variable", cuda_allocator.USER_SETTINGS_VARIABLES)
def test_the_users_settings_stand(no_user_settings, monkeypatch, variable):
    applied = []
    monkeypatch.setenv(variable, "expandable_segments:False")
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", applied.append)
    for initialized in (False, True):
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
        assert configure_cuda_allocator() is None
    assert applied == []
    assert os.environ[variable] == "expandable_segments:False"
    assert all(os.environ.get(name) in (None, "expandable_segments:False")
               for name in cuda_allocator.USER_SETTINGS_VARIABLES)


def test_a_cpu_device_leaves_the_allocator_alone(no_user_settings, monkeypatch):
    from opengem.train.trainer import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    assert "PYTORCH_ALLOC_CONF" not in os.environ
