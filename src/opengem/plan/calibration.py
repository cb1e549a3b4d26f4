"""Calibration tables: what the kernels reach on a real GPU, for the cost model.

A table (JSON, written by ``opengem bench calibrate`` or shipped in ``opengem/plan/calibrations``)::

    {"device": ..., "source": ..., "peak_bf16_tflops": 989, "hbm_gbps": 4800,
     "gemm": [[M, N, K, TFLOP/s], ...],                          # bf16 GEMMs
     "attention": {"jfa": [[keys_per_query, fwd TFLOP/s, bwd TFLOP/s], ...], "gdpa": [...]},
     "block_attention_gbps": [fwd, bwd],                          # bandwidth-bound
     "embedding_gbps": ..., "copy_gbps": ...,
     "elementwise_bytes": ...,   # bytes per token, layer and d_model element moved by norms / casts / element-wise
     "activation_bytes": ...,    # bytes per token, layer and d_model element kept for backward
     "host": {"launch_us": ..., "attention_call_us": ..., "launches_per_layer": ..., "launches_per_step": ...,
              "step_ms": ..., "layer_ms": ...},                # the last two measured by the host probe (optional)
     "sm_contention": ...,       # compute slowdown while NCCL kernels run beside it (fraction)
     "notes": {...},             # where each figure comes from
     "measured": {...}}          # optional: raw microbenchmarks of the run (launch_us, norm_gbps, ...)

``elementwise_bytes``, ``activation_bytes``, ``sm_contention`` and the host counts are fitted on a
training step, not measurable by kernels alone: ``table_from_measurements`` carries them over from a base
table, rescaling element-wise bytes and host times by this machine's microbenchmarks against the base's
``measured`` figures when it has them.

Every number is finite; rates are positive and no TFLOP/s exceeds ``peak_bf16_tflops`` (efficiency <= 1),
host figures are >= 0, ``sm_contention`` is in [0, 1); ``calibration_from_dict`` refuses anything else.

Rates transfer to another GPU of the cluster as fractions: compute by ``peak_bf16_tflops``, memory-bound
work by ``hbm_gbps`` (``Rates``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from opengem.plan.cluster import GPUSpec, read_shipped_or_file
from opengem.validation import is_number, is_positive_finite

SHIPPED = ("h200",)
ATTENTION_FAMILIES = ("jfa", "gdpa")
GEMM_M_SATURATION = 2**16  # beyond this many rows a GEMM's efficiency no longer depends on M


@dataclass(frozen=True)
class HostCosts:
    """Host time of a training step. Measured (``step_ms`` + ``layer_ms`` x layers, from ``opengem bench
    calibrate``'s host probe: a compiled GEM step at a tiny batch, at two depths) when the table has it;
    else the launch model: launches x ``launch_us`` + attention calls x ``attention_call_us``."""

    launch_us: float  # host time per launched kernel in a training step (framework + launch)
    attention_call_us: float  # extra host work per attention-op call (schedules, tuning lookups)
    launches_per_layer: float  # kernels per GEM layer, forward + backward
    launches_per_step: float  # kernels outside the layers (embeddings, heads, loss, optimizer)
    step_ms: float | None = None  # measured: host time of a step outside the GEM layers
    layer_ms: float | None = None  # measured: host time per GEM layer, forward + backward


@dataclass(frozen=True)
class Calibration:
    device: str
    source: str
    peak_bf16_tflops: float
    hbm_gbps: float
    gemm: list[list[float]]
    attention: dict[str, list[list[float]]]
    block_attention_gbps: list[float]
    embedding_gbps: float
    copy_gbps: float
    elementwise_bytes: float
    activation_bytes: float
    host: HostCosts
    sm_contention: float
    notes: dict[str, str] = field(default_factory=dict)
    measured: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path


def _check_rate(value: Any, key: str, source: str) -> None:
    if not is_positive_finite(value):
        raise ValueError(f"{source}: {key} must be a positive finite number, got {value!r}")


def _check_points(points: Any, key: str, fields: str, rates: slice, peak: float, source: str) -> None:
    """A non-empty list of positive finite ``[fields]`` points whose TFLOP/s (``rates``) do not exceed ``peak``:
    a rate above the peak is an efficiency above 1, which the cost model would take as is."""
    if not isinstance(points, list) or not points:
        raise ValueError(f"{source}: {key} must be a non-empty list of [{fields}], got {points!r}")
    width = fields.count(",") + 1
    for i, point in enumerate(points):
        if not (isinstance(point, list) and len(point) == width
                and all(is_positive_finite(x) for x in point)):
            raise ValueError(f"{source}: {key}[{i}] must be [{fields}] of positive finite numbers, got {point!r}")
        if max(point[rates]) > peak:
            raise ValueError(f"{source}: {key}[{i}] = {point} exceeds peak_bf16_tflops {peak} (an efficiency above 1)")


def calibration_from_dict(data: dict[str, Any], source: str) -> Calibration:
    """Build a :class:`Calibration`; a missing, unknown, mistyped or out-of-range entry raises naming ``source``
    and the key."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: a calibration table must be a JSON object, got {type(data).__name__}")
    if "host" not in data:
        raise ValueError(f"{source}: missing key 'host'")
    for key in ("host", "attention", "notes", "measured"):
        if key in data and not isinstance(data[key], dict):
            raise ValueError(f"{source}: {key} must be an object, got {data[key]!r}")
    try:
        table = Calibration(**{**data, "host": HostCosts(**data["host"])})
    except (KeyError, TypeError) as error:
        raise ValueError(f"{source}: not a calibration table ({error})") from None
    for key in ("peak_bf16_tflops", "hbm_gbps", "embedding_gbps", "copy_gbps", "elementwise_bytes", "activation_bytes"):
        _check_rate(getattr(table, key), key, source)
    peak = table.peak_bf16_tflops
    _check_points(table.gemm, "gemm", "M, N, K, TFLOP/s", slice(3, 4), peak, source)
    unknown = [family for family in table.attention if family not in ATTENTION_FAMILIES]
    if unknown:  # a misspelt family would be ignored
        raise ValueError(f"{source}: attention: unknown {', '.join(map(repr, unknown))} "
                         f"(known: {', '.join(ATTENTION_FAMILIES)})")
    for family in ATTENTION_FAMILIES:
        _check_points(table.attention.get(family), f"attention.{family}", "keys, fwd, bwd", slice(1, 3), peak, source)
    gbps = table.block_attention_gbps
    if not isinstance(gbps, list) or len(gbps) != 2:
        raise ValueError(f"{source}: block_attention_gbps must be [fwd, bwd], got {gbps!r}")
    for i, value in enumerate(gbps):
        _check_rate(value, f"block_attention_gbps[{i}]", source)
    for entry in dataclasses.fields(HostCosts):
        value = getattr(table.host, entry.name)
        if value is None and entry.default is None:  # step_ms / layer_ms: absent from launch-model tables
            continue
        if not (is_number(value) and 0 <= value < math.inf):
            raise ValueError(f"{source}: host.{entry.name} must be a finite number >= 0, got {value!r}")
    measured_host = (table.host.step_ms, table.host.layer_ms)
    if measured_host.count(None) == 1:
        raise ValueError(f"{source}: host.step_ms and host.layer_ms come together and are >= 0, got {measured_host}")
    contention = table.sm_contention
    if not (is_number(contention) and 0 <= contention < 1):  # a slowdown fraction; NaN fails too
        raise ValueError(f"{source}: sm_contention must be a number in [0, 1), got {contention!r}")
    for key in ("device", "source"):
        if not isinstance(getattr(table, key), str):
            raise ValueError(f"{source}: {key} must be a string, got {getattr(table, key)!r}")
    if not all(isinstance(v, str) for v in table.notes.values()):
        raise ValueError(f"{source}: notes must map names to strings, got {table.notes!r}")
    if not all(is_number(v) and math.isfinite(v) for v in table.measured.values()):
        raise ValueError(f"{source}: measured must map names to finite numbers, got {table.measured!r}")
    for key in RESCALING_FIGURES:  # table_from_measurements divides by them: 0 had raised ZeroDivisionError there
        if key in table.measured and not table.measured[key] > 0:
            raise ValueError(f"{source}: measured.{key} must be > 0, got {table.measured[key]!r}")
    return table


