"""Bytes moved by a step's element-wise work, counted on any device (eager, no GPU needed).

``ElementwiseBytes`` is a dispatch mode that adds up the bytes of every input and output of the aten ops
other than GEMMs and views, and of nothing inside opengem's own ops (attention, embeddings: their
kernels are measured on the GPU). Eager counts overstate what a compiled step moves (Inductor fuses chains
of these ops), but they compare two settings of one model fairly: the sequence stream in fp32 against bf16
(``GEMConfig.sequence_dtype``), for example.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, ClassVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class ElementwiseBytes(TorchDispatchMode):
    """``total``: bytes read and written by the non-GEMM, non-view aten ops run under the mode; ``by_op``:
    the same per aten op name (``"add.Tensor"``), which ops the bytes are in."""

    SKIP: ClassVar[frozenset[str]] = frozenset({
        "mm", "addmm", "bmm", "baddbmm", "view", "_unsafe_view", "t", "transpose", "expand", "unsqueeze",
        "squeeze", "slice", "select", "permute", "as_strided", "detach", "alias", "split", "unbind",
        "split_with_sizes", "_reshape_alias",
    })  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.by_op: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.namespace != "opengem" and func.__name__.split(".")[0] not in self.SKIP:
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            moved = sum(t.numel() * t.element_size() for t in tensors)
            self.total += moved
            self.by_op[func.__name__] += moved
        return out
