"""The report's privacy section: each DP run's (ε, δ) guarantee per site, from ``results.json["privacy"]``
(written by the engine under ``privacy.dp``), and whether the run summed its updates securely."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fedseg.apps.report.markup import para, table
from fedseg.apps.report.runs import Run

__all__ = ["privacy_section"]


def _num(v: Any, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, int | float) else "–"


def privacy_section(runs: Sequence[Run]) -> str | None:
    """One row per site of every run with ``privacy.dp`` on: ε spent, δ, the accountant, σ, the sampling rate,
    the privatized steps; None when no run used DP."""
    rows = []
    for r in runs:
        priv = r.results.get("privacy")
        if not isinstance(priv, dict):
            continue
        secure = ((r.results.get("config") or {}).get("privacy") or {}).get("secure_aggregation")
        stopped = priv.get("stopped_after_round")
        for site, s in (priv.get("sites") or {}).items():
            rows.append(
                [
                    r.label,
                    site,
                    priv.get("dp", "–"),
                    _num(s.get("epsilon"), ".3f"),
                    _num(s.get("epsilon_lifetime", s.get("epsilon")), ".3f"),
                    "∞ (seeded)" if priv.get("epsilon_against_server") == "inf" else _num(s.get("epsilon"), ".3f"),
                    _num(priv.get("delta"), "g"),
                    priv.get("accountant", "–"),
                    _num(priv.get("epsilon_budget"), "g"),
                    _num(s.get("noise_multiplier"), ".4g"),
                    _num(priv.get("clip"), "g"),
                    _num(s.get("sample_rate"), ".4g"),
                    s.get("steps", "–"),
                    "on" if secure else "off",
                    "–" if stopped is None else stopped,
                ]
            )
    if not rows:
        return None
    intro = para(
        "Differential privacy of each run with privacy.dp on: the ε each site has spent over the run at the given δ, "
        "by the accountant named (Poisson-sampling analysis at q = batch size / training cases; docs/privacy.md), "
        "and 'ε all runs', what its data has spent over every run in its ledger (a deployed site's lifetime "
        "budget, its policy's max_epsilon; the run's own ε where the ledger holds no other run), "
        "with the noise multiplier σ, the clipping bound C and the privatized steps it counts. "
        "'ε vs server' is ∞ for a run with privacy.dp_randomness = seeded (a test mode): the server knows the seed "
        "and can regenerate the noise and the batches. "
        "'stopped after' is the last round trained when the ε budget stopped the run."
    )
    head = [
        "Run",
        "Site",
        "DP",
        "ε",
        "ε all runs",
        "ε vs server",
        "δ",
        "accountant",
        "ε budget",
        "σ",
        "C",
        "q",
        "steps",
        "secure aggregation",
        "stopped after",
    ]
    return intro + table(head, rows)
