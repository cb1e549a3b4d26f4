"""`opengem info --preset NAME`: a GEM preset's parameter counts and model FLOPs per sample."""

from __future__ import annotations

import argparse

from opengem.models.presets import GEM_PRESETS, PresetSummary, describe

FLOP_CONVENTION = (
    "FLOPs (GEM_SPEC section 8): 2*M*N*K per GEMM on real rows, attention 4*H*D per unmasked pair; "
    "train = forward + backward (2x GEMMs, 2.5x attention); one sample at the preset's mean history length."
)


def add_info_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("info", help="parameter counts and FLOPs per sample of GEM presets")
    parser.add_argument("--preset", choices=sorted(GEM_PRESETS), help="one preset (default: all)")


def run_info(args: argparse.Namespace) -> int:
    names = [args.preset] if args.preset else list(GEM_PRESETS)
    for name in names:
        print(format_summary(describe(name)))
    print(FLOP_CONVENTION)
    return 0


def format_summary(summary: PresetSummary) -> str:
    return "\n".join([
        f"{summary.name}: {summary.purpose}",
        f"  dense parameters   {summary.dense_parameters / 1e6:>12,.1f} M",
        f"  sparse parameters  {summary.sparse_parameters / 1e9:>12,.3f} B",
        f"  mean history       {summary.mean_history_length:>12,.1f} events",
        f"  forward FLOPs      {summary.forward_flops / 1e9:>12,.3f} GFLOP / sample",
        f"  train FLOPs        {summary.train_flops / 1e9:>12,.3f} GFLOP / sample",
        f"  attention share    {100 * summary.attention_share:>12.1f} % of train FLOPs",
    ])  # fmt: skip
