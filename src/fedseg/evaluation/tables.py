"""Markdown tables in the FedSM paper's Table 3 layout, for one run or several seeds."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["mean_sd", "method_rows", "table3", "table5"]


#: Row keys a table reads: Dice, and the Hausdorff distance (mm) where a run has it.
_KEYS = ("per_site_dice", "client_avg_dice", "global_dice", "per_site_hd95", "client_avg_hd95", "global_hd95")


def _row_numbers(d: dict[str, Any]) -> dict[str, Any]:
    return {k: d[k] for k in _KEYS if k in d}


def method_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Table rows of one run: the method's row, plus one row per local model for ``local``.

    Each row: ``label``, ``per_site_dice``, ``client_avg_dice``, ``global_dice``, and the same for
    ``hd95`` when the run has it.
    """
    method = results["method"]
    if method == "local":
        out = []
        for r in results["rows"]:
            site = r.get("home_site") or r["name"]
            out.append({"label": f"{site} Local", **_row_numbers(r)})
        out.append({"label": "Local (own site)", **_row_numbers(results)})
        return out
    return [{"label": results.get("label", method), **_row_numbers(results)}]


def mean_sd(values: Sequence[float | None], digits: int = 4) -> str:
    """``"m ± sd"`` (``digits`` decimals) over the values that are numbers; one value alone, ``"–"`` for none."""
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return "–"
    if len(vals) == 1:
        return f"{vals[0]:.{digits}f}"
    return f"{statistics.mean(vals):.{digits}f} ± {statistics.stdev(vals):.{digits}f}"


def table3(runs: Sequence[dict[str, Any]], sites: Sequence[str] | None = None) -> str:
    """Markdown table: one row per method (per local model), Dice per site, Client Avg Dice, Global Dice.

    Runs of the same method and different seeds are merged into mean ± sd.  When the runs carry the
    95th-percentile Hausdorff distance (volumes), a second table in the same layout gives it in mm.
    """
    if not runs:
        return "(no runs)\n"
    sites = list(sites or runs[0]["sites"])
    grouped: dict[str, list[dict[str, Any]]] = {}
    for res in runs:
        for row in method_rows(res):
            grouped.setdefault(row["label"], []).append(row)
    seeds = sorted({r.get("seed") for r in runs})
    lines = _metric_table(grouped, sites, "dice", "Dice", 4)
    note = (
        f"\nDice = mean over label channels per case; {len(seeds)} seed(s): {seeds}"
        + (" (mean ± sd)" if len(seeds) > 1 else "")
        + ".\n"
    )
    out = "\n".join(lines) + "\n" + note
    if any("client_avg_hd95" in r for rows in grouped.values() for r in rows):
        out += (
            "\n"
            + "\n".join(_metric_table(grouped, sites, "hd95", "HD95 (mm)", 2))
            + "\n\nHD95 = 95th-percentile Hausdorff distance in each scan's own grid (mm, lower is better), mean "
            "over label channels per case; both masks empty = 0, exactly one empty = the field of view's diagonal.\n"
        )
    return out


def _metric_table(grouped: Mapping[str, list[dict[str, Any]]], sites: Sequence[str], key: str, title: str, digits: int):
    header = ["Method", *sites, f"Client Avg {title}", f"Global {title}"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, rows in grouped.items():
        cells = [label]
        cells += [mean_sd([r.get(f"per_site_{key}", {}).get(s) for r in rows], digits) for s in sites]
        cells += [mean_sd([r.get(f"client_avg_{key}") for r in rows], digits)]
        cells += [mean_sd([r.get(f"global_{key}") for r in rows], digits)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def table5(rows: Sequence[Mapping[str, Any]], sites: Sequence[str]) -> str:
    """Markdown in FedSM Table 5's layout: selection frequency of GM and each PM at γ = 0, Dice, best γ and its Dice."""
    head = ["Unseen site", "γ", "GM", *[f"PM {s}" for s in sites], "Dice", "Best γ, Dice"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        sel = r["selection_at_0"]
        cells = [str(r["site"]), "0", f"{sel['global']:.2f}"]
        cells += ["N/A" if s == r["site"] else f"{sel.get(f'personal/{s}', 0.0):.2f}" for s in sites]
        cells += [f"{r['dice_at_0']:.4f}", f"{r['best_gamma']:g}, {r['best_dice']:.4f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return (
        "\n".join(lines)
        + "\n\nGM = global model, PM = personalized model; frequencies of the selector's choice on the unseen site's test cases at γ = 0; best γ over the grid on the unseen site's test set (as the paper reports it).\n"
    )