def load_calibration(name_or_path: str | Path) -> Calibration:
    """A shipped table by name (``h200``) or a JSON file written by ``opengem bench calibrate``."""
    text, source = read_shipped_or_file(name_or_path, "calibrations", ".json", SHIPPED, "calibration")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{source}: not valid JSON: {error}") from None
    return calibration_from_dict(data, source)


RESCALING_FIGURES = ("launch_us", "norm_gbps", "copy_gbps")  # raw figures that carry step-fitted entries over


@dataclass(frozen=True)
class Measurements:
    """What one ``opengem bench calibrate`` run measured on its GPU (rates at the sizes it ran)."""

    device: str
    run: str  # how it was measured (command, date, versions, sizes): the table's ``source``
    peak_bf16_tflops: float  # the device's dense BF16 peak (datasheet)
    hbm_gbps: float  # the device's nominal HBM bandwidth (datasheet)
    gemm: list[list[float]]  # [M, N, K, TFLOP/s]: bf16 nn.Linear forward + backward, 6 M N K per pass
    jfa: list[list[float]]  # [keys per query, fwd TFLOP/s, bwd TFLOP/s]
    gdpa: list[list[float]]  # [short length, fwd, bwd]: cross-attention (K/V that long) + pooling (that many seeds)
    block_attention_gbps: list[float]  # [fwd, bwd]
    embedding_gbps: float  # 3 x bytes of rows read / (lookup + fused backward and update): the cost model's charge
    copy_gbps: float  # device-to-device copy, bytes read + written
    raw: dict[str, float]  # microbenchmarks kept in the table's ``measured``: launch_us, norm_gbps, h2d_gbps, ...
    errors: dict[str, float]  # relative error of each measured op against its reference (small case)


