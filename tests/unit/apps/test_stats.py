"""Table 2 helpers, the Wilcoxon signed-rank test of paired per-case Dice, and the α-trajectory plot."""

from __future__ import annotations

import pytest

from fedseg.algorithms import REGISTRY
from fedseg.algorithms.autofedavg import AutoFedAvg, AutoFedAvgParams
from fedseg.evaluation.plots import alpha_trajectory, plot_alpha_trajectory, plot_interval_effect
from fedseg.evaluation.stats import (
    compare_runs,
    default_label,
    local_avg_gen,
    model_site_matrix,
    table2,
    table2_rows,
    wilcoxon_signed_rank,
)

SITES = ["A", "B"]


def _run(method, seed, global_cases, matrix=None, config=None, home_rows=True):
    """A minimal results.json: per-case Dice of the global model per site, optional site-selected rows;
    ``label`` and ``primary`` as the engine writes them (the algorithm's label with default settings)."""
    cls = REGISTRY[method]
    per_site = {s: sum(c) / len(c) for s, c in global_cases.items()}
    rows = [{"name": "global", "home_site": None, "per_site_dice": per_site}]
    if matrix is not None and home_rows:
        rows += [
            {"name": f"global@{k}", "home_site": k, "per_site_dice": dict(zip(SITES, matrix[i]))}
            for i, k in enumerate(SITES)
        ]
    return {
        "method": method,
        "label": cls.label_for(cls.Params()),
        "primary": cls.primary,
        "seed": seed,
        "sites": SITES,
        "per_site_dice": per_site,
        "client_avg_dice": sum(per_site.values()) / len(per_site),
        "rows": rows,
        "per_case_dice": {"global": global_cases},
        "config": config or {},
    }


def test_wilcoxon_all_positive_differences_hand_derived():
    """d = (1..6) > 0: W− = 0; exact two-sided p = 2 · P(W+ = 21) = 2 / 2^6 = 0.03125."""
    # Execute
    r = wilcoxon_signed_rank([2, 4, 6, 8, 10, 12], [1, 2, 3, 4, 5, 6])
    # Assert
    assert r["statistic"] == 0.0
    assert r["pvalue"] == pytest.approx(0.03125)
    assert r["n"] == 6 and r["n_nonzero"] == 6 and r["mean_diff"] == pytest.approx(3.5)


def test_wilcoxon_identical_runs_give_p_one_and_bad_pairs_are_rejected():
    assert wilcoxon_signed_rank([0.5, 0.7], [0.5, 0.7])["pvalue"] == 1.0
    with pytest.raises(ValueError, match="same cases in both runs"):
        wilcoxon_signed_rank([0.1, 0.2, 0.3], [0.1, 0.2])
    with pytest.raises(ValueError, match="test split is empty"):
        wilcoxon_signed_rank([], [])


def test_local_avg_is_diagonal_mean_and_local_gen_off_diagonal_mean():
    """M = [[0.9, 0.5, 0.4], [0.3, 0.8, 0.2], [0.1, 0.6, 0.7]]: diag (0.9+0.8+0.7)/3 = 0.8; off (0.5+0.4+0.3+0.2+0.1+0.6)/6 = 0.35."""
    avg, gen = local_avg_gen([[0.9, 0.5, 0.4], [0.3, 0.8, 0.2], [0.1, 0.6, 0.7]])
    assert avg == pytest.approx(0.8) and gen == pytest.approx(0.35)
    with pytest.raises(ValueError, match="square"):
        local_avg_gen([[0.1, 0.2]])


def test_model_site_matrix_from_site_selected_rows():
    # Prepare
    res = _run("autofedavg", 0, {"A": [0.5], "B": [0.6]}, matrix=[[0.9, 0.4], [0.3, 0.8]])
    # Execute
    sites, m = model_site_matrix(res)
    # Assert
    assert sites == SITES and m == [[0.9, 0.4], [0.3, 0.8]]
    assert model_site_matrix(_run("fedavg", 0, {"A": [0.5], "B": [0.6]}))[1] == []


def test_compare_runs_pairs_by_seed_and_pools_sites():
    # Prepare: the candidate beats the baseline on every case by 0.1 (A) or 0.2 (B)
    base = [_run("fedavg", s, {"A": [0.1, 0.2, 0.3, 0.4], "B": [0.5, 0.4, 0.3, 0.2]}) for s in (0, 1)]
    cand = [_run("autofedavg", s, {"A": [0.2, 0.3, 0.4, 0.5], "B": [0.7, 0.6, 0.5, 0.4]}) for s in (0, 1)]
    # Execute
    t = compare_runs(cand, base)
    # Assert: 8 pairs per site (2 seeds × 4 cases), 16 over all sites
    assert t["A"]["n"] == 8 and t["all"]["n"] == 16
    assert t["A"]["mean_diff"] == pytest.approx(0.1) and t["all"]["mean_diff"] == pytest.approx(0.15)
    assert t["all"]["pvalue"] < 0.05
    with pytest.raises(ValueError, match="pair the runs by seed"):
        compare_runs(cand, base[:1])
    with pytest.raises(KeyError, match="no per-case Dice of candidate 'personal'"):
        compare_runs(cand, base, candidate="personal")


