"""PNG plots (matplotlib, Agg backend): latency CDFs per group, the engine's state over time, sweeps.

matplotlib is the optional `bench` extra, so it is imported on first use, never when this module is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conveyor.bench.records import RunResult

CDF_LATENCIES = (("ttft", "time to first token"), ("e2e", "end-to-end"))


def available() -> bool:
    """Whether matplotlib (the `bench` extra) can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    return plt


def latency_cdf(result: RunResult, path: Path) -> Path:
    """One panel per latency kind; one curve per group (completed requests)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(CDF_LATENCIES), figsize=(11, 4))
    groups = sorted({r.group for r in result.records})
    for ax, (attr, title) in zip(axes, CDF_LATENCIES, strict=True):
        for group in groups:
            xs = sorted(
                v
                for r in result.records
                if r.group == group and r.status == "completed" and (v := getattr(r, attr)) is not None
            )
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=group)
        ax.set_title(f"{title} ({result.target})")
        ax.set_xlabel("seconds")
        ax.set_ylabel("share of completed requests")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(loc="lower right")
        else:
            ax.text(0.5, 0.5, "not measured by this target", ha="center", transform=ax.transAxes)
    return save_figure(plt, fig, path)


def timeline(result: RunResult, path: Path) -> Path:
    """Queue depth and running sequences per group, and KV usage, against time since the run started."""
    plt = _pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    ts = [s.t for s in result.samples]
    groups = sorted({g for s in result.samples for g in (*s.waiting, *s.running)})
    for group in groups:
        axes[0].plot(ts, [s.waiting.get(group, 0) for s in result.samples], label=group)
        axes[1].plot(ts, [s.running.get(group, 0) for s in result.samples], label=group)
    kv = [
        (s.t, s.kv_used_blocks / s.kv_total_blocks)
        for s in result.samples
        if s.kv_used_blocks is not None and s.kv_total_blocks
    ]
    if kv:
        axes[2].plot([t for t, _ in kv], [u for _, u in kv], color="tab:red")
    else:
        axes[2].text(
            0.5, 0.5, "KV usage not exposed by this target", ha="center", transform=axes[2].transAxes
        )
    for ax, label in zip(axes, ("queue depth", "running sequences", "KV blocks used (share)"), strict=True):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="upper right")
    axes[2].set_xlabel("seconds since start")
    axes[0].set_title(f"engine state over time ({result.target})")
    return save_figure(plt, fig, path)


def sweep_plot(param: str, values: list[str], summaries: list[dict[str, dict[str, Any]]], path: Path) -> Path:
    """Throughput, and per-group p90 TTFT and end-to-end latency, against the swept value."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].plot(values, [s["all"]["output_tokens_per_s"] for s in summaries], marker="o")
    axes[0].set_title("output tokens/s (all groups)")
    groups = sorted({g for s in summaries for g in s if g != "all"})
    for ax, key, title in (
        (axes[1], "ttft_s", "p90 time to first token"),
        (axes[2], "e2e_s", "p90 end-to-end"),
    ):
        for group in groups:
            ys = [s.get(group, {}).get(key, {}).get("p90") for s in summaries]
            ax.plot(values, [float("nan") if y is None else y for y in ys], marker="o", label=group)
        ax.set_title(f"{title} (s)")
        ax.legend()
    for ax in axes:
        ax.set_xlabel(param)
        ax.grid(alpha=0.3)
    return save_figure(plt, fig, path)


def save_figure(plt: Any, fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
