"""The numbers a report shows, computed from ``results.json`` documents only (no models, no HTML).

* :func:`method_cases` — per-case test Dice of a run's results row (its primary
  candidate, or each site's own model);
* :func:`headline` — Client Avg / Global Dice per variant with their uncertainty (mean ±
  sd over seeds, or a bootstrap 95 % interval over cases for one seed) and the
  differences to FedAvg and to centralized training;
* :func:`fedsm_summary` and :func:`fedsm_findings` — what FedSM's composite did per
  site: its Dice beside the global and personalized models', where the selector sent
  the images, and sentences that say where the composite gained or lost and why.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from fedseg.algorithms import REGISTRY
from fedseg.algorithms.fedsm import FedSM
from fedseg.apps.report.runs import primary_of
from fedseg.evaluation.stats import bootstrap_ci

__all__ = [
    "best_round",
    "fedsm_findings",
    "fedsm_summary",
    "headline",
    "is_fedsm",
    "method_cases",
    "model_short",
    "reference_variant",
]


def _primary(method: str) -> str | None:
    return primary_of(method)


def method_cases(results: Mapping[str, Any]) -> dict[str, list[float]]:
    """``{site: per-case test Dice}`` of the run's results row (the numbers behind ``per_site_dice``).

    The primary candidate's cases (FedAvg's ``global``, FedSM's ``fedsm``), or for
    methods whose models belong to sites each site's own model on its own test set.
    Sites without stored per-case Dice are left out.
    """
    pcd = results.get("per_case_dice") or {}
    primary = _primary(str(results["method"]))
    if primary is not None:
        return {s: list(v) for s, v in (pcd.get(primary) or {}).items() if s in results["sites"]}
    home = {r.get("home_site"): r["name"] for r in results.get("rows", []) if r.get("home_site")}
    return {s: list(pcd[home[s]][s]) for s in results["sites"] if s in home and s in (pcd.get(home[s]) or {})}


def best_round(results: Mapping[str, Any]) -> str:
    """The round whose model makes the results row: one number, or ``lo–hi`` when each site's own model has its own."""
    primary = _primary(str(results["method"]))
    rows = results.get("rows") or []
    if primary is not None:
        got = [r.get("best_round") for r in rows if r["name"] == primary]
    else:
        got = [r.get("best_round") for r in rows if r.get("home_site") in results["sites"]]
    got = [int(g) for g in got if g is not None]
    if not got:
        return "–"
    lo, hi = min(got), max(got)
    return str(lo) if lo == hi else f"{lo}–{hi} (per site)"


def _mean_sd(values: Sequence[float]) -> tuple[float, float | None]:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return float("nan"), None
    return statistics.mean(vals), (statistics.stdev(vals) if len(vals) > 1 else None)


def reference_variant(variants: Mapping[str, Sequence[Mapping[str, Any]]], method: str) -> str | None:
    """The variant the headline compares against: the plain run of ``method`` (label without settings) first."""
    of_method = [v for v, rs in variants.items() if rs and rs[0]["method"] == method]
    plain = [v for v in of_method if "(" not in v]
    chosen = plain or of_method
    return chosen[0] if chosen else None


def _delta(
    runs: Sequence[Mapping[str, Any]], refs: Sequence[Mapping[str, Any]], key: str, boot: int, seed: int
) -> dict[str, Any]:
    """Difference ``key`` (client_avg_dice / global_dice) of a variant to a reference variant, with its uncertainty."""
    if any(list(r["sites"]) != list(refs[0]["sites"]) for r in [*runs, *refs]):
        return {"value": None}  # Client Avg / Global Dice over different sites are not comparable
    by_seed = {r.get("seed"): r for r in refs}
    paired = [(r, by_seed[r.get("seed")]) for r in runs if r.get("seed") in by_seed]
    if len(paired) >= 2:
        d = [a[key] - b[key] for a, b in paired]
        m, sd = _mean_sd(d)
        return {"value": m, "sd": sd, "n": len(d)}
    if len(runs) == 1 and len(refs) == 1:
        a, b = method_cases(runs[0]), method_cases(refs[0])
        if a and set(a) == set(b) and all(len(a[s]) == len(b[s]) for s in a) and set(a) == set(runs[0]["sites"]):
            ci = bootstrap_ci(a, b, n_boot=boot, seed=seed)["client_avg" if key == "client_avg_dice" else "global"]
            return {"value": runs[0][key] - refs[0][key], "ci": ci}
    return {"value": _mean_sd([r[key] for r in runs])[0] - _mean_sd([r[key] for r in refs])[0]}


