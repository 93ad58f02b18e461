"""Significance tests and the Auto-FedAvg paper's Table 2 layout.

Definitions (Xia et al., "Auto-FedAvg", Section 4.2, Table 2):

* **global test avg** — the best global model (highest mean validation Dice over
  the sites) tested on every site; the mean of the per-site Dice (each site counts
  once; our ``client_avg_dice``).
* **best local models** — for each site k, the model with the highest validation
  Dice *on site k alone* (a local-only model, or the global model at the round best
  for site k: candidates ``global@<site>``), tested on every site: a K × K matrix
  M[k][j] (model of site k on site j).
* **local avg** — mean of the diagonal of M; **local gen** — mean of the
  off-diagonal entries.
* **Wilcoxon signed-rank test** of per-case Dice of two runs on the same federation
  (cases paired in test order, ``results["per_case_dice"][candidate][site]``),
  two-sided, via :func:`scipy.stats.wilcoxon`; a cell is marked † when p < 0.05 and
  the candidate's mean is higher.

Several seeds of one method are merged into mean ± sd; the Wilcoxon test then pools
the paired cases of all seeds (seed s of the candidate paired with seed s of the baseline).

Rows are labelled by ``results["label"]`` (the algorithm's own label, e.g.
"Auto-FedAvg-N-Dirichlet", written by the engine; :meth:`fedseg.seams.algorithm.Algorithm.label`),
or the method's name for results that have none (hand-made ones): this module knows no algorithm.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedseg.foundation.seeding import derive_seed

__all__ = [
    "bootstrap_ci",
    "compare_runs",
    "default_label",
    "local_avg_gen",
    "model_site_matrix",
    "per_case",
    "table2",
    "table2_rows",
    "wilcoxon_signed_rank",
]


def wilcoxon_signed_rank(candidate: Sequence[float], baseline: Sequence[float]) -> dict[str, float]:
    """Two-sided Wilcoxon signed-rank test of paired per-case scores.

    Parameters
    ----------
    candidate, baseline
        Per-case Dice of the same N test cases, in the same order.

    Returns
    -------
    dict
        ``statistic``, ``pvalue``, ``n`` (pairs), ``n_nonzero`` (pairs that differ),
        ``mean_diff`` (mean of candidate − baseline).  When every pair is equal the
        test is undefined; we return statistic 0 and p = 1.
    """
    a, b = [float(x) for x in candidate], [float(x) for x in baseline]
    if len(a) != len(b):
        raise ValueError(
            f"paired test needs the same cases in both runs: got {len(a)} and {len(b)} scores; "
            "compare runs on the same federation and test split"
        )
    if not a:
        raise ValueError("paired test of no cases: the test split is empty")
    diffs = [x - y for x, y in zip(a, b)]
    nonzero = sum(1 for d in diffs if d != 0.0)
    out = {"n": len(a), "n_nonzero": nonzero, "mean_diff": sum(diffs) / len(diffs)}
    if nonzero == 0:
        return {**out, "statistic": 0.0, "pvalue": 1.0}
    from scipy.stats import wilcoxon

    res = wilcoxon(a, b, alternative="two-sided")
    return {**out, "statistic": float(res.statistic), "pvalue": float(res.pvalue)}


def bootstrap_ci(
    per_site: Mapping[str, Sequence[float]],
    baseline: Mapping[str, Sequence[float]] | None = None,
    n_boot: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> dict[str, tuple[float, float]]:
    """Percentile bootstrap interval of Client Avg Dice and Global Dice over test cases (one run).

    Cases are resampled with replacement **within each site** (the sites are fixed; only
    which cases were drawn is uncertain), ``n_boot`` times.  Each resample gives Client
    Avg Dice = mean over sites of the site's mean and Global Dice = mean over all
    resampled cases pooled.  With ``baseline`` (another run's per-case Dice of the same
    cases, in the same order) the same indices are drawn for both and the interval is
    of the paired difference (run − baseline).  The draws come from
    ``numpy.random.default_rng(derive_seed(seed, "bootstrap"))``, so the interval is
    reproducible.

    Returns ``{"client_avg": (lo, hi), "global": (lo, hi)}``.
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"bootstrap level = {level}; give a coverage in (0, 1), e.g. 0.95")
    sites = [s for s in per_site if len(per_site[s])]
    if not sites:
        raise ValueError("bootstrap of no cases: every site's test split is empty")
    if baseline is not None:
        bad = [s for s in sites if len(baseline.get(s, ())) != len(per_site[s])]
        if bad:
            raise ValueError(f"paired bootstrap needs the same cases in both runs; case counts differ on {bad}")
    rng = np.random.default_rng(derive_seed(seed, "bootstrap"))
    site_means, sums, total = [], 0.0, 0
    for s in sites:
        x = np.asarray(per_site[s], dtype=np.float64)
        if baseline is not None:
            x = x - np.asarray(baseline[s], dtype=np.float64)
        idx = rng.integers(0, len(x), size=(n_boot, len(x)))
        draws = x[idx]
        site_means.append(draws.mean(axis=1))
        sums = sums + draws.sum(axis=1)
        total += len(x)
    client = np.mean(site_means, axis=0)
    pooled = np.asarray(sums) / total
    q = [100 * (1 - level) / 2, 100 * (1 + level) / 2]
    lo_c, hi_c = np.percentile(client, q)
    lo_g, hi_g = np.percentile(pooled, q)
    return {"client_avg": (float(lo_c), float(hi_c)), "global": (float(lo_g), float(hi_g))}