def table_from_measurements(m: Measurements, base: Calibration, base_name: str) -> Calibration:
    """The calibration table of a run; step-fitted entries come from ``base`` (see the module doc)."""
    measured = {**m.raw, "copy_gbps": m.copy_gbps}
    host, elementwise = base.host, base.elementwise_bytes
    if "host_step_ms" in measured:  # the host probe ran: measured host times replace the launch model
        host = dataclasses.replace(host, step_ms=measured["host_step_ms"], layer_ms=measured["host_layer_ms"])
    if all(key in base.measured for key in RESCALING_FIGURES):
        cpu = measured["launch_us"] / base.measured["launch_us"]
        host = dataclasses.replace(host, launch_us=host.launch_us * cpu, attention_call_us=host.attention_call_us * cpu)
        if host.step_ms is not None and "host_step_ms" not in measured:  # a base's measured host times, rescaled
            host = dataclasses.replace(host, step_ms=host.step_ms * cpu, layer_ms=host.layer_ms * cpu)
        base_ratio = base.measured["norm_gbps"] / base.measured["copy_gbps"]
        elementwise *= base_ratio / (measured["norm_gbps"] / measured["copy_gbps"])
        carried = (f"from {base_name}, rescaled: host times x{cpu:.2f} (tiny-kernel launch time), element-wise bytes "
                   f"by the fused norm's share of the copy bandwidth ({base_ratio:.2f} there)")
    else:
        carried = f"carried from {base_name} unchanged (it has no {'/'.join(RESCALING_FIGURES)} figures to rescale by)"
    errors = ", ".join(f"{op} {error:.1e}" for op, error in m.errors.items())
    notes = {
        "gemm": "bf16 nn.Linear forward + backward (dX, dW) on [M, K] x [K, N], 6 M N K FLOPs per pass",
        "jfa": "causal JFA, equal lengths, H 4, D 128; keys per query = visible pairs / tokens; bwd = 2.5x fwd FLOPs",
        "gdpa": "silu GDPA, H 4, D 128: PFFN cross-attention (K/V of that length) and seed pooling (that many "
                "broadcast queries) over the same histories, FLOPs and times summed",
        "block_attention_gbps": "block 64, H 4, D 128: fwd bytes q + k + v + o, bwd q + k + v + do + dq + dk + dv "
                                "(bf16)",
        "embedding_gbps": "fused lookup + row-wise Adagrad backward: 3 x rows-read bytes per step time (the cost "
                          "model's charge); measured.embedding_forward_gbps: the lookup alone (rows read + output)",
        "copy_gbps": "device-to-device copy (read + write); measured.h2d_gbps: pinned host-to-device copy",
        "step_fitted": f"elementwise_bytes, activation_bytes, host, sm_contention: {carried}",
        "checks": f"relative error against the reference (small case): {errors}",
    }
    if "host_step_ms" in measured:
        notes["host"] = ("step_ms, layer_ms: the host probe (compiled gem-small GEM at a tiny batch, two depths; "
                         "opengem.train.bench.host_probe); the launch-model figures beside them are unused")
    table = Calibration(
        device=m.device, source=m.run, peak_bf16_tflops=m.peak_bf16_tflops, hbm_gbps=m.hbm_gbps, gemm=m.gemm,
        attention={"jfa": m.jfa, "gdpa": m.gdpa}, block_attention_gbps=m.block_attention_gbps,
        embedding_gbps=m.embedding_gbps, copy_gbps=m.copy_gbps, elementwise_bytes=elementwise,
        activation_bytes=base.activation_bytes, host=host, sm_contention=base.sm_contention, notes=notes,
        measured=measured,
    )  # fmt: skip
    return calibration_from_dict(table.to_json(), m.run)  # the loader's checks, before anything is written


