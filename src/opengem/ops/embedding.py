"""Fused multi-table embedding lookup (pooled and sequence features) with the optimizer applied in backward.

Layout. All tables live in ONE flat 1-D ``weights`` buffer (rows of table t, dim_t elements each,
concatenated), like fbgemm's TBE ``weights_dev`` + ``weights_offsets``. One buffer rather than a table of
per-table pointers because: one tensor is one custom-op argument that ``torch.compile`` and the mutation
annotations understand (raw ``data_ptr`` tables are invisible to both), per-table views for
``state_dict`` are free, and the kernels need just one base pointer. Tables of different weight dtypes
go in different buffers (one launch per dtype).

Each feature f (a KeyedJagged key) is described by one int64 row of ``feature_meta [F, 6]`` (columns
``WEIGHT_OFFSET, DIM, POOLING, OUT_OFFSET, ROW_OFFSET, NUM_ROWS`` in
`opengem.ops.reference.embedding`): where its table starts in
``weights`` (elements), the table's dim, its pooling (``POOL_SUM``, ``POOL_MEAN`` or ``POOL_NONE`` for a
sequence feature), where its output starts in the flat output (elements), where its table's first row
sits in the row-wise optimizer state, and the table's number of rows. Build it with
:meth:`LookupLayout.build`.

Input: ``ids [N]`` (int32/int64) and ``offsets [F * B + 1]`` (int32/int64), the KeyedJagged layout: bag
``f * B + b`` holds feature f's ids of sample b. Output: one flat buffer in ``weights.dtype``; feature f
occupies ``[OUT_OFFSET, OUT_OFFSET + B * dim)`` as ``[B, dim]`` when pooled (sum, or mean; an empty bag
gives 0) or ``[T_f, dim]`` (one row per id) for a sequence. Accumulation is fp32.

Optimizer in backward (``FusedUpdate``): the backward aggregates each unique row's gradient over the
whole batch (duplicate ids across bags and features of the same table give ONE update) and updates the
weights and the optimizer state in place; no dense table gradient exists. Definitions (g = aggregated
gradient of a row, plus ``weight_decay * w``, L2 style; rows absent from the batch are untouched):

- ``sgd``: ``w -= lr * g``.
- ``rowwise_adagrad`` (fbgemm's ``EXACT_ROWWISE_ADAGRAD``): one fp32 accumulator per row,
  ``state += mean(g**2 over the row)``, ``w -= lr * g / (sqrt(state) + eps)``.
- ``rowwise_adam``: first moment per element, second moment per row (mean of g**2), a global step
  count t (incremented once per backward, on the device), ``w -= lr * m_hat / (sqrt(v_hat) + eps)``
  with the usual bias corrections ``1 - beta**t``.

Low-precision weights are updated in fp32 and rounded to nearest once per step.

Dispatch: CUDA tensors run the Triton kernels; CPU tensors run the PyTorch reference; the environment
variable ``OPENGEM_EMBEDDING_BACKEND=triton`` forces Triton (for interpreter tests), ``=reference`` the
reference (also on CUDA: the reference-kernel training run of ``benchmarks/gem_curves.py``); another value is an
error naming the variable (``opengem.ops.backend``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import register_flop_formula

from opengem.jagged.host import known_host_copy, to_device
from opengem.jagged.jagged import validate_offsets
from opengem.ops.backend import triton_chosen
from opengem.ops.fp32_gemm import fp32_product
from opengem.ops.reference import embedding as reference
from opengem.ops.reference.embedding import (
    DIM,
    META_COLUMNS,
    NUM_ROWS,
    OPT_ROWWISE_ADAGRAD,
    OPT_ROWWISE_ADAM,
    OPT_SGD,
    OUT_OFFSET,
    POOL_MEAN,
    POOL_NONE,
    POOL_SUM,
    POOLING,
    ROW_OFFSET,
    WEIGHT_OFFSET,
)
from opengem.validation import is_int, is_number

POOLING_CODES = {"sum": POOL_SUM, "mean": POOL_MEAN, "none": POOL_NONE}
OPTIMIZER_CODES = {"sgd": OPT_SGD, "rowwise_adagrad": OPT_ROWWISE_ADAGRAD, "rowwise_adam": OPT_ROWWISE_ADAM}
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def _use_triton(weights: torch.Tensor) -> bool:
    return triton_chosen(weights.device, env="OPENGEM_EMBEDDING_BACKEND")


def _triton():  # imported lazily: CPU-only installs need no Triton
    from opengem.ops.triton import embedding as triton_embedding

    return triton_embedding


def _lookup_impl(
    weights, feature_meta, ids, offsets, batch_size: int, out_numel: int, max_dim: int, dim_align: int
) -> torch.Tensor:
    if _use_triton(weights):
        return _triton().embedding_lookup(weights, feature_meta, ids, offsets, batch_size, out_numel, max_dim, dim_align)
    return reference.embedding_lookup(weights, feature_meta, ids, offsets, batch_size, out_numel)


# ---------------------------------------------------------------------------------------------------
# custom ops


@torch.library.custom_op("opengem::embedding_lookup", mutates_args=())
def _lookup_op(
    weights: torch.Tensor,
    feature_meta: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    batch_size: int,
    out_numel: int,
    max_dim: int,
    dim_align: int,
) -> torch.Tensor:
    return _lookup_impl(weights, feature_meta, ids, offsets, batch_size, out_numel, max_dim, dim_align)


@_lookup_op.register_fake
def _(weights, feature_meta, ids, offsets, batch_size, out_numel, max_dim, dim_align):
    return weights.new_empty(out_numel)


@torch.library.custom_op("opengem::embedding_dense_grad", mutates_args=())
def _dense_grad_op(
    grad_out: torch.Tensor,
    weights: torch.Tensor,
    feature_meta: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    batch_size: int,
    max_dim: int,
    dim_align: int,
) -> torch.Tensor:
    if _use_triton(weights):
        return _triton().embedding_dense_grad(grad_out, weights, feature_meta, ids, offsets, batch_size, max_dim, dim_align)
    return reference.embedding_dense_grad(grad_out, weights, feature_meta, ids, offsets, batch_size)


@_dense_grad_op.register_fake
def _(grad_out, weights, feature_meta, ids, offsets, batch_size, max_dim, dim_align):
    return torch.empty_like(weights)


def _lookup_setup(ctx, inputs, output) -> None:
    weights, feature_meta, ids, offsets, batch_size, _, max_dim, dim_align = inputs
    ctx.save_for_backward(weights, feature_meta, ids, offsets)
    ctx.sizes = (batch_size, max_dim, dim_align)


def _lookup_backward(ctx, grad_out):
    weights, feature_meta, ids, offsets = ctx.saved_tensors
    grad = _dense_grad_op(grad_out.contiguous(), weights, feature_meta, ids, offsets, *ctx.sizes)
    return grad, None, None, None, None, None, None, None


_lookup_op.register_autograd(_lookup_backward, setup_context=_lookup_setup)


@torch.library.custom_op("opengem::embedding_fused_update_", mutates_args=("weights", "row_state", "elem_state", "step"))
def _fused_update_op(
    grad_out: torch.Tensor,
    weights: torch.Tensor,
    row_state: torch.Tensor,
    elem_state: torch.Tensor,
    step: torch.Tensor,
    skip: torch.Tensor,
    feature_meta: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    batch_size: int,
    max_dim: int,
    dim_align: int,
    optimizer: int,
    lr: float,
    eps: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    stochastic_rounding: bool,
) -> None:
    state = (grad_out, weights, row_state, elem_state, step, feature_meta, ids, offsets, batch_size)
    hyper = (optimizer, lr, eps, beta1, beta2, weight_decay)
    if _use_triton(weights):
        _triton().embedding_fused_update_(*state, max_dim, dim_align, *hyper, skip=skip,
                                          stochastic_rounding=stochastic_rounding)  # fmt: skip
    else:
        reference.embedding_fused_update_(*state, *hyper, skip=skip, stochastic_rounding=stochastic_rounding)


@_fused_update_op.register_fake
def _(grad_out, weights, row_state, elem_state, step, skip, feature_meta, ids, offsets, batch_size, max_dim, dim_align,
      *hyper):
    return None


@torch.library.custom_op("opengem::embedding_lookup_fused", mutates_args=())
def _fused_lookup_op(
    weights: torch.Tensor,
    row_state: torch.Tensor,
    elem_state: torch.Tensor,
    step: torch.Tensor,
    skip: torch.Tensor,
    anchor: torch.Tensor,
    feature_meta: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    batch_size: int,
    out_numel: int,
    max_dim: int,
    dim_align: int,
    optimizer: int,
    lr: float,
    eps: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    stochastic_rounding: bool,
) -> torch.Tensor:
    return _lookup_impl(weights, feature_meta, ids, offsets, batch_size, out_numel, max_dim, dim_align)


@_fused_lookup_op.register_fake
def _(weights, row_state, elem_state, step, skip, anchor, feature_meta, ids, offsets, batch_size, out_numel, max_dim, dim_align, *hyper):
    return weights.new_empty(out_numel)


def _fused_setup(ctx, inputs, output) -> None:
    weights, row_state, elem_state, step, skip, anchor, feature_meta, ids, offsets, batch_size, _, max_dim, dim_align, *hyper = inputs
    # The tables are kept as attributes, not saved tensors: the update mutates them in the backward, and
    # they are state (like an optimizer's), not activations. ``skip`` too: it is set after the forward.
    ctx.tables = (weights, row_state, elem_state, step, skip)
    ctx.save_for_backward(anchor, feature_meta, ids, offsets)
    ctx.sizes, ctx.hyper = (batch_size, max_dim, dim_align), hyper


def _fused_backward(ctx, grad_out):
    anchor, feature_meta, ids, offsets = ctx.saved_tensors
    weights, row_state, elem_state, step, skip = ctx.tables
    _fused_update_op(
        grad_out.contiguous(), weights, row_state, elem_state, step, skip, feature_meta, ids, offsets,
        *ctx.sizes, *ctx.hyper,
    )  # fmt: skip
    return (None, None, None, None, None, torch.zeros_like(anchor)) + (None,) * 14


_fused_lookup_op.register_autograd(_fused_backward, setup_context=_fused_setup)


@register_flop_formula([torch.ops.opengem.embedding_lookup, torch.ops.opengem.embedding_lookup_fused])
def _embedding_flops(*args, **kwargs) -> int:
    """Embedding lookups are memory traffic, not useful FLOPs (GEM_SPEC section 8): they count zero."""
    return 0


# ---------------------------------------------------------------------------------------------------
# public API


@dataclass(frozen=True)
class FusedUpdate:
    """Optimizer applied inside the backward of :func:`embedding_lookup`, and the state it updates.

    ``row_state``: fp32 ``[total rows]`` (Adagrad accumulator / Adam second moment; empty for SGD).
    ``elem_state``: fp32 shaped like ``weights`` for ``rowwise_adam`` (first moment), else empty.
    ``step``: int64 ``[1]`` step counter. ``anchor``: any tensor with ``requires_grad=True``; it connects
    the output to autograd (the weights themselves are not autograd leaves) and receives a zero gradient. A lookup in
    grad mode with an anchor that does not require grad is refused (its update would never run); under ``no_grad``
    the update is ignored.
    ``skip``: optional ``[1]`` flag read on the device when the backward runs: nonzero leaves the tables,
    the state and ``step`` untouched (the trainer sets it from ``isfinite(loss)``, without a host sync).
    ``stochastic_rounding``: bf16 tables store their updated rows rounded stochastically, keyed by ``step``
    (`opengem.ops.reference.embedding`); fp32 and fp16 tables round to nearest either way.
    """

    kind: str
    row_state: torch.Tensor
    elem_state: torch.Tensor
    step: torch.Tensor
    anchor: torch.Tensor
    lr: float = 0.01
    eps: float = 1e-8
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    skip: torch.Tensor | None = None
    stochastic_rounding: bool = True

    def __post_init__(self) -> None:
        # checked here, not in the backward: a bad kind, number or state had failed (or silently corrupted the
        # tables) only at the first training step. Sizes against the tables: at the lookup (_check_tables_fit).
        if self.kind not in OPTIMIZER_CODES:
            raise ValueError(f"update.kind must be one of {sorted(OPTIMIZER_CODES)}, got {self.kind!r}")
        check_update_settings(self.lr, self.eps, self.betas, self.weight_decay)
        states = [("row_state", self.row_state)] if self.kind != "sgd" else []
        states += [("elem_state", self.elem_state)] if self.kind == "rowwise_adam" else []
        for name, state in states:
            fp32_vector = isinstance(state, torch.Tensor) and state.dtype == torch.float32 and state.dim() == 1
            if not (fp32_vector and state.numel()):
                raise ValueError(f"update.{name} must be a non-empty 1-D fp32 tensor for {self.kind!r}, "
                                 f"got {_describe(state)}")  # fmt: skip
        if not isinstance(self.step, torch.Tensor) or self.step.dtype != torch.int64 or self.step.shape != (1,):
            raise ValueError(f"update.step must be an int64 [1] tensor, got {_describe(self.step)}")
        if self.skip is not None and (not isinstance(self.skip, torch.Tensor) or self.skip.shape != (1,)):
            raise ValueError(f"update.skip must be None or a [1] tensor, got {_describe(self.skip)}")
        if not isinstance(self.anchor, torch.Tensor):
            raise ValueError(f"update.anchor must be a tensor, got {type(self.anchor).__name__}")


def _describe(value: object) -> str:
    return f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def check_update_settings(lr: float, eps: float, betas: tuple[float, float], weight_decay: float) -> None:
    """The fused optimizer's numbers (shared by :class:`FusedUpdate` and ``opengem.nn.EmbeddingOptimizer``): a NaN,
    infinite or negative ``lr`` had run and written NaN or diverging rows into the tables without a word."""
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if not (is_number(value) and value >= 0):  # NaN fails too
            raise ValueError(f"{name} must be >= 0, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value!r}")
    if len(betas) != 2 or not all(is_number(beta) and 0 <= beta < 1 for beta in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas}")


@dataclass(frozen=True)
class LookupLayout:
    """Where each feature of one batch reads and writes: ``feature_meta`` plus the host sizes of the output.

    ``meta_rows`` is the host copy of ``feature_meta`` (used to split the flat output without a sync).
    """

    feature_meta: torch.Tensor  # int64 [F, 6] on the weights' device
    meta_rows: tuple[tuple[int, ...], ...]
    batch_size: int
    out_numel: int
    max_dim: int
    dim_align: int  # largest power of two <= 8 dividing every dim (lets kernels vectorize row loads)

    @classmethod
    def build(
        cls,
        tables: Sequence[tuple[int, int, int, int]],
        feature_tables: Sequence[int],
        feature_pooling: Sequence[str],
        feature_lengths: Sequence[int],
        batch_size: int,
        device: torch.device | str,
    ) -> LookupLayout:
        """``tables[t]`` = (weight offset in elements, row offset, rows, dim) of table t in the flat buffer.

        Feature f reads table ``feature_tables[f]`` with ``feature_pooling[f]`` ("sum", "mean", "none")
        and has ``feature_lengths[f]`` ids in the batch (sizes a sequence feature's output).
        """
        if not is_int(batch_size) or batch_size < 0:  # 2.5 had given a float out_numel
            raise ValueError(f"batch_size must be an int >= 0, got {batch_size!r}")
        per_feature = {"feature_tables": feature_tables, "feature_pooling": feature_pooling,
                       "feature_lengths": feature_lengths}  # fmt: skip
        if len({len(v) for v in per_feature.values()}) != 1:
            sizes = ", ".join(f"{name} {len(v)}" for name, v in per_feature.items())
            raise ValueError(f"feature_tables, feature_pooling and feature_lengths need one entry each, got {sizes}")
        fields = ("weight offset", "row offset", "rows", "dim")
        for t, table in enumerate(tables):  # a dim <= 0 or negative rows had given a negative out_numel
            if len(table) != 4:
                raise ValueError(f"tables[{t}] must be ({', '.join(fields)}), got {table!r}")
            for name, value, low in zip(fields, table, (0, 0, 1, 1)):
                if not is_int(value) or value < low:
                    raise ValueError(f"tables[{t}]: {name} must be an int >= {low}, got {value!r}")
        rows, out, max_dim = [], 0, 0
        for f, (table, pooling, count) in enumerate(zip(feature_tables, feature_pooling, feature_lengths, strict=True)):
            if not is_int(table) or not 0 <= table < len(tables):  # a negative index would wrap to another table
                raise ValueError(f"feature_tables[{f}] = {table} must be in [0, {len(tables)})")
            if pooling not in POOLING_CODES:
                raise ValueError(f"feature_pooling[{f}] must be one of {sorted(POOLING_CODES)}, got {pooling!r}")
            if not is_int(count) or count < 0:
                raise ValueError(f"feature_lengths[{f}] must be an int >= 0, got {count!r}")
            weight_offset, row_offset, num_rows, dim = tables[table]
            code = POOLING_CODES[pooling]
            rows.append((weight_offset, dim, code, out, row_offset, num_rows))
            out += (count if code == POOL_NONE else batch_size) * dim
            max_dim = max(max_dim, dim)
        # through pinned memory: a copy from pageable memory would wait for all queued GPU work
        meta = to_device(torch.tensor(rows, dtype=torch.int64).reshape(-1, META_COLUMNS), torch.device(device))
        dim_align = math.gcd(8, *(row[DIM] for row in rows))  # 8, 4, 2 or 1: every offset is a multiple
        return cls(meta, tuple(rows), batch_size, out, max_dim, dim_align)

    def split_outputs(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each feature's ``[B, dim]`` (pooled) or ``[T_f, dim]`` (sequence) view of the flat output.

        One ``split`` rather than F slices: its backward is a single concatenation, whereas each slice's
        backward would materialize a zero-filled gradient as large as the whole output.
        """
        ends = [row[OUT_OFFSET] for row in self.meta_rows[1:]] + [self.out_numel]
        sizes = [end - row[OUT_OFFSET] for row, end in zip(self.meta_rows, ends)]
        return [part.view(-1, row[DIM]) for part, row in zip(flat.split(sizes), self.meta_rows)]


def check_embedding_inputs(
    weights: torch.Tensor, feature_meta: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, batch_size: int
) -> None:
    """Shape/dtype/device checks (no device sync). Id ranges are checked by :func:`check_ids`."""
    if weights.dtype not in WEIGHT_DTYPES or weights.dim() != 1:
        raise ValueError(f"weights must be a 1-D fp32/bf16/fp16 buffer, got {weights.dtype} {tuple(weights.shape)}")
    if feature_meta.dtype != torch.int64 or feature_meta.dim() != 2 or feature_meta.shape[1] != META_COLUMNS:
        raise ValueError(f"feature_meta must be int64 [F, {META_COLUMNS}], got {feature_meta.dtype} {tuple(feature_meta.shape)}")
    if ids.dtype not in INDEX_DTYPES or ids.dim() != 1:
        raise ValueError(f"ids must be 1-D int32/int64, got {ids.dtype} {tuple(ids.shape)}")
    if offsets.dtype not in INDEX_DTYPES or offsets.dim() != 1:
        raise ValueError(f"offsets must be 1-D int32/int64, got {offsets.dtype} {tuple(offsets.shape)}")
    expected = feature_meta.shape[0] * batch_size + 1
    if offsets.numel() != expected:
        raise ValueError(f"offsets must have F * B + 1 = {expected} entries, got {offsets.numel()}")
    for name, tensor in (("feature_meta", feature_meta), ("ids", ids), ("offsets", offsets)):
        if tensor.device != weights.device:
            raise ValueError(f"{name} is on {tensor.device} but weights are on {weights.device}")
    for name, tensor in (("weights", weights), ("feature_meta", feature_meta), ("ids", ids), ("offsets", offsets)):
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernels index it as a dense buffer)")


