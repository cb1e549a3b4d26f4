"""Plain PyTorch specification of the fused embedding lookup and of its in-backward optimizer update.

Layout (shared with the Triton kernels, described in full in `opengem.ops.embedding`):

- ``weights``: every table's rows concatenated in one flat 1-D buffer.
- ``feature_meta``: int64 ``[F, 6]``; row f gives feature f's table as (element offset of the table in
  ``weights``, dim, pooling code, element offset of the feature's output in the flat output, offset of
  the table's first row in the row-wise state, number of rows).
- ``ids`` ``[N]`` and ``offsets`` ``[F * B + 1]``: the KeyedJagged layout (feature-major bags).

Everything is computed in fp32 and rounded to the weights' dtype once at the end: to nearest, or for bf16 tables
with ``stochastic_rounding`` (fbgemm's default for half-precision tables) stochastically
(`opengem.ops.reference.rounding`), so that updates under half a bf16 ulp (a hot row's late Adagrad steps) still
move the row in expectation. The bits are keyed by the step count and counted by each element's index in
``weights``; fp16 tables round to nearest.
"""

from __future__ import annotations

import torch

from opengem.ops.reference.rounding import counter_bits, element_counters, step_key, stochastic_round_bf16

# Columns of ``feature_meta`` and pooling codes (imported by the op and the kernels).
WEIGHT_OFFSET, DIM, POOLING, OUT_OFFSET, ROW_OFFSET, NUM_ROWS = range(6)
META_COLUMNS = 6
POOL_SUM, POOL_MEAN, POOL_NONE = 0, 1, 2
OPT_SGD, OPT_ROWWISE_ADAGRAD, OPT_ROWWISE_ADAM = 0, 1, 2
EMBEDDING_ROUNDING_SEED = 0x5EED  # the tables' rounding key, with the step (the AdamW shadows' keys use the run's seed)


def _table_view(weights: torch.Tensor, meta: list[int]) -> torch.Tensor:
    start, dim, rows = meta[WEIGHT_OFFSET], meta[DIM], meta[NUM_ROWS]
    return weights[start : start + rows * dim].view(rows, dim)


def _bag_of_each_id(lengths: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)


def _feature_bounds(offsets: torch.Tensor, batch_size: int, num_features: int) -> list[int]:
    """Where each feature's ids start (F + 1 host ints). Only these, not all F * B + 1 offsets: under
    ``torch.compile`` every host int becomes a traced symbol and a guard, so a whole-offsets ``tolist``
    made compile time grow with the batch (minutes at B = 8192)."""
    return offsets[::batch_size].tolist() if batch_size else [0] * (num_features + 1)


def embedding_lookup(
    weights: torch.Tensor, feature_meta: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, batch_size: int, out_numel: int
) -> torch.Tensor:
    """Flat output ``[out_numel]`` in ``weights.dtype``: pooled features ``[B, dim]``, sequences ``[T_f, dim]``."""
    out = torch.zeros(out_numel, dtype=torch.float32, device=weights.device)
    bounds = _feature_bounds(offsets, batch_size, feature_meta.shape[0])
    for f, meta in enumerate(feature_meta.tolist()):
        first, last = bounds[f], bounds[f + 1]
        rows = _table_view(weights, meta).index_select(0, ids[first:last].long()).float()
        if meta[POOLING] != POOL_NONE:
            lengths = offsets[f * batch_size + 1 : (f + 1) * batch_size + 1] - offsets[f * batch_size : (f + 1) * batch_size]
            pooled = torch.zeros(batch_size, meta[DIM], device=weights.device).index_add_(0, _bag_of_each_id(lengths), rows)
            if meta[POOLING] == POOL_MEAN:
                pooled = pooled / lengths.clamp(min=1)[:, None]
            rows = pooled
        out[meta[OUT_OFFSET] : meta[OUT_OFFSET] + rows.numel()] = rows.flatten()
    return out.to(weights.dtype)


