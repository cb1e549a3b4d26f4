"""Every ``@triton.jit`` function of opengem reads only the globals a compiled kernel may read.

The CPU interpreter (CI) runs kernels as Python and reads any global; Triton's compiler only accepts
constexpr globals, modules, jit functions and triton.language objects, so a plain ``X = 1e-12`` read by a
kernel passes CI and fails on the first GPU (it did: the FP8 attention's quantize pass, session 3). This
test applies the compiler's rule (``triton.compiler.code_generator``'s global lookup) to the source.
"""

import ast
import importlib
import inspect
import pkgutil
import textwrap
import types

import pytest
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

import opengem.ops.triton as triton_ops

KERNEL_TYPES = (JITFunction, InterpretedFunction)  # @triton.jit makes the second under TRITON_INTERPRET=1


def _jit_functions() -> list[tuple[str, JITFunction]]:
    found = []
    for info in pkgutil.iter_modules(triton_ops.__path__):
        module = importlib.import_module(f"{triton_ops.__name__}.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, KERNEL_TYPES) and value.fn.__module__ == module.__name__:
                found.append((f"{info.name}.{name}", value))
    return found


def _allowed(value: object) -> bool:
    """The compiler's rule for a global a kernel reads."""
    return (
        isinstance(value, (types.ModuleType, *KERNEL_TYPES, tl.dtype, tl.constexpr))
        or getattr(value, "__triton_builtin__", False)
        or getattr(value, "__triton_aggregate__", False)
        or getattr(value, "__module__", "").startswith("triton.language")
    )


def _globals_read(fn: JITFunction) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn.fn)))
    function = tree.body[0]
    local = {a.arg for a in ast.walk(function.args) if isinstance(a, ast.arg)}
    local |= {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    loads = set()
    for node in ast.walk(function):
        if node in function.args.defaults or node in function.args.kw_defaults:
            continue  # defaults may read any global (the compiler allows it)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            loads.add(node.id)
    return loads - local


JIT_FUNCTIONS = _jit_functions()


def test_the_kernels_are_found():
    names = {name for name, _ in JIT_FUNCTIONS}
    assert len(names) > 30 and "jagged_attention_fp8._quantize_block" in names


@pytest.mark.parametrize(("name", "fn"), JIT_FUNCTIONS, ids=[name for name, _ in JIT_FUNCTIONS])
def test_kernel_reads_only_constexpr_globals(name, fn):
    scope = fn.fn.__globals__
    bad = sorted(g for g in _globals_read(fn) if g in scope and not _allowed(scope[g]))
    assert not bad, f"{name} reads non-constexpr globals {bad}: wrap them in tl.constexpr(...)"


def test_the_rule_catches_a_plain_float_global():
    module = types.ModuleType("fake_kernels")
    exec(  # noqa: S102 - a kernel defined in a throwaway module
        "import triton\nimport triton.language as tl\nLIMIT = 1e-12\nGOOD = tl.constexpr(2.0)\n"
        "def kernel(X):\n    x = tl.load(X)\n    tl.store(X, tl.maximum(x, LIMIT) * GOOD)\n",
        module.__dict__,
    )
    bad = [g for g in ("LIMIT", "GOOD", "tl") if not _allowed(module.__dict__[g])]
    assert bad == ["LIMIT"]
    assert triton.__version__  # the rule mirrors this Triton's code generator