@dataclass(frozen=True)
class IdCheck:
    """A range check of one lookup's ids, started on the ids' device without a sync (:meth:`start`).

    ``bad`` (bool ``[N]``) marks the ids outside ``[0, num_rows[f])``. :func:`raise_bad_ids` reads the
    checks of many lookups with ONE host synchronization and raises for the first bad id.
    """

    ids: torch.Tensor
    feature_starts: torch.Tensor  # [F + 1]: where each feature's ids begin
    num_rows: tuple[int, ...]
    feature_names: tuple[str, ...]
    bad: torch.Tensor

    @classmethod
    def start(
        cls,
        ids: torch.Tensor,
        offsets: torch.Tensor,
        batch_size: int,
        num_rows: Sequence[int],
        feature_names: Sequence[str],
    ) -> IdCheck:
        """``ids [N]`` and ``offsets [F * B + 1]`` in the KeyedJagged layout; feature f has ``num_rows[f]`` rows."""
        if len(feature_names) != len(num_rows):
            raise ValueError(f"num_rows has {len(num_rows)} entries but feature_names {len(feature_names)}")
        if not is_int(batch_size) or batch_size < 0:
            raise ValueError(f"batch_size must be an int >= 0, got {batch_size!r}")
        if offsets.numel() != len(num_rows) * batch_size + 1:
            raise ValueError(f"offsets must have F * B + 1 = {len(num_rows) * batch_size + 1} entries "
                             f"(F = {len(num_rows)} features, B = {batch_size}), got {offsets.numel()}")  # fmt: skip
        if batch_size == 0 and ids.numel():  # had failed in offsets[::0]
            raise ValueError(f"batch_size is 0 (an empty batch) but there are {ids.numel()} ids")
        if ids.numel() == 0:  # also covers B = 0
            starts = torch.zeros(len(num_rows) + 1, dtype=torch.int64)
            return cls(ids, starts, tuple(num_rows), tuple(feature_names), torch.zeros(0, dtype=torch.bool, device=ids.device))
        limits = to_device(torch.tensor(list(num_rows), dtype=torch.int64), ids.device)  # pinned: no sync
        starts = offsets[::batch_size].long()
        limit_of_id = torch.repeat_interleave(limits, starts[1:] - starts[:-1], output_size=ids.numel())
        return cls(ids, starts, tuple(num_rows), tuple(feature_names), (ids < 0) | (ids >= limit_of_id))

    def raise_first(self) -> None:
        """Raise ``ValueError`` naming the feature, position and id of the first bad id (syncs; error path)."""
        if not bool(self.bad.any()):
            return
        position = int(torch.nonzero(self.bad)[0])
        host_starts = self.feature_starts.tolist()
        feature = max(f for f in range(len(self.num_rows)) if host_starts[f] <= position)
        raise ValueError(
            f"feature {self.feature_names[feature]!r}: id {int(self.ids[position])} at position "
            f"{position - host_starts[feature]} is out of range [0, {self.num_rows[feature]})"
        )


