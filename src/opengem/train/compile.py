"""Regional ``torch.compile`` of the dense blocks: fuses the norms, casts, activations and residual adds
around the GEMMs, which at d_model 256-512 cost as much memory traffic as the GEMMs themselves.

Regions are whole blocks (a GEM layer, the history's token rows, a token summary, a transformer layer) rather than
the model: the embedding lookup and the batch layout live on the host and would break the graph. Blocks of one type
share their compiled code, so compile time does not grow with depth. Shapes are dynamic: the jagged token count
changes every batch. The attention ops are custom ops, opaque to the compiler.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch._inductor import list_mode_options
from torch.distributed.fsdp import FSDPModule

from opengem.models.gem import GEMLayer, SequenceTokens
from opengem.nn.gem_layers import TokenSummary
from opengem.nn.layers import JaggedTransformerLayer

REGIONS: tuple[type[nn.Module], ...] = (GEMLayer, SequenceTokens, TokenSummary, JaggedTransformerLayer)


def compile_regions(model: nn.Module, backend: str = "inductor", mode: str = "default", cpp_wrapper: bool = False
                    ) -> int:
    """Compile, in place, the outermost submodules of ``model`` that are instances of :data:`REGIONS`.

    Returns how many were compiled. ``fullgraph=True``: a graph break inside a block is a bug to fix,
    not a silent slowdown. The one exception is a block holding its own FSDP units (the expert-parallel
    experts, sharded on their own mesh): FSDP2's hooks on a nested unit run eagerly (dynamo skips them on
    torch 2.11), so the block's graph breaks around that unit, by design.

    ``cpp_wrapper``: Inductor writes each graph's wrapper in C++ (compiled with the host's C++ compiler), so the
    blocks launch their kernels and call cuBLAS and our custom ops from C++ instead of generated Python lines, which
    held the interpreter lock for 45 of 75 ms a gem-large step (session 55's samples). Inductor only.
    """
    if cpp_wrapper and backend != "inductor":
        raise ValueError(f"cpp_wrapper is an Inductor option; backend {backend!r} has no C++ wrapper")
    settings: dict[str, Any] = {"mode": None if mode == "default" else mode}
    if cpp_wrapper:  # torch.compile takes a mode or options, not both: the mode's own options, plus the wrapper
        settings = {"options": {**list_mode_options(mode), "cpp_wrapper": True}}
    return _compile_regions(model, backend, settings)


def _compile_regions(model: nn.Module, backend: str, settings: dict[str, Any]) -> int:
    count = 0
    for child in model.children():
        if isinstance(child, REGIONS):
            nested_fsdp = any(isinstance(m, FSDPModule) for m in child.modules() if m is not child)
            child.compile(backend=backend, dynamic=True, fullgraph=not nested_fsdp, **settings)
            count += 1
        else:
            count += _compile_regions(child, backend, settings)
    return count
