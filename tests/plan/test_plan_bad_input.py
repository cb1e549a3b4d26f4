"""Bad cluster files, calibration tables and planner arguments: each is refused with a ValueError (a missing file:
FileNotFoundError) that names the file and key, or the argument, instead of being accepted or failing deep inside."""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import Any, Callable

import pytest

from opengem.cli.main import main
from opengem.parallel.mesh import ParallelConfig
from opengem.plan.calibration import load_calibration
from opengem.plan.cluster import load_cluster
from opengem.plan.comm import collective_seconds, group_tier
from opengem.plan.cost import Layout
from opengem.plan.planner import Planner

GOOD = resources.files("opengem.plan").joinpath("clusters", "h100.toml").read_text()
TABLE = json.loads(resources.files("opengem.plan").joinpath("calibrations", "h200.json").read_text())


def edited(text: str, old: str, new: str) -> str:
    assert old in text
    return text.replace(old, new, 1)


@pytest.fixture(scope="module")
def planner() -> Planner:
    return Planner("gem-small", load_cluster("h100"), 8)


# --- #2: GPU counts that no layout can use ------------------------------------------------------------------------


@pytest.mark.parametrize("gpus", [12, 10])
def test_gpus_that_are_not_whole_hosts_are_named_before_planning(gpus, capsys):
    message = f"--gpus {gpus}: not a whole number of hosts of 8 GPUs (cluster h100); use a multiple of 8 or at most 8"
    with pytest.raises(ValueError, match=re.escape(message)):
        Planner("gem-small", load_cluster("h100"), gpus)
    assert main(["plan", "--preset", "gem-small", "--gpus", str(gpus)]) == 2
    assert message in capsys.readouterr().err  # not "no layout ... fits": memory was never the problem
    assert Planner("gem-small", load_cluster("h100"), 4).gpus == 4  # part of one host is fine


def test_nothing_fitting_says_how_many_layouts_were_evaluated(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(edited(GOOD, "hbm_gib = 80.0", "hbm_gib = 1.0"))
    with pytest.raises(ValueError, match=r"no layout of gem-small fits 1 GPUs of h100 \(1 GiB each\): "
                                         r"none of the 2 layouts evaluated fits in memory"):
        Planner("gem-small", load_cluster(path), 1).plan((16,))


# --- #5: a relative calibration path in a cluster file -----------------------------------------------------------


def test_relative_calibration_is_found_beside_the_cluster_file(tmp_path, monkeypatch, capsys):
    folder, elsewhere = tmp_path / "x", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    (folder / "mycal.json").write_text(json.dumps({**TABLE, "device": "beside the cluster file"}))
    (folder / "my.toml").write_text(edited(GOOD, 'calibration = "h200"', 'calibration = "mycal.json"'))
    monkeypatch.chdir(elsewhere)
    cluster = load_cluster(folder / "my.toml")
    assert cluster.calibration == str(folder / "mycal.json")
    assert Planner("gem-small", cluster, 8).rates.table.device == "beside the cluster file"
    assert main(["plan", "--preset", "gem-small", "--cluster", str(folder / "my.toml"), "--gpus", "8",
                 "--local-batch", "2048", "--top", "1"]) == 0  # fmt: skip
    assert "best:" in capsys.readouterr().out


def test_relative_calibration_falls_back_to_the_current_directory_and_a_missing_one_is_named(tmp_path, monkeypatch):
    (tmp_path / "cwdcal.json").write_text(json.dumps({**TABLE, "device": "in the current directory"}))
    cluster_file = tmp_path / "clusters" / "my.toml"
    cluster_file.parent.mkdir()
    cluster_file.write_text(edited(GOOD, 'calibration = "h200"', 'calibration = "cwdcal.json"'))
    monkeypatch.chdir(tmp_path)
    assert Planner("gem-small", load_cluster(cluster_file), 8).rates.table.device == "in the current directory"
    cluster_file.write_text(edited(GOOD, 'calibration = "h200"', 'calibration = "nope.json"'))
    message = (f"{cluster_file}: calibration = 'nope.json' not found (looked in {cluster_file.parent} and the current "
               f"directory; shipped: h200)")
    with pytest.raises(FileNotFoundError, match=re.escape(message)):
        Planner("gem-small", load_cluster(cluster_file), 8)


# --- #7, #24: cluster numbers, unknown keys, absurd sizes --------------------------------------------------------


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("bandwidth_gbps = 360.0", "bandwidth_gbps = nan",
         "[network.nvlink]: bandwidth_gbps must be a positive finite number, got nan"),
        ("bandwidth_gbps = 360.0", "bandwidth_gbps = inf",
         "[network.nvlink]: bandwidth_gbps must be a positive finite number, got inf"),
        ("latency_us = 3.0", "latency_us = inf",
         "[network.nvlink]: latency_us must be a positive finite number, got inf"),
        ("hbm_gib = 80.0", "hbm_gib = nan", "[gpu]: hbm_gib must be a positive finite number, got nan"),
        ("oversubscription = 4.0", "oversubscription = nan",
         "[network.cross_zone]: oversubscription must be a positive finite number, got nan"),
        ("hbm_gbps = 3350.0", "hbm_gbps = 3350.0\nhbm_gbs = 1.0",
         "[gpu]: unknown key 'hbm_gbs' (known: name, bf16_tflops, fp8_tflops, hbm_gib, hbm_gbps)"),
        ("zones = 16", "zones = 16\nzone = 4",
         "[topology]: unknown key 'zone' (known: gpus_per_host, hosts_per_zone, zones)"),
        ("latency_us = 8.0", "latency_us = 8.0\nlatency = 1",
         "[network.intra_zone]: unknown key 'latency' (known: bandwidth_gbps, latency_us, oversubscription)"),
        ('name = "h100"', 'gpus = 64\nname = "h100"',
         ": unknown key 'gpus' (known: name, calibration, gpu, topology, network)"),
        ("[network.nvlink]", "[network.cross_rack]\nbandwidth_gbps = 1.0\nlatency_us = 1.0\noversubscription = 1.0\n"
         "[network.nvlink]", "[network]: unknown key 'cross_rack' (known: nvlink, intra_zone, cross_zone)"),
        ("zones = 16", "zones = 100000000",
         "[topology]: gpus_per_host x hosts_per_zone x zones = 25600000000 GPUs, more than one job can address"),
    ],
)
def test_bad_cluster_numbers_and_unknown_keys_are_named(tmp_path, old, new, message):
    path = tmp_path / "bad.toml"
    path.write_text(edited(GOOD, old, new))
    with pytest.raises(ValueError, match=re.escape(f"{path}{'' if message.startswith(':') else ' '}{message}")):
        load_cluster(path)


