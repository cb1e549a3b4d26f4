"""PNG of a `bench train` result: the step's time split by phase (matplotlib, the optional `plot` extra)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn

from opengem.validation import is_number

# What `plot_phases` reads of a result (key -> the keys it reads inside; None: a plain value)
PLOTTED = {"phases_ms": (), "results": ("samples_per_s", "mfu"), "settings": ("precision", "batch_size"),
           "preset": None, "environment": ("device",)}
_JSON_KINDS = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number",
               type(None): "null"}


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_phases(payload: dict[str, Any], out: Path) -> Path:
    """Horizontal bars, milliseconds per step of each phase, titled with the headline figures."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    phases = payload["phases_ms"]
    results, settings = payload["results"], payload["settings"]
    names = list(phases)
    figure, axes = plt.subplots(figsize=(8, 0.45 * len(names) + 1.8))
    bars = axes.barh(names[::-1], [phases[n] for n in names[::-1]], color="tab:blue")
    total = sum(phases.values())
    axes.bar_label(bars, labels=[f"{phases[n]:.2f} ms ({100 * phases[n] / total:.0f} %)" for n in names[::-1]],
                   padding=3, fontsize=8)
    axes.set_xlabel("ms per step (profiled steps)")
    axes.set_xlim(0, 1.35 * max(phases.values(), default=1.0) or 1.0)
    mfu = results["mfu"]
    headline = f"{results['samples_per_s']:,.0f} samples/s" + ("" if mfu is None else f", E2E MFU {100 * mfu:.1f} %")
    axes.set_title(
        f"{payload['preset']} on {payload['environment']['device']} ({settings['precision']}, "
        f"batch {settings['batch_size']}): {headline}", fontsize=9,
    )
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=120, format="png")  # an explicit format: no ".png" appended to a name without it
    plt.close(figure)
    return out


def check_result(payload: object, json_path: Path) -> None:
    """Raise ``ValueError`` naming ``json_path`` and what is missing unless ``payload`` has every part of a `bench
    train` result that the plot reads."""

    def fail(why: str) -> NoReturn:
        raise ValueError(f"{json_path} is not an `opengem bench train` result ({why})")

    if not isinstance(payload, dict):
        fail(f"the JSON is {_JSON_KINDS.get(type(payload), type(payload).__name__)}, not an object")
    if payload.get("benchmark") != "train":
        fail(f"'benchmark' is {payload.get('benchmark')!r}, not 'train'")
    for key, inner in PLOTTED.items():
        if key not in payload:
            fail(f"missing {key!r}")
        if inner is not None and not isinstance(payload[key], dict):
            fail(f"{key!r} is not an object")
        for name in inner or ():
            if name not in payload[key]:
                fail(f"missing '{key}.{name}'")
    for name, ms in payload["phases_ms"].items():
        if not is_number(ms):
            fail(f"phases_ms.{name} is not a number: {ms!r}")


def plot_file(json_path: Path, out: Path | None = None) -> Path:
    """Render ``json_path`` (a `bench train` result) to ``out`` (default: the same name with ``.png``); returns the
    path written, ``out`` itself (a PNG, whatever its suffix: the caller refuses other formats' names)."""
    try:
        payload = json.loads(json_path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read benchmark result {json_path}: {error}") from error
    check_result(payload, json_path)
    if not matplotlib_available():
        raise ValueError("plotting needs matplotlib: pip install 'opengem[plot]'")
    return plot_phases(payload, json_path.with_suffix(".png") if out is None else out)
