"""Report sections computed from the runs' ``results.json`` (and ``config.toml`` text) alone: no model is run.

Each function takes the loaded runs (:func:`fedseg.apps.report.runs.load_runs`) and returns
HTML built with :mod:`fedseg.apps.report.markup`, or None when the runs give it nothing to show.
Runs are keyed by their variant label (method + variant settings); seeds of one
variant are aggregated, variants never.
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedseg.apps.report import figures
from fedseg.apps.report.markup import figure, markdown_html, note, para, table
from fedseg.apps.report.numbers import (
    headline,
    method_cases,
    reference_variant,
)
from fedseg.apps.report.runs import Run, method_settings, primary_of, sites_of, variants_of
from fedseg.evaluation.stats import table2, wilcoxon_signed_rank
from fedseg.evaluation.tables import table3, table5
from fedseg.foundation.config import UNET_CHANNELS, UNET_STRIDES

__all__ = [
    "alpha_section",
    "bookkeeping_config",
    "bookkeeping_runs",
    "colors_of",
    "curves_section",
    "distributions_section",
    "headline_section",
    "table2_section",
    "table3_section",
    "table5_section",
]


def fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return "–" if math.isnan(v) else f"{v:.{digits}f}"
    return str(v)


def colors_of(runs: Sequence[Run]) -> dict[str, Any]:
    """One colour per variant, and the same colour for every seed's label of that variant."""
    variants = list(variants_of(runs))
    palette = figures.color_of(variants)
    out = dict(palette)
    for r in runs:
        out[r.label] = palette[r.variant]
    return out


# ------------------------------------------------------------------ headline
def _value(cell: Mapping[str, Any], signed: bool = False) -> str:
    """HTML cell: the value, and its ± sd or [95 % interval] on a second, smaller line."""
    v = cell.get("value")
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    f = (lambda x: f"{x:+.4f}") if signed else (lambda x: f"{x:.4f}")
    if cell.get("sd") is not None:
        extra = f"± {cell['sd']:.4f}"
    elif cell.get("ci") is not None:
        lo, hi = cell["ci"]
        extra = f"[{f(lo)}, {f(hi)}]"
    else:
        return html.escape(f(v))
    return f'{html.escape(f(v))}<br><span class="small">{html.escape(extra)}</span>'


def headline_section(runs: Sequence[Run], seed: int = 0) -> str:
    """The first screen: Client Avg / Global Dice per variant with uncertainty, Δ to FedAvg and centralized,
    the best round, and the test cases per site."""
    variants = {v: [r.results for r in rs] for v, rs in variants_of(runs).items()}
    site_sets = [tuple(r.results["sites"]) for r in runs]
    common = max(set(site_sets), key=site_sets.count)
    off = {r.variant for r in runs if tuple(r.results["sites"]) != common}  # other sites: not comparable, listed last

    def order(r: dict[str, Any]) -> tuple[bool, float]:
        v = r["client_avg"]["value"]
        return (r["label"] in off, -v if not math.isnan(v) else math.inf)

    rows = sorted(headline(variants, seed=seed), key=order)
    refs = [name for name in ("FedAvg", "centralized") if any(name in r["delta"] for r in rows)]
    head = ["Method", "Seed(s)", "Client Avg Dice", "Global Dice"]
    for ref in refs:
        head += [f"Δ Client Avg vs {ref}", f"Δ Global vs {ref}"]
    head.append("Best round")
    body = []
    for r in rows:
        name = r["label"] + (f" ({len(variants[r['label']][0]['sites'])} sites)" if r["label"] in off else "")
        cells = [
            html.escape(name),
            html.escape(", ".join(str(s) for s in r["seeds"])),
            _value(r["client_avg"]),
            _value(r["global"]),
        ]
        for ref in refs:
            d = r["delta"].get(ref)
            cells += (
                ["(reference)", "(reference)"]
                if d is None
                else [_value(d["client_avg"], True), _value(d["global"], True)]
            )
        cells.append(html.escape(r["best_round"]))
        body.append(cells)
    multi = any(len(r["seeds"]) > 1 for r in rows)
    single = any(len(r["seeds"]) == 1 for r in rows)
    how = []
    if multi:
        how.append("With several seeds: mean ± sd over seeds (Δ: over the seeds both methods ran)")
    if single:
        how.append(
            f"With one seed: the run's value [95 % bootstrap interval over its test cases, resampled within each site, "
            f"2000 resamples, seed {seed}] (Δ: paired bootstrap over the same cases)"
        )
    best = max(
        (r for r in rows if r["label"] not in off and not math.isnan(r["client_avg"]["value"])),
        key=lambda r: r["client_avg"]["value"],
        default=None,
    )
    parts = []
    if best is not None:
        parts.append(
            para(
                f"Highest Client Avg Dice: {best['label']} ({best['client_avg']['value']:.4f}). Rows are sorted by Client Avg Dice"
                + ("; runs on other sites (their number in brackets) come last." if off else ".")
            )
        )
    parts.append(table(head, body, cls="headline", raw=True))
    parts.append(
        para(
            "Client Avg Dice = mean over sites of each site's mean test Dice; Global Dice = mean over all "
            "test cases pooled. Each method is shown by its reported model at its best validation round. "
            + ". ".join(how)
            + ". Δ is left out (–) between runs on different sites.",
            "small",
        )
    )
    sites = sites_of(runs)
    counts: dict[str, int | None] = {}
    for s in sites:
        got = {r.results.get("num_cases", {}).get(s) for r in runs if s in r.results["sites"]} - {None}
        counts[s] = got.pop() if len(got) == 1 else None
    total = sum(c for c in counts.values() if c)
    if total:
        crow = [[s, fmt(c), f"{100 * c / total:.0f} %" if c else "–"] for s, c in counts.items()]
        parts.append("<h3>Test cases per site</h3>")
        parts.append(table(["Site", "Test cases", "Share of Global Dice"], crow))
    return "\n".join(parts)