def raise_bad_ids(checks: Sequence[IdCheck]) -> None:
    """Raise for the first bad id of ``checks``; one host synchronization for all of them together."""
    if not checks:
        return
    if bool(torch.stack([check.bad.any() for check in checks]).any()):
        for check in checks:
            check.raise_first()


def check_ids(
    ids: torch.Tensor, offsets: torch.Tensor, batch_size: int, num_rows: Sequence[int], feature_names: Sequence[str]
) -> None:
    """Raise ``ValueError`` naming the feature, position and id of the first id outside ``[0, num_rows[f])``.

    One host synchronization (on a device); the detailed search runs only when an id is bad. To check many
    lookups with one synchronization, start an :class:`IdCheck` for each and pass them to :func:`raise_bad_ids`.
    """
    raise_bad_ids([IdCheck.start(ids, offsets, batch_size, num_rows, feature_names)])


def _check_bags(layout: LookupLayout, ids: torch.Tensor, offsets: torch.Tensor, ids_checked: bool) -> None:
    """The offsets against the ids and the layout, and on the CPU the ids' ranges unless ``ids_checked``: wherever
    that needs no device sync (CPU tensors, or offsets with a registered host mirror). The kernels read whatever the
    offsets and ids point at, so a device caller without a mirror checks first (:func:`check_ids`, the jagged
    constructors)."""
    host = known_host_copy(offsets)
    if host is None:
        return
    validate_offsets(offsets, ids.numel(), "offsets")  # reads the mirror (and its cached summary), no sync
    batch = layout.batch_size
    for f, row in enumerate(layout.meta_rows):
        if row[POOLING] != POOL_NONE:
            continue
        end = layout.meta_rows[f + 1][OUT_OFFSET] if f + 1 < len(layout.meta_rows) else layout.out_numel
        sized, given = (end - row[OUT_OFFSET]) // row[DIM], int(host[(f + 1) * batch] - host[f * batch])
        if sized != given:  # the kernel writes the layout's rows: extra ids would be dropped, missing ones unwritten
            raise ValueError(f"feature {f} (pooling 'none'): the layout has rows for {sized} ids, offsets give {given}")
    if ids.device.type == "cpu" and not ids_checked:
        check_ids(ids, host, batch, [row[NUM_ROWS] for row in layout.meta_rows],
                  [str(f) for f in range(len(layout.meta_rows))])  # "feature '2': id ..."


