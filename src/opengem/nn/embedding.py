"""`EmbeddingCollection`: many embedding tables looked up from one `KeyedJagged` batch.

With an optimizer (the default), the tables are trained like fbgemm's TBE: the optimizer step runs
inside the backward of the lookup (duplicate ids aggregated first, one update per unique row per step,
no dense gradient), and the tables are buffers, NOT parameters, so a dense optimizer built from
``module.parameters()`` never touches them. Weights and optimizer state are in ``state_dict()`` (flat
per weight dtype: ``weights_<dtype>``, ``row_state_<dtype>``, ``elem_state_<dtype>``, ``step_<dtype>``),
so checkpoint and resume round-trip exactly. Each backward applies one step immediately (there is no
gradient accumulation across micro-batches; scale ``lr`` instead). With ``optimizer=None`` every table is an ordinary
``nn.Parameter`` (``weights.<table index>``, shape ``[rows, dim]``) with plain autograd gradients.

Initialization: ``init_std=None`` -> uniform on ``[-1/sqrt(num_embeddings), +1/sqrt(num_embeddings)]``
(TorchRec's default); otherwise normal with that standard deviation.

Id validation: ids outside ``[0, num_embeddings)`` raise ``ValueError`` naming the feature, the position
and the id, before any lookup reads a row. Always on CPU; on the GPU when ``validate_ids=True`` (the
default), at the cost of ONE host synchronization per forward (the checks of all weight groups are read
together). ``validate_ids=False`` removes it (a tuned training loop, once the data pipeline is trusted).

No other device synchronization: outputs are sized from the host mirror of the batch's lengths, which a
``KeyedJagged`` moved with ``.to(device)`` carries (`opengem.jagged.host`); the layout and the sequence
outputs' offsets go to the device through pinned memory. (A batch whose device lengths have no host mirror
is read to the host once.)
"""

from __future__ import annotations

import math
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from opengem.jagged import Jagged, KeyedJagged, offsets_from_lengths
from opengem.jagged.host import host_copy, to_device
from opengem.ops.embedding import (
    FusedUpdate,
    IdCheck,
    LookupLayout,
    check_update_settings,
    embedding_lookup,
    raise_bad_ids,
)
from opengem.validation import is_int, is_number, require_positive

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class EmbeddingTableConfig:
    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: tuple[str, ...]  # KeyedJagged keys looked up in this table
    pooling: Literal["sum", "mean", "none"] = "sum"  # "none": sequence feature, one output row per id
    dtype: torch.dtype = torch.float32  # fp32 / bf16 / fp16 weights
    init_std: float | None = None  # None: uniform(+-1/sqrt(num_embeddings))

    def __post_init__(self) -> None:
        for name in ("num_embeddings", "embedding_dim"):  # 4.5 failed later in torch.empty
            value = getattr(self, name)
            if not is_int(value):
                raise ValueError(f"table {self.name!r}: {name} must be an int, got {value!r}")
        if self.num_embeddings <= 0 or self.embedding_dim <= 0:
            raise ValueError(f"table {self.name!r}: num_embeddings and embedding_dim must be positive")
        if self.pooling not in ("sum", "mean", "none"):
            raise ValueError(f"table {self.name!r}: pooling must be 'sum', 'mean' or 'none', got {self.pooling!r}")
        if self.dtype not in _DTYPE_NAMES:
            raise ValueError(f"table {self.name!r}: dtype must be float32, bfloat16 or float16, got {self.dtype}")
        names = self.feature_names  # a bare str would be iterated as one feature per character
        if isinstance(names, str) or not isinstance(names, Sequence) or not all(isinstance(f, str) for f in names):
            raise ValueError(f"table {self.name!r}: feature_names must be a sequence of str, got {names!r}")
        if not names:
            raise ValueError(f"table {self.name!r} has no feature_names")
        std = self.init_std  # checked here: torch's normal_ had refused it without naming the table
        if std is not None and not (is_number(std) and 0 <= std < math.inf):
            raise ValueError(f"table {self.name!r}: init_std must be None or a finite number >= 0, got {std!r}")


