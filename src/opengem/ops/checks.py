"""Input validation shared by the attention ops: clear errors naming the argument, before any kernel runs."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from opengem.jagged import validate_offsets
from opengem.jagged.host import host_copy, offsets_summary
from opengem.validation import is_number, is_positive_finite


class ArgNames(NamedTuple):
    """The names the called function gives the offsets and max lengths, for the errors: self-attention ops take one
    ``offsets`` and one ``max_len`` for both q and k/v."""

    q_offsets: str = "q_offsets"
    k_offsets: str = "k_offsets"
    max_len_q: str = "max_len_q"
    max_len_k: str = "max_len_k"


SELF_ATTENTION = ArgNames("offsets", "offsets", "max_len", "max_len")


def is_plain_int(value: object) -> bool:
    """A Python int that is not a bool (``True`` had been taken as 1); the ops' schemas take Python ints only."""
    return isinstance(value, int) and not isinstance(value, bool)


def unit_stride(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` as the kernels read it: they index offsets and targets through bare pointers, so a strided view
    (``validate_offsets`` accepts one) is copied; a contiguous tensor is returned itself, its host mirror with it."""
    return None if t is None else t.contiguous()


def check_bools(fn: str, **flags: object) -> None:
    """Each of ``flags`` a real bool: 0 had run as False, and "no" reached torch's op schema check, which is not ours.
    Python-scalar checks only (no device sync)."""
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise ValueError(f"{fn}: {name} must be a bool, got {flag!r}")


def check_finite_numbers(fn: str, **values: object) -> None:
    """Each of ``values`` a finite real number: a str ("2") had been converted by float(), a bool taken as 0 or 1,
    and NaN or inf made the whole output NaN or inf."""
    for name, value in values.items():
        if not is_number(value):
            raise ValueError(f"{fn}: {name} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{fn}: {name} must be finite, got {value!r}")


def check_positive_finite(fn: str, **values: object) -> None:
    """Each of ``values`` a number in (0, inf): where the op divides by it or takes its log."""
    for name, value in values.items():
        if not is_positive_finite(value):
            raise ValueError(f"{fn}: {name} must be a positive finite number, got {value!r}")


def check_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offsets: torch.Tensor,
    k_offsets: torch.Tensor,
    max_len_q: int,
    max_len_k: int,
    names: ArgNames = ArgNames(),
) -> None:
    """Validate jagged ``q [Tq, H, D]``, ``k, v [Tk, H_kv, D]`` and their offsets.

    Checks ranks, matching head dims, ``H_kv`` dividing ``H``, dtypes, devices, the offsets' invariants,
    and that the host integers ``max_len_*`` are at least the longest sequence (a shorter one would make
    kernels skip rows silently). ``names``: the caller's names of the offsets and max lengths, which the errors use.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must have shape [T, heads, head_dim], got {shape}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q head_dim {q.shape[2]} != k head_dim {k.shape[2]}")
    if q.shape[2] == 0:  # had returned an empty [T, H, 0] output
        raise ValueError("head_dim must be >= 1, got 0")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"k/v heads ({k.shape[1]}) must divide q heads ({q.shape[1]}) for GQA/MQA")
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    validate_offsets(q_offsets, q.shape[0], names.q_offsets)  # first: it names offsets that are not tensors at all
    if names.k_offsets == names.q_offsets and k.shape[0] != q.shape[0]:  # one offsets: "offsets[-1]" would mislead
        raise ValueError(f"k and v must have as many rows as q ({q.shape[0]}), got {k.shape[0]}")
    validate_offsets(k_offsets, k.shape[0], names.k_offsets)
    devices = {t.device for t in (q, k, v, q_offsets, k_offsets)}
    if len(devices) != 1:
        raise ValueError(f"q, k, v and offsets must be on one device, got {sorted(map(str, devices))}")
    if q_offsets.numel() != k_offsets.numel():
        raise ValueError(
            f"{names.q_offsets} and {names.k_offsets} describe different batch sizes: "
            f"{q_offsets.numel() - 1} vs {k_offsets.numel() - 1}"
        )
    check_max_len(q_offsets, max_len_q, names.max_len_q)
    check_max_len(k_offsets, max_len_k, names.max_len_k)


def check_projection_bias(bias: torch.Tensor, like: torch.Tensor, size: int, what: str,
                          name: str = "projection_bias") -> None:
    """An op's projection bias ``name``: ``[size]`` (``what`` says what that size is), floating, on ``like``'s
    device."""
    if bias.shape != (size,):
        raise ValueError(f"{name} must have shape [{size}] ({what}), got {list(bias.shape)}")
    if bias.device != like.device or not bias.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor on {like.device}, got {bias.dtype} on {bias.device}")


def check_max_len(offsets: torch.Tensor, max_len: int, name: str) -> None:
    if not is_plain_int(max_len) or max_len < 0:
        raise ValueError(f"{name} must be a non-negative host int, got {max_len!r}")
    longest = offsets_summary(offsets).longest
    if longest > max_len:
        raise ValueError(f"{name} = {max_len} is shorter than the longest sequence ({longest})")


def check_mask_scalars(contextual_len: int, window: int | None) -> None:
    """The mask options that need no batch: checked even where no mask applies, so a bad value is never ignored.
    Bools are refused: ``True`` had been taken as 1."""
    if not is_plain_int(contextual_len) or contextual_len < 0:
        raise ValueError(f"contextual_len must be a non-negative int, got {contextual_len!r}")
    if window is not None and (not is_plain_int(window) or window < 0):
        raise ValueError(f"window must be None or a non-negative int, got {window!r}")


def check_mask_options(
    offsets: torch.Tensor, num_targets: torch.Tensor | None, contextual_len: int, window: int | None
) -> None:
    """Validate the recommendation-mask options against the batch described by ``offsets``."""
    check_mask_scalars(contextual_len, window)
    if num_targets is None:
        return
    if not isinstance(num_targets, torch.Tensor):
        raise ValueError(f"num_targets must be a torch.Tensor or None, got {type(num_targets).__name__}")
    batch = offsets.numel() - 1
    if num_targets.shape != (batch,):
        raise ValueError(f"num_targets must have shape [{batch}], got {tuple(num_targets.shape)}")
    if num_targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"num_targets must be int32 or int64, got {num_targets.dtype}")
    host = host_copy(offsets)
    lengths = host[1:] - host[:-1]
    targets = host_copy(num_targets).to(lengths.dtype)
    bad = torch.nonzero((targets < 0) | (targets > lengths)).flatten()
    if bad.numel():
        b = int(bad[0])
        raise ValueError(f"num_targets[{b}] = {int(targets[b])} must be in [0, length {int(lengths[b])}]")
