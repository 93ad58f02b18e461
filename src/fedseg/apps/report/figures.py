"""The report's figures, drawn with matplotlib's object API on the Agg canvas and returned as PNG bytes.

* :func:`training_curves` — validation Dice as measured per site and method (FedSM Fig. 2 layout),
  the best round marked, centralized training as a horizontal dashed line (its best validation Dice);
* :func:`history_figure` — training loss and cumulative traffic against rounds;
* :func:`fedsm_history_figure` — FedSM's selector: routing accuracy and loss against rounds;
* :func:`dice_distributions` — per-case test Dice per site and method (box + dots);
* :func:`alpha_figure` — Auto-FedAvg's aggregation weights α per round (Auto-FedAvg Fig. 3a);
* :func:`loss_surface_figure` — 1D loss surfaces, one panel per method (FedSM Fig. 4);
* :func:`tsne_figure` — t-SNE map of the selector's features coloured by site (FedSM Fig. 3);
* :func:`predictions_figure` — the masks drawn over the image: ground truth, then each method's prediction.

No global backend switch: figures are :class:`matplotlib.figure.Figure` objects
rendered by ``FigureCanvasAgg``.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedseg.evaluation.plots import alpha_trajectory

__all__ = [
    "alpha_figure",
    "best_so_far",
    "color_of",
    "dice_distributions",
    "fedsm_history_figure",
    "history_figure",
    "loss_surface_figure",
    "predictions_figure",
    "site_curve",
    "to_png",
    "training_curves",
    "tsne_figure",
]

DPI = 80
#: Font size (pt) of titles, labels and legends; ticks are one smaller.
FONT = 10


def to_png(fig: Any, dpi: int = DPI, colors: int | None = 256) -> bytes:
    """Render a matplotlib ``Figure`` to PNG bytes (Agg canvas).

    ``colors``: quantize to an adaptive palette of this many colours (Pillow, a
    matplotlib dependency), which makes plots 2–4× smaller at no visible cost; None
    keeps full RGBA.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    buf = io.BytesIO()
    if colors is None:
        fig.savefig(buf, format="png", dpi=dpi)
        return buf.getvalue()
    from PIL import Image

    fig.set_dpi(dpi)
    canvas.draw()
    rgba = np.asarray(canvas.buffer_rgba())
    img = Image.fromarray(rgba[..., :3].copy()).quantize(
        colors=colors, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE
    )
    img.save(buf, format="png", optimize=True)
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


def site_curve(
    history: Sequence[Mapping[str, Any]], candidate: str | None, site: str, home: Mapping[str, str] | None = None
) -> tuple[list[int], list[float]]:
    """(rounds, validation Dice) of one candidate on one site from a run's history.

    ``candidate`` None means "the site's own model": ``home[site]`` names it.
    Rounds without validation (or without that candidate/site) are left out.
    """
    name = candidate if candidate is not None else (home or {}).get(site)
    rounds: list[int] = []
    values: list[float] = []
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


def _style(ax, title: str | None = None, xlabel: str | None = None, ylabel: str | None = None) -> None:
    if title:
        ax.set_title(title, fontsize=FONT)
    if xlabel:
        ax.set_xlabel(xlabel, fontsize=FONT)
    if ylabel:
        ax.set_ylabel(ylabel, fontsize=FONT)
    ax.tick_params(labelsize=FONT - 1)
    ax.grid(alpha=0.3)


def _shared_ylim(axes, values: Sequence[float], lo0: float | None = None, hi0: float | None = None) -> None:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return
    lo, hi = min(vals), max(vals)
    lo = lo if lo0 is None else min(lo, lo0)
    hi = hi if hi0 is None else max(hi, hi0)
    pad = 0.05 * (hi - lo if hi > lo else 1.0)
    for ax in axes:
        ax.set_ylim(lo - pad, hi + pad)


def _legend_below(fig, axes) -> None:
    handles, labels = [], []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 4), fontsize=FONT)


