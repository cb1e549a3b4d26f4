"""Run an ``opengem`` command with Inductor settings changed first: what a compiled region's host time and launch
count become with, e.g., combo kernels (small independent kernels, such as the per-weight bf16 casts, launched as one).

``python -m benchmarks.diag.with_inductor_config combo_kernels=True size_asserts=False -- bench train --preset ...``

Each ``NAME=VALUE`` sets ``torch._inductor.config.NAME`` (dotted names reach sub-configs, e.g.
``triton.unique_kernel_names``) to the Python literal VALUE before anything compiles; an unknown name, or a value of
another type than the setting's, is an error rather than a silently ignored setting. The settings enter Inductor's
cache key, so the run compiles afresh.
"""

from __future__ import annotations

import ast
import sys

import torch._inductor.config as inductor_config

from opengem.cli.main import main as opengem_main


def apply(settings: list[str]) -> dict[str, object]:
    """Set each ``NAME=VALUE``; returns what was set."""
    applied: dict[str, object] = {}
    for setting in settings:
        name, sep, text = setting.partition("=")
        if not sep:
            raise SystemExit(f"settings are NAME=VALUE, got {setting!r}")
        *parents, leaf = name.split(".")
        owner = inductor_config
        for part in parents:
            owner = getattr(owner, part, None)
            if owner is None:
                raise SystemExit(f"torch._inductor.config has no {name!r}")
        if not hasattr(owner, leaf):
            raise SystemExit(f"torch._inductor.config has no {name!r}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise SystemExit(f"{name}: {text!r} is not a Python literal") from None
        current = getattr(owner, leaf)
        if current is not None and type(value) is not type(current):
            raise SystemExit(f"{name} is a {type(current).__name__} ({current!r}), got {value!r}")
        setattr(owner, leaf, value)
        applied[name] = value
    return applied


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: with_inductor_config NAME=VALUE ... -- OPENGEM_ARGS ...")
    split = argv.index("--")
    applied = apply(argv[:split])
    print(f"inductor settings: {applied}", file=sys.stderr, flush=True)
    return opengem_main(argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main())
