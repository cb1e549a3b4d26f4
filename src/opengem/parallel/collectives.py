"""Collective selection (NCCL kernels or SM-free copy-engine transfers) and a per-step byte counter.

Why: NCCL kernels occupy ~24 SMs each and cost up to 15% of compute efficiency; copy-engine
all-gathers inside a host use almost none (GEM_SPEC section 7). Two SM-free routes exist:

1. NCCL's zero-CTA policy (``NCCL_CTA_POLICY_ZERO``, NCCL >= 2.28): NCCL runs intra-node all-gather /
   all-to-all on the copy engines when the buffers live in registered symmetric windows. PyTorch
   exposes it as ``ProcessGroupNCCL.Options().config.cta_policy`` or the ``NCCL_CTA_POLICY=2``
   environment variable, and FSDP2 allocates its all-gather buffers in symmetric memory with
   ``FSDPModule.set_symm_mem_for_comm()``.
2. PyTorch symmetric memory's copy-engine ("low contention") all-gather,
   ``torch.distributed._symmetric_memory._low_contention_all_gather``, usable for our own gathers
   (expert-parallel activations) when route 1 is unavailable.

``select_collectives`` is the pure decision (unit-tested on CPU); ``probe_capabilities`` reads the
installed torch / NCCL. NVLink multicast (NVLS / multimem) stays off: ``setup_environment`` sets
``NCCL_NVLS_ENABLE=0`` and ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and nothing here calls a multicast API.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

MIN_NCCL_FOR_ZERO_CTA = (2, 28)
NCCL_CTA_POLICY_ZERO_VALUE = "2"
MULTICAST_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
PROCESS_GROUP = "process_group"  # all-gather routes
SYMM_MEM_COPY_ENGINE = "symm_mem_copy_engine"


@dataclass(frozen=True)
class Capabilities:
    """What the installed stack offers. ``nccl_version`` is ``None`` without NCCL (CPU builds)."""

    backend: str
    nccl_version: tuple[int, int, int] | None
    torch_has_cta_policy_zero: bool
    fsdp_has_symm_mem: bool
    symm_mem_all_gather: bool


@dataclass(frozen=True)
class CollectivePlan:
    """The chosen route. ``reason`` says why, in one line, for the run log."""

    nccl_zero_cta: bool
    fsdp_symm_mem: bool
    expert_all_gather: str  # PROCESS_GROUP or SYMM_MEM_COPY_ENGINE
    reason: str

    @property
    def is_default(self) -> bool:
        """Whether this route is the default one (for ``copy_engine``: a fallback, which ``reason`` explains)."""
        return not (self.nccl_zero_cta or self.fsdp_symm_mem) and self.expert_all_gather == PROCESS_GROUP


def select_collectives(requested: str, caps: Capabilities) -> CollectivePlan:
    """Choose the collective route for ``requested`` (``"default"`` or ``"copy_engine"``).

    - ``"default"``: NCCL / gloo kernels everywhere.
    - ``"copy_engine"`` on NCCL:
      * NCCL >= 2.28 and torch exposing ``NCCL_CTA_POLICY_ZERO``: zero-CTA policy for every
        communicator; FSDP all-gather buffers in symmetric memory when FSDP2 offers
        ``set_symm_mem_for_comm``; the expert all-gather goes through the process group (NCCL then
        uses the copy engines itself).
      * otherwise, if torch's symmetric-memory copy-engine all-gather exists: use it for the expert
        all-gather; FSDP keeps NCCL kernels.
      * otherwise: default route, with the reason.
    - ``"copy_engine"`` on any other backend (gloo): default route (copy engines are a GPU feature).
    """
    if requested not in ("default", "copy_engine"):
        raise ValueError(f"collectives must be 'default' or 'copy_engine', got {requested!r}")
    if requested == "default":
        return CollectivePlan(False, False, PROCESS_GROUP, "default collectives requested")
    if caps.backend != "nccl":
        return CollectivePlan(False, False, PROCESS_GROUP, f"copy_engine needs NCCL; backend is {caps.backend}")
    has_zero_cta = (
        caps.nccl_version is not None
        and caps.nccl_version[:2] >= MIN_NCCL_FOR_ZERO_CTA
        and caps.torch_has_cta_policy_zero
    )
    if has_zero_cta:
        return CollectivePlan(
            True, caps.fsdp_has_symm_mem, PROCESS_GROUP, f"NCCL {caps.nccl_version} zero-CTA policy"
        )
    if caps.symm_mem_all_gather:
        return CollectivePlan(
            False,
            False,
            SYMM_MEM_COPY_ENGINE,
            f"NCCL {caps.nccl_version} lacks zero-CTA; symmetric-memory copy-engine all-gather for experts",
        )
    return CollectivePlan(False, False, PROCESS_GROUP, f"no copy-engine route with NCCL {caps.nccl_version}")


def probe_capabilities(backend: str) -> Capabilities:
    """Read the installed torch / NCCL features (safe on CPU builds)."""
    nccl_version = None
    if backend == "nccl" and torch.cuda.is_available():
        version = torch.cuda.nccl.version()
        nccl_version = tuple(version[:3]) if isinstance(version, tuple) else _split_nccl_code(version)
    process_group_nccl = getattr(dist, "ProcessGroupNCCL", None)
    try:
        from torch.distributed import _symmetric_memory as symm_mem

        symm_mem_all_gather = hasattr(symm_mem, "_low_contention_all_gather")
    except ImportError:
        symm_mem_all_gather = False
    from torch.distributed.fsdp import FSDPModule

    return Capabilities(
        backend=backend,
        nccl_version=nccl_version,
        torch_has_cta_policy_zero=hasattr(process_group_nccl, "NCCL_CTA_POLICY_ZERO"),
        fsdp_has_symm_mem=hasattr(FSDPModule, "set_symm_mem_for_comm"),
        symm_mem_all_gather=symm_mem_all_gather and torch.cuda.is_available(),
    )


def _split_nccl_code(code: int) -> tuple[int, int, int]:
    """NCCL's integer version code: 2.28.3 is 22803 (>= 2.9), 2.8.4 is 2804."""
    if code >= 10000:
        return code // 10000, code % 10000 // 100, code % 100
    return code // 1000, code % 1000 // 100, code % 100