def training_curves(
    curves: Mapping[str, Mapping[str, tuple[list[int], list[float]]]],
    sites: Sequence[str],
    upper: Mapping[str, Mapping[str, float]] | None = None,
    colors: Mapping[str, Any] | None = None,
    best: Mapping[str, Mapping[str, int]] | None = None,
) -> bytes:
    """Validation Dice as measured against rounds, one panel per site, one y-range for all panels.

    Parameters
    ----------
    curves
        ``{label: {site: (rounds, val dice)}}``; several runs of one variant may share
        a colour by giving labels ``"<variant> seed k"`` and ``colors`` per label.
    upper
        ``{label: {site: best val dice}}`` drawn as horizontal dashed lines (centralized training).
    colors
        ``{label: colour}`` (default: :func:`color_of` in the given order).  Lines are
        drawn thinner one after the other so that identical curves stay visible.
    best
        ``{label: {site: round}}``: the round whose model the results row reports;
        marked with a circle on the curve.
    """
    upper = upper or {}
    best = best or {}
    colors = colors or color_of([*curves, *upper])
    fig, axes = _grid(len(sites), ncols=3, w=4.0, h=2.9)
    seen: list[float] = []
    for ax, s in zip(axes, sites):
        for i, (label, per_site) in enumerate(curves.items()):
            rounds, values = per_site.get(s, ([], []))
            if not rounds:
                continue
            seen += values
            ax.plot(rounds, values, color=colors[label], lw=max(1.0, 2.4 - 0.3 * i), label=label)
            b = (best.get(label) or {}).get(s)
            if b in rounds:
                ax.plot([b], [values[rounds.index(b)]], "o", color=colors[label], ms=7, mfc="white", mew=1.8)
        for label, levels in upper.items():
            if s in levels:
                seen.append(levels[s])
                ax.axhline(levels[s], color=colors[label], ls="--", lw=1.3, label=label)
        _style(ax, s, "round", "validation Dice")
    _shared_ylim(axes, seen)
    _legend_below(fig, axes)
    return to_png(fig)


def history_figure(
    loss: Mapping[str, tuple[list[int], list[float]]],
    traffic: Mapping[str, tuple[list[int], list[float]]],
    colors: Mapping[str, Any] | None = None,
) -> bytes:
    """Two panels against rounds: training loss (mean over sites) and cumulative traffic (MB, sent + received)."""
    from matplotlib.figure import Figure

    colors = colors or color_of(list(dict.fromkeys([*loss, *traffic])))
    fig = Figure(figsize=(11.0, 3.4), layout="constrained")
    ax_l, ax_t = fig.subplots(1, 2)
    for i, (label, (r, v)) in enumerate(loss.items()):
        ax_l.plot(r, v, color=colors[label], lw=max(1.0, 2.4 - 0.3 * i), label=label)
    for i, (label, (r, v)) in enumerate(traffic.items()):
        ax_t.plot(r, v, color=colors[label], lw=max(1.0, 2.4 - 0.3 * i), label=label)
    _style(ax_l, "training loss (mean over sites)", "round", "loss")
    _style(ax_t, "cumulative training traffic", "round", "MB (sent + received, all sites)")
    _legend_below(fig, [ax_l, ax_t])
    return to_png(fig)


def fedsm_history_figure(histories: Mapping[str, Sequence[Mapping[str, Any]]]) -> bytes:
    """Per FedSM run (one row): the selector's routing accuracy as a site × round map, and its training loss per site against rounds."""
    from matplotlib.figure import Figure

    n = len(histories)
    fig = Figure(figsize=(11.0, 2.5 * n + 0.7), layout="constrained")
    axes = fig.subplots(n, 2, squeeze=False, width_ratios=[1.15, 1])
    sites: list[str] = []
    for entries in histories.values():
        for e in entries:
            for s in e.get("routing_acc") or e.get("selector_loss") or {}:
                if s not in sites:
                    sites.append(s)
    colors = color_of(sites)
    image = None
    for (label, entries), (ax_a, ax_l) in zip(histories.items(), axes):
        rounds = [int(e["round"]) for e in entries]
        acc = np.full((len(sites), len(rounds)), np.nan)
        for j, e in enumerate(entries):
            for i, s in enumerate(sites):
                v = (e.get("routing_acc") or {}).get(s)
                if v is not None:
                    acc[i, j] = float(v)
        if rounds:
            image = ax_a.imshow(
                acc,
                aspect="auto",
                cmap="viridis",
                vmin=0.0,
                vmax=1.0,
                interpolation="nearest",
                extent=(rounds[0] - 0.5, rounds[-1] + 0.5, len(sites) - 0.5, -0.5),
            )
        ax_a.set_yticks(range(len(sites)))
        ax_a.set_yticklabels(sites)
        _style(ax_a, f"{label}: routing accuracy (validation)", "round")
        ax_a.grid(False)
        for s in sites:
            pts = [
                (int(e["round"]), float(e["selector_loss"][s]))
                for e in entries
                if (e.get("selector_loss") or {}).get(s) is not None
            ]
            if pts:
                ax_l.plot(*zip(*pts), color=colors[s], lw=1.4, label=s)
        _style(ax_l, f"{label}: selector training loss", "round", "cross-entropy")
    if image is not None:
        bar = fig.colorbar(image, ax=list(axes[:, 0]), shrink=0.8, pad=0.01)
        bar.set_label("share routed to own site", fontsize=FONT - 1)
        bar.ax.tick_params(labelsize=FONT - 1)
    _legend_below(fig, list(axes[:, 1]))
    return to_png(fig)


