"""The cached Triton launcher: what it keys on, when it goes through Triton, and what it hands the compiled kernel.

The kernel here is a recording stand-in (the CPU has no Triton driver); the GPU tests of every GDPA kernel run
through the real launcher (it is on by default), and ``tests/gpu/test_gdpa_gpu.py``'s
``test_repeat_launches_skip_triton_with_the_same_bits`` checks that repeat calls skip Triton's path.
"""

import numpy as np
import pytest
import torch
from triton.knobs import runtime as triton_runtime
from triton.runtime.jit import KernelParam
from triton.tools.tensor_descriptor import TensorDescriptor

from opengem.ops.triton import launcher as launcher_module
from opengem.ops.triton.launcher import CachedLauncher, _Unkeyed, arg_key, cached_launches_enabled, launch_mode_setting


def _params(source: str) -> list[KernelParam]:
    namespace: dict = {}
    exec(f"import triton.language as tl\ndef kernel({source}): pass", namespace)
    import inspect

    signature = inspect.signature(namespace["kernel"])
    return [KernelParam(i, p, False, False) for i, p in enumerate(signature.parameters.values())]


class _Compiled:
    def __init__(self, name: str) -> None:
        self.name, self.function, self.packed_metadata, self.runs = name, f"{name}-function", f"{name}-meta", []

    def run(self, *launch_args) -> None:
        self.runs.append(launch_args)


class _Kernel:
    """Records ``kernel[grid](...)`` calls (Triton's path) and returns a new compiled kernel each time."""

    def __init__(self) -> None:
        self.params = _params("x, n, scale, FLAG: tl.constexpr, y=None, BLOCK: tl.constexpr = 16")
        self.pre_run_hooks: list = []
        self.calls: list = []

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            return _Compiled(f"compiled{len(self.calls)}")

        return call


def _launcher() -> tuple[_Kernel, CachedLauncher]:
    kernel = _Kernel()
    return kernel, CachedLauncher(kernel, device=lambda: 3, stream=lambda device: 100 + device)


def test_repeat_calls_of_a_key_skip_triton_and_pass_every_argument_in_signature_order():
    kernel, cached = _launcher()
    x = torch.zeros(64)
    first = cached[(4,)](x, 32, 0.5, True, BLOCK=32, num_warps=4)
    assert len(kernel.calls) == 1 and cached.through_triton == 1
    x2 = torch.ones(64)  # another tensor of the same dtype and alignment, another int of the same class
    again = cached[(5, 2)](x2, 48, 0.25, True, BLOCK=32, num_warps=4)
    assert again is first and len(kernel.calls) == 1 and cached.through_triton == 1 and cached.keys == 1
    (run,) = first.runs
    assert run[:9] == (5, 2, 1, 103, "compiled1-function", "compiled1-meta", None, None, None)
    assert run[9] is x2 and run[10:] == (48, 0.25, True, None, 32)  # y's default, then BLOCK from the kwargs


@pytest.mark.parametrize(
    "change",
    [
        lambda a: {**a, "x": torch.zeros(65)[1:]},  # misaligned base
        lambda a: {**a, "x": torch.zeros(64, dtype=torch.float16)},
        lambda a: {**a, "n": 1},  # Triton makes 1 a constant
        lambda a: {**a, "n": 33},  # not a multiple of 16
        lambda a: {**a, "n": 2**31},  # i64
        lambda a: {**a, "flag": False},  # a constexpr passed by position: keyed on its value
        lambda a: {**a, "block": 64},
        lambda a: {**a, "warps": 8},
    ],
)
def test_a_change_that_may_change_the_specialization_goes_through_triton(change):
    kernel, cached = _launcher()
    base = {"x": torch.zeros(64), "n": 32, "flag": True, "block": 32, "warps": 4}
    for arguments in (base, change(base)):
        cached[(1,)](arguments["x"], arguments["n"], 1.0, arguments["flag"], BLOCK=arguments["block"],
                     num_warps=arguments["warps"])
    assert cached.through_triton == 2 and len(kernel.calls) == 2


def test_unknown_argument_types_callable_grids_and_launch_hooks_go_through_triton_every_call():
    kernel, cached = _launcher()
    x = torch.zeros(64)
    for _ in range(2):
        cached[(1,)](x, np.int64(32), 1.0, True)
        cached[lambda meta: (1,)](x, 32, 1.0, True)
    assert cached.through_triton == 4
    cached[(1,)](x, 32, 1.0, True)  # the plain call's key, now kept
    hook = lambda metadata: None  # noqa: E731 (a profiler's hook)
    triton_runtime.launch_enter_hook.add(hook)
    try:
        cached[(1,)](x, 32, 1.0, True)
    finally:
        triton_runtime.launch_enter_hook.remove(hook)
    assert cached.through_triton == 6
    cached[(1,)](x, 32, 1.0, True)
    assert cached.through_triton == 6 and len(kernel.calls) == 6


def test_arg_key_classes():
    aligned = torch.zeros(32)
    assert arg_key(aligned) == arg_key(torch.ones(8)) != arg_key(aligned[1:])
    assert arg_key(32) == arg_key(4096) != arg_key(33) == arg_key(35) != arg_key(1)
    assert arg_key(2**31 - 16) != arg_key(2**31) != arg_key(2**63)
    assert arg_key(0.5) == arg_key(2.0) and arg_key(True) != arg_key(False) and arg_key(None) != arg_key(False)
    desc = TensorDescriptor.from_tensor(torch.zeros(64, 32), [16, 32])
    assert arg_key(desc) == arg_key(TensorDescriptor.from_tensor(torch.ones(64, 32), [16, 32]))
    assert arg_key(desc) != arg_key(TensorDescriptor.from_tensor(torch.zeros(64, 32), [32, 32]))
    assert arg_key(desc) != arg_key(TensorDescriptor.from_tensor(torch.zeros(64, 40)[:, :32], [16, 32]))
    with pytest.raises(_Unkeyed):
        arg_key(np.float32(1.0))


def test_launch_mode_setting(monkeypatch):
    monkeypatch.setenv("OPENGEM_TRITON_LAUNCH", "triton")
    assert launch_mode_setting() == "triton"
    monkeypatch.setenv("OPENGEM_TRITON_LAUNCH", "fast")
    with pytest.raises(ValueError, match="OPENGEM_TRITON_LAUNCH must be one of"):
        launch_mode_setting()


def test_cached_launches_need_the_setting_and_a_triton_whose_rules_the_key_was_checked_against():
    assert cached_launches_enabled("3.6.0", "cached")
    assert not cached_launches_enabled("3.6.0", "triton")
    assert not cached_launches_enabled("3.9.0", "cached")  # its specialization may key on more: Triton's path


def test_launcher_leaves_interpreted_kernels_and_the_triton_setting_to_triton(monkeypatch):
    kernel = _Kernel()  # not a JITFunction (as the interpreter's kernels are not)
    assert launcher_module.launcher(kernel) is kernel
    monkeypatch.setattr(launcher_module, "CACHED", False)
    assert launcher_module.launcher(kernel) is kernel



def test_cached_launchers_name_each_launcher_by_its_kernel(monkeypatch):
    kernel, cached = _launcher()

    def my_kernel():  # the Python function a JITFunction wraps
        pass

    kernel.fn = my_kernel
    monkeypatch.setattr(launcher_module, "_LAUNCHERS", {kernel: cached})
    assert launcher_module.cached_launchers() == {"my_kernel": cached}