def headline(
    variants: Mapping[str, Sequence[Mapping[str, Any]]], boot: int = 2000, seed: int = 0
) -> list[dict[str, Any]]:
    """One row per variant: Client Avg / Global Dice with uncertainty, Δ to FedAvg and centralized, cases, best round.

    Parameters
    ----------
    variants
        ``{variant label: [results of each seed]}`` (seeds of one variant only).
    boot, seed
        Bootstrap resamples and seed (:func:`fedseg.evaluation.stats.bootstrap_ci`).

    Each row: ``label``, ``method``, ``seeds``, ``client_avg`` / ``global`` as
    ``{"value", "sd"}`` (several seeds) or ``{"value", "ci"}`` (one seed, bootstrap
    95 % interval over the test cases), ``delta`` ``{"FedAvg"|"centralized":
    {"client_avg", "global"}}`` (each ``{"value"[, "sd"|"ci"]}``), ``best_round``.
    Δ's uncertainty: sd over seeds paired by seed, or a paired bootstrap over the
    same test cases when each side has one run.
    """
    refs = {"FedAvg": reference_variant(variants, "fedavg"), "centralized": reference_variant(variants, "centralized")}
    rows = []
    for label, runs in variants.items():
        row: dict[str, Any] = {
            "label": label,
            "method": runs[0]["method"],
            "seeds": sorted({r.get("seed") for r in runs}, key=str),
        }
        for key, name in (("client_avg_dice", "client_avg"), ("global_dice", "global")):
            m, sd = _mean_sd([r[key] for r in runs])
            row[name] = {"value": m, "sd": sd}
        if len(runs) == 1:
            cases = method_cases(runs[0])
            if cases and set(cases) == set(runs[0]["sites"]) and any(cases.values()):
                ci = bootstrap_ci(cases, n_boot=boot, seed=seed)
                row["client_avg"]["ci"], row["global"]["ci"] = ci["client_avg"], ci["global"]
        row["delta"] = {}
        for ref_name, ref in refs.items():
            if ref is None or ref == label:
                continue
            row["delta"][ref_name] = {
                name: _delta(runs, variants[ref], key, boot, seed)
                for key, name in (("client_avg_dice", "client_avg"), ("global_dice", "global"))
            }
        rounds = sorted({best_round(r) for r in runs})
        row["best_round"] = ", ".join(rounds)
        rows.append(row)
    return rows


# ------------------------------------------------------------------ FedSM
def is_fedsm(method: str) -> bool:
    """Whether ``method`` is a FedSM-family algorithm (fedsm, fedsm-extra, fedsm-ensemble, or a registered subclass)."""
    cls = REGISTRY.get(method)
    return cls is not None and issubclass(cls, FedSM)


def model_short(name: str) -> str:
    """``global`` → ``GM``, ``personal/site3`` → ``PM site3`` (the paper's names)."""
    return "GM" if name == "global" else ("PM " + name.split("/", 1)[1] if name.startswith("personal/") else name)