def per_case(results: Mapping[str, Any], candidate: str, site: str) -> list[float]:
    """Per-case Dice (mean over label channels) of a candidate on a site's test split, in test order."""
    try:
        return list(results["per_case_dice"][candidate][site])
    except KeyError:
        raise KeyError(
            f"run of {results.get('method')!r} has no per-case Dice of candidate {candidate!r} on site {site!r}; "
            f"candidates: {sorted(results.get('per_case_dice', {}))}"
        ) from None


def compare_runs(
    candidate_runs: Sequence[Mapping[str, Any]] | Mapping[str, Any],
    baseline_runs: Sequence[Mapping[str, Any]] | Mapping[str, Any],
    candidate: str = "global",
    baseline: str = "global",
    sites: Sequence[str] | None = None,
) -> dict[str, dict[str, float]]:
    """Wilcoxon tests per site and over all sites' cases (``"all"``) between two methods.

    Runs are paired by seed (each seed needs both runs); one run each may be given
    as a plain results dict.  ``"all"`` pools every site's cases, the paired
    version of "global test avg".
    """
    cands = [candidate_runs] if isinstance(candidate_runs, Mapping) else list(candidate_runs)
    bases: dict[Any, Any] = {
        r.get("seed"): r for r in ([baseline_runs] if isinstance(baseline_runs, Mapping) else baseline_runs)
    }
    sites = list(sites or cands[0]["sites"])
    a: dict[str, list[float]] = {s: [] for s in sites}
    b: dict[str, list[float]] = {s: [] for s in sites}
    for run in cands:
        base = bases.get(run.get("seed"))
        if base is None:
            raise ValueError(
                f"no baseline run with seed {run.get('seed')}; pair the runs by seed (baseline seeds: {sorted(bases)})"
            )
        for s in sites:
            a[s] += per_case(run, candidate, s)
            b[s] += per_case(base, baseline, s)
    out = {s: wilcoxon_signed_rank(a[s], b[s]) for s in sites}
    out["all"] = wilcoxon_signed_rank([x for s in sites for x in a[s]], [x for s in sites for x in b[s]])
    return out


def model_site_matrix(results: Mapping[str, Any]) -> tuple[list[str], list[list[float]]]:
    """The best local models' K × K Dice matrix of a run: ``M[k][j]`` = model of site k on site j.

    Uses the result rows that belong to a site (``home_site``): the local models of
    ``local``, or the per-site-selected global models ``global@<site>``.
    Returns ``(sites, M)``; empty when the run has no such rows.
    """
    sites = list(results["sites"])
    own = {r["home_site"]: r for r in results.get("rows", []) if r.get("home_site")}
    if not own:
        return sites, []
    missing = [s for s in sites if s not in own]
    if missing:
        raise ValueError(f"run of {results.get('method')!r} has no site-selected model for sites {missing}")
    return sites, [[float(own[k]["per_site_dice"][j]) for j in sites] for k in sites]


def local_avg_gen(matrix: Sequence[Sequence[float]]) -> tuple[float, float]:
    """("local avg", "local gen"): mean of the diagonal and of the off-diagonal entries of a K × K matrix."""
    k = len(matrix)
    if k == 0 or any(len(row) != k for row in matrix):
        raise ValueError(f"need a square model × site matrix, got {k} rows of lengths {[len(r) for r in matrix]}")
    diag = [matrix[i][i] for i in range(k)]
    off = [matrix[i][j] for i in range(k) for j in range(k) if i != j]
    return sum(diag) / k, (sum(off) / len(off) if off else float("nan"))


def default_label(results: Mapping[str, Any]) -> str:
    """The run's row label: ``results["label"]`` (the algorithm's, e.g. "FedAvg - even",
    "Auto-FedAvg-N-Dirichlet"), else the method's name."""
    return str(results.get("label") or results["method"])