def _check_tables_fit(weights: torch.Tensor, layout: LookupLayout, update: FusedUpdate | None) -> None:
    """Each table the layout reads inside ``weights``, and inside the update's state (host ints only: no sync).
    The reference had failed in a view, the kernels would read and write past the buffers."""
    for f, row in enumerate(layout.meta_rows):
        table = f"feature {f}'s table ({row[NUM_ROWS]} rows x dim {row[DIM]} at element {row[WEIGHT_OFFSET]})"
        if row[WEIGHT_OFFSET] + row[NUM_ROWS] * row[DIM] > weights.numel():
            raise ValueError(f"weights has {weights.numel()} elements, too few for {table}")
        state_rows = row[ROW_OFFSET] + row[NUM_ROWS]
        if update is not None and update.kind != "sgd" and state_rows > update.row_state.numel():
            raise ValueError(f"update.row_state has {update.row_state.numel()} rows, too few for {table} "
                             f"at state row {row[ROW_OFFSET]}")  # fmt: skip
    if update is None:
        return
    if update.kind == "rowwise_adam" and update.elem_state.shape != weights.shape:
        raise ValueError(f"update.elem_state must be shaped like weights {tuple(weights.shape)} for 'rowwise_adam', "
                         f"got {tuple(update.elem_state.shape)}")  # fmt: skip
    for name in ("row_state", "elem_state", "step", "skip"):
        state = getattr(update, name)
        if state is not None and state.numel() and (state.device != weights.device or not state.is_contiguous()):
            layout_name = "contiguous" if state.is_contiguous() else "non-contiguous"
            raise ValueError(f"update.{name} must be contiguous on weights' device {weights.device}, "
                             f"got {layout_name} on {state.device}")  # fmt: skip


