"""The report's FedSM section, from the runs' results (and, for runs that did not record their routing,
the routing computed by :mod:`fedseg.apps.report.model_sections`): selector curves, γ, the composite vs the
global and personalized models, the routing matrix and the findings."""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

from fedseg.apps.report import figures
from fedseg.apps.report.markup import figure, note, para, table
from fedseg.apps.report.numbers import (
    best_round,
    fedsm_findings,
    fedsm_summary,
    is_fedsm,
    model_short,
)
from fedseg.apps.report.runs import Run, method_settings
from fedseg.apps.report.sections import fmt
from fedseg.foundation.errors import ConfigError
from fedseg.seams.checkpoint import read_best_meta

__all__ = ["fedsm_section", "gamma_of"]


def gamma_of(run: Run, routing: Mapping[str, Any] | None) -> tuple[Any, Any]:
    """(γ setting, γ used at test) of a FedSM run: the setting from its config (``auto`` or a number; the
    default when not given) and the value in its routing report or ``checkpoints/best.json``."""
    setting = method_settings(run).get(
        "gamma", (run.results.get("config") or {}).get("fedsm", {}).get("gamma", "default")
    )
    used = (routing or {}).get("gamma_per_model") or (routing or {}).get("gamma")
    if used is None:
        try:
            config = read_best_meta(run.path / "checkpoints")["fedsm"]["config"]
            used = config.get("gamma_per_model") or config["gamma"]
        except (ConfigError, KeyError, TypeError):
            used = None
    if isinstance(used, list):  # fedsm.gamma = "auto-per-model": one threshold per personalized model
        used = "per model " + ", ".join(f"{float(g):g}" for g in used)
    return setting, used


def fedsm_section(
    runs: Sequence[Run], routings: Mapping[str, Mapping[str, Any] | None], notes: Mapping[str, str] | None = None
) -> str | None:
    """Every FedSM-family run: selector curves, γ, composite vs global vs personalized models, routing matrix, findings.

    ``routings``: ``{run label: routing report on test}`` (``results["fedsm"]``, or computed
    from the checkpoints by :func:`fedseg.apps.report.model_sections.routing_on_test`); ``notes``
    say why a run has none.
    """
    fs = [r for r in runs if is_fedsm(r.method)]
    if not fs:
        return None
    notes = notes or {}
    parts = [
        para(
            "FedSM routes each test image through its model selector: to a site's personalized model (PM) when the "
            "selector's top probability exceeds γ, otherwise to the global model (GM) (FedSM Alg. 2; FedSM-extra takes "
            "the argmax over GM and PMs, the ensemble mixes all models by the selector's probabilities)."
        )
    ]
    hist = {
        r.label: r.results.get("history", [])
        for r in fs
        if any(e.get("routing_acc") or e.get("selector_loss") for e in r.results.get("history", []))
    }
    if hist:
        parts.append(
            figure(
                "fig-fedsm-history",
                figures.fedsm_history_figure(hist),
                (
                    "Model selector during training, per site: routing accuracy (share of the site's validation images the selector, "
                    "as received at the start of the round, assigns to that site) and the selector's training loss, against rounds."
                ),
            )
        )
    for r in fs:
        routing = routings.get(r.label)
        summ = fedsm_summary(r.results, routing)
        setting, used = gamma_of(r, routing)
        mode = (routing or {}).get("mode")
        parts.append(f"<h3>{html.escape(r.label)}</h3>")
        gtxt = (
            f"γ setting: {setting}; γ used at test: {used if not isinstance(used, float) else f'{used:g}'}"
            if mode in (None, "gate")
            else f"selection mode: {mode} (γ not used)"
        )
        parts.append(para(f"{gtxt}; reported model from round {best_round(r.results)}."))
        models = summ["models"]
        head = ["Site", "test cases", "composite", *[model_short(m) for m in models]]
        rows = []
        for s in summ["sites"]:
            d = summ["dice"][s]
            rows.append(
                [s, fmt(r.results.get("num_cases", {}).get(s)), fmt(d.get("fedsm")), *[fmt(d.get(m)) for m in models]]
            )
        if summ["inside"]:
            parts.append(para("Test Dice per site of the composite (the reported model) and of each model inside it."))
        else:
            parts.append(
                para(
                    "Test Dice per site of the composite (the reported model), and of the global and personalized "
                    "models from the results rows: each at its own best validation round, which need not be the "
                    "composite's round (the models inside the composite are scored when the routing is computed)."
                )
            )
        parts.append(table(head, rows))
        if summ["selection"]:
            sel_rows = []
            for s, sel in summ["selection"].items():
                acc = (summ["routing_acc"] or {}).get(s)
                sel_rows.append(
                    [s, fmt(acc, 2), *[("–" if sel.get(m) is None else f"{100 * sel[m]:.0f} %") for m in models]]
                )
            what = (
                "argmax of the selector"
                if mode in ("argmax", "mix")
                else f"at γ = {used:g}"
                if isinstance(used, float)
                else f"at γ {used}"
                if str(used).startswith("per model")
                else f"at γ = {used}"
            )
            parts.append(
                para(
                    f"Routing on test ({what}): share of each site's test images sent to each model; routing acc = "
                    "share the selector assigns to the site itself."
                )
            )
            parts.append(table(["Site", "routing acc", *[model_short(m) for m in models]], sel_rows))
        elif r.label in notes:
            parts.append(note(notes[r.label]))
        same = _equal_to_fedavg(r, runs)
        if same:
            parts.append(
                para(
                    f"Its composite's test Dice equals {same}'s (same seed) on every site: FedSM's global model is "
                    "trained as FedAvg, and the composite is that global model wherever the selector sends the images to it."
                )
            )
        findings = fedsm_findings(summ)
        if findings:
            parts.append('<ul class="finding">' + "".join(f"<li>{html.escape(f)}</li>" for f in findings) + "</ul>")
    return "\n".join(parts)


def _equal_to_fedavg(run: Run, runs: Sequence[Run]) -> str | None:
    """The FedAvg run label whose per-site Dice the FedSM run's equals exactly (same seed and sites), if any."""
    for r in runs:
        if r.method == "fedavg" and r.seed == run.seed and r.results["sites"] == run.results["sites"]:
            a, b = run.results["per_site_dice"], r.results["per_site_dice"]
            if all(a.get(s) is not None and abs(a[s] - b.get(s, math.inf)) < 1e-12 for s in run.results["sites"]):
                return r.variant
    return None
