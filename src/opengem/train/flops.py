"""Model FLOPs of a training step and MFU (GEM_SPEC section 8).

Convention: useful work only. ``2 M N K`` per GEMM on real (unpadded) rows, attention ``4 H D`` per
unmasked (query, key) pair; backward = 2x forward for GEMMs (input and weight gradients), 2.5x for
attention; embeddings, norms and element-wise ops count zero; recompute counts zero. One refinement over
the ``3x`` rule: the projection of the raw dense features has no input gradient (the features are data,
autograd never computes it), so its backward counts 1x. With it the analytic count equals what
``torch.utils.flop_counter`` measures with our registered op formulas (:func:`measured_flops`).

MFU's denominator is the device's dense BF16 peak (:data:`DEVICE_PEAKS`, also when FP8 runs), and, as a
second figure, the measured BF16 matmul ceiling of the device (:func:`measured_matmul_peak`).
"""

from __future__ import annotations

import itertools
import math
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from opengem.data.schema import TASKS, Batch
from opengem.models.gem import GEM
from opengem.models.presets import gem_model_flops
from opengem.models.sequence_ctr import SequenceCTRModel
from opengem.nn.wukong import unpadded_token_mixing
from opengem.ops.attention_flops import visible_pairs
from opengem.validation import check_optional_positive_finite, is_int, is_number


@dataclass(frozen=True)
class FlopCount:
    """FLOPs of one batch: ``gemm`` and ``attention`` are forward counts, ``train`` is forward + backward."""

    gemm: int
    attention: int
    train: int

    @property
    def forward(self) -> int:
        return self.gemm + self.attention

    @property
    def attention_share(self) -> float:
        """Attention's part of the training FLOPs (forward 1x + backward 2.5x)."""
        return 3.5 * self.attention / self.train if self.train else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "forward": self.forward, "attention_share": self.attention_share}


def train_flops(model: nn.Module, history_lengths: Sequence[int] | torch.Tensor) -> FlopCount:
    """Analytic :class:`FlopCount` of one training step of ``model`` on a batch with these history lengths.

    Covers :class:`GEM` and :class:`SequenceCTRModel`; any other module raises ``TypeError``.
    """
    lengths = _history_lengths(history_lengths)
    if isinstance(model, GEM):
        counts = gem_model_flops(model, lengths)
        dense_input_gemm = 2 * len(lengths) * model.dense_proj.in_features * model.config.d_model
    elif isinstance(model, SequenceCTRModel):
        counts = _sequence_ctr_flops(model, lengths)
        dense_input_gemm = 2 * len(lengths) * model.dense_proj.in_features * model.dense_proj.out_features
    else:
        raise TypeError(f"no FLOP formula for {type(model).__name__}; covered: GEM, SequenceCTRModel")
    gemm, attention = counts["gemm"], counts["attention"]
    # backward: 2x GEMMs minus the dense features' input gradient that is never computed, 2.5x attention
    train = 3 * gemm - dense_input_gemm + attention * 7 // 2
    return FlopCount(gemm=gemm, attention=attention, train=train)


def _history_lengths(history_lengths: Sequence[int] | torch.Tensor) -> list[int]:
    """The lengths as ints, checked: an empty batch had counted 0 FLOPs, a float length was truncated, a negative one
    failed deep in the attention count and a 2-D tensor as a bare "only one element tensors" error."""
    if isinstance(history_lengths, torch.Tensor):
        if history_lengths.dim() != 1 or history_lengths.is_floating_point() or history_lengths.is_complex():
            raise ValueError(f"history_lengths must be a 1-D integer tensor, got {history_lengths.dim()}-D "
                             f"{history_lengths.dtype}")
        history_lengths = history_lengths.tolist()
    lengths = list(history_lengths)
    if not lengths:
        raise ValueError("history_lengths is empty: a batch's FLOPs need at least one sample")
    for index, n in enumerate(lengths):
        if not is_int(n) or n < 0:
            raise ValueError(f"history_lengths[{index}] must be an int >= 0, got {n!r}")
    return [int(n) for n in lengths]


def batch_train_flops(model: nn.Module, batch: Batch) -> FlopCount:
    """:func:`train_flops` with the batch's actual jagged history lengths (read on the host: no sync)."""
    return train_flops(model, batch.history_age.lengths_host())


def _sequence_ctr_flops(model: SequenceCTRModel, lengths: list[int]) -> dict[str, int]:
    """Forward ``{"gemm", "attention"}`` of :class:`SequenceCTRModel` (see its module for the data flow)."""
    config = model.config
    batch, tokens = len(lengths), sum(lengths)
    e, d = config.embedding_dim, config.d_model
    gemm = batch * model.dense_proj.in_features * e
    attention = 0
    if config.history != "none":
        gemm += tokens * len(model.sequence_names) * e * d  # history token projection
    if config.history == "attention":
        gemm += batch * e * d  # candidate projection
        with_target = torch.tensor(lengths, dtype=torch.int64) + 1  # the candidate is appended as a target
        pairs = visible_pairs(with_target, with_target, masked=True, causal=True,
                              num_targets=torch.ones(batch, dtype=torch.int64))
        for layer in model.encoder:
            hidden = layer.ffn[0].out_features
            gemm += (tokens + batch) * (4 * d * d + 2 * d * hidden)  # qkv, out, feed-forward
            attention += 2 * d * pairs  # 4 H D per pair, halved like the GEMMs (doubled below)
    dims = [model.interaction[0].in_features, *config.mlp_dims]
    gemm += batch * sum(a * b for a, b in itertools.pairwise(dims))
    gemm += len(TASKS) * batch * config.mlp_dims[-1]  # one logit per task
    return {"gemm": 2 * gemm, "attention": 2 * attention}


