"""PNG of a `bench train` result: the step's time split by phase (matplotlib, the optional `plot` extra)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


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
    figure.savefig(out, dpi=120)
    plt.close(figure)
    return out


def plot_file(json_path: Path, out: Path | None = None) -> Path:
    """Render ``json_path`` (a `bench train` result) to ``out`` (default: the same name with ``.png``)."""
    try:
        payload = json.loads(json_path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read benchmark result {json_path}: {error}") from error
    if payload.get("benchmark") != "train" or "phases_ms" not in payload:
        raise ValueError(f"{json_path} is not an `opengem bench train` result (no phases_ms)")
    if not matplotlib_available():
        raise ValueError("plotting needs matplotlib: pip install 'opengem[plot]'")
    return plot_phases(payload, out or json_path.with_suffix(".png"))