def fedsm_summary(results: Mapping[str, Any], routing: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Per site: the composite's Dice beside the global and every personalized model's, and the routing.

    ``routing`` is a routing report on the test split (``results["fedsm"]`` of
    ``fedseg fedsm`` runs, or one the report computed from the checkpoints): its
    ``per_site[site]["selection"]`` gives the share of the site's test images each
    model received.  Returns ``{"sites", "models" (["global", "personal/…"]),
    "dice": {site: {"fedsm"|model: Dice}}, "selection": {site: {model: share}} | None,
    "routing_acc": {site: acc} | None, "inside"}``; Dice values missing from the results are None.
    ``inside`` is True when the models' Dice are those of the models inside the composite
    (from the routing report); False when some come from the results rows, where each
    candidate is at its own best round.
    """
    rows = {r["name"]: r for r in results.get("rows", [])}
    routing = (
        routing if routing is not None else results.get("fedsm") if isinstance(results.get("fedsm"), dict) else None
    )
    sites = list(results["sites"])
    if routing is not None and routing.get("models"):
        models = list(routing["models"])
    else:
        models = ["global", *[f"personal/{s}" for s in sites]]
    dice: dict[str, dict[str, float | None]] = {}
    inside = True
    for s in sites:
        d: dict[str, float | None] = {"fedsm": results["per_site_dice"].get(s)}
        per_model = ((routing or {}).get("per_site", {}).get(s) or {}).get("dice_per_model") or {}
        for m in models:
            v = per_model.get(m)
            if v is None and m in rows:
                v = rows[m]["per_site_dice"].get(s)
                inside = False
            d[m] = v
        dice[s] = d
    selection = routing_acc = None
    if routing is not None and routing.get("per_site"):
        per = routing["per_site"]
        selection = {s: dict(per[s].get("selection") or {}) for s in per}
        routing_acc = {s: per[s].get("routing_acc") for s in per}
    return {
        "sites": sites,
        "models": models,
        "dice": dice,
        "selection": selection,
        "routing_acc": routing_acc,
        "inside": inside,
        "mode": (routing or {}).get("mode", "gate"),
    }


def fedsm_findings(summary: Mapping[str, Any], tol: float = 0.005) -> list[str]:
    """Sentences generated from :func:`fedsm_summary`: per site, the composite's gain or loss against the global
    model and where that site's test images went.

    Example: ``"site5: composite 0.612 vs global model 0.655 (-0.043, lost); its images went 40 % to PM site3
    (Dice 0.511 on site5), 60 % to GM — 40 % went to another site's personalized model."``  When every
    image of every site went to one model, a first sentence says so (the composite is then
    that model).  Differences smaller than ``tol`` count as equal.
    """
    out = []
    sel_all = summary.get("selection") or {}
    mix = (
        summary.get("mode") == "mix"
    )  # the ensemble: every model contributes; the selection is the selector's top choice
    went = "the selector's top choice for its images was" if mix else "its images went"
    fed_sel = {s: sel_all[s] for s in summary["sites"] if sel_all.get(s)}
    if fed_sel and not mix:
        tops = {max(sel, key=lambda m: sel[m] or 0.0) for sel in fed_sel.values()}
        if len(tops) == 1:
            m = tops.pop()
            if all((sel.get(m) or 0.0) >= 0.999 for sel in fed_sel.values()):
                if m == "global":
                    out.append(
                        "Every test image of every site went to the global model (the selector's top probability "
                        "never passed γ), so the composite is its global model on every site."
                    )
                else:
                    out.append(
                        f"Every test image of every site went to {model_short(m)}, so the composite is that one "
                        "model on every site."
                    )
    for s in summary["sites"]:
        d = summary["dice"][s]
        comp, gm = d.get("fedsm"), d.get("global")
        if comp is None or gm is None:
            continue
        diff = comp - gm
        sel = sel_all.get(s)
        verdict = f"within ±{tol:g}" if abs(diff) < tol else ("gained" if diff > 0 else "lost")
        text = f"{s}: composite {comp:.3f} vs global model {gm:.3f} ({diff:+.3f}, {verdict})"
        if sel:
            shares = sorted(((v, m) for m, v in sel.items() if v), reverse=True)
            parts = []
            for v, m in shares[:3]:
                own = " (its own)" if m == f"personal/{s}" else ""
                md = d.get(m)
                on = f" (Dice {md:.3f} on {s})" if md is not None and m != "global" else ""
                parts.append(f"{100 * v:.0f} % to {model_short(m)}{own}{on}")
            if len(shares) > 3:
                parts.append(f"{100 * sum(v for v, _ in shares[3:]):.0f} % to {len(shares) - 3} other model(s)")
            text += f"; {went} " + ", ".join(parts)
            own_share = sel.get(f"personal/{s}") or 0.0
            other = sum(v for v, m in shares if m not in ("global", f"personal/{s}"))
            if mix:
                pass  # the output mixes all models: no single model explains the difference
            elif diff <= -tol and other > 0:
                text += f" — {100 * other:.0f} % went to another site's personalized model"
            elif diff >= tol and own_share >= 0.5:
                text += " — mostly to its own personalized model"
            elif diff >= tol and other >= 0.5:
                text += " — another site's personalized model scored higher on it than the global model"
        else:
            own = d.get(f"personal/{s}")
            if own is not None:
                text += f"; its own personalized model scores {own:.3f}"
            text += " (routing on test not recorded)"
        out.append(text + ".")
    return out
