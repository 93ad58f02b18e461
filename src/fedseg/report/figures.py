"""The report's figures, drawn with matplotlib's object API on the Agg canvas and returned as PNG bytes.

* :func:`training_curves` — best-so-far validation Dice per site and method (FedSM Fig. 2),
  centralized training as a horizontal dashed line (its best validation Dice);
* :func:`alpha_figure` — Auto-FedAvg's aggregation weights α per round (Auto-FedAvg Fig. 3a);
* :func:`loss_surface_figure` — 1D loss surfaces, one panel per method (FedSM Fig. 4);
* :func:`tsne_figure` — t-SNE map of the selector's features coloured by site (FedSM Fig. 3);
* :func:`predictions_figure` — image, ground truth and each method's prediction per case.

No global backend switch: figures are :class:`matplotlib.figure.Figure` objects
rendered by ``FigureCanvasAgg``.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "alpha_figure",
    "best_so_far",
    "color_of",
    "loss_surface_figure",
    "predictions_figure",
    "site_curve",
    "to_png",
    "training_curves",
    "tsne_figure",
]

DPI = 80


def to_png(fig: Any, dpi: int = DPI) -> bytes:
    """Render a matplotlib ``Figure`` to PNG bytes (Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def color_of(labels: Sequence[str]) -> dict[str, Any]:
    """One colour per label (tab10, then tab20), stable for a given label order."""
    from matplotlib import colormaps

    cmap = colormaps["tab10" if len(labels) <= 10 else "tab20"]
    return {label: cmap(i % cmap.N) for i, label in enumerate(labels)}


def best_so_far(values: Sequence[float]) -> list[float]:
    """Running maximum (the papers report the best validation result during training)."""
    out, best = [], -math.inf
    for v in values:
        best = max(best, v)
        out.append(best)
    return out


def site_curve(history: Sequence[Mapping[str, Any]], candidate: str | None, site: str, home: Mapping[str, str] | None = None) -> tuple[list[int], list[float]]:
    """(rounds, validation Dice) of one candidate on one site from a run's history.

    ``candidate`` None means "the site's own model": ``home[site]`` names it.
    Rounds without validation (or without that candidate/site) are left out.
    """
    name = candidate if candidate is not None else (home or {}).get(site)
    rounds, values = [], []
    if name is None:
        return rounds, values
    for entry in history:
        v = (entry.get("val_dice") or {}).get(name, {}).get(site)
        if v is not None and not (isinstance(v, float) and math.isnan(v)):
            rounds.append(int(entry["round"]))
            values.append(float(v))
    return rounds, values


def _grid(n: int, ncols: int = 3, w: float = 3.3, h: float = 2.6):
    from matplotlib.figure import Figure

    ncols = min(ncols, n)
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(w * ncols, h * nrows + 0.5), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def training_curves(
    curves: Mapping[str, Mapping[str, tuple[list[int], list[float]]]],
    sites: Sequence[str],
    upper: Mapping[str, Mapping[str, float]] | None = None,
    colors: Mapping[str, Any] | None = None,
) -> bytes:
    """Best-so-far validation Dice against rounds, one panel per site (FedSM Fig. 2).

    Parameters
    ----------
    curves
        ``{method label: {site: (rounds, val dice)}}``; plotted as running maxima.
    upper
        ``{label: {site: best val dice}}`` drawn as horizontal dashed lines
        (centralized training, the upper bound).
    colors
        ``{label: colour}`` (default: :func:`color_of` in the given order).  Lines are
        drawn thinner one after the other so that identical curves stay visible.
    """
    upper = upper or {}
    colors = colors or color_of([*curves, *upper])
    fig, axes = _grid(len(sites))
    for ax, s in zip(axes, sites):
        for i, (label, per_site) in enumerate(curves.items()):
            rounds, values = per_site.get(s, ([], []))
            if rounds:
                ax.plot(rounds, best_so_far(values), color=colors[label], lw=max(0.9, 2.6 - 0.35 * i), label=label)
        for label, per_site in upper.items():
            if s in per_site:
                ax.axhline(per_site[s], color=colors[label], ls="--", lw=1.2, label=label)
        ax.set_title(s, fontsize=9)
        ax.set_xlabel("round", fontsize=8)
        ax.set_ylabel("best val Dice", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    handles, labels = [], []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 5), fontsize=8)
    return to_png(fig)


