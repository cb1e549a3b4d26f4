"""`opengem bench train | layers | plot | calibrate`: training speed, MFU, the phase split (GEM_SPEC section 8) and
the planner's calibration table."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from opengem.train.config import PRECISIONS, PRESETS


def add_bench_parser(commands: argparse._SubParsersAction) -> None:
    from opengem.train.config import LOW_PRECISION_MLPS

    parser = commands.add_parser("bench", help="training speed benchmarks (MFU, phase split, layers alone)")
    kinds = parser.add_subparsers(dest="bench_command", required=True)
    for name, help_text in (("train", "steady-state speed of the whole training step"),
                            ("layers", "each layer type of the model run alone: local MFU")):
        sub = kinds.add_parser(name, help=help_text)
        sub.add_argument("--preset", choices=sorted(PRESETS), default="gem-small")
        sub.add_argument("--precision", choices=PRECISIONS,
                         help="default: a --set precision=..., else bf16 on CUDA and fp32 on CPU")
        sub.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
        sub.add_argument("--batch-size", type=int, help="default: the preset's")
        sub.add_argument("--peak-tflops", type=float, help="dense BF16 peak of a device not in the table")
        sub.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting")
        sub.add_argument("--out", type=Path, help="JSON file (default: benchmarks/results/<kind>_<preset>.json)")
    train = kinds.choices["train"]
    train.add_argument("--steps", type=int, default=50, help="timed steps")
    train.add_argument("--warmup", type=int, default=10,
                       help="steps before timing, besides one run of the timed steps' own batches")
    train.add_argument("--lead-steps", type=int, default=3,
                       help="untimed steps after the loader restarts for the timed window (its workers' start)")
    train.add_argument("--max-tuning-steps", type=int, default=20,
                       help="after the warm-up, up to this many more steps while the autotuners meet new keys or a "
                            "step compiles (1.5x slower than the fastest)")
    train.add_argument("--low-precision-mlp", choices=LOW_PRECISION_MLPS, default="none",
                       help="FP8 recipe for the large Linear layers (opengem.nn.low_precision)")
    train.add_argument("--compile", action="store_true", help="torch.compile the model")
    train.add_argument("--num-workers", type=int, help="data loader workers (default: the preset's)")
    train.add_argument("--profile-steps", type=int, default=3, help="steps profiled for the phase split")
    train.add_argument("--trace", type=Path, help="write the profiled steps' CPU + GPU timeline (Chrome / Perfetto "
                       "JSON, gzipped when the name ends in .gz)")
    train.add_argument("--loader-batches", type=int, default=20, help="batches timed for the loader alone")
    train.add_argument("--with-layers", action="store_true",
                       help="also time each layer alone (`bench layers`): local MFU and the scaling ratio E2E / local")
    train.add_argument("--matmul-size", type=int, help="GEMM size of the measured ceiling (default 8192 on CUDA)")
    layers = kinds.choices["layers"]
    layers.add_argument("--repeats", type=int, default=10, help="timed runs per layer (median)")
    plot = kinds.add_parser("plot", help="render a `bench train` JSON result as a PNG of the phase split")
    plot.add_argument("file", type=Path)
    plot.add_argument("--out", type=Path, help="PNG file (default: the JSON's name with .png)")
    calibrate = kinds.add_parser("calibrate", help="measure the planner's calibration table on this GPU")
    calibrate.add_argument("--out", type=Path, default=Path("benchmarks/results/calibration.json"),
                           help="calibration JSON, for `opengem plan --calibration` (default: %(default)s)")
    calibrate.add_argument("--quick", action="store_true",
                           help="fewer shapes, no kernel autotuning (< 45 s before the host probe)")
    calibrate.add_argument("--base", default="h200", help="table of the step-fitted entries (shipped name or file)")
    calibrate.add_argument("--peak-tflops", type=float, help="dense BF16 peak of a device not in the table")
    calibrate.add_argument("--hbm-gbps", type=float, help="nominal HBM bandwidth of a device not in the table")
    calibrate.add_argument("--no-host-probe", action="store_true",
                           help="skip the host probe (gem-small trained at a tiny batch, 2 depths, compiled: ~1 min); "
                                "the host term then stays the base table's")


def run_bench(args: argparse.Namespace) -> int:
    from opengem.train.bench import layers, plot, step
    from opengem.train.bench.timing import write_json

    if args.bench_command == "calibrate":
        return run_calibrate(args)
    if args.bench_command == "plot":
        if args.out is not None:
            step.require_file_name(args.out, "--out")
            if args.out.suffix.lower() not in ("", ".png"):  # the file is PNG whatever its name says
                raise ValueError(f"--out {args.out}: bench plot writes a PNG; give a name ending in .png")
        print(f"wrote {plot.plot_file(args.file, args.out)}")
        return 0
    common = {"preset": args.preset, "precision": args.precision, "device": args.device,
              "batch_size": args.batch_size, "peak_tflops": args.peak_tflops, "overrides": tuple(args.set)}
    default_output = layers.default_output if args.bench_command == "layers" else step.default_output
    out = default_output(args.preset) if args.out is None else args.out
    step.require_file_name(out, "--out")  # before the run: the JSON is written after it
    if args.bench_command == "layers":
        payload = layers.bench_layers(step.TrainBenchOptions(**common), repeats=args.repeats)
        path = write_json(out, payload)
        print(layers.format_report(payload))
        print(f"wrote {path}")
        return 0
    options = step.TrainBenchOptions(
        **common, steps=args.steps, warmup=args.warmup, lead_steps=args.lead_steps,
        max_tuning_steps=args.max_tuning_steps, low_precision_mlp=args.low_precision_mlp,
        compile=args.compile, num_workers=args.num_workers, profile_steps=args.profile_steps, trace=args.trace,
        loader_batches=args.loader_batches, matmul_size=args.matmul_size,
    )  # fmt: skip
    if out.with_suffix(".png") == out:
        raise ValueError(f"--out {out} would be overwritten by its plot (the same name with .png); give a .json name")
    step.require_file_name(out.with_suffix(".png"), "--out's plot")
    payload = step.bench_train(options)
    path = write_json(out, payload)
    print(step.format_report(payload))
    print(f"wrote {path}", flush=True)  # before the layers: a run cut short there keeps the step's figures
    if args.with_layers:
        step.add_scaling_ratio(payload, layers.bench_layers(options, repeats=5))
        write_json(path, payload)
        print(step.format_scaling(payload["results"]), f"(rewrote {path})")
    if plot.matplotlib_available():
        print(f"wrote {plot.plot_phases(payload, path.with_suffix('.png'))}")
    else:
        print(f"note: matplotlib is not installed (pip install 'opengem[plot]'): no PNG; "
              f"render it later with `opengem bench plot {path}`")
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    from opengem.plan.calibration import load_calibration, table_from_measurements
    from opengem.train.bench import calibrate
    from opengem.train.bench.host_probe import HostProbe
    from opengem.train.bench.step import require_file_name

    base = load_calibration(args.base)  # a bad --base or --out fails before minutes of measuring
    require_file_name(args.out, "--out")
    try:
        measured = calibrate.measure(calibrate.QUICK if args.quick else calibrate.FULL, args.peak_tflops, args.hbm_gbps,
                                     host_probe=None if args.no_host_probe else HostProbe())
    except calibrate.NoCudaDevice as error:
        print(f"opengem: error: {error}", file=sys.stderr)
        return 2
    print(calibrate.format_table(measured))
    print(f"wrote {table_from_measurements(measured, base, args.base).save(args.out)}")
    return 0