def measured_flops(model: nn.Module, batch: Batch) -> int:
    """Forward + backward FLOPs of one step as counted by ``torch.utils.flop_counter``.

    Runs a real forward and backward (``logits.sum()`` as the loss: the loss itself counts zero), so it
    leaves gradients in ``.grad`` and, with a fused embedding optimizer, applies one sparse update. Wukong's
    token mixing runs unpadded here, so the count is of useful products, as the analytic one is.
    """
    with unpadded_token_mixing(model), FlopCounterMode(display=False) as counter:
        model(batch).sum().backward()
    return int(counter.get_total_flops())


# ---------------------------------------------------------------------------------------------------
# device peaks and MFU


@dataclass(frozen=True)
class DevicePeak:
    """Dense (not 2:4 sparse) tensor-core peaks in TFLOP/s from the vendor datasheets."""

    bf16_tflops: float
    fp8_tflops: float | None  # None: no FP8 tensor cores
    pattern: str  # regex matched (case-insensitive) against ``torch.cuda.get_device_name()``


# Ordered: the first matching pattern wins, so specific variants come before the generic name.
DEVICE_PEAKS: dict[str, DevicePeak] = {
    "GB200": DevicePeak(2500.0, 5000.0, r"\bGB200\b"),
    "B200": DevicePeak(2250.0, 4500.0, r"\bB200\b"),
    "H200 NVL": DevicePeak(835.0, 1671.0, r"\bH200\b.*\bNVL\b"),
    "H200": DevicePeak(989.0, 1979.0, r"\bH200\b"),
    "H100 NVL": DevicePeak(835.0, 1671.0, r"\bH100\b.*\bNVL\b"),
    "H100 PCIe": DevicePeak(756.0, 1513.0, r"\bH100\b.*\bPCIe\b"),
    "H100 SXM": DevicePeak(989.0, 1979.0, r"\bH100\b"),  # "NVIDIA H100 80GB HBM3"
    "A100": DevicePeak(312.0, None, r"\bA100\b"),
}


def device_peak_flops(device_name: str, precision: str = "bf16", peak_tflops: float | None = None) -> float:
    """Dense peak FLOP/s of the named device (``torch.cuda.get_device_name()`` strings) for ``precision``
    ``"bf16"`` or ``"fp8"``. ``peak_tflops`` given explicitly wins (for devices not in the table)."""
    if precision not in ("bf16", "fp8"):
        raise ValueError(f"precision must be 'bf16' or 'fp8', got {precision!r}")
    if peak_tflops is not None:
        # NaN and infinity had passed `<= 0` and made every MFU NaN or 0
        if not is_number(peak_tflops):
            raise ValueError(f"peak_tflops must be a number, got {peak_tflops!r}")
        check_optional_positive_finite(peak_tflops=peak_tflops)
        return peak_tflops * 1e12
    for name, peak in DEVICE_PEAKS.items():
        if re.search(peak.pattern, device_name, flags=re.IGNORECASE):
            tflops = peak.bf16_tflops if precision == "bf16" else peak.fp8_tflops
            if tflops is None:
                raise ValueError(f"{name} ({device_name!r}) has no {precision} tensor cores")
            return tflops * 1e12
    raise ValueError(
        f"unknown device {device_name!r}: no dense peak known (table: {', '.join(DEVICE_PEAKS)}); "
        "pass the peak explicitly (--peak-tflops)"
    )


def mfu(flops_per_s: float, peak_flops: float) -> float:
    """Model FLOPs utilization: achieved useful FLOP/s over the peak FLOP/s."""
    check_optional_positive_finite(peak_flops=peak_flops)  # NaN had passed `<= 0`: a NaN MFU
    if not 0 <= flops_per_s < math.inf:
        raise ValueError(f"flops_per_s must be finite and >= 0, got {flops_per_s}")
    return flops_per_s / peak_flops


def measured_matmul_peak(
    device: torch.device | str, dtype: torch.dtype = torch.bfloat16, size: int = 8192, repeats: int = 5
) -> float:
    """The measured ceiling: best FLOP/s of ``repeats`` timed ``size^3`` GEMMs (after a warm-up).

    CUDA: CUDA events around each GEMM. CPU (for tests and CPU runs): wall clock.
    """
    device = torch.device(device)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # warm-up: cuBLAS heuristics and clocks
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            begin = time.perf_counter()
            a @ b
            seconds = time.perf_counter() - begin
        best = min(best, seconds)
    return 2 * size**3 / best