def setup_environment(requested: str = "default", caps: Capabilities | None = None) -> CollectivePlan:
    """Set the collective environment variables; call before ``init_process_group`` on every rank.

    Always turns NVLink multicast off. For a zero-CTA plan sets ``NCCL_CTA_POLICY=2`` (picked up by
    every NCCL communicator created afterwards). Variables already set by the user are kept.
    """
    for key, value in MULTICAST_OFF_ENV.items():
        os.environ.setdefault(key, value)
    plan = select_collectives(requested, caps or probe_capabilities(_backend_from_env()))
    if plan.nccl_zero_cta:
        os.environ.setdefault("NCCL_CTA_POLICY", NCCL_CTA_POLICY_ZERO_VALUE)
    return plan


def _backend_from_env() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


# torch >= 2.12 names the fixed-size collectives ``*_single`` and deprecates the older names; the GPU
# image's torch 2.11 may only have the older ones.
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def enable_copy_engine_all_gather(group: dist.ProcessGroup) -> None:
    """Prepare ``group`` for ``all_gather_single(..., route=SYMM_MEM_COPY_ENGINE)`` (torch versions that need it)."""
    from torch.distributed import _symmetric_memory as symm_mem

    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None and not symm_mem.is_symm_mem_enabled_for_group(group.group_name):
        enable(group.group_name)


def all_gather_single(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, route: str = PROCESS_GROUP
) -> None:
    """``output`` (world * n, ...) <- concatenation of every rank's ``input`` (n, ...).

    ``route=SYMM_MEM_COPY_ENGINE`` (CUDA only) copies the peers' buffers with the copy engines through
    PyTorch symmetric memory instead of running an NCCL kernel; call ``enable_copy_engine_all_gather``
    on the group first.
    """
    if route == SYMM_MEM_COPY_ENGINE:
        gathered = torch.ops.symm_mem._low_contention_all_gather(input, group.group_name)
        output.copy_(torch.ops._c10d_functional.wait_tensor(gathered))
        return
    _ALL_GATHER_SINGLE(output, input, group=group)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``output`` (n, ...) <- block ``rank`` of the sum over ranks of ``input`` (world * n, ...)."""
    _REDUCE_SCATTER_SINGLE(output, input, group=group)


class CommStats:
    """Bytes moved per collective and per mesh dimension, accumulated until ``reset()`` (once a step).

    Convention (nccl-tests' "size"): each entry is the size in bytes of the collective's full buffer
    on one rank: the all-gather output, the reduce-scatter input, the all-reduce tensor. Padding
    that is actually sent counts. ``calls`` counts the collectives issued.
    """

    def __init__(self) -> None:
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)

    def record(self, dim: str, collective: str, nbytes: int) -> None:
        self.bytes[(dim, collective)] += int(nbytes)
        self.calls[(dim, collective)] += 1

    def add(self, counts: dict[tuple[str, str], int]) -> None:
        """Add analytic counts (e.g. ``fsdp_step_bytes``) as one call each."""
        for (dim, collective), nbytes in counts.items():
            self.record(dim, collective, nbytes)

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def total(self) -> int:
        return sum(self.bytes.values())

    def as_dict(self) -> dict[str, int]:
        """``{"dim/collective": bytes}``, sorted, for logging."""
        return {f"{dim}/{collective}": n for (dim, collective), n in sorted(self.bytes.items())}