def alpha_figure(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> bytes:
    """α_k against rounds (Auto-FedAvg Fig. 3a), one panel per run; grey lines mark rounds where α was learned.

    ``runs``: ``{label: history}``; entries with an ``alpha`` dict ``{site: α}`` are used.
    """
    from fedseg.evaluation.plots import alpha_trajectory

    fig, axes = _grid(len(runs), ncols=2, w=4.2, h=3.0)
    for ax, (label, history) in zip(axes, runs.items()):
        rounds, alpha, learned = alpha_trajectory(history)
        for s, values in alpha.items():
            ax.plot(rounds, values, marker=".", label=s)
        for r in learned:
            ax.axvline(r, color="0.88", lw=0.8, zorder=0)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("round", fontsize=8)
        ax.set_ylabel("α (aggregation weight)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return to_png(fig)


def loss_surface_figure(surfaces: Mapping[str, Any], xlabel: str, ylabel: str, colors: Mapping[str, Any] | None = None) -> bytes:
    """One panel per method: the loss along each random direction against α (FedSM Fig. 4), shared y axis."""
    fig, axes = _grid(len(surfaces), ncols=4, w=3.0, h=2.6)
    lo = min(float(np.min(s.losses)) for s in surfaces.values())
    hi = max(float(np.max(s.losses)) for s in surfaces.values())
    pad = 0.05 * (hi - lo if hi > lo else 1.0)
    colors = colors or color_of(list(surfaces))
    for ax, (label, surf) in zip(axes, surfaces.items()):
        for row in surf.losses:
            ax.plot(surf.alphas, row, color=colors[label], lw=0.9, alpha=0.8)
        ax.plot([0.0], [surf.center], "k.", ms=5)
        ax.set_ylim(lo - pad, hi + pad)
        ax.set_title(f"{label}\nsharpness {surf.sharpness:.3f}", fontsize=8)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    return to_png(fig)


def tsne_figure(points: np.ndarray, sites: Sequence[str], title: str = "") -> bytes:
    """Scatter of a 2-D embedding (N, 2), one colour per site (FedSM Fig. 3)."""
    from matplotlib.figure import Figure

    order = list(dict.fromkeys(sites))
    colors = color_of(order)
    fig = Figure(figsize=(4.6, 4.0), layout="constrained")
    ax = fig.subplots()
    arr = np.asarray(sites)
    for s in order:
        pts = points[arr == s]
        ax.scatter(pts[:, 0], pts[:, 1], s=14, color=colors[s], label=s, alpha=0.85)
    ax.set_xticks([])
    ax.set_yticks([])
    if title:
        ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="best")
    return to_png(fig)


def _image(x: np.ndarray) -> tuple[np.ndarray, str | None]:
    """(H, W[, 3]) array in [0, 1] from a (C, H, W) image; RGB when C = 3, else the first channel in grey."""
    if x.shape[0] == 3:
        img = np.moveaxis(x, 0, -1)
        cmap = None
    else:
        img = x[0]
        cmap = "gray"
    lo, hi = float(img.min()), float(img.max())
    return (img - lo) / (hi - lo) if hi > lo else np.zeros_like(img), cmap


def predictions_figure(rows: Sequence[Mapping[str, Any]], methods: Sequence[str], channels: Sequence[str]) -> bytes:
    """Grid: one row per test case — image, ground truth, then each method's prediction.

    Parameters
    ----------
    rows
        ``{"site", "case", "image" (C, H, W), "label" (L, H, W) binary, "preds": {method: ((L, H, W) binary, dice) }}``.
    methods
        Column order of the predictions.
    channels
        Label channel names; masks are shown as the sum over channels (e.g. disc = 1,
        cup inside it = 2).
    """
    from matplotlib.figure import Figure

    ncols = 2 + len(methods)
    nrows = len(rows)
    fig = Figure(figsize=(1.45 * ncols, 1.5 * nrows + 0.3), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    vmax = max(1, len(channels))
    for i, row in enumerate(rows):
        img, cmap = _image(np.asarray(row["image"], dtype=np.float64))
        cells = [("image", img, cmap, None), ("ground truth", np.asarray(row["label"]).sum(axis=0), "viridis", vmax)]
        for m in methods:
            pred = row["preds"].get(m)
            cells.append((m, None if pred is None else np.asarray(pred[0]).sum(axis=0), "viridis", vmax))
        for j, (title, arr, cm, vm) in enumerate(cells):
            ax = axes[i][j]
            ax.set_xticks([])
            ax.set_yticks([])
            if arr is None:
                ax.text(0.5, 0.5, "n/a", ha="center", va="center", fontsize=7, transform=ax.transAxes)
            elif vm is None:
                ax.imshow(arr, cmap=cm)
            else:
                ax.imshow(arr, cmap=cm, vmin=0, vmax=vm, interpolation="nearest")
            if j >= 2 and row["preds"].get(methods[j - 2]) is not None:
                ax.set_xlabel(f"Dice {row['preds'][methods[j - 2]][1]:.2f}", fontsize=6, labelpad=1)
            if i == 0:
                ax.set_title(title, fontsize=7)
            if j == 0:
                ax.set_ylabel(f"{row['site']} #{row['case']}", fontsize=7)
    return to_png(fig)
