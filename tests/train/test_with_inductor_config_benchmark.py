"""benchmarks.diag.with_inductor_config: Inductor settings applied before an opengem command, bad ones refused."""

import pytest
import torch._inductor.config as inductor_config

from benchmarks.diag import with_inductor_config as diag


@pytest.fixture(autouse=True)
def restored_config():
    """Inductor's settings as they were after each test (``patch`` restores what the diag sets inside it)."""
    with inductor_config.patch({"combo_kernels": False, "triton.unique_kernel_names": True}):
        yield


def test_settings_apply_then_the_command_runs(monkeypatch):
    ran = []
    monkeypatch.setattr(diag, "opengem_main", lambda argv: ran.append((argv, inductor_config.combo_kernels)) or 0)
    assert diag.main(["combo_kernels=True", "triton.unique_kernel_names=False", "--", "bench", "train"]) == 0
    assert ran == [(["bench", "train"], True)] and inductor_config.triton.unique_kernel_names is False


@pytest.mark.parametrize(
    "argv, message",
    [
        (["no_such_setting=1", "--", "info"], "has no 'no_such_setting'"),
        (["triton.no_such=1", "--", "info"], "has no 'triton.no_such'"),
        (["combo_kernels=1", "--", "info"], r"combo_kernels is a bool \(False\), got 1"),
        (["combo_kernels=yes", "--", "info"], "'yes' is not a Python literal"),
        (["combo_kernels", "--", "info"], "settings are NAME=VALUE"),
        (["combo_kernels=True", "info"], "usage"),
    ],
)
def test_bad_settings_are_refused(monkeypatch, argv, message):
    monkeypatch.setattr(diag, "opengem_main", lambda argv: pytest.fail("the command ran"))
    with pytest.raises(SystemExit, match=message):
        diag.main(argv)
