"""Regional ``torch.compile`` of the dense blocks: fuses the norms, casts, activations and residual adds
around the GEMMs, which at d_model 256-512 cost as much memory traffic as the GEMMs themselves.

Regions are whole blocks (a GEM layer, the history's token rows, a token summary, a transformer layer) rather than
the model: the embedding lookup and the batch layout live on the host and would break the graph. Blocks of one type
share their compiled code, so compile time does not grow with depth. Shapes are dynamic: the jagged token count
changes every batch. The attention ops are custom ops, opaque to the compiler.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._inductor import list_mode_options
from torch.distributed.fsdp import FSDPModule

from opengem.models.gem import GEMLayer, SequenceTokens
from opengem.nn.gem_layers import TokenSummary
from opengem.nn.layers import JaggedTransformerLayer

REGIONS: tuple[type[nn.Module], ...] = (GEMLayer, SequenceTokens, TokenSummary, JaggedTransformerLayer)


def compile_regions(model: nn.Module, backend: str = "inductor", mode: str = "default", cpp_wrapper: bool = False,
                    memory_budget: float = 1.0) -> int:
    """Compile, in place, the outermost submodules of ``model`` that are instances of :data:`REGIONS`.

    Returns how many were compiled. ``fullgraph=True``: a graph break inside a block is a bug to fix,
    not a silent slowdown. The one exception is a block holding its own FSDP units (the expert-parallel
    experts, sharded on their own mesh): FSDP2's hooks on a nested unit run eagerly (dynamo skips them on
    torch 2.11), so the block's graph breaks around that unit, by design.

    ``cpp_wrapper``: Inductor writes each graph's wrapper in C++ (compiled with the host's C++ compiler), so the
    blocks launch their kernels and call cuBLAS and our custom ops from C++ instead of generated Python lines, which
    held the interpreter lock for 45 of 75 ms a gem-large step (session 55's samples). Inductor only.

    ``memory_budget``: the share, in [0, 1], of the activations that the compiler's partitioner saves by default that
    each block may keep for its backward (PyTorch's activation memory budget); the rest is recomputed there, the
    cheapest first by FLOPs (our attention ops' by their FLOP formulas), so the norms, casts and activations go before
    any GEMM or attention. 1 keeps the default partition; 0 recomputes the block's whole forward, as
    ``activation_checkpointing`` does. Inductor only.
    """
    if backend != "inductor" and (cpp_wrapper or memory_budget != 1):
        raise ValueError(f"cpp_wrapper and memory_budget are Inductor settings; backend {backend!r} has neither")
    if not 0 <= memory_budget <= 1:
        raise ValueError(f"memory_budget must be in [0, 1] (a share of the default saved activations), "
                         f"got {memory_budget}")
    if memory_budget != 1:  # Inductor's own wrapper, which takes the mode and the options together
        options = {"cpp_wrapper": True} if cpp_wrapper else None
        return _compile_regions(model, BudgetedInductor(memory_budget, mode, options), {})
    settings: dict[str, Any] = {"mode": None if mode == "default" else mode}
    if cpp_wrapper:  # torch.compile takes a mode or options, not both: the mode's own options, plus the wrapper
        settings = {"options": {**list_mode_options(mode), "cpp_wrapper": True}}
    return _compile_regions(model, backend, settings)


class BudgetedInductor(torch._TorchCompileInductorWrapper):
    """torch.compile's Inductor backend with the partitioner's activation memory budget set while it splits each
    graph into forward and backward (a block's recompiles too), instead of process-wide; the budget is part of
    the AOTAutograd cache key, so a cached partition of another budget is not reused."""

    def __init__(self, budget: float, mode: str, options: dict[str, Any] | None) -> None:
        super().__init__(mode=mode, options=options, dynamic=True)
        self.budget = budget

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # is_non_builtin_to_include: our custom ops (the attention) enter the ranking with their FLOP formulas;
        # without it the partitioner's aggressive pass takes them for free to recompute (gem-large b512 at 0.35 ran
        # JFA's forward twice: 39.5 ms a step instead of ~17, session 58)
        with torch._functorch.config.patch(activation_memory_budget=self.budget, is_non_builtin_to_include=True):
            return super().__call__(*args, **kwargs)

    def __eq__(self, other: object) -> bool:
        return super().__eq__(other) and self.budget == getattr(other, "budget", None)


def _compile_regions(model: nn.Module, backend: str | BudgetedInductor, settings: dict[str, Any]) -> int:
    count = 0
    for child in model.children():
        if isinstance(child, REGIONS):
            nested_fsdp = any(isinstance(m, FSDPModule) for m in child.modules() if m is not child)
            child.compile(backend=backend, dynamic=True, fullgraph=not nested_fsdp, **settings)
            count += 1
        else:
            count += _compile_regions(child, backend, settings)
    return count
