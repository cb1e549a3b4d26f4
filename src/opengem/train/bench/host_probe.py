"""The host time of a training step, for the planner's host term (``HostCosts.step_ms`` / ``layer_ms``).

A step is host-bound when the CPU takes longer to issue its kernels (Python, dispatch, compiled-graph
wrappers, the attention ops' schedules) than the GPU takes to run them. That time hardly depends on the
model's widths, but it grows with its depth. So the probe trains the preset's GEM at a batch small enough
for the GPU to keep up, at two depths, and times the host loop alone: pre-staged batches, no
synchronization until the last step is issued. Each step is timed on its own and the median kept: a step
that meets a new shape (an Inductor recompile, a Triton specialization) takes seconds, and on an H200 a
mean over 10 steps read 236 ms at 2 layers against 58 ms at 4. Per-step and per-layer costs are then the
line through the two points. The batch's length-dependent host work (tile schedules over B samples) is
included at the probe's batch, not the planned one: a lower bound there, to be compared against `bench
train`.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from itertools import islice

import torch

from opengem.nn.embedding import trust_ids
from opengem.train.config import load_config
from opengem.train.data_stream import SyntheticBatches
from opengem.train.trainer import build_learner

WARMUP = 6  # compiles, autotunes, fills schedule caches


@dataclasses.dataclass(frozen=True)
class HostProbe:
    preset: str = "gem-small"
    depths: tuple[int, int] = (2, 4)
    batch_size: int = 64
    steps: int = 20
    compile: bool = True  # as the GPU presets train

    def __post_init__(self) -> None:
        if len(self.depths) != 2 or not 0 < self.depths[0] < self.depths[1]:
            raise ValueError(f"depths must be two increasing layer counts, got {self.depths}")
        if self.batch_size < 1 or self.steps < 1:
            raise ValueError(f"batch_size and steps must be >= 1, got {self.batch_size}, {self.steps}")


def host_ms_per_step(probe: HostProbe, layers: int, device: torch.device) -> float:
    """Host milliseconds to issue one training step of the preset's GEM with ``layers`` layers."""
    overrides = [f"batch_size={probe.batch_size}", "architecture=gem", "baseline=false", "num_workers=0",
                 f"device={device.type}", f"compile={str(probe.compile).lower()}"]  # fmt: skip
    config = load_config(probe.preset, overrides=overrides)
    config = dataclasses.replace(config, gem=dataclasses.replace(config.gem, num_layers=layers))
    learner = build_learner(config, config.model.history, device)
    trust_ids(learner.model)  # synthetic ids: no id check (a sync) per step
    host_batches = list(islice(iter(SyntheticBatches(config, 0)), WARMUP + probe.steps))
    pinned = device.type == "cuda"
    batches = [(b.pin_memory() if pinned else b).to(device, non_blocking=True) for b in host_batches]
    for batch in batches[:WARMUP]:
        learner.step(batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    step_s = []
    for batch in batches[WARMUP:]:
        start = time.perf_counter()
        learner.step(batch)
        step_s.append(time.perf_counter() - start)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 1e3 * statistics.median(step_s)


def measure_host(probe: HostProbe, device: torch.device) -> dict[str, float]:
    """``host_step_ms`` (outside the layers) and ``host_layer_ms`` (per layer), from the two depths."""
    shallow, deep = probe.depths
    times = [host_ms_per_step(probe, layers, device) for layers in probe.depths]
    layer_ms = max(0.0, (times[1] - times[0]) / (deep - shallow))
    step_ms = max(0.0, times[0] - layer_ms * shallow)
    print(f"[host] {probe.preset} at batch {probe.batch_size}: {times[0]:.1f} ms per step at {shallow} layers, "
          f"{times[1]:.1f} ms at {deep}: {step_ms:.1f} ms + {layer_ms:.2f} ms per layer", flush=True)
    return {"host_step_ms": step_ms, "host_layer_ms": layer_ms}
