"""The tuner's plots (matplotlib, Agg backend, imported on first use as bench/plots.py does): the objective of
every configuration tried, its runs' spread as an error bar, and each group's on-time share per configuration.
Configurations are numbered as in the report's table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conveyor.bench.metrics import ALL
from conveyor.bench.plots import save_figure
from conveyor.bench.tune_judge import ON_TIME


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    return plt


def objective_plot(labels: list[str], configs: list[dict[str, Any]], path: Path) -> Path:
    """Mean objective per configuration; the bar spans its runs' min..max (the spread)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(labels)), 4))
    means = [c["objective"]["mean"] for c in configs]
    low = [c["objective"]["mean"] - min(c["objective"]["values"]) for c in configs]
    high = [max(c["objective"]["values"]) - c["objective"]["mean"] for c in configs]
    ax.errorbar(labels, means, yerr=[low, high], fmt="o", capsize=4)
    ax.set_xlabel("configuration (see the report's table)")
    ax.set_ylabel("objective (mean; bar: min..max over runs)")
    ax.grid(alpha=0.3)
    return save_figure(plt, fig, path)


def on_time_plot(labels: list[str], configs: list[dict[str, Any]], path: Path) -> Path:
    """Each group's mean on-time share per configuration (groups without a deadline have none)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(labels)), 4))
    groups = sorted({g for c in configs for g in c["metrics"] if g != ALL})
    for group in groups:
        shares = [c["metrics"].get(group, {}).get(ON_TIME) for c in configs]
        if any(s is not None for s in shares):
            ax.plot(labels, [float("nan") if s is None else s for s in shares], marker="o", label=group)
    ax.set_xlabel("configuration (see the report's table)")
    ax.set_ylabel("on-time share (mean over runs)")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no group has a deadline", ha="center", transform=ax.transAxes)
    return save_figure(plt, fig, path)
