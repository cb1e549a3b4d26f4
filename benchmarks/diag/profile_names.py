"""Diagnostic: which device events of a profiled gem-tiny bench step are not kernels we place (session 4)."""

import collections
import json
import os
import sys

import torch

from opengem.cli.main import main
from opengem.train.bench import step

seen = {}


def dump(events):
    events = list(events)
    cpu = torch.autograd.DeviceType.CPU
    launches = {e.id for e in events if e.device_type == cpu and e.name.startswith("cu")}
    by_name = collections.defaultdict(lambda: [0, 0.0, 0, set()])
    for e in events:
        if e.device_type != cpu:
            row = by_name[e.name]
            row[0] += 1
            row[1] += e.time_range.end - e.time_range.start
            row[2] += e.id in launches
            row[3].add(str(e.device_type))
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]
    seen["device_events"] = [[n[:160], c, us, linked, sorted(t)] for n, (c, us, linked, t) in top]
    cpu_names = collections.Counter(e.name for e in events if e.device_type == cpu and e.name.startswith("cu"))
    seen["launch_calls"] = cpu_names.most_common(20)
    return original(events)


original = step.family_split
step.family_split = dump
argv = [
    "bench",
    "train",
    "--preset",
    "gem-tiny",
    "--batch-size",
    "128",
    "--device",
    "cuda",
    "--precision",
    "bf16",
    "--steps",
    "6",
    "--warmup",
    "3",
    "--num-workers",
    "2",
    "--loader-batches",
    "5",
    "--matmul-size",
    "2048",
    "--out",
    os.path.join(sys.argv[1], "tiny.json"),
]
main(argv)
for row in seen["device_events"]:
    print(row)
print(seen["launch_calls"])
with open(os.path.join(sys.argv[1], "profile_names.json"), "w") as file:
    json.dump(seen, file, indent=1)
