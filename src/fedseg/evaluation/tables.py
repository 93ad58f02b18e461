"""Markdown tables in the FedSM paper's Table 3 layout, for one run or several seeds."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["mean_sd", "method_rows", "table3", "table5"]


def method_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Table rows of one run: the method's row, plus one row per local model for ``local``.

    Each row: ``label``, ``per_site_dice``, ``client_avg_dice``, ``global_dice``.
    """
    method = results["method"]
    if method == "local":
        out = []
        for r in results["rows"]:
            site = r.get("home_site") or r["name"]
            out.append(
                {"label": f"{site} Local", **{k: r[k] for k in ("per_site_dice", "client_avg_dice", "global_dice")}}
            )
        out.append(
            {
                "label": "Local (own site)",
                **{k: results[k] for k in ("per_site_dice", "client_avg_dice", "global_dice")},
            }
        )
        return out
    return [
        {
            "label": results.get("label", method),
            **{k: results[k] for k in ("per_site_dice", "client_avg_dice", "global_dice")},
        }
    ]


def mean_sd(values: Sequence[float | None]) -> str:
    """``"m ± sd"`` (4 decimals) over the values that are numbers; one value alone, ``"–"`` for none."""
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return "–"
    if len(vals) == 1:
        return f"{vals[0]:.4f}"
    return f"{statistics.mean(vals):.4f} ± {statistics.stdev(vals):.4f}"


def table3(runs: Sequence[dict[str, Any]], sites: Sequence[str] | None = None) -> str:
    """Markdown table: one row per method (per local model), Dice per site, Client Avg Dice, Global Dice.

    Runs of the same method and different seeds are merged into mean ± sd.
    """
    if not runs:
        return "(no runs)\n"
    sites = list(sites or runs[0]["sites"])
    grouped: dict[str, list[dict[str, Any]]] = {}
    for res in runs:
        for row in method_rows(res):
            grouped.setdefault(row["label"], []).append(row)
    seeds = sorted({r.get("seed") for r in runs})
    header = ["Method", *sites, "Client Avg Dice", "Global Dice"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, rows in grouped.items():
        cells = [label]
        cells += [mean_sd([r["per_site_dice"].get(s) for r in rows]) for s in sites]
        cells += [mean_sd([r["client_avg_dice"] for r in rows]), mean_sd([r["global_dice"] for r in rows])]
        lines.append("| " + " | ".join(cells) + " |")
    note = (
        f"\nDice = mean over label channels per case; {len(seeds)} seed(s): {seeds}"
        + (" (mean ± sd)" if len(seeds) > 1 else "")
        + ".\n"
    )
    return "\n".join(lines) + "\n" + note


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
