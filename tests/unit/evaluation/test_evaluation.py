"""Dice per case, Table 3 quantities, best-round selection, multi-seed tables."""

from __future__ import annotations

import math

import torch

from fedseg.evaluation.summary import row_from_cases
from fedseg.evaluation.tables import table3
from fedseg.simulation.runner import simulate
from fedseg.site.workload import dice_metric
from tests.support.helpers import tiny_config


def _two_cases() -> tuple[torch.Tensor, torch.Tensor]:
    """(target, logits) of two 2-channel 2×2 cases (described in the test below)."""
    target = torch.zeros(2, 2, 2, 2)
    target[0, 0] = 1.0
    target[1, 0, 0, 0] = 1.0
    logits = torch.full((2, 2, 2, 2), -10.0)
    logits[0, 0, 0, :] = 10.0
    logits[1, 0, 1, 1] = 10.0
    return target, logits


def test_dice_per_case_and_channel_hand_computed():
    # Prepare: case 0: channel 0 prediction covers 2 of 4 true pixels and nothing else -> 2*2/(2+4) = 2/3;
    #          channel 1 empty prediction on empty truth -> 1.  Case 1: disjoint -> 0 and 1.
    target, logits = _two_cases()
    # Execute
    d = dice_metric(0.5)(logits, target)
    # Assert
    assert d.shape == (2, 2)
    assert torch.allclose(d, torch.tensor([[2 / 3, 1.0], [0.0, 1.0]], dtype=d.dtype))


def test_empty_dice_sets_the_score_of_a_case_with_empty_mask_and_prediction():
    """Same cases as above: the two channels with empty mask and empty prediction take eval.empty_dice
    (0 here); an empty mask with a non-empty prediction stays 0, the others are unchanged."""
    target, logits = _two_cases()
    target = torch.cat([target, torch.zeros(1, 2, 2, 2)])
    logits = torch.cat([logits, torch.full((1, 2, 2, 2), -10.0)])
    logits[2, 1, 0, 0] = 10.0  # case 2: channel 1 predicts a pixel on an empty mask -> 0; channel 0 both empty
    d0 = dice_metric(0.5, empty_dice=0.0)(logits, target)
    d1 = dice_metric(0.5)(logits, target)
    assert torch.allclose(d0, torch.tensor([[2 / 3, 0.0], [0.0, 0.0], [0.0, 0.0]], dtype=d0.dtype))
    assert torch.allclose(d1, torch.tensor([[2 / 3, 1.0], [0.0, 1.0], [1.0, 0.0]], dtype=d1.dtype))


def test_eval_settings_are_validated():
    import pytest

    from fedseg.foundation.config import EvalConfig
    from fedseg.foundation.errors import ConfigError

    with pytest.raises(ConfigError, match=r"eval.empty_dice = 1.5; give a value in \[0, 1\]"):
        EvalConfig(empty_dice=1.5).validate()
    with pytest.raises(ConfigError, match="eval.best_criterion = 'median'; use 'cases'"):
        EvalConfig(best_criterion="median").validate()


def test_best_criterion_sites_scores_the_mean_of_per_site_means(sites, workload):
    """Site 1 gets 6 validation cases, sites 2 and 3 keep 3.  best_criterion = 'sites': val_score =
    (d1 + d2 + d3) / 3 of the per-site means d_k the engine records in val_dice; 'cases' (default):
    (6 d1 + 3 d2 + 3 d3) / 12 — different unless d1 equals the mean of d2 and d3."""
    import dataclasses

    from torch.utils.data import ConcatDataset

    from fedseg.foundation.config import EvalConfig

    data = dict(sites)
    data["site1"] = dataclasses.replace(data["site1"], val=ConcatDataset([data["site1"].val, data["site2"].val]))
    by_site = simulate(
        dataclasses.replace(tiny_config("fedavg", rounds=2), eval=EvalConfig(best_criterion="sites")),
        workload,
        data,
        progress=False,
    )
    by_case = simulate(tiny_config("fedavg", rounds=2), workload, data, progress=False)
    for e_s, e_c in zip(by_site["history"], by_case["history"]):
        per_site = e_s["val_dice"]["global"]
        assert math.isclose(e_s["val_score"]["global"], sum(per_site.values()) / len(per_site), rel_tol=1e-12)
        assert e_s["val_dice"] == e_c["val_dice"]  # same training, only the score differs
        n = {"site1": 6, "site2": 3, "site3": 3}
        pooled = sum(per_site[s] * n[s] for s in per_site) / sum(n.values())
        assert math.isclose(e_c["val_score"]["global"], pooled, rel_tol=1e-9)
        assert not math.isclose(e_s["val_score"]["global"], e_c["val_score"]["global"], rel_tol=1e-9)


def test_client_avg_vs_global_dice():
    # site a: cases with channel means 1.0 and 0.0 -> 0.5; site b: one case 0.8.
    # client avg = (0.5 + 0.8) / 2 = 0.65; global = (1 + 0 + 0.8) / 3 = 0.6
    row = row_from_cases({"a": [[1.0, 1.0], [0.0, 0.0]], "b": [[0.6, 1.0]]}, ["a", "b"], ["disc", "cup"])
    assert math.isclose(row["client_avg_dice"], 0.65)
    assert math.isclose(row["global_dice"], 0.6)
    assert row["per_site_channel_dice"]["b"] == {"disc": 0.6, "cup": 1.0}


def test_best_round_is_the_best_validation_round(sites, workload):
    res = simulate(tiny_config("fedavg", rounds=4), workload, sites, progress=False)
    scores = [e["val_score"]["global"] for e in res["history"]]
    row = res["rows"][0]
    assert row["best_val_dice"] == max(scores)
    assert row["best_round"] == scores.index(max(scores)) + 1


def test_table3_merges_seeds_into_mean_and_sd():
    def run(seed, v):
        return {
            "method": "fedavg",
            "seed": seed,
            "sites": ["a"],
            "per_site_dice": {"a": v},
            "client_avg_dice": v,
            "global_dice": v,
        }

    md = table3([run(0, 0.5), run(1, 0.7)])
    # mean 0.6, sample sd of (0.5, 0.7) = 0.1414
    assert "| fedavg | 0.6000 ± 0.1414 | 0.6000 ± 0.1414 | 0.6000 ± 0.1414 |" in md
    assert "2 seed(s)" in md


def test_centralized_trains_on_the_pooled_data(sites, workload):
    res = simulate(tiny_config("centralized", rounds=1), workload, sites, progress=False)
    # one epoch of the union: ceil(n_total / batch) steps, all at the pooled site
    n_total = sum(len(d.train) for d in sites.values())
    assert list(res["history"][0]["train_loss"]) == ["pooled"]
    assert set(res["per_site_dice"]) == set(sites)
    assert n_total > 0