def _interpolate_log(points: list[list[float]], x: float, column: int) -> float:
    """Piecewise linear in log(x) over sorted points, clamped at both ends."""
    ordered = sorted(points)
    if x <= ordered[0][0]:
        return ordered[0][column]
    for low, high in zip(ordered, ordered[1:]):
        if x <= high[0]:
            t = math.log(x / low[0]) / math.log(high[0] / low[0])
            return low[column] + t * (high[column] - low[column])
    return ordered[-1][column]


@dataclass(frozen=True)
class Rates:
    """A calibration table carried over to ``gpu``: achieved FLOP/s and bytes/s of each kind of work."""

    table: Calibration
    gpu: GPUSpec

    @property
    def compute_scale(self) -> float:
        return self.gpu.bf16_tflops / self.table.peak_bf16_tflops

    @property
    def memory_scale(self) -> float:
        return self.gpu.hbm_gbps / self.table.hbm_gbps

    def gemm_flops_per_s(self, m: float, n: float, k: float) -> float:
        """Inverse-distance weighting (log2 space, M saturating) over the measured GEMM shapes."""
        def coords(a: float, b: float, c: float) -> tuple[float, ...]:
            return math.log2(min(a, GEMM_M_SATURATION)), math.log2(b), math.log2(c)

        target = coords(m, n, k)
        total = weight_sum = 0.0
        for pm, pn, pk, tflops in self.table.gemm:
            distance = sum((a - b) ** 2 for a, b in zip(coords(pm, pn, pk), target))
            if distance < 1e-12:
                return tflops * 1e12 * self.compute_scale
            weight = 1.0 / distance
            total, weight_sum = total + weight * tflops, weight_sum + weight
        return total / weight_sum * 1e12 * self.compute_scale

    def attention_flops_per_s(self, family: str, keys_per_query: float) -> tuple[float, float]:
        points = self.table.attention[family]
        fwd, bwd = (_interpolate_log(points, max(keys_per_query, 1.0), c) for c in (1, 2))
        return fwd * 1e12 * self.compute_scale, bwd * 1e12 * self.compute_scale

    def bytes_per_s(self, gbps: float) -> float:
        return gbps * 1e9 * self.memory_scale