# ------------------------------------------------------------------ tables
def _docs(runs: Sequence[Run]) -> list[dict[str, Any]]:
    return [{**r.results, "label": r.variant} for r in runs]


def table3_section(runs: Sequence[Run]) -> str:
    docs = _docs(runs)
    text = (
        "Test Dice of each method's reported model (best validation round) on every site's test set. "
        "For local training, one row per site's model tested on every site."
    )
    if any("client_avg_hd95" in d for d in docs):
        text += (
            " Below it, the 95th-percentile Hausdorff distance (HD95, mm, lower is better) of the same "
            "predictions, scored in each scan's own grid."
        )
    return para(text) + markdown_html(table3(docs, sites_of(runs)))


def _table2_row(doc: Mapping[str, Any]) -> bool:
    """Whether a run has a row in the Auto-FedAvg paper's Table 2 layout (local models, FedAvg variants,
    FedProx, centralized, Auto-FedAvg…), from its method's ``primary`` candidate in the registry: a method
    reported by one global model (tested as ``global``), or by the sites' own models (one row per model)."""
    primary = primary_of(str(doc["method"]))
    return primary is None or (primary == "global" and "global" in (doc.get("per_case_dice") or {}))


def table2_section(runs: Sequence[Run]) -> str | None:
    methods = {r.method for r in runs}
    if not ({"autofedavg", "fedavg"} <= methods):
        return None
    sites = runs[[r.method for r in runs].index("fedavg")].results["sites"]
    base = reference_variant({r.variant: [r.results] for r in runs}, "fedavg")
    # the registry's primary also for results written before they stored it
    chosen = [{**d, "primary": primary_of(d["method"])} for d in _docs(runs) if d["sites"] == sites and _table2_row(d)]
    try:
        md = table2(chosen, baseline=base or "FedAvg")
    except Exception as e:  # a run without the paired per-case scores
        return note(f"Table 2 could not be built: {e}")
    intro = para(
        "Auto-FedAvg Table 2 layout (Dice in %): the global model on each site and its mean (global test avg); "
        "local avg / local gen = mean of the best local models on their own / on the other sites. "
        "† marks a significant gain over FedAvg (two-sided Wilcoxon signed-rank test of per-case Dice, p < 0.05)."
    )
    return intro + markdown_html(md)


def table5_section(runs: Sequence[Run]) -> str | None:
    held = [r for r in runs if r.heldout]
    if not held:
        return None
    rows, notes = [], []
    for r in held:
        k = r.heldout
        per = r.results["fedsm"]["per_site"].get(k) or {}
        dbg = {float(g): d for g, d in (per.get("dice_by_gamma") or {}).items() if d is not None}
        sel0 = (per.get("selection_by_gamma") or {}).get(str(0.0))
        if not dbg or sel0 is None or 0.0 not in dbg:
            notes.append(
                f"{r.label}: no selection frequencies at γ = 0 (run it with 0 in fedsm.gamma_grid, as `fedseg fedsm unseen` does)"
            )
            continue
        best_g = max(sorted(dbg), key=lambda g: dbg[g])
        rows.append(
            {"site": k, "selection_at_0": sel0, "dice_at_0": dbg[0.0], "best_gamma": best_g, "best_dice": dbg[best_g]}
        )
    sites = sites_of(runs)
    sites += [r.heldout for r in held if r.heldout and r.heldout not in sites]
    body = para(
        "FedSM Table 5 layout: the federation trains without site k; the selector routes the unseen site's test images."
    )
    if rows:
        body += markdown_html(table5(rows, sites))
    body += "".join(note(n) for n in notes)
    return body


