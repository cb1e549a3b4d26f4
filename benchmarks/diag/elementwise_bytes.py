"""Element-wise bytes of one eager forward + backward, sequence stream in fp32 vs in the compute dtype.

    PYTHONPATH=src python -m benchmarks.diag.elementwise_bytes [--preset gem-small] [--batch-size 256] [--top 12]

CPU, bf16 autocast, the preset's GEM with the reference attention (``opengem.train.bench.elementwise``
says what is counted). The figures behind ``GEMConfig.sequence_dtype``'s comment and docs/performance.md.
"""

from __future__ import annotations

import argparse

import torch

from opengem.train.bench.elementwise import ElementwiseBytes
from opengem.train.config import load_config
from opengem.train.data_stream import SyntheticBatches
from opengem.train.trainer import build_learner


def step_bytes(preset: str, batch_size: int, sequence_dtype: str) -> ElementwiseBytes:
    overrides = ["architecture=gem", "device=cpu", "baseline=false", "compile=false", f"batch_size={batch_size}",
                 f"gem.sequence_dtype={sequence_dtype}"]  # fmt: skip
    config = load_config(preset, overrides=overrides)
    torch.manual_seed(0)
    model = build_learner(config, config.model.history, torch.device("cpu")).model
    batch = next(iter(SyntheticBatches(config, 0)))
    with ElementwiseBytes() as moved:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(batch).float()
        logits.sum().backward()
    return moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gem-small")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--top", type=int, default=12, help="ops listed by bytes, per setting")
    args = parser.parse_args()
    moved = {dtype: step_bytes(args.preset, args.batch_size, dtype) for dtype in ("fp32", "compute")}
    fp32, compute = moved["fp32"].total, moved["compute"].total
    print(f"{args.preset} at batch {args.batch_size}: {fp32 / 1e9:.1f} GB with the fp32 sequence stream, "
          f"{compute / 1e9:.1f} GB in the compute dtype ({compute / fp32 - 1:+.0%})")
    for dtype, counted in moved.items():
        print(f"sequence stream {dtype}, the ops that move the most:")
        for op, n in counted.by_op.most_common(args.top):
            print(f"  {n / 1e9:8.2f} GB  {100 * n / counted.total:5.1f}%  {op}")


if __name__ == "__main__":
    main()
