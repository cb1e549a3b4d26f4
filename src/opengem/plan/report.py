"""Readable and JSON reports of a :class:`~opengem.plan.planner.Plan`, the reasons for each degree, a plot."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from opengem.plan.cost import Prediction
from opengem.plan.planner import Plan

GIB = 2**30
MFU_NOTE = ("MFU: useful FLOPs (GEM_SPEC section 8) / (step time x dense BF16 peak); local MFU: kernels alone, "
            "no host, communication, imbalance or recompute; scaling = E2E / local")
DEGREES = (("dense_shard", "FSDP shard"), ("expert", "expert parallel"), ("sparse_replicate", "sparse replicas"),
           ("activation_checkpointing", "activation checkpointing"), ("collectives", "collectives"))


def _row(p: Prediction) -> str:
    return (f"{p.layout.describe():<42} {p.step_s * 1e3:>8.0f} {p.e2e_mfu:>6.1%} {p.local_mfu:>6.1%} "
            f"{p.scaling_ratio:>6.2f} {p.memory_total / GIB:>6.1f}")


def reasons(plan: Plan) -> list[str]:
    """For each degree of the best layout: the best layout that differs only there, and why it lost."""
    best = plan.best
    lines = []
    for attribute, label in DEGREES:
        chosen = getattr(best.layout.parallel, attribute)
        rivals = [p for p in plan.ranked if getattr(p.layout.parallel, attribute) != chosen
                  and p.layout.local_batch == best.layout.local_batch
                  and all(getattr(p.layout.parallel, a) == getattr(best.layout.parallel, a) for a, _ in DEGREES if a != attribute)]
        if not rivals:
            lines.append(f"- {label} = {chosen}: every alternative with the other choices kept does not fit in memory "
                         f"or is invalid on this cluster")
            continue
        rival = rivals[0]
        delta = rival.step_s - best.step_s
        cause = max(("host", rival.host_s - best.host_s), ("device", rival.device_s - best.device_s),
                    ("exposed communication", rival.exposed_comm_s - best.exposed_comm_s), key=lambda x: x[1])
        lines.append(f"- {label} = {chosen}: the best alternative ({attribute} = {getattr(rival.layout.parallel, attribute)}) "
                     f"is {delta * 1e3:+.0f} ms per step ({rival.e2e_mfu:.1%} MFU), mostly {cause[0]} ({cause[1] * 1e3:+.0f} ms)")
    return lines


def format_plan(plan: Plan, top: int = 5) -> str:
    best = plan.best
    c = best.layout.parallel
    lines = [f"plan: {plan.preset} on {plan.gpus} GPUs of {plan.cluster.name} ({plan.cluster.gpu.name}); "
             f"{plan.evaluated} layouts, {plan.infeasible} do not fit",
             f"{'layout':<42} {'step ms':>8} {'E2E':>6} {'local':>6} {'scale':>6} {'GiB':>6}"]
    lines += [_row(p) for p in plan.ranked[:top]]
    lines += ["", f"best: dense_replicate={c.dense_replicate} dense_shard={c.dense_shard} expert={c.expert} "
              f"sparse_group={c.sparse_group} sparse_replicate={c.sparse_replicate}"
              f"{' (fully sharded 2D)' if best.layout.sparse_fully_sharded and c.sparse_replicate > 1 else ''}, "
              f"local batch {best.layout.local_batch} (global {best.layout.local_batch * plan.gpus}), "
              f"activation checkpointing {'on' if c.activation_checkpointing else 'off'}, collectives {c.collectives}",
              f"step {best.step_s * 1e3:.0f} ms = max(host {best.host_s * 1e3:.0f}, device {best.device_s * 1e3:.0f} "
              f"+ exposed communication {best.exposed_comm_s * 1e3:.0f}); load imbalance x{best.imbalance:.2f} with "
              f"Base Batch Shuffling, x{best.imbalance_without_shuffling:.2f} without",
              "kernels (ms): " + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in best.kernel_times.items()),
              "memory (GiB): " + ", ".join(f"{k} {v / GIB:.1f}" for k, v in best.memory.items()),
              f"{'collective':<36} {'tier':<11} {'group':>6} {'MB':>10} {'ms':>8} {'exposed':>8}"]
    lines += [f"{x.dim + '/' + x.collective:<36} {x.tier:<11} {x.group:>6} {x.bytes / 1e6:>10.1f} {x.seconds * 1e3:>8.1f} "
              f"{x.exposed * 1e3:>8.1f}" for x in best.collectives if x.bytes > 0 and x.group > 1]
    lines += ["why these degrees:", *reasons(plan), MFU_NOTE]
    return "\n".join(lines)


def _prediction_json(p: Prediction) -> dict[str, Any]:
    return {"layout": {**asdict(p.layout.parallel), "local_batch": p.layout.local_batch,
                       "sparse_fully_sharded": p.layout.sparse_fully_sharded, "batch_shuffling": p.layout.batch_shuffling},
            "step_ms": p.step_s * 1e3, "host_ms": p.host_s * 1e3, "device_ms": p.device_s * 1e3,
            "exposed_comm_ms": p.exposed_comm_s * 1e3, "e2e_mfu": p.e2e_mfu, "local_mfu": p.local_mfu,
            "scaling_ratio": p.scaling_ratio, "imbalance": p.imbalance,
            "imbalance_without_shuffling": p.imbalance_without_shuffling,
            "memory_gib": {k: v / GIB for k, v in p.memory.items()},
            "kernels_ms": {k: v * 1e3 for k, v in p.kernel_times.items()},
            "collectives": [asdict(x) for x in p.collectives]}


def write_json(plan: Plan, path: Path, top: int = 10) -> Path:
    payload = {"preset": plan.preset, "cluster": plan.cluster.name, "gpus": plan.gpus, "evaluated": plan.evaluated,
               "infeasible": plan.infeasible, "mfu_convention": MFU_NOTE, "reasons": reasons(plan),
               "ranked": [_prediction_json(p) for p in plan.ranked[:top]]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path


def plot(plan: Plan, path: Path, top: int = 10) -> Path:
    """Stacked bars of the top layouts' step time: kernels, imbalance and contention, exposed comm, host excess."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = plan.ranked[:top]
    names = [p.layout.describe() for p in shown]
    kernels = [p.kernels_s * 1e3 for p in shown]
    overhead = [(p.device_s - p.kernels_s) * 1e3 for p in shown]
    comm = [p.exposed_comm_s * 1e3 for p in shown]
    host = [max(0.0, p.step_s - p.device_s - p.exposed_comm_s) * 1e3 for p in shown]
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(shown) + 2))
    left = [0.0] * len(shown)
    for values, label in ((kernels, "kernels"), (overhead, "imbalance, recompute, SM contention"),
                          (comm, "exposed communication"), (host, "host-bound excess")):
        ax.barh(names, values, left=left, label=label)
        left = [a + b for a, b in zip(left, values)]
    for i, p in enumerate(shown):
        ax.text(left[i], i, f" {p.e2e_mfu:.1%}", va="center")
    ax.invert_yaxis()
    ax.set_xlabel("predicted step time per GPU (ms); label: E2E MFU")
    ax.set_title(f"{plan.preset} on {plan.gpus} GPUs of {plan.cluster.name}")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
