"""benchmarks.diag.launch_sources on the CPU: a real profile of a small step groups its leaf ops by op chain and the
source line that called them; kernel names are shortened; device events are grouped per step with their time; the
host's self CPU time is summed per op and per Python function."""

from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from benchmarks.diag.launch_sources import (
    host_time,
    kernel_kind,
    launch_groups,
    launches_by_kind,
    op_chain,
    profile_launches,
)


def zero_filled_step() -> None:
    buffer = torch.zeros(64, 8)  # the line the grouping must name
    (buffer + 1).sum()


def test_a_real_cpu_profile_names_the_calling_line_of_each_leaf_op():
    groups, host = profile_launches(zero_filled_step, steps=3, sync=lambda: None)
    zeros = [g for g in groups if "aten::zeros" in g["ops"]]
    assert zeros, [g["ops"] for g in groups]
    assert all("test_launch_sources_benchmark.py" in g["source"] for g in zeros)
    assert all(g["per_step"] == 1.0 for g in zeros)  # three steps, one zeros a step
    assert any(g["ops"] == "aten::fill_ < aten::sum" for g in groups)  # leaf ops, their callers after them
    assert "aten::zeros" in host["ops"] and all(ms >= 0 for ms in host["ops"].values())
    assert any("zero_filled_step" in name for name in host["python"])


def event(name, parent=None, stack=(), kernels=(), children=(), python=False):
    return SimpleNamespace(name=name, cpu_parent=parent, stack=list(stack), kernels=list(kernels),
                           cpu_children=list(children), device_type=DeviceType.CPU, is_python_function=python)


def test_device_events_are_grouped_by_kernel_chain_and_nearest_recorded_source():
    caller = event("src/opengem/ops/gdpa.py(88): schedule", parent=event("torch/nn/x.py(3): f", python=True),
                   python=True)
    outer = event("aten::zeros", parent=caller)
    inner = event("aten::zero_", parent=outer)
    fill = event("aten::fill_", parent=inner, kernels=[SimpleNamespace(name="Memset (Device)", duration=2.0)] * 4)
    backward = event("aten::sum", parent=event("autograd::engine::evaluate_function: MulBackward0"),
                     kernels=[SimpleNamespace(name="void at::native::reduce_kernel<128, 4>(float*)", duration=10.0)])
    groups = launch_groups([outer, inner, fill, backward], steps=2)
    assert groups[0] == {"kernel": "Memset (Device)", "ops": "aten::fill_ < aten::zero_ < aten::zeros",
                         "source": "src/opengem/ops/gdpa.py(88): schedule", "per_step": 2.0,
                         "device_ms_per_step": pytest.approx(0.004)}
    assert groups[1]["kernel"] == "at::native::reduce_kernel" and groups[1]["source"] == "(no Python frame recorded)"
    recorded = event("aten::mm", stack=["torch/nn/functional.py(9): linear", "torchinductor_root/ab/cab.py(40): call"],
                     kernels=[SimpleNamespace(name="nvjet_sm90", duration=1.0)])
    assert launch_groups([recorded], steps=1)[0]["source"] == "torchinductor_root/ab/cab.py(40): call"
    unmarked = event("aten::mm", parent=event("torch/nn/functional.py(9): linear", python=True),
                     kernels=[SimpleNamespace(name="nvjet_sm90", duration=1.0)])
    assert launch_groups([unmarked], steps=1)[0]["source"] == "torch/nn/functional.py(9): linear"
    assert launches_by_kind(groups) == {"Memset (Device)": 2.0, "at::native::reduce_kernel": 0.5}
    with pytest.raises(ValueError, match="steps must be >= 1"):
        launch_groups([], steps=0)


def test_kernel_names_and_chains_are_short():
    assert kernel_kind("Memcpy HtoD (Pinned -> Device)") == "Memcpy HtoD (Pinned -> Device)"
    assert kernel_kind("triton_poi_fused_add_3") == "triton_poi_fused_add_3"
    chain = event("e", parent=event("d", parent=event("c", parent=event("b", parent=event("a", parent=event("z"))))))
    assert op_chain(chain) == "e < d < c < b < a"
    assert op_chain(event("x", parent=event("ProfilerStep#3", parent=event("a.py(1): f", python=True)))) == "x"


def test_host_time_sums_self_cpu_per_op_and_per_python_function_a_step():
    events = [event("aten::mm"), event("aten::mm"), event("gdpa.py(10): backward", python=True), event("aten::add")]
    for e, us in zip(events, (3000.0, 1000.0, 6000.0, 500.0), strict=True):
        e.self_cpu_time_total = us
    host = host_time(events, steps=2, top=1)
    assert host == {"ops": {"aten::mm": 2.0}, "python": {"gdpa.py(10): backward": 3.0}}
