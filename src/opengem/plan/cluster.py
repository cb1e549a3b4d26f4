"""Cluster descriptions: GPUs, hosts, zones and the three network tiers, read from TOML.

Schema (every key required, no others; numbers positive and finite)::

    name = "h100"
    calibration = "h200"            # calibration table: a shipped name or a JSON path (relative: to this file's
                                    # folder, else to the current directory)
    [gpu]
    name = "H100 SXM5 80GB"
    bf16_tflops = 989.0             # dense tensor-core peaks
    fp8_tflops = 1979.0
    hbm_gib = 80.0                  # memory capacity
    hbm_gbps = 3350.0               # memory bandwidth, GB/s
    [topology]
    gpus_per_host = 8
    hosts_per_zone = 32
    zones = 16
    [network.nvlink]                # the same three keys for network.intra_zone and network.cross_zone
    bandwidth_gbps = 360.0          # achievable GB/s per GPU and direction
    latency_us = 3.0                # per message step
    oversubscription = 1.0          # bandwidth divisor (>= 1) when every GPU sends at once

A group of ranks uses the slowest tier it spans: inside a host NVLink, inside a zone the intra-zone
network, else the cross-zone network (``Cluster.tier_for_span``).
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from opengem.parallel.mesh import Topology
from opengem.validation import is_int, is_number, is_positive_finite

TIERS = ("nvlink", "intra_zone", "cross_zone")
SHIPPED = ("h100", "h200")
GPU_KEYS = ("name", "bf16_tflops", "fp8_tflops", "hbm_gib", "hbm_gbps")
TOPOLOGY_KEYS = ("gpus_per_host", "hosts_per_zone", "zones")
TIER_KEYS = ("bandwidth_gbps", "latency_us", "oversubscription")
TOP_LEVEL_KEYS = ("name", "calibration", "gpu", "topology", "network")
MAX_GPUS = 2**31 - 1  # ranks and world sizes are 32-bit ints in torch.distributed and NCCL


@dataclass(frozen=True)
class GPUSpec:
    name: str
    bf16_tflops: float
    fp8_tflops: float
    hbm_gib: float
    hbm_gbps: float

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gib * 2**30


@dataclass(frozen=True)
class Tier:
    name: str
    bandwidth_gbps: float
    latency_us: float
    oversubscription: float

    @property
    def bytes_per_s(self) -> float:
        """Achievable bandwidth per GPU when every GPU of the tier sends at once."""
        return self.bandwidth_gbps * 1e9 / self.oversubscription


@dataclass(frozen=True)
class Cluster:
    name: str
    calibration: str
    gpu: GPUSpec
    gpus_per_host: int
    hosts_per_zone: int
    zones: int
    tiers: dict[str, Tier]
    source: str = ""  # the file it came from

    @property
    def gpus_per_zone(self) -> int:
        return self.gpus_per_host * self.hosts_per_zone

    @property
    def total_gpus(self) -> int:
        return self.gpus_per_zone * self.zones

    @property
    def topology(self) -> Topology:
        return Topology(self.gpus_per_host, self.hosts_per_zone)

    def tier_for_span(self, span: int) -> Tier:
        """The tier a group of ``span`` consecutive, aligned ranks communicates over."""
        if span <= self.gpus_per_host:
            return self.tiers["nvlink"]
        if span <= self.gpus_per_zone:
            return self.tiers["intra_zone"]
        return self.tiers["cross_zone"]


def _number(table: dict[str, Any], key: str, where: str, integer: bool = False) -> float:
    if key not in table:
        raise ValueError(f"{where}: missing key {key!r}")
    value = table[key]
    if not (is_int(value) if integer else is_number(value)):
        expected = "an integer" if integer else "a number"
        raise ValueError(f"{where}: {key} must be {expected}, got {value!r}")
    if not is_positive_finite(value):
        expected = "a positive integer" if integer else "a positive finite number"
        raise ValueError(f"{where}: {key} must be {expected}, got {value!r}")
    return value


def _text(table: dict[str, Any], key: str, where: str) -> str:
    if key not in table:
        raise ValueError(f"{where}: missing key {key!r}")
    if not isinstance(table[key], str) or not table[key]:
        raise ValueError(f"{where}: {key} must be a non-empty string, got {table[key]!r}")
    return table[key]


def _table(parent: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    if key not in parent:
        raise ValueError(f"{where}: missing table [{key}]")
    if not isinstance(parent[key], dict):
        raise ValueError(f"{where}: {key} must be a table, got {parent[key]!r}")
    return parent[key]


def _known_keys(table: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    """A misspelt key would otherwise be ignored and its setting silently left out."""
    unknown = [key for key in table if key not in known]
    if unknown:
        raise ValueError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                         f"(known: {', '.join(known)})")


def cluster_from_dict(data: dict[str, Any], source: str) -> Cluster:
    """Build a :class:`Cluster` from parsed TOML; errors name ``source`` and the offending key. A table is checked
    for unknown keys after its known ones are read, so a misspelt key reads as missing first."""
    gpu = _table(data, "gpu", source)
    where = f"{source} [gpu]"
    spec = GPUSpec(_text(gpu, "name", where), *(float(_number(gpu, k, where)) for k in ("bf16_tflops", "fp8_tflops", "hbm_gib", "hbm_gbps")))
    _known_keys(gpu, GPU_KEYS, where)
    topo = _table(data, "topology", source)
    counts = [int(_number(topo, k, f"{source} [topology]", integer=True)) for k in TOPOLOGY_KEYS]
    _known_keys(topo, TOPOLOGY_KEYS, f"{source} [topology]")
    if math.prod(counts) > MAX_GPUS:  # a typo such as zones = 100000000 (the planner would search it for ever)
        raise ValueError(f"{source} [topology]: gpus_per_host x hosts_per_zone x zones = {math.prod(counts)} GPUs, "
                         f"more than one job can address ({MAX_GPUS}: ranks are 32-bit)")
    network = _table(data, "network", source)
    tiers = {}
    for name in TIERS:
        tier = _table(network, name, f"{source} [network]")
        where = f"{source} [network.{name}]"
        tiers[name] = Tier(name, *(float(_number(tier, k, where)) for k in TIER_KEYS))
        _known_keys(tier, TIER_KEYS, where)
        if not tiers[name].oversubscription >= 1:
            raise ValueError(f"{where}: oversubscription must be >= 1, got {tiers[name].oversubscription}")
    _known_keys(network, TIERS, f"{source} [network]")
    cluster = Cluster(_text(data, "name", source), _text(data, "calibration", source), spec, *counts, tiers, source)
    _known_keys(data, TOP_LEVEL_KEYS, source)
    return cluster


def read_shipped_or_file(
    name_or_path: str | Path, folder: str, suffix: str, shipped: tuple[str, ...], what: str
) -> tuple[str, str]:
    """``(text, source)`` of a file shipped in ``opengem/plan/<folder>/`` by name, or of a file by path."""
    if str(name_or_path) in shipped:
        text = resources.files("opengem.plan").joinpath(folder, f"{name_or_path}{suffix}").read_text()
        return text, f"{name_or_path}{suffix} (shipped)"
    path = Path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} file {path} not found (shipped {what}s: {', '.join(shipped)})")
    try:
        return path.read_text(encoding="utf-8"), str(path)  # TOML and JSON are UTF-8 whatever the locale
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not a UTF-8 text file ({error})") from None


def load_cluster(name_or_path: str | Path) -> Cluster:
    """A shipped cluster by name (``h100``, ``h200``) or a TOML file by path.

    A relative ``calibration`` path that names a file beside the TOML file is made to point at it (a cluster
    file and its table travel together); otherwise it stays as written, relative to the current directory."""
    from opengem.plan.calibration import SHIPPED as SHIPPED_CALIBRATIONS  # that module imports this one

    text, source = read_shipped_or_file(name_or_path, "clusters", ".toml", SHIPPED, "cluster")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{source}: not valid TOML: {error}") from None
    cluster = cluster_from_dict(data, source)
    beside = Path(source).parent / cluster.calibration
    if str(name_or_path) not in SHIPPED and cluster.calibration not in SHIPPED_CALIBRATIONS and beside.is_file():
        cluster = dataclasses.replace(cluster, calibration=str(beside))
    return cluster