def embedding_lookup(
    weights: torch.Tensor,
    layout: LookupLayout,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    update: FusedUpdate | None = None,
    *,
    ids_checked: bool = False,
) -> torch.Tensor:
    """Look up every feature of a KeyedJagged batch in one launch; returns the flat output (see module doc).

    Args:
        weights: flat ``[sum_t rows_t * dim_t]`` fp32/bf16/fp16 buffer of all tables.
        layout: the batch's :class:`LookupLayout` (``feature_meta`` on ``weights``' device).
        ids: ``[N]`` int32/int64 ids; checked against each table's rows on the CPU, read as in range on a
            device (check them with :func:`check_ids` or :class:`IdCheck`: the op does not sync).
        offsets: ``[F * B + 1]`` int32/int64 bag offsets over ``ids``; validated where a host copy is at hand
            (CPU tensors, device tensors with a registered mirror, :mod:`opengem.jagged.host`).
        update: ``None`` -> plain autograd (a dense gradient of ``weights`` if it requires grad);
            a :class:`FusedUpdate` -> the optimizer step runs inside the backward and mutates
            ``weights`` and the state in place.
        ids_checked: the caller already ran :func:`check_ids` / :class:`IdCheck` on these ids (as an embedding
            module does for all its lookups at once, before any runs): skip the op's own CPU check.
    Returns:
        ``[layout.out_numel]`` in ``weights.dtype``; split it with :meth:`LookupLayout.split_outputs`.
    """
    check_embedding_inputs(weights, layout.feature_meta, ids, offsets, layout.batch_size)
    if not torch.compiler.is_compiling():
        _check_bags(layout, ids, offsets, ids_checked)
        _check_tables_fit(weights, layout, update)
    sizes = (layout.batch_size, layout.out_numel, layout.max_dim, layout.dim_align)
    if update is None:
        return _lookup_op(weights, layout.feature_meta, ids, offsets, *sizes)
    if torch.is_grad_enabled() and not update.anchor.requires_grad:
        # the anchor is the output's only autograd input: without requires_grad the backward, and with it the
        # update, would never run and the tables would silently stay as they are (under no_grad nothing trains)
        raise ValueError("update.anchor must require grad while grad mode is on: it carries the fused update "
                         "through autograd (pass update=None, or look up under torch.no_grad(), for no update)")
    skip = torch.zeros(1, device=weights.device) if update.skip is None else update.skip
    return _fused_lookup_op(
        weights, update.row_state, update.elem_state, update.step, skip, update.anchor, layout.feature_meta, ids, offsets,
        *sizes, OPTIMIZER_CODES[update.kind], update.lr, update.eps, update.betas[0], update.betas[1],
        update.weight_decay, update.stochastic_rounding,
    )  # fmt: skip


