"""The host-speed probes `bench train` records, so runs on different machines can be told apart."""

import pytest
import torch

from opengem.train.bench.host_speed import format_host_speed, host_speed, launch_us, python_ms


def test_probes_time_real_work_and_scale_with_it():
    cpu = torch.device("cpu")
    assert launch_us(cpu, launches=200, rounds=3) > 0
    short, long = python_ms(iterations=20_000, rounds=3), python_ms(iterations=400_000, rounds=3)
    assert 0 < short < long  # 20x the loop: the median cannot come out shorter


@pytest.mark.parametrize("probe", [lambda: launch_us(torch.device("cpu"), launches=0),
                                   lambda: launch_us(torch.device("cpu"), rounds=0),
                                   lambda: python_ms(iterations=0), lambda: python_ms(rounds=-1)])
def test_probes_refuse_no_work(probe):
    with pytest.raises(ValueError, match="must be >= 1"):
        probe()


def test_report_line_names_cpu_load_and_both_probes():
    speed = host_speed(torch.device("cpu"))
    assert set(speed) == {"cpu", "cpus", "load_avg", "launch_us", "python_ms"}
    (line,) = format_host_speed({"cpu": "Xeon 8480", "cpus": 16, "load_avg": [0.22, 0.1, 0.0], "launch_us": 4.513,
                                 "python_ms": 12.34})
    assert line == ("  host                      4.51 us / launch, 12.3 ms of fixed Python "
                    "(Xeon 8480, 16 CPUs, load 0.22)")
    assert format_host_speed(None) == []  # a result written before the probe existed
