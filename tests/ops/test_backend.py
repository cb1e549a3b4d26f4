"""The ops' shared choice between their Triton kernels and their reference (``opengem.ops.backend``)."""

import pytest
import torch

from opengem.ops.backend import triton_chosen

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU


@pytest.mark.parametrize(("device", "backend", "expected"), [
    (CPU, None, False), (CUDA, None, True), (CPU, "auto", False), (CUDA, "auto", True),
    (CPU, "triton", True), (CUDA, "reference", False),
])  # fmt: skip
def test_auto_follows_the_device_and_a_named_backend_wins(monkeypatch, device, backend, expected):
    monkeypatch.delenv("OPENGEM_TEST_BACKEND", raising=False)
    assert triton_chosen(device, backend, "OPENGEM_TEST_BACKEND") is expected


def test_the_environment_variable_applies_where_the_caller_left_the_choice(monkeypatch):
    monkeypatch.setenv("OPENGEM_TEST_BACKEND", "triton")
    assert triton_chosen(CPU, None, "OPENGEM_TEST_BACKEND") and triton_chosen(CPU, "auto", "OPENGEM_TEST_BACKEND")
    assert not triton_chosen(CPU, "reference", "OPENGEM_TEST_BACKEND")  # the argument wins
    assert not triton_chosen(CPU, None)  # an op without a variable ignores it
    monkeypatch.setenv("OPENGEM_TEST_BACKEND", "")  # set but empty: as unset
    assert triton_chosen(CUDA, None, "OPENGEM_TEST_BACKEND") and not triton_chosen(CPU, None, "OPENGEM_TEST_BACKEND")


def test_an_unknown_backend_is_refused_naming_where_it_came_from(monkeypatch):
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'triton', 'reference'\), got 'cuda'"):
        triton_chosen(CPU, "cuda")
    monkeypatch.setenv("OPENGEM_TEST_BACKEND", "tritno")  # a typo was silently the device's default for embeddings
    with pytest.raises(ValueError, match="the environment variable OPENGEM_TEST_BACKEND must be one of .* 'tritno'"):
        triton_chosen(CUDA, None, "OPENGEM_TEST_BACKEND")