@torch.library.custom_op("opengem::few_row_grad", mutates_args=())
def few_row_grad(ids: torch.Tensor, grad: torch.Tensor, rows: int) -> torch.Tensor:
    """The fp32 gradient ``[rows, d]`` of a table of a few rows looked up at ``ids`` (``grad [N, d]``: the looked-up
    rows' gradients), summed by id as one GEMM on the ids' one-hot matrix (exact products, fp32 sums): no scatter of
    ``N x d`` atomic adds into a few rows. A custom op, so FLOP counters skip it: an embedding's gradient counts zero
    (GEM_SPEC section 8)."""
    with torch.autocast(grad.device.type, enabled=False):
        # [rows, N] as the transpose of an [N, rows] matrix (its rows, not N, make the GEMM's leading dimension), built
        # in grad's dtype with no int64 one-hot matrix first
        one_hot = (ids.unsqueeze(1) == torch.arange(rows, device=ids.device)).to(grad.dtype).t()
        return fp32_product(one_hot, grad)


@few_row_grad.register_fake
def _(ids, grad, rows):
    return grad.new_empty((rows, grad.shape[1]), dtype=torch.float32)


__all__ = [
    "FusedUpdate",
    "IdCheck",
    "LookupLayout",
    "check_embedding_inputs",
    "check_ids",
    "check_update_settings",
    "embedding_lookup",
    "few_row_grad",
    "raise_bad_ids",
]