@dataclass(frozen=True)
class EmbeddingOptimizer:
    """Optimizer applied inside the backward; definitions in `opengem.ops.embedding` (fbgemm's row-wise)."""

    kind: Literal["rowwise_adagrad", "sgd", "rowwise_adam"] = "rowwise_adagrad"
    lr: float = 0.01
    eps: float = 1e-8
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    # bf16 tables store their updated rows rounded stochastically (fbgemm's default for half-precision tables): to
    # nearest, a row's updates under half a bf16 ulp (a hot row's late Adagrad steps) would be lost
    stochastic_rounding: bool = True

    def __post_init__(self) -> None:
        kinds = typing.get_args(typing.get_type_hints(EmbeddingOptimizer)["kind"])
        if self.kind not in kinds:  # had surfaced only at the first training backward
            raise ValueError(f"kind must be one of {sorted(kinds)}, got {self.kind!r}")
        require_positive(self, ("lr",))  # stricter than the op: an lr of 0 here would train nothing
        check_update_settings(self.lr, self.eps, self.betas, self.weight_decay)  # the op's own checks (finite too)


@dataclass(frozen=True)
class _Group:
    """Tables sharing one flat weight buffer (one kernel launch): all of one dtype, or one table when unfused."""

    key: str
    tables: tuple[int, ...]
    weight_offsets: tuple[int, ...]  # element offset of each table in the flat buffer
    row_offsets: tuple[int, ...]  # offset of each table's first row in the row-wise state


def _init_table_(weight: torch.Tensor, config: EmbeddingTableConfig) -> torch.Tensor:
    """Initialize ``weight`` (any view, any float dtype) in place; see the module docstring."""
    if config.init_std is None:
        bound = 1.0 / math.sqrt(config.num_embeddings)
        return weight.uniform_(-bound, bound)
    return weight.normal_(0.0, config.init_std)


