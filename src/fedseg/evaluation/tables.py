"""Markdown tables in the FedSM paper's Table 3 layout, for one run or several seeds."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["mean_sd", "method_rows", "privacy_of", "table3", "table5"]


def privacy_of(results: Mapping[str, Any]) -> dict[str, Any] | None:
    """A DP run's guarantee from ``results["privacy"]``: ``dp``, ``epsilon`` (the largest ε spent by any
    site: each site holds its own (ε, δ) guarantee and the federation's is its weakest), ``delta``,
    ``accountant``, ``seeded`` (``privacy.dp_randomness = "seeded"``: the server can regenerate the noise and
    the batches, so against it ε is ∞); None for a run without ``privacy.dp``."""
    priv = results.get("privacy")
    if not isinstance(priv, Mapping):
        return None
    given = [s.get("epsilon") for s in (priv.get("sites") or {}).values() if isinstance(s, Mapping)]
    eps = [float(e) for e in given if isinstance(e, int | float)]
    return {
        "dp": priv.get("dp"),
        "epsilon": max(eps) if eps else None,
        "delta": priv.get("delta"),
        "accountant": priv.get("accountant"),
        "seeded": priv.get("epsilon_against_server") == "inf",
    }


#: Row keys a table reads: Dice, and the Hausdorff distance (mm) where a run has it.
_KEYS = ("per_site_dice", "client_avg_dice", "global_dice", "per_site_hd95", "client_avg_hd95", "global_hd95")


def _row_numbers(d: dict[str, Any]) -> dict[str, Any]:
    return {k: d[k] for k in _KEYS if k in d}


def method_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Table rows of one run: the method's row, plus one row per local model for ``local``.

    Each row: ``label``, ``per_site_dice``, ``client_avg_dice``, ``global_dice``, the same for ``hd95``
    when the run has it, and ``privacy`` (:func:`privacy_of`); a DP run's label names its mode
    (``FedAvg (dp=sample)``), so that it is not merged with the same method's runs without DP.
    """
    priv = privacy_of(results)
    if priv is None:
        return [{**r, "privacy": None} for r in _rows(results)]
    tag = f"dp={priv['dp']}"  # (a report's variant label may name it already)
    return [
        {**r, "label": r["label"] if tag in r["label"] else f"{r['label']} ({tag})", "privacy": priv}
        for r in _rows(results)
    ]


def _rows(results: dict[str, Any]) -> list[dict[str, Any]]:
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
    found: set[Any] = {r.get("seed") for r in runs}
    seeds = sorted(found)
    private = [p for p in (privacy_of(r) for r in runs) if p is not None]
    lines = _metric_table(grouped, sites, "dice", "Dice", 4, epsilon=bool(private))
    note = (
        f"\nDice = mean over label channels per case; {len(seeds)} seed(s): {seeds}"
        + (" (mean ± sd)" if len(seeds) > 1 else "")
        + ".\n"
    )
    if private:
        guarantees = sorted({(p["delta"], p["accountant"]) for p in private}, key=str)
        at = "; ".join(
            f"δ = {d:g}, accountant {a}" if isinstance(d, int | float) else f"accountant {a}" for d, a in guarantees
        )
        note += f"ε = the largest ε spent by any site over the run ({at}); ∞ = no differential privacy.\n"
        if any(p.get("seeded") for p in private):
            note += (
                "∞ vs server: privacy.dp_randomness = seeded (a test mode): the server knows the seed, so it can "
                "regenerate the noise and the batches; the ε shown holds against other parties only.\n"
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


def _metric_table(
    grouped: Mapping[str, list[dict[str, Any]]],
    sites: Sequence[str],
    key: str,
    title: str,
    digits: int,
    epsilon: bool = False,
):
    header = ["Method", *sites, f"Client Avg {title}", f"Global {title}"] + (["ε"] if epsilon else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, rows in grouped.items():
        cells = [label]
        cells += [mean_sd([r.get(f"per_site_{key}", {}).get(s) for r in rows], digits) for s in sites]
        cells += [mean_sd([r.get(f"client_avg_{key}") for r in rows], digits)]
        cells += [mean_sd([r.get(f"global_{key}") for r in rows], digits)]
        if epsilon:
            dp = [r["privacy"] for r in rows if r.get("privacy") is not None]
            eps = mean_sd([p["epsilon"] for p in dp], 2) if dp else "∞"
            cells.append(f"{eps} (∞ vs server)" if any(p.get("seeded") for p in dp) else eps)
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
