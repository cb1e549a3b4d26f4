"""Which Triton kernels a run really launched: opengem's kernel families and a launch counter.

A training run that promises "every attention on its Triton kernel" (or "the fp32 references only")
is checked by counting launches through Triton's launch-enter hook: each launch reports its kernel's
name, which is matched against the jit functions of each family's modules.
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Sequence
from typing import Any, Self

from opengem.models.gem import GEMConfig

# The modules holding each family's Triton kernels: a launch counts for a family when its kernel name is
# one of the module's jit functions.
KERNEL_MODULES: dict[str, tuple[str, ...]] = {
    "jagged_attention": ("opengem.ops.triton.jagged_attention",),
    "block_attention": ("opengem.ops.triton.block_attention",),
    "gdpa": ("opengem.ops.triton.gdpa", "opengem.ops.triton.gdpa_kernels"),
    "embedding": ("opengem.ops.triton.embedding",),
}


def required_families(gem: GEMConfig) -> list[str]:
    """The Triton kernel families a GEM with this config launches on the Triton path."""
    families = ["embedding"]
    if gem.use_sequence:
        families.append("jagged_attention" if gem.self_attention == "jfa" else "block_attention")
        if gem.use_pffn or (gem.use_pooling and gem.num_seeds > 0):
            families.append("gdpa")
    return families


def kernel_names() -> dict[str, set[str]]:
    """Family -> the names of the jit functions in its modules (what Triton reports as the kernel name)."""
    from triton.runtime.jit import KernelInterface

    names: dict[str, set[str]] = {}
    for family, modules in KERNEL_MODULES.items():
        found: set[str] = set()
        for module_name in modules:
            for obj in vars(importlib.import_module(module_name)).values():
                if not isinstance(obj, KernelInterface):
                    continue
                while isinstance(obj, KernelInterface):  # autotuner -> jit (or interpreted) function -> Python function
                    obj = obj.fn
                found.add(obj.__name__)
        names[family] = found
    return names


class TritonLaunches:
    """Counts Triton kernel launches by kernel name while active, through Triton's launch-enter hook.

    ``available`` is False when this Triton has no hook chain (then nothing can be verified).
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.chain = _launch_hook_chain()
        self.available = self.chain is not None

    def _record(self, metadata: Any) -> None:
        data = getattr(metadata, "data", metadata)  # a LazyDict: .data holds the name without extra work
        self.counts[str(data["name"])] += 1

    def __enter__(self) -> Self:
        if self.chain is not None:
            self.chain.add(self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.chain is not None:
            self.chain.remove(self._record)


def _launch_hook_chain() -> Any:
    try:
        import triton
    except ImportError:
        return None
    chain = getattr(getattr(getattr(triton, "knobs", None), "runtime", None), "launch_enter_hook", None)
    return chain if hasattr(chain, "add") and hasattr(chain, "remove") else None


def dispatch_report(
    backend: str, counts: Counter[str], families: Sequence[str], names: dict[str, set[str]], available: bool
) -> dict[str, Any]:
    """Which opengem kernels a run launched, and whether that is what its backend promises.

    A Triton run must launch at least one kernel of every family in ``families``; a reference run none of
    any opengem family. Launches of other Triton kernels (e.g. torch.compile's) are counted apart.
    """
    ours = set().union(*names.values())
    launched = {name: n for name, n in sorted(counts.items()) if name in ours}
    per_family = {family: sum(n for name, n in launched.items() if name in names[family]) for family in names}
    problems: list[str] = []
    if not available:
        problems.append("this Triton has no launch hook: the kernels' dispatch cannot be verified")
    elif backend == "triton":
        problems += [f"no Triton kernel of {family} launched" for family in families if per_family[family] == 0]
    elif launched:
        problems.append(f"the reference run launched opengem Triton kernels: {launched}")
    return {
        "ok": not problems,
        "problems": problems,
        "launches_per_family": per_family,
        "launches": launched,
        "other_triton_launches": sum(n for name, n in counts.items() if name not in ours),
    }
