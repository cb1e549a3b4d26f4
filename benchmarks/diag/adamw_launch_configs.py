"""The shadow AdamW kernel's launch shape (elements a loop iteration, iterations a program, warps) on a preset's
Linear parameters, with fp32 and with bf16 moments, beside the device copy bandwidth.

Session 62 read the bf16 moments at 72% of a copy's bandwidth against 92% for fp32 moments (10.25 against 11.32 ms
on gem-large): the kernel took one access an element (now 16-byte ones where aligned) and, under Triton 3.6, 252-255
registers at the then-shipped 4096 x 8 warps (128 at 2048 x 8 or 4096 x 16), so one program an SM. Session 63 (H100):
2048 x 4 blocks x 16 warps, 54 registers, took 7.49 ms with bf16 moments (98% of a copy; 9.30 at 4096 x 8 x 8) and
10.46 with fp32 moments (11.11), and is now shipped. Each shape is checked
first (one update against the shipped shape's, on the same state: the same bits, since the rounding counters are
element indices whatever the tiling), then timed in interleaved rounds.

Run on a GPU: ``PYTHONPATH=src:. python -m benchmarks.diag.adamw_launch_configs [--preset gem-large]``.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from benchmarks.common import interleaved_ms, print_table, write_results
from benchmarks.optimizer import HYPER, copy_bandwidth_gbps, linear_shapes, random_parameters, shadow_adamw_state
from opengem.ops.adamw import ShadowAdamWTensors, shadow_adamw_update
from opengem.ops.triton import adamw as kernel

SHAPES = list(itertools.product((2048, 4096, 8192), (4, 8, 16), (4, 8, 16)))  # (BLOCK, BLOCKS_PER_ITEM, NUM_WARPS)


@contextmanager
def launch_shape(block: int, blocks_per_item: int, num_warps: int) -> Iterator[None]:
    """The kernel module's launch constants set for the calls inside (a new ShadowAdamWTensors plans its work items
    from them on its first update)."""
    saved = kernel.BLOCK, kernel.BLOCKS_PER_ITEM, kernel.NUM_WARPS
    kernel.BLOCK, kernel.BLOCKS_PER_ITEM, kernel.NUM_WARPS = block, blocks_per_item, num_warps
    try:
        yield
    finally:
        kernel.BLOCK, kernel.BLOCKS_PER_ITEM, kernel.NUM_WARPS = saved


class Learner:
    """The shadow AdamW's state on random parameters (`benchmarks.optimizer.shadow_adamw_state`), gradients, and a
    pristine copy of the parameters to restart from."""

    def __init__(self, shapes: list[torch.Size], moments: torch.dtype, device: str, seed: int = 0) -> None:
        self.initial, self.grads = random_parameters(shapes, device, seed)
        self.state = shadow_adamw_state([p.clone() for p in self.initial], moments)

    def restart(self) -> None:
        torch._foreach_copy_(self.state.params, self.initial)
        for tensor in (*self.state.exp_avgs, *self.state.exp_avg_sqs, *self.state.steps):
            tensor.zero_()

    def updater(self, shape: tuple[int, int, int]):
        """Updates under ``shape``: a fresh ShadowAdamWTensors over the same buffers, its work items planned and the
        kernel launched with the shape's constants (both read the module's: a launch outside the shape would run
        the shipped tiling over work items planned for another)."""
        s = self.state
        tensors = ShadowAdamWTensors(s.params, s.exp_avgs, s.exp_avg_sqs, s.shadows, s.steps)

        def update() -> None:
            with launch_shape(*shape):
                shadow_adamw_update(tensors, self.grads, **HYPER)
        return update

    def tensors(self) -> list[torch.Tensor]:
        return [*self.state.params, *self.state.exp_avgs, *self.state.exp_avg_sqs, *self.state.shadows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gem-large")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = "cuda"  # the timings (triton.testing.do_bench) need a GPU driver, even under the interpreter
    shapes = linear_shapes(args.preset)
    numel = sum(s.numel() for s in shapes)
    copy_gbps = copy_bandwidth_gbps(device)
    shipped = (kernel.BLOCK, kernel.BLOCKS_PER_ITEM, kernel.NUM_WARPS)
    rows = []
    for moments, bytes_per_parameter in ((torch.bfloat16, 20), (torch.float32, 28)):
        learner = Learner(shapes, moments, device)
        learner.updater(shipped)()
        expected = [t.clone() for t in learner.tensors()]
        calls = {}
        for shape in SHAPES:
            learner.restart()
            update = learner.updater(shape)
            update()  # plans and compiles under this shape
            same = all(torch.equal(a, b) for a, b in zip(learner.tensors(), expected))
            calls[shape] = (update, same)
        times = interleaved_ms({shape: update for shape, (update, _) in calls.items()}, rounds=args.rounds)
        for shape, each in times.items():
            ms = statistics.median(each)
            gbps = bytes_per_parameter * numel / ms / 1e6
            rows.append({"moments": str(moments).removeprefix("torch."), "block": shape[0],
                         "blocks_per_item": shape[1], "num_warps": shape[2], "shipped": shape == shipped, "ms": ms,
                         "ms_each_round": each, "GBps": gbps, "pct_of_copy": 100 * gbps / copy_gbps,
                         "same_update_as_shipped": calls[shape][1]})
        del learner, calls, times
        torch.cuda.empty_cache()
    print_table(rows, ["moments", "block", "blocks_per_item", "num_warps", "shipped", "ms", "pct_of_copy",
                       "same_update_as_shipped"])
    path = write_results(f"adamw_launch_configs_{args.preset}", rows,
                         {"preset": args.preset, "parameters": numel, "copy_GBps": copy_gbps})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
