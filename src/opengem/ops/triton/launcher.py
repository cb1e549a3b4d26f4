"""Repeat launches of a ``@triton.jit`` kernel without ``JITFunction.run``'s per-call work (issue 10's host time).

Triton 3.6's ``kernel[grid](...)`` binds and specializes every argument, formats the compile options into a cache
key and builds launch metadata on every call. In gem-large's compiled step (b256, H100, session 53's
``op_host_time``) that path took 14.8 of the 51 ms a step that opengem's op calls spent on the host, under cProfile,
for ~123 launches. :func:`launcher` keys each call on everything Triton's specialization may depend on (finer
than Triton's own key, which only costs extra entries), sends a key's first call through Triton (compile,
specialize, launch) and keeps the compiled kernel it returns; the key's later calls go to that kernel's launcher.

``OPENGEM_TRITON_LAUNCH=triton`` (read at import) sends every call through Triton, as do the interpreter, Triton
versions whose specialization rules the key was not checked against (:data:`VERIFIED_TRITON`) and any launch while
a Triton launch hook is set (profilers and launch counters see every launch).

Measured (session 53, gem-large b256 on one H100, both paths in one process, `benchmarks.diag.launch_ab`): on a
fast host, where the GPU paces the step, 1.000x; on a slow host, where the host paces it, 0.948x the step time by
the median of 8 rounds (0.989x by the mean), inside that host's +-10% drift between rounds.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import triton
from triton.knobs import runtime as triton_runtime
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

LAUNCH_MODES = ("cached", "triton")


def launch_mode_setting() -> str:
    setting = os.environ.get("OPENGEM_TRITON_LAUNCH", "cached")
    if setting not in LAUNCH_MODES:
        raise ValueError(f"OPENGEM_TRITON_LAUNCH must be one of {LAUNCH_MODES}, got {setting!r}")
    return setting


# Triton's specialization rules that arg_key was checked against: the GPU image's Triton (its native
# specialize_impl: tensors by dtype and 16-byte alignment, ints by == 1, % 16 and width, constexprs by value)
VERIFIED_TRITON = ("3.6.",)


def cached_launches_enabled(triton_version: str, setting: str) -> bool:
    return setting == "cached" and triton_version.startswith(VERIFIED_TRITON)


CACHED = cached_launches_enabled(triton.__version__, launch_mode_setting())


class _Unkeyed(Exception):
    """An argument of a type the key does not know: the call goes through Triton."""


def _int_key(value: int) -> tuple:
    # Triton specializes an int on == 1, divisibility by 16 and its width (i32 / i64 / u64)
    return value == 1, value % 16 == 0, -(2**31) <= value < 2**31, value >= 2**63


def arg_key(value: Any) -> Hashable:
    """What Triton's specialization of a runtime argument may depend on, or :class:`_Unkeyed`."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    kind = type(value)
    if kind is int:
        return _int_key(value)
    if kind is float:
        return float
    if kind is bool or value is None:
        return kind, value
    if kind is TensorDescriptor:
        base = value.base
        return (base.dtype, base.data_ptr() % 16 == 0, tuple(value.block_shape), value.padding,
                tuple(_int_key(n) for n in value.shape), tuple(_int_key(n) for n in value.strides))  # fmt: skip
    raise _Unkeyed(kind)


class CachedLauncher:
    """``kernel[grid](*args, **kwargs)`` with the compiled kernel of each argument key kept (see the module doc)."""

    def __init__(self, kernel: JITFunction, device: Callable[[], int] | None = None,
                 stream: Callable[[int], int] | None = None) -> None:
        """``device`` and ``stream`` (the current device, its current raw stream): Triton's driver's by default."""
        self.kernel = kernel
        params = kernel.params
        self._names = tuple(p.name for p in params)
        self._constexpr = tuple(p.is_constexpr for p in params)
        self._runtime = frozenset(p.name for p in params if not p.is_constexpr)
        self._defaults = {p.name: p.default for p in params if p.has_default}
        self._compiled: dict[Hashable, Any] = {}
        self._device, self._stream = device, stream
        self.through_triton = 0  # calls sent through kernel[grid] (first calls of a key, hooks, unknown types)

    def __getitem__(self, grid: Sequence[int]) -> Callable[..., Any]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _key(self, args: tuple, kwargs: dict) -> Hashable:
        keys = [value if constexpr else arg_key(value) for value, constexpr in zip(args, self._constexpr)]
        for name, value in kwargs.items():  # constexprs and launch options by value, runtime arguments keyed
            keys.append((name, arg_key(value) if name in self._runtime else value))
        return self._device(), tuple(keys)

    def launch(self, grid: Sequence[int], args: tuple, kwargs: dict) -> Any:
        if self._device is None:
            driver = triton.runtime.driver.active
            self._device, self._stream = driver.get_current_device, driver.get_current_stream
        if callable(grid):  # a grid of the bound arguments: Triton binds them
            return self._through_triton(grid, args, kwargs)
        try:
            key = self._key(args, kwargs)
            compiled = self._compiled.get(key)
        except (_Unkeyed, TypeError):  # an unknown argument type, or an unhashable constexpr
            return self._through_triton(grid, args, kwargs)
        if compiled is None or self._hooked():
            compiled = self._through_triton(grid, args, kwargs)
            if compiled is not None:
                self._compiled[key] = compiled
            return compiled
        values = list(args)
        for name in self._names[len(args):]:
            values.append(kwargs[name] if name in kwargs else self._defaults[name])
        grid_x, grid_y, grid_z = (*grid, 1, 1)[:3]
        compiled.run(grid_x, grid_y, grid_z, self._stream(key[0]), compiled.function, compiled.packed_metadata, None,
                     None, None, *values)
        return compiled

    def _through_triton(self, grid: Any, args: tuple, kwargs: dict) -> Any:
        self.through_triton += 1
        return self.kernel[grid](*args, **kwargs)

    @property
    def keys(self) -> int:
        """Argument keys with a compiled kernel kept."""
        return len(self._compiled)

    def _hooked(self) -> bool:
        """A launch hook or pre-run hook is set: Triton's own path calls them."""
        return bool(triton_runtime.launch_enter_hook.calls or triton_runtime.launch_exit_hook.calls
                    or self.kernel.pre_run_hooks)


_LAUNCHERS: dict[JITFunction, CachedLauncher] = {}


def launcher(kernel: JITFunction) -> Any:
    """``launcher(kernel)[grid](...)`` launches as ``kernel[grid](...)`` does, through the cache when it applies."""
    if not CACHED or not isinstance(kernel, JITFunction):  # the interpreter's kernels run as Triton runs them
        return kernel
    cached = _LAUNCHERS.get(kernel)
    if cached is None:
        cached = _LAUNCHERS[kernel] = CachedLauncher(kernel)
    return cached


def cached_launchers() -> dict[str, CachedLauncher]:
    """The launchers made so far, by kernel name (diagnostics read their ``through_triton`` and ``keys``)."""
    return {kernel.fn.__name__: cached for kernel, cached in _LAUNCHERS.items()}