def dice_distributions(
    data: Mapping[str, Mapping[str, Sequence[float]]], labels: Sequence[str], colors: Mapping[str, Any] | None = None
) -> bytes:
    """Per-case test Dice, one panel per site: a box (quartiles, whiskers 1.5 IQR) and every case as a dot, per method.

    ``data``: ``{site: {label: [per-case Dice]}}``; dots are spread evenly across the
    box (no random jitter), one y-range for all panels.
    """
    colors = colors or color_of(labels)
    sites = list(data)
    fig, axes = _grid(len(sites), ncols=3, w=4.0, h=3.1)
    seen: list[float] = []
    for ax, s in zip(axes, sites):
        for i, label in enumerate(labels):
            vals = [float(v) for v in data[s].get(label, []) if v is not None and math.isfinite(v)]
            if not vals:
                continue
            seen += vals
            ax.boxplot(
                [vals],
                positions=[i],
                widths=0.6,
                showfliers=False,
                medianprops={"color": "black"},
                boxprops={"color": colors[label]},
                whiskerprops={"color": colors[label]},
                capprops={"color": colors[label]},
            )
            xs = np.linspace(i - 0.22, i + 0.22, len(vals)) if len(vals) > 1 else np.array([float(i)])
            ax.scatter(xs, vals, s=12, color=colors[label], alpha=0.8, zorder=3)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels([str(j + 1) for j in range(len(labels))])
        n = max((len(v) for v in data[s].values()), default=0)
        _style(ax, f"{s} ({n} test cases)", "method (numbered as in the legend)", "test Dice per case")
    _shared_ylim(axes, seen, 0.0, 1.0)
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], color=colors[lab], marker="o", ls="", label=f"{j + 1}: {lab}") for j, lab in enumerate(labels)
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(labels), 4), fontsize=FONT)
    return to_png(fig)