# ------------------------------------------------------------------ distributions
def distributions_section(runs: Sequence[Run]) -> tuple[str, bytes | None]:
    """(HTML, PNG): per-case test Dice per site and variant (seeds pooled), and Wilcoxon tests against FedAvg."""
    variants = variants_of(runs)
    sites = sites_of(runs)
    data: dict[str, dict[str, list[float]]] = {s: {} for s in sites}
    for v, rs in variants.items():
        for r in rs:
            for s, vals in method_cases(r.results).items():
                data[s].setdefault(v, []).extend(vals)
    labels = [v for v in variants if any(v in data[s] for s in sites)]
    if not labels:
        return note("the runs store no per-case Dice (per_case_dice in results.json)"), None
    png = figures.dice_distributions(data, labels, colors_of(runs))
    ref = reference_variant({v: [r.results for r in rs] for v, rs in variants.items()}, "fedavg")
    parts = []
    if ref is None:
        parts.append(note("no FedAvg run among the runs: no paired comparisons"))
        return "\n".join(parts), png
    by_seed = {r.seed: method_cases(r.results) for r in variants[ref]}
    rows = []
    for v, rs in variants.items():
        if v == ref:
            continue
        a: dict[str, list[float]] = {s: [] for s in sites}
        b: dict[str, list[float]] = {s: [] for s in sites}
        for r in rs:
            base = by_seed.get(r.seed)
            if base is None:
                continue
            mine = method_cases(r.results)
            for s in sites:
                if s in mine and s in base and len(mine[s]) == len(base[s]):
                    a[s] += mine[s]
                    b[s] += base[s]
        cells = [v]
        for key in [*sites, "all"]:
            xa = [x for s in sites for x in a[s]] if key == "all" else a[key]
            xb = [x for s in sites for x in b[s]] if key == "all" else b[key]
            if not xa:
                cells.append("–")
                continue
            t = wilcoxon_signed_rank(xa, xb)
            cells.append(f"{t['mean_diff']:+.3f} (p={t['pvalue']:.2g}, n={t['n']})")
        rows.append(cells)
    if rows:
        parts.append(
            para(
                f"Paired comparison with {ref}: mean difference of per-case Dice (method − {ref}), "
                "two-sided Wilcoxon signed-rank p-value and number of paired cases, per site and over all "
                "sites' cases; seeds paired by seed and pooled. With few cases per site a p-value cannot be small."
            )
        )
        parts.append(table(["Method", *sites, "all sites"], rows))
    return "\n".join(parts), png


# ------------------------------------------------------------------ curves
def _best_rounds(r: Run) -> dict[str, int]:
    """``{site: round}`` of the model each site's curve reports (the primary candidate's best round, or the site's own model's)."""
    primary = primary_of(r.method)
    out = {}
    for row in r.results.get("rows", []):
        if row.get("best_round") is None:
            continue
        if primary is not None and row["name"] == primary:
            return {s: int(row["best_round"]) for s in r.results["sites"]}
        if primary is None and row.get("home_site"):
            out[row["home_site"]] = int(row["best_round"])
    return out


def curves_section(runs: Sequence[Run]) -> str:
    sites = sites_of(runs)
    colors = colors_of(runs)
    curves: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
    upper: dict[str, dict[str, float]] = {}
    best: dict[str, dict[str, int]] = {}
    loss: dict[str, tuple[list[int], list[float]]] = {}
    traffic: dict[str, tuple[list[int], list[float]]] = {}
    for r in runs:
        hist = r.results.get("history") or []
        primary = primary_of(r.method)
        home = {row.get("home_site"): row["name"] for row in r.results.get("rows", []) if row.get("home_site")}
        per_site = {s: figures.site_curve(hist, primary, s, home) for s in sites}
        if any(v[0] for v in per_site.values()):
            if r.method == "centralized":
                upper[r.label] = {s: max(v[1]) for s, v in per_site.items() if v[1]}
            else:
                curves[r.label] = per_site
                best[r.label] = _best_rounds(r)
        pts = [
            (int(e["round"]), sum(e["train_loss"].values()) / len(e["train_loss"]))
            for e in hist
            if isinstance(e.get("train_loss"), dict)
            and e["train_loss"]
            and all(isinstance(v, (int, float)) for v in e["train_loss"].values())
        ]
        if pts:
            loss[r.label] = ([p[0] for p in pts], [p[1] for p in pts])
        cum, rounds, vals = 0.0, [], []
        for e in hist:
            b = e.get("bytes")
            if isinstance(b, dict):
                cum += (
                    sum(
                        float(x.get("sent", 0)) + float(x.get("received", 0)) for x in b.values() if isinstance(x, dict)
                    )
                    / 1e6
                )
                rounds.append(int(e["round"]))
                vals.append(cum)
        if rounds and cum > 0:
            traffic[r.label] = (rounds, vals)
    parts = []
    if curves or upper:
        png = figures.training_curves(curves, sites, upper, colors, best)
        parts.append(
            figure(
                "fig-curves",
                png,
                (
                    "Validation Dice per site against rounds, as measured at each validation round, for each method's reported model "
                    "(the global model, FedSM's composite, or the site's own model for local and personalized methods). "
                    "The circle marks the round whose model the results report (best validation score); centralized training is "
                    "the dashed line at its best validation Dice. All panels share one y-range."
                ),
            )
        )
    else:
        parts.append(note("no validation Dice in the runs' histories (eval.every larger than the rounds?)"))
    if loss or traffic:
        png = figures.history_figure(loss, traffic, colors)
        parts.append(
            figure(
                "fig-history",
                png,
                (
                    "Left: training loss per round, mean over sites of each site's mean local training loss (for FedSM the global "
                    "model's loss). Right: cumulative tensor traffic of training (sent + received by all sites), in MB."
                ),
            )
        )
    return "\n".join(parts)