def test_labels_follow_the_paper_and_come_from_the_algorithms():
    """The algorithms name their rows as the Auto-FedAvg paper's Table 2 does; stats only reads
    ``results["label"]`` (the method's name for results without one)."""
    assert REGISTRY["fedavg-even"].label_for(None) == "FedAvg - even"
    assert REGISTRY["local"].label_for(None) == "Local only"
    assert AutoFedAvg.label_for(AutoFedAvgParams()) == "Auto-FedAvg-N-Dirichlet"
    assert AutoFedAvg.label_for(AutoFedAvgParams(granularity="layer", param="softmax")) == "Auto-FedAvg-L-Softmax"
    assert AutoFedAvg.label_for(AutoFedAvgParams(reinit=True)) == "Auto-FedAvg-N-Dirichlet*"
    assert default_label({"method": "fedavg-even", "label": "FedAvg - even"}) == "FedAvg - even"
    assert default_label({"method": "fedavg-even"}) == "fedavg-even"


def test_every_method_has_a_title():
    assert all(cls.title for cls in REGISTRY.values()), [n for n, c in REGISTRY.items() if not c.title]
    titles = [cls.title for cls in REGISTRY.values()]
    assert len(set(titles)) == len(titles)


def test_table2_layout_mean_sd_and_significance_mark():
    # Prepare: local (matrix), FedAvg and a better Auto-FedAvg, two seeds each
    local = [_run("local", s, {"A": [0.5], "B": [0.5]}, matrix=[[0.9, 0.3], [0.5, 0.7]]) for s in (0, 1)]
    cases_base = {"A": [0.1 * i for i in range(1, 9)], "B": [0.05 * i for i in range(1, 9)]}
    cases_cand = {s: [x + 0.05 for x in c] for s, c in cases_base.items()}
    fedavg = [_run("fedavg", s, cases_base) for s in (0, 1)]
    auto = [_run("autofedavg", s, cases_cand, matrix=[[0.8 + 0.01 * s, 0.4], [0.4, 0.8]]) for s in (0, 1)]
    # Execute
    rows = table2_rows(local[0])
    md = table2([*local, *fedavg, *auto])
    lines = md.splitlines()
    # Assert: local rows carry the matrix's local avg (0.8) and local gen (0.4)
    assert [r["label"] for r in rows] == ["Local only - A", "Local only - B"]
    assert rows[0]["global_test_avg"] == pytest.approx(0.6)
    assert rows[0]["local_avg"] == pytest.approx(0.8) and rows[0]["local_gen"] == pytest.approx(0.4)
    assert lines[0] == "| Method | A | B | global test avg | local avg | local gen |"
    auto_line = next(line for line in lines if line.startswith("| Auto-FedAvg-N-Dirichlet |"))
    # local avg per seed: (0.80 + 0.80)/2 = 0.800 and (0.81 + 0.80)/2 = 0.805 -> mean 0.8025, sd 0.005/√2 = 0.0035
    assert "80.25 ± 0.35" in auto_line
    assert auto_line.count("†") == 3  # A, B and global test avg significantly better than FedAvg
    fedavg_line = next(line for line in lines if line.startswith("| FedAvg |"))
    assert "†" not in fedavg_line and fedavg_line.endswith("| – | – |")
    assert "Wilcoxon signed-rank p-values vs FedAvg" in md


def _history():
    return [
        {"round": 1, "alpha": {"A": 0.5, "B": 0.5}, "alpha_learned": False},
        {"round": 2, "alpha": {"A": 0.6, "B": 0.4}, "alpha_learned": True},
    ]


def test_alpha_trajectory_and_plots(tmp_path):
    # Execute
    rounds, alpha, learned = alpha_trajectory(_history())
    png = plot_alpha_trajectory({"Auto-FedAvg-N-Dirichlet": {"history": _history()}}, tmp_path / "alpha.png")
    png2 = plot_interval_effect({1: [0.6, 0.62], 5: [0.61, 0.6], 10: [0.59]}, tmp_path / "t0.png")
    # Assert
    assert rounds == [1, 2] and alpha == {"A": [0.5, 0.6], "B": [0.5, 0.4]} and learned == [2]
    for p in (png, png2):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no 'alpha' entries"):
        alpha_trajectory([{"round": 1, "train_loss": {}}])


def test_bootstrap_ci_is_seeded_paired_and_about_the_right_width():
    """Percentile bootstrap over cases within sites: reproducible for a seed; zero width for constant data and for
    the paired difference of identical runs; for n = 400 cases of sd 0.1 the 95 % interval of the mean is about
    2 · 1.96 · 0.1 / √400 ≈ 0.0196 wide."""
    import numpy as np

    from fedseg.evaluation.stats import bootstrap_ci

    rng = np.random.default_rng(1)
    big = {"a": list(rng.normal(0.5, 0.1, 400))}
    ci = bootstrap_ci(big, seed=3)
    assert ci == bootstrap_ci(big, seed=3) and ci != bootstrap_ci(big, seed=4)
    lo, hi = ci["client_avg"]
    assert lo < float(np.mean(big["a"])) < hi and 0.016 < hi - lo < 0.024
    assert bootstrap_ci({"a": [0.3] * 5, "b": [0.7] * 2})["client_avg"] == pytest.approx((0.5, 0.5))
    assert (
        bootstrap_ci({"a": [0.3, 0.4] * 5, "b": [0.7] * 2})["global"][0]
        < bootstrap_ci({"a": [0.3, 0.4] * 5, "b": [0.7] * 2})["global"][1]
    )
    assert bootstrap_ci(big, big) == {"client_avg": (0.0, 0.0), "global": (0.0, 0.0)}
    with pytest.raises(ValueError, match="case counts differ"):
        bootstrap_ci({"a": [0.1, 0.2]}, {"a": [0.1]})