# --- #26: files that are not text --------------------------------------------------------------------------------


@pytest.mark.parametrize("load", [load_cluster, load_calibration])
def test_a_binary_file_is_named(tmp_path, load: Callable[[Path], Any]):
    path = tmp_path / "binary"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match=re.escape(f"{path}: not a UTF-8 text file (")):
        load(path)


# --- #8: calibration tables --------------------------------------------------------------------------------------


def _set(key: str, value: Any) -> Callable[[dict], None]:
    def mutate(table: dict) -> None:
        *parents, last = key.split(".")
        for parent in parents:
            table = table[parent]
        table[last] = value

    return mutate


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (_set("peak_bf16_tflops", "989"), "peak_bf16_tflops must be a positive finite number, got '989'"),
        (_set("peak_bf16_tflops", float("nan")), "peak_bf16_tflops must be a positive finite number, got nan"),
        (_set("hbm_gbps", float("inf")), "hbm_gbps must be a positive finite number, got inf"),
        (_set("elementwise_bytes", float("nan")), "elementwise_bytes must be a positive finite number, got nan"),
        (_set("gemm", [[8192, 8192, 8192, float("nan")]]),
         "gemm[0] must be [M, N, K, TFLOP/s] of positive finite numbers, got [8192, 8192, 8192, nan]"),
        (_set("gemm", [[8192, 8192, 8192, "500"]]),
         "gemm[0] must be [M, N, K, TFLOP/s] of positive finite numbers, got [8192, 8192, 8192, '500']"),
        (_set("gemm", [[8192, 8192, 8192, 4031.0]]),
         "gemm[0] = [8192, 8192, 8192, 4031.0] exceeds peak_bf16_tflops 989.0 (an efficiency above 1)"),
        (_set("attention.jfa", [[315, 3500.0, 129.0]]),
         "attention.jfa[0] = [315, 3500.0, 129.0] exceeds peak_bf16_tflops 989.0 (an efficiency above 1)"),
        (_set("attention", [1]), "attention must be an object, got [1]"),
        (_set("attention.jfaa", [[315, 175.0, 129.0]]), "attention: unknown 'jfaa' (known: jfa, gdpa)"),
        (_set("block_attention_gbps", []), "block_attention_gbps must be [fwd, bwd], got []"),
        (_set("block_attention_gbps", [4197.0, -1.0]), "block_attention_gbps[1] must be a positive finite number"),
        (_set("sm_contention", -5.0), "sm_contention must be a number in [0, 1), got -5.0"),
        (_set("sm_contention", 50.0), "sm_contention must be a number in [0, 1), got 50.0"),
        (_set("sm_contention", "0.1"), "sm_contention must be a number in [0, 1), got '0.1'"),
        (_set("host.launch_us", -100.0), "host.launch_us must be a finite number >= 0, got -100.0"),
        (_set("host.launches_per_step", True), "host.launches_per_step must be a finite number >= 0, got True"),
        (lambda t: t["host"].update(step_ms=float("nan"), layer_ms=1.0),
         "host.step_ms must be a finite number >= 0, got nan"),
        (_set("host", [1, 2]), "host must be an object, got [1, 2]"),
        (_set("notes", 5), "notes must be an object, got 5"),
        # table_from_measurements divides by these: 0 had been a ZeroDivisionError there, -5 a negative host time
        (_set("measured", {"launch_us": 0.0}), "measured.launch_us must be > 0, got 0.0"),
        (_set("measured", {"norm_gbps": -5.0}), "measured.norm_gbps must be > 0, got -5.0"),
    ],
)
def test_bad_calibration_entries_are_named(tmp_path, mutate, message):
    table = json.loads(json.dumps(TABLE))
    mutate(table)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(table))
    with pytest.raises(ValueError, match=re.escape(f"{path}: {message}")):
        load_calibration(path)