def per_id_gradients(
    grad_out: torch.Tensor, feature_meta: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, batch_size: int
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """For each table (keyed by its row offset): the ids looked up in it and each id's fp32 gradient row."""
    bounds = _feature_bounds(offsets, batch_size, feature_meta.shape[0])
    grad_out = grad_out.float()
    per_table: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for f, meta in enumerate(feature_meta.tolist()):
        first, last = bounds[f], bounds[f + 1]
        dim, start = meta[DIM], meta[OUT_OFFSET]
        if meta[POOLING] == POOL_NONE:
            grads = grad_out[start : start + (last - first) * dim].view(-1, dim)
        else:
            lengths = offsets[f * batch_size + 1 : (f + 1) * batch_size + 1] - offsets[f * batch_size : (f + 1) * batch_size]
            pooled_grad = grad_out[start : start + batch_size * dim].view(batch_size, dim)
            if meta[POOLING] == POOL_MEAN:
                pooled_grad = pooled_grad / lengths.clamp(min=1)[:, None]
            grads = pooled_grad.index_select(0, _bag_of_each_id(lengths))
        per_table.setdefault(meta[ROW_OFFSET], []).append((ids[first:last].long(), grads))
    return {key: (torch.cat([i for i, _ in parts]), torch.cat([g for _, g in parts])) for key, parts in per_table.items()}


def embedding_dense_grad(
    grad_out: torch.Tensor, weights: torch.Tensor, feature_meta: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, batch_size: int
) -> torch.Tensor:
    """The plain autograd gradient of ``weights`` (dense, same shape and dtype), for the unfused path."""
    grad = torch.zeros(weights.shape, dtype=torch.float32, device=weights.device)
    metas = {m[ROW_OFFSET]: m for m in feature_meta.tolist()}
    for key, (table_ids, grads) in per_id_gradients(grad_out, feature_meta, ids, offsets, batch_size).items():
        _table_view(grad, metas[key]).index_add_(0, table_ids, grads)
    return grad.to(weights.dtype)


def embedding_fused_update_(
    grad_out: torch.Tensor,
    weights: torch.Tensor,
    row_state: torch.Tensor,
    elem_state: torch.Tensor,
    step: torch.Tensor,
    feature_meta: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    batch_size: int,
    optimizer: int,
    lr: float,
    eps: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    skip: torch.Tensor | None = None,
    stochastic_rounding: bool = False,
) -> None:
    """Aggregate the gradient of each unique row of the batch, then apply one optimizer step to it, in place.

    ``row_state`` (fp32, one per row of all tables): the Adagrad accumulator or Adam's second moment.
    ``elem_state`` (fp32, shaped like ``weights``; empty unless Adam): Adam's first moment.
    ``step`` (int64 ``[1]``): the number of optimizer steps, incremented here (Adam's bias correction).
    ``skip`` (``[1]``, optional): nonzero -> nothing changes (the step of a non-finite loss).
    ``stochastic_rounding``: a bf16 ``weights`` takes its updated rows rounded stochastically (module doc).
    """
    if skip is not None and bool(skip.item() != 0):
        return
    step += 1
    count = int(step.item())
    t = float(count) if optimizer == OPT_ROWWISE_ADAM else 0.0
    stochastic = stochastic_rounding and weights.dtype == torch.bfloat16
    bits_key = step_key(EMBEDDING_ROUNDING_SEED, count) if stochastic else 0
    metas = {m[ROW_OFFSET]: m for m in feature_meta.tolist()}
    for key, (table_ids, grads) in per_id_gradients(grad_out, feature_meta, ids, offsets, batch_size).items():
        if table_ids.numel() == 0:
            continue
        meta = metas[key]
        unique, inverse = torch.unique(table_ids, return_inverse=True)
        grad = torch.zeros(unique.numel(), meta[DIM], device=grads.device).index_add_(0, inverse, grads)
        table = _table_view(weights, meta)
        w = table.index_select(0, unique).float()
        grad = grad + weight_decay * w
        rows = key + unique
        if optimizer == OPT_SGD:
            w = w - lr * grad
        elif optimizer == OPT_ROWWISE_ADAGRAD:
            acc = row_state[rows] + grad.pow(2).mean(dim=1)
            row_state[rows] = acc
            w = w - lr * grad / (acc.sqrt()[:, None] + eps)
        else:
            moments = _table_view(elem_state, meta)
            m = beta1 * moments.index_select(0, unique) + (1 - beta1) * grad
            v = beta2 * row_state[rows] + (1 - beta2) * grad.pow(2).mean(dim=1)
            moments[unique] = m
            row_state[rows] = v
            m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
            w = w - lr * m_hat / (v_hat.sqrt()[:, None] + eps)
        if stochastic:  # counted by the flat element index
            index = meta[WEIGHT_OFFSET] + unique[:, None] * meta[DIM] + torch.arange(meta[DIM], device=w.device)
            table[unique] = stochastic_round_bf16(w, counter_bits(element_counters(index), bits_key))
        else:
            table[unique] = w.to(weights.dtype)
