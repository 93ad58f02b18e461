"""Figures: the trajectory of Auto-FedAvg's aggregation weights (paper Fig. 3a) and the effect of t0 (Fig. 4).

Drawn with matplotlib's object API on the Agg canvas (no display, no global
backend switch), written as PNG.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["alpha_trajectory", "plot_alpha_trajectory", "plot_interval_effect"]


def alpha_trajectory(history: Sequence[Mapping[str, Any]]) -> tuple[list[int], dict[str, list[float]], list[int]]:
    """α per site per round from a run's history.

    Returns
    -------
    rounds, alpha, learned
        The rounds that carry ``alpha``; ``{site: [α_k per round]}`` (layer-wise runs
        record the mean over layers); the rounds in which α was learned.
    """
    rounds: list[int] = []
    alpha: dict[str, list[float]] = {}
    learned: list[int] = []
    for entry in history:
        a = entry.get("alpha")
        if not a:
            continue
        rounds.append(int(entry["round"]))
        for s, v in a.items():
            alpha.setdefault(s, []).append(float(v))
        if entry.get("alpha_learned"):
            learned.append(int(entry["round"]))
    if not rounds:
        raise ValueError("the history has no 'alpha' entries; plot a run of method 'autofedavg'")
    return rounds, alpha, learned


def _save(fig, path: str | Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=120)
    return path


def plot_alpha_trajectory(
    runs: Mapping[str, Mapping[str, Any]] | Mapping[str, Any], path: str | Path, title: str | None = None
) -> Path:
    """Plot α_k against rounds (Fig. 3a), one panel per run.

    Parameters
    ----------
    runs
        One ``results`` dict (with ``history``) or ``{label: results}``.
    path
        PNG to write.
    """
    from matplotlib.figure import Figure

    if "history" in runs:
        runs = {title or str(runs.get("method")): runs}  # type: ignore[dict-item]
    n = len(runs)
    fig = Figure(figsize=(4.2 * n, 3.2), layout="constrained")
    axes = fig.subplots(1, n, squeeze=False)[0]
    for ax, (label, res) in zip(axes, runs.items()):
        rounds, alpha, learned = alpha_trajectory(res["history"])
        for s, values in alpha.items():
            ax.plot(rounds, values, marker=".", label=s)
        for r in learned:
            ax.axvline(r, color="0.85", lw=0.8, zorder=0)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("round")
        ax.set_ylabel("α (mean over layers)" if "-L-" in label else "α")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    if title and n > 1:
        fig.suptitle(title)
    return _save(fig, path)


def plot_interval_effect(
    values: Mapping[int, Sequence[float]],
    path: str | Path,
    ylabel: str = "global test avg Dice",
    title: str | None = None,
) -> Path:
    """Mean ± sd (over seeds) of a score against the learning interval t0 (Fig. 4)."""
    from matplotlib.figure import Figure

    t0s = sorted(values)
    means = [statistics.mean(values[t]) for t in t0s]
    sds = [statistics.stdev(values[t]) if len(values[t]) > 1 else 0.0 for t in t0s]
    fig = Figure(figsize=(4, 3), layout="constrained")
    ax = fig.subplots()
    ax.errorbar(t0s, means, yerr=sds, marker="o", capsize=3)
    ax.set_xticks(t0s)
    ax.set_xlabel("interval t0 (rounds)")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    return _save(fig, path)