def _site_models(results: Mapping[str, Any]) -> bool:
    """Whether the run's reported models belong to the sites (``primary`` None: local, personalized)."""
    return results["primary"] is None


def table2_rows(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Table 2 rows of one run.

    A run whose models belong to the sites (local training): one row per site's model
    (its Dice on every site and their mean), each carrying the matrix's local avg /
    local gen.  Other methods: one row, the global model's per-site Dice and "global
    test avg", plus local avg / gen from the per-site-selected global models when the
    run has them (else None).
    """
    label = default_label(results)
    sites, m = model_site_matrix(results)
    avg, gen = local_avg_gen(m) if m else (None, None)
    if _site_models(results) and m:
        rows = []
        for k, s in enumerate(sites):
            per_site = dict(zip(sites, m[k]))
            rows.append(
                {
                    "label": f"{label} - {s}",
                    "per_site": per_site,
                    "global_test_avg": sum(m[k]) / len(m[k]),
                    "local_avg": avg,
                    "local_gen": gen,
                }
            )
        return rows
    return [
        {
            "label": label,
            "per_site": dict(results["per_site_dice"]),
            "global_test_avg": results["client_avg_dice"],
            "local_avg": avg,
            "local_gen": gen,
        }
    ]


def _fmt(values: Sequence[float | None], pct: bool) -> str:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return "–"
    f = 100.0 if pct else 1.0
    if len(vals) == 1:
        return f"{f * vals[0]:.2f}" if pct else f"{vals[0]:.4f}"
    m, sd = statistics.mean(vals) * f, statistics.stdev(vals) * f
    return f"{m:.2f} ± {sd:.2f}" if pct else f"{m:.4f} ± {sd:.4f}"


def table2(runs: Sequence[Mapping[str, Any]], baseline: str = "FedAvg", alpha: float = 0.05, pct: bool = True) -> str:
    """Markdown table in the layout of the Auto-FedAvg paper's Table 2 (Dice in %).

    Columns: Dice of the row's model on each site, "global test avg", "local avg",
    "local gen".  Rows with the same label (several seeds) are merged into mean ± sd.
    Cells of the global model's columns carry † when a Wilcoxon signed-rank test of
    per-case Dice against ``baseline`` gives p < ``alpha`` and a higher mean; the
    p-values follow in a second table.
    """
    if not runs:
        return "(no runs)\n"
    sites = list(runs[0]["sites"])
    grouped: dict[str, list[dict[str, Any]]] = {}
    runs_of: dict[str, list[Mapping[str, Any]]] = {}
    for res in runs:
        for row in table2_rows(res):
            grouped.setdefault(row["label"], []).append(row)
        runs_of.setdefault(default_label(res), []).append(res)
    tests: dict[str, dict[str, dict[str, float]]] = {}
    if baseline in runs_of:
        for label, rs in runs_of.items():
            if label != baseline and not _site_models(rs[0]):
                tests[label] = compare_runs(rs, runs_of[baseline], sites=sites)
    header = ["Method", *sites, "global test avg", "local avg", "local gen"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, rows in grouped.items():
        t = tests.get(label, {})

        def mark(key: str) -> str:
            r = t.get(key)  # noqa: B023 (mark is called in this iteration)
            return "†" if r is not None and r["pvalue"] < alpha and r["mean_diff"] > 0 else ""

        cells = [label]
        cells += [_fmt([r["per_site"].get(s) for r in rows], pct) + mark(s) for s in sites]
        cells.append(_fmt([r["global_test_avg"] for r in rows], pct) + mark("all"))
        cells += [_fmt([r["local_avg"] for r in rows], pct), _fmt([r["local_gen"] for r in rows], pct)]
        lines.append("| " + " | ".join(cells) + " |")
    found: set[Any] = {r.get("seed") for r in runs}
    seeds = sorted(found)
    out = "\n".join(lines) + "\n"
    out += (
        f"\nDice{' (%)' if pct else ''}; {len(seeds)} seed(s) {seeds}"
        + (", mean ± sd" if len(seeds) > 1 else "")
        + f". † = Wilcoxon signed-rank test of per-case Dice vs {baseline}, p < {alpha}, higher mean.\n"
    )
    if tests:
        out += f"\nWilcoxon signed-rank p-values vs {baseline} (per-case Dice of the global model, seeds pooled; Δ = mean difference):\n\n"
        out += "| Method | " + " | ".join([*sites, "all sites"]) + " |\n|" + "---|" * (len(sites) + 2) + "\n"
        for label, t in tests.items():
            cells = [f"{t[k]['pvalue']:.3g} (Δ {100 * t[k]['mean_diff']:+.2f})" for k in [*sites, "all"]]
            out += f"| {label} | " + " | ".join(cells) + " |\n"
    return out
