"""`opengem data movielens --out DIR`: MovieLens-100K (from recbole's example data) as Parquet sequences."""

from __future__ import annotations

import argparse
from pathlib import Path

from opengem.data.movielens import leave_one_out, read_inter, stats, write_parquet


def add_movielens_parser(data_commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``movielens`` under the ``opengem data`` subcommands."""
    parser = data_commands.add_parser(
        "movielens",
        help="write MovieLens-100K per-user sequences as Parquet (needs `pip install --no-deps recbole==1.2.1`)",
    )
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--inter", type=Path, help="a RecBole .inter file instead of recbole's ml-100k.inter")
    return parser


def movielens_command(args: argparse.Namespace) -> int:
    """Read, write and print statistics. Raises ValueError (bad file) or FileNotFoundError (no recbole)."""
    if args.out.exists() and not args.out.is_dir():  # a raw FileExistsError traceback, after reading the data
        raise ValueError(f"--out {args.out} is a file, not a folder")
    sequences = read_inter(args.inter)
    paths = write_parquet(sequences, args.out)
    split = leave_one_out(sequences)
    summary = stats(sequences)
    print(f"wrote {', '.join(str(p) for p in paths)}")
    for key, value in summary.items():
        print(f"  {key:<14}{value:.6g}" if isinstance(value, float) else f"  {key:<14}{value}")
    train_items = sum(len(s) for s in split.train)
    print(f"  leave-one-out: {train_items} training interactions, {len(split.valid_target)} validation and "
          f"{len(split.test_target)} test targets")  # fmt: skip
    return 0
