"""Cluster descriptions: GPUs, hosts, zones and the three network tiers, read from TOML.

Schema (every key required; numbers positive)::

    name = "h100"
    calibration = "h200"            # calibration table: a shipped name or a JSON path
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

import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from opengem.parallel.mesh import Topology

TIERS = ("nvlink", "intra_zone", "cross_zone")
SHIPPED = ("h100", "h200")


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
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        expected = "an integer" if integer else "a number"
        raise ValueError(f"{where}: {key} must be {expected}, got {value!r}")
    if value <= 0:
        raise ValueError(f"{where}: {key} must be positive, got {value!r}")
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


def cluster_from_dict(data: dict[str, Any], source: str) -> Cluster:
    """Build a :class:`Cluster` from parsed TOML; errors name ``source`` and the offending key."""
    gpu = _table(data, "gpu", source)
    where = f"{source} [gpu]"
    spec = GPUSpec(_text(gpu, "name", where), *(float(_number(gpu, k, where)) for k in ("bf16_tflops", "fp8_tflops", "hbm_gib", "hbm_gbps")))
    topo = _table(data, "topology", source)
    counts = [int(_number(topo, k, f"{source} [topology]", integer=True)) for k in ("gpus_per_host", "hosts_per_zone", "zones")]
    network = _table(data, "network", source)
    tiers = {}
    for name in TIERS:
        tier = _table(network, name, f"{source} [network]")
        where = f"{source} [network.{name}]"
        tiers[name] = Tier(name, *(float(_number(tier, k, where)) for k in ("bandwidth_gbps", "latency_us", "oversubscription")))
        if tiers[name].oversubscription < 1:
            raise ValueError(f"{where}: oversubscription must be >= 1, got {tiers[name].oversubscription}")
    return Cluster(_text(data, "name", source), _text(data, "calibration", source), spec, *counts, tiers, source)


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
    return path.read_text(), str(path)


def load_cluster(name_or_path: str | Path) -> Cluster:
    """A shipped cluster by name (``h100``, ``h200``) or a TOML file by path."""
    text, source = read_shipped_or_file(name_or_path, "clusters", ".toml", SHIPPED, "cluster")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{source}: not valid TOML: {error}") from None
    return cluster_from_dict(data, source)
