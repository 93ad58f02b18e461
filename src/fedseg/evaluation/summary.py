"""Results of one run: per-case scores → per-site Dice, Client Avg Dice, Global Dice.

Definitions (FedSM paper, Table 3):

* a case's Dice is the mean over label channels (the paper averages disc and cup);
* a site's Dice is the mean over its test cases;
* **Client Avg Dice** is the mean of the per-site Dice (each site counts once);
* **Global Dice** is the mean over all sites' test cases pooled (large sites weigh more).

Further test metrics (the 95th-percentile Hausdorff distance ``hd95`` of volumes, in mm) are
summarized the same way under their own names (``per_site_hd95``, ``client_avg_hd95``,
``global_hd95``, ``per_case_hd95``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from fedseg.foundation.config import RunConfig

__all__ = ["row_from_cases", "summarize"]


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else float("nan")


def row_from_cases(
    per_site: Mapping[str, Sequence[Sequence[float]]],
    sites: Sequence[str],
    metric_names: Sequence[str],
    metric: str = "dice",
) -> dict[str, Any]:
    """Table 3 quantities from per-case, per-channel scores.

    Parameters
    ----------
    per_site
        ``{site: [[channel scores] per case]}``.
    sites
        Site order (and which sites count).
    metric_names
        Channel names.
    metric
        The metric's name in the keys (``"dice"``; ``"hd95"`` for the Hausdorff distance).

    Returns
    -------
    dict
        ``per_site_dice``, ``per_site_channel_dice`` ({site: {channel: dice}}),
        ``client_avg_dice``, ``global_dice``, ``num_cases`` (``dice`` replaced by ``metric``).  A site
        without cases (a deployed site that answered no test exchange) has Dice NaN and 0 cases and is
        left out of the client average, so the other sites' results stay usable.
    """
    per_site_dice: dict[str, float] = {}
    per_channel: dict[str, dict[str, float]] = {}
    pooled: list[float] = []
    counts = {}
    for s in sites:
        cases = per_site.get(s, [])
        means = [_mean(c) for c in cases]
        pooled += means
        counts[s] = len(cases)
        per_site_dice[s] = _mean(means)
        per_channel[s] = {m: _mean([c[j] for c in cases]) for j, m in enumerate(metric_names)}
    return {
        f"per_site_{metric}": per_site_dice,
        f"per_site_channel_{metric}": per_channel,
        f"client_avg_{metric}": _mean([d for s, d in per_site_dice.items() if counts[s]]),
        f"global_{metric}": _mean(pooled),
        "num_cases": counts,
    }


def _without_counts(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k != "num_cases"}


class BestResult(Protocol):
    """What :func:`summarize` reads of a candidate's best validation result (``seams.checkpoint.Best``)."""

    score: float
    round: int
    candidate: Any  # has ``home_site``


def summarize(
    method: str,
    sites: list[str],
    cfg: RunConfig,
    per_case: dict[str, dict[str, list[list[float]]]],
    best: Mapping[str, BestResult],
    primary: str | None,
    metric_names: list[str],
    history: list[dict[str, Any]],
    label: str | None = None,
    test_metrics: Mapping[str, Mapping[str, Mapping[str, list[list[float]]]]] | None = None,
) -> dict[str, Any]:
    """The ``results.json`` document of a run (schema in ``docs/results-format.md``).

    ``rows`` has one entry per candidate (e.g. each local model tested on every
    site: the model × site matrix).  The top-level numbers are the method's row:
    the ``primary`` candidate, or — for methods whose models belong to sites
    (local, personalized) — each site's own model on its own test set.  ``label`` is
    the run's row label in tables (the algorithm's ``label()``; default: ``method``).
    ``test_metrics`` (``{metric: {candidate: {site: per-case (N, C)}}}``, e.g. ``hd95``) adds each
    metric's per-site, client-average, global and per-case numbers to every row and to the method's row.
    """
    test_metrics = test_metrics or {}
    rows = []
    for name, cases in per_case.items():
        b = best[name]
        row = {"name": name, "home_site": b.candidate.home_site, "best_round": b.round, "best_val_dice": b.score}
        row.update(row_from_cases(cases, sites, metric_names))
        for metric, by_cand in test_metrics.items():
            if name in by_cand:
                row.update(_without_counts(row_from_cases(by_cand[name], sites, metric_names, metric)))
        rows.append(row)
    homes = {best[name].candidate.home_site: name for name in per_case}

    def method_cases(cases_of: Mapping[str, Mapping[str, Any]]) -> Mapping[str, Any]:
        if primary is not None:
            return cases_of[primary] if cases_of is per_case else cases_of.get(primary, {})
        # a site's own model; none for a deployed site that never answered (no own model was trained)
        return {s: cases_of.get(homes[s], {}).get(s, []) for s in sites if s in homes}

    top = row_from_cases(method_cases(per_case), sites, metric_names)
    top["sites_without_results"] = [s for s in sites if not top["num_cases"][s]]
    for metric, by_cand in test_metrics.items():
        top.update(_without_counts(row_from_cases(method_cases(by_cand), sites, metric_names, metric)))
        top[f"per_case_{metric}"] = {
            name: {s: [_mean(c) for c in cs] for s, cs in cases.items()} for name, cases in by_cand.items()
        }
    per_case_dice = {name: {s: [_mean(c) for c in cs] for s, cs in cases.items()} for name, cases in per_case.items()}
    return {
        "method": method,
        "label": label or method,
        "primary": primary,
        "sites": sites,
        "seed": cfg.seed,
        "metric_names": metric_names,
        **top,
        "rows": rows,
        "per_case_dice": per_case_dice,
        "history": history,
        "config": cfg.to_dict() if hasattr(cfg, "to_dict") else dataclasses.asdict(cfg),
    }