def test_a_calibration_that_is_not_an_object_is_named(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2, 3]")
    with pytest.raises(ValueError, match=re.escape(f"{path}: a calibration table must be a JSON object, got list")):
        load_calibration(path)


# --- #23: the Python API's own arguments -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("local_batches", "sparse_sync_every", "message"),
    [
        ((512,), 0, "sparse_sync_every must be an integer >= 1, got 0"),
        ((512,), -1, "sparse_sync_every must be an integer >= 1, got -1"),
        ((512,), 1.5, "sparse_sync_every must be an integer >= 1, got 1.5"),
        ((0,), 1, "local_batches must be non-empty integers >= 1, got (0,)"),
        ((-5,), 1, "local_batches must be non-empty integers >= 1, got (-5,)"),
        ((), 1, "local_batches must be non-empty integers >= 1, got ()"),
        ((2.5,), 1, "local_batches must be non-empty integers >= 1, got (2.5,)"),
    ],
)
def test_plan_arguments_are_checked(planner, local_batches, sparse_sync_every, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        planner.plan(local_batches, sparse_sync_every=sparse_sync_every)


def test_layouts_and_gpu_counts_are_checked(planner):
    with pytest.raises(ValueError, match=re.escape("local_batch must be >= 1, got 0")):
        planner.predict(Layout(ParallelConfig().resolved(8), 0))
    with pytest.raises(ValueError, match=re.escape("sparse_sync_every must be >= 1, got 0")):
        Layout(ParallelConfig().resolved(8), 512, sparse_sync_every=0)
    with pytest.raises(ValueError, match=re.escape("--gpus must be an integer, got 8.0")):
        Planner("gem-small", load_cluster("h100"), 8.0)


def test_layouts_take_ints_and_bools_and_a_resolved_config(planner):
    resolved = ParallelConfig().resolved(8)
    for bad in (2.5, True):  # had been predicted
        with pytest.raises(ValueError, match=re.escape(f"Layout: local_batch must be an int, got {bad!r}")):
            Layout(resolved, bad)
    with pytest.raises(ValueError, match="Layout: sparse_fully_sharded must be a bool, got 'no'"):  # meant yes
        Layout(resolved, 512, "no")
    with pytest.raises(ValueError, match="Layout: batch_shuffling must be a bool, got 0"):
        planner.plan((512,), batch_shuffling=0)
    with pytest.raises(ValueError, match="Layout: parallel must be resolved .* dense_shard=-1"):  # costed -1 ranks
        Layout(ParallelConfig(), 512)


def test_collective_costs_refuse_unknown_names_and_negative_bytes():
    cluster = load_cluster("h100")
    nvlink = cluster.tiers["nvlink"]
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):  # had been costed as an all-gather
        collective_seconds("allreduce", 1e6, 8, nvlink)
    with pytest.raises(ValueError, match=re.escape("all_gather: nbytes must be >= 0, got -1000000.0")):  # cost 0
        collective_seconds("all_gather", -1e6, 8, nvlink)
    with pytest.raises(ValueError, match="unknown mesh dim 'sharded'; known: shard, "):  # a bare KeyError
        group_tier(cluster, ParallelConfig().resolved(8), "sharded")