def alpha_figure(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> bytes:
    """α_k against rounds (Auto-FedAvg Fig. 3a), one panel per run; grey lines mark rounds where α was learned.

    ``runs``: ``{label: history}``; entries with an ``alpha`` dict ``{site: α}`` are used.
    """
    fig, axes = _grid(len(runs), ncols=2, w=4.2, h=3.0)
    for ax, (label, history) in zip(axes, runs.items()):
        rounds, alpha, learned = alpha_trajectory(history)
        for s, values in alpha.items():
            ax.plot(rounds, values, marker=".", label=s)
        for r in learned:
            ax.axvline(r, color="0.88", lw=0.8, zorder=0)
        _style(ax, label, "round", "α (aggregation weight)")
        ax.legend(fontsize=FONT - 1)
    return to_png(fig)


def loss_surface_figure(
    surfaces: Mapping[str, Any], xlabel: str, ylabel: str, colors: Mapping[str, Any] | None = None
) -> bytes:
    """One panel per method: the loss along each random direction against α (FedSM Fig. 4), shared y axis."""
    fig, axes = _grid(len(surfaces), ncols=3, w=4.0, h=3.0)
    lo = min(float(np.min(s.losses)) for s in surfaces.values())
    hi = max(float(np.max(s.losses)) for s in surfaces.values())
    pad = 0.05 * (hi - lo if hi > lo else 1.0)
    colors = colors or color_of(list(surfaces))
    for ax, (label, surf) in zip(axes, surfaces.items()):
        for row in surf.losses:
            ax.plot(surf.alphas, row, color=colors[label], lw=0.9, alpha=0.8)
        ax.plot([0.0], [surf.center], "k.", ms=5)
        ax.set_ylim(lo - pad, hi + pad)
        _style(ax, f"{label}\nsharpness {surf.sharpness:.3f}", xlabel, ylabel)
    return to_png(fig)


def tsne_figure(points: np.ndarray, sites: Sequence[str], title: str = "") -> bytes:
    """Scatter of a 2-D embedding (N, 2), one colour per site (FedSM Fig. 3)."""
    from matplotlib.figure import Figure

    order = list(dict.fromkeys(sites))
    colors = color_of(order)
    fig = Figure(figsize=(5.2, 4.4), layout="constrained")
    ax = fig.subplots()
    arr = np.asarray(sites)
    for s in order:
        pts = points[arr == s]
        ax.scatter(pts[:, 0], pts[:, 1], s=14, color=colors[s], label=s, alpha=0.85)
    ax.set_xticks([])
    ax.set_yticks([])
    if title:
        ax.set_title(title, fontsize=FONT)
    ax.legend(fontsize=FONT - 1, loc="best")
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


#: Mask colours per label channel (disc, cup, …): filled overlay for predictions, contour for the ground truth.
MASK_COLORS = ("#00e5ff", "#ff2bd6", "#39ff14", "#ffffff", "#0050ff")
#: Colour of the ground-truth contour drawn over predictions.
TRUTH_COLOR = "#ffffff"


def _overlay(ax, img: np.ndarray, cmap: str | None, masks: np.ndarray | None, truth: np.ndarray | None) -> None:
    """The image with each channel of ``masks`` filled (semi-transparent) and ``truth`` drawn as contours."""
    from matplotlib.colors import to_rgba

    ax.imshow(img, cmap=cmap, interpolation="nearest")
    if masks is not None:
        for c in range(masks.shape[0]):
            rgba = np.zeros((*masks.shape[1:], 4))
            rgba[masks[c] > 0] = to_rgba(MASK_COLORS[c % len(MASK_COLORS)], 0.45)
            ax.imshow(rgba, interpolation="nearest")
    if truth is not None:
        for c in range(truth.shape[0]):
            if truth[c].any() and not truth[c].all():
                ax.contour(truth[c].astype(float), levels=[0.5], colors=[TRUTH_COLOR], linewidths=1.3)


def predictions_figure(rows: Sequence[Mapping[str, Any]], methods: Sequence[str], channels: Sequence[str]) -> bytes:
    """Grid: one row per test case; the first column is the image with the ground truth filled, then each method's
    prediction filled over the image with the ground truth as a contour.

    Parameters
    ----------
    rows
        ``{"site", "case", "image" (C, H, W), "label" (L, H, W) binary,
        "preds": {method: ((L, H, W) binary, dice[, routed model name])}}``.
    methods
        Column order of the predictions.
    channels
        Label channel names; channel j has colour ``MASK_COLORS[j]`` (legend below).
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    ncols = 1 + len(methods)
    nrows = len(rows)
    fig = Figure(figsize=(1.9 * ncols + 0.4, 2.05 * nrows + 0.7), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for i, row in enumerate(rows):
        img, cmap = _image(np.asarray(row["image"], dtype=np.float64))
        truth = np.asarray(row["label"])
        for j in range(ncols):
            ax = axes[i][j]
            ax.set_xticks([])
            ax.set_yticks([])
            if j == 0:
                _overlay(ax, img, cmap, truth, None)
                ax.set_ylabel(f"{row['site']} case {row['case']}", fontsize=FONT - 1)
                if i == 0:
                    ax.set_title("ground truth", fontsize=FONT - 1)
                continue
            m = methods[j - 1]
            pred = row["preds"].get(m)
            if i == 0:
                ax.set_title(m, fontsize=FONT - 1)
            if pred is None:
                ax.imshow(img, cmap=cmap, alpha=0.35)
                ax.text(0.5, 0.5, "n/a", ha="center", va="center", fontsize=FONT, transform=ax.transAxes)
                continue
            _overlay(ax, img, cmap, np.asarray(pred[0]), truth)
            text = f"Dice {pred[1]:.2f}"
            if len(pred) > 2 and pred[2]:
                text += f" · {pred[2]}"
            ax.set_xlabel(text, fontsize=FONT - 1, labelpad=2)
    from matplotlib.artist import Artist
    from matplotlib.lines import Line2D

    handles: list[Artist] = [
        Patch(color=MASK_COLORS[c % len(MASK_COLORS)], alpha=0.6, label=name) for c, name in enumerate(channels)
    ]
    handles.append(Line2D([], [], color="0.3", lw=1.3, label="ground truth outline (white)"))
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=FONT - 1)
    return to_png(fig)