class EmbeddingCollection(nn.Module):
    def __init__(
        self,
        tables: Sequence[EmbeddingTableConfig],
        optimizer: EmbeddingOptimizer | None = EmbeddingOptimizer(),
        device: torch.device | str | None = None,
        validate_ids: bool = True,
    ) -> None:
        super().__init__()
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"table names must be unique, got {names}")
        self.tables = tuple(tables)
        self.optimizer = optimizer
        self.validate_ids = validate_ids
        self.feature_table: dict[str, int] = {}
        for index, table in enumerate(self.tables):
            for feature in table.feature_names:
                if feature in self.feature_table:
                    raise ValueError(f"feature {feature!r} is used by two tables")
                self.feature_table[feature] = index
        if optimizer is None:
            # a list, not a ParameterDict: table names like "items" or "keys" would clash with its methods
            self.weights = nn.ParameterList(
                [
                    nn.Parameter(_init_table_(torch.empty(t.num_embeddings, t.embedding_dim, dtype=t.dtype, device=device), t))
                    for t in self.tables
                ]
            )
            self._groups = tuple(_Group(str(i), (i,), (0,), (0,)) for i in range(len(self.tables)))
        else:
            self._groups = tuple(self._register_fused_groups(device))
            # set to 1 (on the device) before a backward whose fused update must not apply, e.g. by the
            # trainer when the loss is not finite: the kernels read it, so skipping costs no host sync
            self.register_buffer("update_skip", torch.zeros(1, device=device), persistent=False)

    def _register_fused_groups(self, device: torch.device | str | None) -> Iterator[_Group]:
        assert self.optimizer is not None
        for dtype, suffix in _DTYPE_NAMES.items():
            members = tuple(i for i, t in enumerate(self.tables) if t.dtype == dtype)
            if not members:
                continue
            configs = [self.tables[i] for i in members]
            sizes = [t.num_embeddings * t.embedding_dim for t in configs]
            rows = [t.num_embeddings for t in configs]
            weight_offsets = _prefix_sums(sizes)
            weights = torch.empty(sum(sizes), dtype=dtype, device=device)  # filled in place: no 2x peak memory
            for config, start, size in zip(configs, weight_offsets, sizes):
                _init_table_(weights[start : start + size], config)
            adam = self.optimizer.kind == "rowwise_adam"
            needs_rows = self.optimizer.kind != "sgd"
            self.register_buffer(f"weights_{suffix}", weights)
            self.register_buffer(f"row_state_{suffix}", torch.zeros(sum(rows) if needs_rows else 0, device=device))
            self.register_buffer(f"elem_state_{suffix}", torch.zeros(sum(sizes) if adam else 0, device=device))
            self.register_buffer(f"step_{suffix}", torch.zeros(1, dtype=torch.int64, device=device))
            yield _Group(suffix, members, weight_offsets, _prefix_sums(rows))

    def _apply(self, fn, recurse: bool = True):
        """Tables and optimizer state keep their configured dtypes under ``model.to(torch.bfloat16)``,
        ``.half()`` or ``.float()`` on a whole model: those move them (device) but never cast them (the
        table dtype is ``EmbeddingTableConfig.dtype``; the optimizer state is always fp32)."""

        def move_only(tensor: torch.Tensor) -> torch.Tensor:
            target = fn(tensor.new_empty(0))  # where fn would put the tensor, without its dtype change
            return tensor.to(device=target.device)

        return super()._apply(move_only, recurse)

    # --- accessors -------------------------------------------------------------------------------------

    def fused_parameters(self) -> Iterator[torch.Tensor]:
        """The flat weight buffers updated inside the backward (empty when ``optimizer=None``)."""
        if self.optimizer is not None:
            for group in self._groups:
                yield getattr(self, f"weights_{group.key}")

    def embedding_weight(self, table: str) -> torch.Tensor:
        """Table ``table`` as a ``[rows, dim]`` tensor (a view of the live weights, in either mode)."""
        index = next((i for i, t in enumerate(self.tables) if t.name == table), None)
        if index is None:
            raise KeyError(f"no table {table!r}; tables are {[t.name for t in self.tables]}")
        config = self.tables[index]
        if self.optimizer is None:
            return self.weights[index]
        group = next(g for g in self._groups if index in g.tables)
        start = group.weight_offsets[group.tables.index(index)]
        flat = getattr(self, f"weights_{group.key}")
        return flat[start : start + config.num_embeddings * config.embedding_dim].view(-1, config.embedding_dim)

    def _flat_weights(self, group: _Group) -> torch.Tensor:
        if self.optimizer is None:
            return self.weights[group.tables[0]].view(-1)
        return getattr(self, f"weights_{group.key}")

    def _update(self, group: _Group, device: torch.device) -> FusedUpdate | None:
        if self.optimizer is None or not torch.is_grad_enabled():
            return None
        opt = self.optimizer
        return FusedUpdate(
            kind=opt.kind,
            row_state=getattr(self, f"row_state_{group.key}"),
            elem_state=getattr(self, f"elem_state_{group.key}"),
            step=getattr(self, f"step_{group.key}"),
            anchor=torch.zeros(0, device=device, requires_grad=True),
            skip=self.update_skip,
            lr=opt.lr,
            eps=opt.eps,
            betas=opt.betas,
            weight_decay=opt.weight_decay,
            stochastic_rounding=opt.stochastic_rounding,
        )

    # --- forward ---------------------------------------------------------------------------------------

    def forward(self, features: KeyedJagged) -> dict[str, torch.Tensor | Jagged]:
        """One entry per feature of the collection: pooled -> ``[B, dim]``; pooling "none" -> Jagged ``[T, dim]``."""
        batch = _HostBatch(features, tuple(self.feature_table))
        lookups = []
        for group in self._groups:
            feature_names = [f for f in self.feature_table if self.feature_table[f] in group.tables]
            if feature_names:
                lookups.append(self._prepare_group(group, feature_names, batch))
        # every group's ids are checked before any lookup runs (a bad id must never reach a kernel), and
        # all the checks are read with one synchronization
        raise_bad_ids([lookup.check for lookup in lookups if lookup.check is not None])
        out: dict[str, torch.Tensor | Jagged] = {}
        for lookup in lookups:
            update = self._update(lookup.group, lookup.weights.device)
            flat = embedding_lookup(lookup.weights, lookup.layout, lookup.ids, lookup.offsets, update,
                                    ids_checked=lookup.check is not None)  # checked above, with feature names
            for name, config, values in zip(lookup.feature_names, lookup.configs, lookup.layout.split_outputs(flat)):
                out[name] = batch.jagged(name, values) if config.pooling == "none" else values
        return {name: out[name] for name in self.feature_table}

    def _prepare_group(self, group: _Group, feature_names: list[str], batch: _HostBatch) -> _GroupLookup:
        weights = self._flat_weights(group)
        ids, lengths = batch.select(feature_names)
        ids, lengths = ids.to(weights.device), lengths.to(weights.device)
        # lengths were checked on the host: a plain cumsum (offsets_from_lengths would sync to re-check them)
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
        torch.cumsum(lengths, 0, out=offsets[1:])
        positions = [group.tables.index(self.feature_table[f]) for f in feature_names]
        configs = [self.tables[group.tables[p]] for p in positions]
        check = None
        if ids.device.type == "cpu" or self.validate_ids:
            check = IdCheck.start(ids, offsets, batch.batch_size, [c.num_embeddings for c in configs], feature_names)
        layout = LookupLayout.build(
            tables=[
                (weight_offset, row_offset, self.tables[i].num_embeddings, self.tables[i].embedding_dim)
                for i, weight_offset, row_offset in zip(group.tables, group.weight_offsets, group.row_offsets)
            ],
            feature_tables=positions,
            feature_pooling=[c.pooling for c in configs],
            feature_lengths=[batch.count(f) for f in feature_names],
            batch_size=batch.batch_size,
            device=weights.device,
        )
        return _GroupLookup(group, tuple(feature_names), tuple(configs), weights, ids, offsets, layout, check)


