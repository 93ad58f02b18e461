"""Dice per case, Table 3 quantities, best-round selection, multi-seed tables."""

from __future__ import annotations

import math

import torch

from conftest import tiny_config
from fedseg.evaluation.summary import row_from_cases
from fedseg.evaluation.tables import table3
from fedseg.runner import simulate
from fedseg.workload import dice_metric


def test_dice_per_case_and_channel_hand_computed():
    # Prepare: case 0: channel 0 prediction covers 2 of 4 true pixels and nothing else -> 2*2/(2+4) = 2/3;
    #          channel 1 empty prediction on empty truth -> 1.  Case 1: disjoint -> 0 and 1.
    target = torch.zeros(2, 2, 2, 2)
    target[0, 0] = 1.0
    target[1, 0, 0, 0] = 1.0
    logits = torch.full((2, 2, 2, 2), -10.0)
    logits[0, 0, 0, :] = 10.0
    logits[1, 0, 1, 1] = 10.0
    # Execute
    d = dice_metric(0.5)(logits, target)
    # Assert
    assert d.shape == (2, 2)
    assert torch.allclose(d, torch.tensor([[2 / 3, 1.0], [0.0, 1.0]], dtype=d.dtype))


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
        return {"method": "fedavg", "seed": seed, "sites": ["a"], "per_site_dice": {"a": v}, "client_avg_dice": v, "global_dice": v}

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