def alpha_section(runs: Sequence[Run]) -> str | None:
    hist = {r.label: r.results["history"] for r in runs if any(e.get("alpha") for e in r.results.get("history", []))}
    if not hist:
        return None
    return figure(
        "fig-alpha",
        figures.alpha_figure(hist),
        "Auto-FedAvg's aggregation weight α of each site per round (Auto-FedAvg Fig. 3a); grey lines mark rounds "
        "in which α was learned. Equal weights would be 1/K each.",
    )


# ------------------------------------------------------------------ bookkeeping
def bookkeeping_runs(runs: Sequence[Run], base: Path) -> str:
    """One row per run (each seed); folders relative to the runs' common folder, which is named above the table."""
    root = Path(os.path.commonpath([str(r.path.resolve()) for r in runs]))
    rows = []
    for r in runs:
        res = r.results
        rows.append(
            [
                r.label,
                r.method,
                fmt(res.get("seed")),
                len(res.get("history", [])),
                ", ".join(res["sites"]),
                fmt(res.get("client_avg_dice")),
                fmt(res.get("global_dice")),
                "–" if res.get("wall_time_s") is None else f"{res['wall_time_s']:.0f} s",
                _rel(r.path, root),
            ]
        )
    return para(f"Run folders below {root} (relative to the report: {_rel(root, base)}).") + table(
        ["Run", "Method", "Seed", "Rounds", "Sites", "Client Avg Dice", "Global Dice", "Wall time", "Folder"], rows
    )


def _rel(path: Path, base: Path) -> str:
    try:
        return os.path.relpath(path.resolve(), base.resolve())
    except ValueError:  # another drive (Windows)
        return str(path)


def bookkeeping_config(runs: Sequence[Run], base: Path) -> str:
    """The settings of every run, a link to its config.toml (relative to the report) and the file's text in a fold-out."""
    rows = []
    details = []
    for r in runs:
        c = r.results.get("config") or {}
        m, t, e = c.get("model") or {}, c.get("train") or {}, c.get("eval") or {}
        work = (
            f"{t.get('local_epochs')} epoch(s)"
            if t.get("local_epochs") is not None
            else f"{t.get('local_steps')} steps"
        )
        extra = ", ".join(f"{k}={v}" for k, v in method_settings(r).items())
        cfg_file = r.path / "config.toml"
        link = (
            f'<a href="{html.escape(Path(_rel(cfg_file, base)).as_posix())}">config.toml</a>'
            if cfg_file.is_file()
            else "–"
        )
        cells = [
            r.label,
            Path(str(c.get("federation", "–"))).name,
            c.get("rounds", "–"),
            f"U-Net {m.get('channels') or list(UNET_CHANNELS)} strides {m.get('strides') or list(UNET_STRIDES)}",
            f"{t.get('optimizer')} lr {t.get('lr')}",
            t.get("batch_size", "–"),
            work,
            t.get("loss", "–"),
            (e.get("every") or 1) if e else "–",  # unset: every round (a volume run records its interval)
            extra or "–",
        ]
        rows.append(
            [html.escape(str(x)) for x in cells[:-1]]
            + [f'<span class="small">{html.escape(str(cells[-1]))}</span>', link]
        )
        text = cfg_file.read_text() if cfg_file.is_file() else "(no config.toml)"
        details.append(
            f"<details><summary>{html.escape(r.label)}: config.toml</summary><pre>{html.escape(text)}</pre></details>"
        )
    head = [
        "Run",
        "Federation",
        "Rounds",
        "Model",
        "Optimizer",
        "Batch",
        "Local work",
        "Loss",
        "Validate every",
        "Method settings",
        "File",
    ]
    return table(head, rows, cls="config", raw=True) + "\n" + "\n".join(details)
