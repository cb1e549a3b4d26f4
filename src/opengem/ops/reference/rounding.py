"""Stochastic rounding of fp32 to bf16 with counter-hashed random bits: the specification that the Triton kernels
(`opengem.ops.triton.rounding`) compute alike, bit for bit.

A value is rounded away from zero with the probability of the 16 fp32 bits bf16 drops, so ``E[rounded] = x``: small
updates accumulate in expectation instead of being lost to round-to-nearest (an AdamW second moment that could never
decay, an embedding row whose updates fall under half an ulp). The random bits are a ``lowbias32`` hash of a
per-call key (seed, step, tensor) and each element's counter, so a run that repeats a step (a resume) rounds alike.
Values are held in int64 tensors as uint32 (each product's low 32 bits kept, as uint32 arithmetic wraps in a kernel).
"""

from __future__ import annotations

import torch

_U32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The ``lowbias32`` integer hash of uint32 values held in int64."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _U32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _U32
    return x ^ (x >> 16)


def rounding_key(seed: int, step: int, tensor: int) -> int:
    """The key of one (seed, step, tensor)'s rounding bits."""
    inner = mix32(torch.tensor(tensor & _U32, dtype=torch.int64)) ^ (step & _U32)
    return int(mix32(mix32(inner) ^ (seed & _U32)))


def step_key(seed: int, step: int) -> int:
    """:func:`rounding_key` of tensor 0: the key of a buffer rounded whole each step (an embedding table's rows)."""
    return rounding_key(seed, step, 0)


def element_counters(index: torch.Tensor) -> torch.Tensor:
    """uint32 counters of int64 element indices: the low half, with the high half's hash folded in (a buffer of over
    2 ** 32 elements does not repeat its bits)."""
    return (index & _U32) ^ mix32(index >> 32)


def counter_bits(counters: torch.Tensor, key: int) -> torch.Tensor:
    """16 random bits (int64 in [0, 2 ** 16)) for each uint32 counter (int64 values in [0, 2 ** 32))."""
    return mix32(counters ^ key) & 0xFFFF


def paired_rounding_bits(numel: int, key: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Two streams of bits for ``numel`` consecutive elements from one hash of each element's counter ``i``: its low
    half and its high half, so two tensors of one element each (AdamW's two moments) draw apart for one hash."""
    hashed = mix32(torch.arange(numel, dtype=torch.int64, device=device) ^ key)
    return hashed & 0xFFFF, hashed >> 16


def rounding_bits(numel: int, key: int, stream: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Stream ``stream`` (0 or 1) of :func:`paired_rounding_bits`."""
    return paired_rounding_bits(numel, key, device)[stream]


def stochastic_round_bf16(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """fp32 ``x`` to bf16, rounded away from zero with the probability of the 16 discarded bits' fraction (``bits``:
    16-bit random integers of ``x``'s size): add them to the fp32 pattern and keep its upper half, which bf16 holds
    exactly. Unbiased: ``E[result] = x``. An infinity stays one; a value within one bf16 ulp of the largest rounds
    up to infinity with that probability."""
    pattern = x.float().contiguous().view(torch.int32).to(torch.int64) & _U32
    rounded = ((pattern + bits.reshape(x.shape)) & 0xFFFF0000).to(torch.int32)  # the cast wraps bit 31 back
    return rounded.view(torch.float32).to(torch.bfloat16)