@dataclass(frozen=True)
class _GroupLookup:
    """One weight group's lookup of a batch, prepared (and its id check started) before any lookup runs."""

    group: _Group
    feature_names: tuple[str, ...]
    configs: tuple[EmbeddingTableConfig, ...]
    weights: torch.Tensor
    ids: torch.Tensor
    offsets: torch.Tensor
    layout: LookupLayout
    check: IdCheck | None


def trust_ids(model: nn.Module) -> None:
    """Turn off the GPU id range check (one device sync per forward) of every ``EmbeddingCollection`` in
    ``model``: for ids in range by construction (the synthetic generators) or checked upstream."""
    for module in model.modules():
        if isinstance(module, EmbeddingCollection):
            module.validate_ids = False


def _prefix_sums(sizes: Sequence[int]) -> tuple[int, ...]:
    out, total = [], 0
    for size in sizes:
        out.append(total)
        total += size
    return tuple(out)


class _HostBatch:
    """A validated KeyedJagged with its lengths on the host (the mirror a ``.to(device)`` batch carries)."""

    def __init__(self, features: KeyedJagged, needed: tuple[str, ...]) -> None:
        if not isinstance(features, KeyedJagged):
            raise ValueError(f"features must be a KeyedJagged, got {type(features).__name__}")
        missing = [f for f in needed if f not in features.keys]
        if missing:
            raise ValueError(f"features is missing keys {missing}; it has {list(features.keys)}")
        if features.values.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"feature ids must be int32 or int64, got {features.values.dtype}")
        if features.lengths.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"feature lengths must be int32 or int64, got {features.lengths.dtype}")
        if features.weights is not None:
            raise ValueError("per-id weights are not supported by EmbeddingCollection")
        self.features = features
        self.batch_size = features.stride
        self.lengths_host = host_copy(features.lengths).long().view(len(features.keys), self.batch_size)
        if bool((self.lengths_host < 0).any()):
            raise ValueError("feature lengths must be non-negative")
        counts = self.lengths_host.sum(dim=1).tolist()
        if sum(counts) != features.values.numel():
            raise ValueError(f"lengths sum to {sum(counts)} but there are {features.values.numel()} ids")
        self.counts = dict(zip(features.keys, counts))
        self.starts = dict(zip(features.keys, _prefix_sums(counts)))

    def count(self, name: str) -> int:
        return self.counts[name]

    def select(self, names: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Ids and lengths of ``names`` only, feature-major (a copy unless they are the whole batch).

        Slices and ``cat`` only: indexing with a host list would copy the index to the device (a sync).
        """
        keys = self.features.keys
        if tuple(names) == keys:
            return self.features.values, self.features.lengths
        ids = torch.cat([self.features.values[self.starts[n] : self.starts[n] + self.counts[n]] for n in names])
        per_key = self.features.lengths.view(len(keys), self.batch_size)
        return ids, torch.cat([per_key[keys.index(n)] for n in names])

    def jagged(self, name: str, values: torch.Tensor) -> Jagged:
        lengths_host = self.lengths_host[self.features.keys.index(name)]
        offsets_host = offsets_from_lengths(lengths_host)
        max_len = int(lengths_host.max()) if self.batch_size else 0
        return Jagged(values, to_device(offsets_host, values.device), offsets_host, max_len)
