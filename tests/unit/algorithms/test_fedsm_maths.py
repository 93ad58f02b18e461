"""FedSM maths on hand-computed tensors: SoftPull (Eq. 11), routing (Alg. 2), Eq. 1 labels,
the ensemble mix, selector-moment averaging and the server round — no engine."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from fedseg.algorithms.fedsm import FedSM, FedSMParams, pick_gamma
from fedseg.algorithms.fedsm.params import DEFAULT_GAMMA_MARGIN
from fedseg.algorithms.fedsm.selection import check_route_metrics, pick_gamma_per_model
from fedseg.algorithms.gradients import optimizer_moments, set_optimizer_moments
from fedseg.algorithms.softpull import (
    check_lambda,
    ensemble_mix,
    oracle_labels,
    route,
    routing_accuracy,
    soft_pull,
    soft_pull_matrix,
)
from fedseg.foundation.config import dataclass_from_dict
from fedseg.foundation.errors import ConfigError, PayloadError
from fedseg.foundation.messages import Reply
from tests.support.helpers import tiny_config


def _w(v: float, n: int = 0) -> dict[str, torch.Tensor]:
    """A one-tensor 'model' w = [v, 2v] plus an integer counter n."""
    return {"w": torch.tensor([v, 2 * v]), "count": torch.tensor(n)}


# ------------------------------------------------------------------ SoftPull
def test_softpull_with_lambda_one_over_k_gives_every_site_the_uniform_mean():
    """λ = 1/K: every row of A is 1/K, so each site gets (0 + 3 + 6)/3 = 3 → w = [3, 6]."""
    # Prepare
    personal = {"a": _w(0.0), "b": _w(3.0), "c": _w(6.0)}
    # Execute
    out = soft_pull(personal, 1 / 3)
    # Assert
    for s in personal:
        torch.testing.assert_close(out[s]["w"], torch.tensor([3.0, 6.0]))


def test_softpull_with_lambda_one_leaves_each_model_bitwise_as_trained():
    # Prepare
    personal = {"a": {"w": torch.tensor([0.1, -7.3])}, "b": {"w": torch.tensor([1e-8, 3.3])}}
    # Execute
    out = soft_pull(personal, 1.0)
    # Assert: bitwise, not just close
    for s in personal:
        assert torch.equal(out[s]["w"], personal[s]["w"])


def test_softpull_matches_hand_computed_values():
    """K = 3, λ = 0.5, off-diagonal (1 − λ)/(K − 1) = 0.25:
    a' = 0.5·0 + 0.25·(3 + 6) = 2.25, b' = 0.5·3 + 0.25·(0 + 6) = 3, c' = 0.5·6 + 0.25·3 = 3.75."""
    personal = {"a": _w(0.0, 1), "b": _w(3.0, 2), "c": _w(6.0, 3)}
    out = soft_pull(personal, 0.5)
    for s, v in (("a", 2.25), ("b", 3.0), ("c", 3.75)):
        torch.testing.assert_close(out[s]["w"], torch.tensor([v, 2 * v]))
    # integer tensors are each site's own, never averaged
    assert [int(out[s]["count"]) for s in "abc"] == [1, 2, 3]


@pytest.mark.parametrize("k,lam", [(2, 0.5), (3, 0.7), (6, 1 / 6), (6, 0.9), (5, 1.0)])
def test_softpull_matrix_is_row_stochastic_with_lambda_on_the_diagonal(k, lam):
    # Execute
    a = soft_pull_matrix(k, lam)
    # Assert
    torch.testing.assert_close(a.sum(dim=1), torch.ones(k, dtype=torch.float64))
    assert bool((a >= 0).all())
    torch.testing.assert_close(a.diagonal(), torch.full((k,), lam, dtype=torch.float64))
    off = a[~torch.eye(k, dtype=torch.bool)]
    torch.testing.assert_close(off, torch.full_like(off, (1 - lam) / (k - 1)))


def test_softpull_equals_the_matrix_applied_to_the_stacked_models():
    g = torch.Generator().manual_seed(0)
    personal = {s: {"w": torch.randn(4, generator=g, dtype=torch.float64)} for s in "abcd"}
    out = soft_pull(personal, 0.7)
    stacked = torch.stack([personal[s]["w"] for s in "abcd"])
    expect = soft_pull_matrix(4, 0.7) @ stacked
    for i, s in enumerate("abcd"):
        torch.testing.assert_close(out[s]["w"], expect[i])


def test_softpull_a_dropped_site_keeps_its_model_and_is_not_mixed_in():
    """c did not reply: a, b mix among themselves (K' = 2, λ = 0.5: both → 1.5); c stays 6."""
    personal = {"a": _w(0.0), "b": _w(3.0), "c": _w(6.0)}
    out = soft_pull(personal, 0.5, replied=["a", "b"])
    torch.testing.assert_close(out["a"]["w"], torch.tensor([1.5, 3.0]))
    torch.testing.assert_close(out["b"]["w"], torch.tensor([1.5, 3.0]))
    assert torch.equal(out["c"]["w"], personal["c"]["w"])


def test_softpull_with_one_reply_does_not_shrink_the_weights():
    """The reference code gives λ·w = 1.4 for w = 2 when one site replies; it must stay 2."""
    personal = {"a": _w(2.0), "b": _w(5.0)}
    out = soft_pull(personal, 0.7, replied=["a"])
    assert torch.equal(out["a"]["w"], torch.tensor([2.0, 4.0]))
    assert torch.equal(out["b"]["w"], personal["b"]["w"])


def test_softpull_rejects_replies_from_unknown_sites():
    with pytest.raises(ValueError, match="no personalized model"):
        soft_pull({"a": _w(1.0)}, 0.7, replied=["a", "zz"])


def test_check_lambda_rejects_one_site_and_lambda_outside_zero_one_and_warns_below_one_over_k():
    """K = 6, λ = 0.1 (Table 7): own weight 0.1 < (1 − 0.1)/5 = 0.18 for every other site → warned, allowed."""
    import warnings

    from fedseg.algorithms.softpull import LambdaBelowOneOverKWarning

    with pytest.raises(ValueError, match="at least 2 sites"):
        check_lambda(0.7, 1)
    with pytest.raises(ValueError, match=r"fedsm.lam = 1.2 is outside \[0, 1\]"):
        check_lambda(1.2, 6)
    with pytest.raises(ValueError, match=r"fedsm.lam = -0.1 is outside \[0, 1\]"):
        check_lambda(-0.1, 6)
    with pytest.warns(LambdaBelowOneOverKWarning, match=r"below 1/K = 0.1667 .* weighs 0.1 .* every other site's 0.18"):
        check_lambda(0.1, 6)
    with pytest.warns(LambdaBelowOneOverKWarning):
        check_lambda(0.0, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_lambda(1 / 6, 6)  # the lower end of the old range: uniform mean, no warning
        check_lambda(1.0, 6)


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"lam": -0.1}, "fedsm.lam = -0.1"),
        ({"lam": 1.5}, "fedsm.lam = 1.5"),
        ({"gamma": "often"}, "fedsm.gamma = 'often'"),
        ({"gamma": 1.2}, "fedsm.gamma = 1.2"),
        ({"gamma_grid": (0.5, 2.0)}, "fedsm.gamma_grid"),
        ({"selector_rounds": 0}, "fedsm.selector_rounds must be >= 1"),
        ({"weighting": "size"}, "fedsm.weighting"),
        ({"selector_weighting": "size"}, "fedsm.selector_weighting"),
        ({"selector_steps": 0}, "fedsm.selector_steps = 0; give an integer >= 1 or 'all'"),
        ({"selector_steps": "some"}, "fedsm.selector_steps = 'some'"),
        (
            {"selector_training": "fedprox"},
            "fedsm.selector_training = 'fedprox'; use 'fga', 'fedavg', 'fedrs' or 'fedaws'",
        ),
        ({"profile": "paper"}, "fedsm.profile = 'paper'; use 'default' or 'reference'"),
        ({"extra_objective": "mix"}, "fedsm.extra_objective = 'mix'; use 'oracle' or 'experts'"),
    ],
)
def test_params_reject_bad_settings_naming_the_key(settings, message):
    """Through the config loader (string options are ``Literal``s it checks) and ``validate`` (ranges)."""
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        dataclass_from_dict(FedSMParams, settings, "fedsm").validate()


def test_fedsm_extra_trains_on_eq1_by_default_and_on_the_experts_objective_when_set():
    """Both profiles: Eq. 1's cross-entropy (the paper's; the experts objective did not beat it on the
    synthetic benchmark); ``extra_objective = "experts"``: the mixture-of-experts objective (τ =
    ensemble_tau).  FedSM-extra's selector is trained on the setting's objective."""
    from fedseg.algorithms import get_algorithm
    from fedseg.algorithms.fedsm.selector import ExpertsLoss, selector_objective

    assert FedSMParams().resolved().extra_objective == "oracle"
    assert FedSMParams(profile="reference").resolved().extra_objective == "oracle"
    cfg = tiny_config("fedsm-extra", rounds=3)
    for fedsm, expected in (
        ({}, "oracle"),
        ({"profile": "reference"}, "oracle"),
        ({"extra_objective": "experts", "ensemble_tau": 0.01}, "experts"),
    ):
        algo = get_algorithm(cfg.__class__(**{**cfg.__dict__, "params": {"fedsm": fedsm}}))
        assert algo.labels == expected

        class _S:  # what selector_objective reads of a site
            algorithm = algo
            workload = None

        objective = selector_objective(_S(), "selector", algo.labels)
        assert objective == (ExpertsLoss(0.01) if expected == "experts" else F.cross_entropy)
        assert selector_objective(_S(), "joint", algo.labels) is F.cross_entropy  # FedSM's Eq. 2 phase


def test_extra_rejects_selector_rounds_that_leave_no_model_rounds():
    cfg = tiny_config("fedsm-extra", rounds=3)
    cfg = cfg.__class__(**{**cfg.__dict__, "params": {"fedsm": {"selector_rounds": 3}}})
    from fedseg.algorithms import get_algorithm

    with pytest.raises(ConfigError, match="selector_rounds = 3 must be between 1 and rounds - 1 = 2"):
        get_algorithm(cfg)


# ------------------------------------------------------------------- routing
def test_route_uses_the_personalized_model_only_above_gamma():
    """Alg. 2: max 0.95 > 0.9 → PM of class 0 (index 1); max 0.6 ≤ 0.9 → GM (index 0).
    γ = 0 always routes to a PM; γ = 1 never does; max exactly γ → GM (strict >)."""
    probs = torch.tensor([[0.95, 0.05], [0.6, 0.4], [0.2, 0.8]])
    assert route(probs, 0.9).tolist() == [1, 0, 0]
    assert route(probs, 0.0).tolist() == [1, 1, 2]
    assert route(probs, 1.0).tolist() == [0, 0, 0]
    assert route(probs, 0.8).tolist() == [1, 0, 0]


def test_route_with_one_threshold_per_personalized_model():
    """γ = (0.9, 0.5): image 0's top class 0 (0.95 > 0.9) → PM 1; image 1's top class 0 (0.6 ≤ 0.9) → GM;
    image 2's top class 1 (0.8 > 0.5) → PM 2.  With (1, 0) class 0 never routes to its PM, class 1 always.
    A threshold list of the wrong length is refused."""
    probs = torch.tensor([[0.95, 0.05], [0.6, 0.4], [0.2, 0.8]])
    assert route(probs, [0.9, 0.5]).tolist() == [1, 0, 2]
    assert route(probs, [1.0, 0.0]).tolist() == [0, 0, 2]
    assert route(probs, [0.9, 0.9]).tolist() == route(probs, 0.9).tolist()
    with pytest.raises(ValueError, match="3 thresholds for a selector of 2 classes"):
        route(probs, [0.5, 0.5, 0.5])


def test_routing_accuracy_counts_images_whose_argmax_is_the_own_site():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.5, 0.1, 0.4]])
    assert routing_accuracy(probs, own=0) == pytest.approx(2 / 3)
    # K + 1-class selector: class 0 is the global model and is ignored
    assert routing_accuracy(probs, own=0, first_personal=1) == pytest.approx(2 / 3)  # argmax over cols 1,2: [0, 0, 1]


def test_oracle_labels_pick_the_model_with_the_lowest_loss_per_image():
    """Eq. 1 with MSE: image 0 is best fit by h_1 (|1−1|), image 1 by h_0 (|0−0|); a tie goes to the global model."""
    y = torch.tensor([[1.0], [0.0], [0.5]]).view(3, 1, 1, 1)
    h0 = torch.zeros(3, 1, 1, 1)
    h1 = torch.ones(3, 1, 1, 1)
    labels = oracle_labels([h0, h1], y, torch.nn.functional.mse_loss)
    assert labels.tolist() == [1, 0, 0]


def test_ensemble_mix_is_the_softmax_weighted_sum_of_outputs():
    """h = 0.25·0 + 0.75·4 = 3 everywhere."""
    w = torch.tensor([[0.25, 0.75]])
    out = ensemble_mix(w, [torch.zeros(1, 2, 3, 3), torch.full((1, 2, 3, 3), 4.0)])
    torch.testing.assert_close(out, torch.full((1, 2, 3, 3), 3.0))


def test_pick_gamma_maximizes_the_sample_weighted_dice():
    """γ=0: (0.9·10 + 0.2·30)/40 = 0.375; γ=0.9: (0.5·10 + 0.6·30)/40 = 0.575 → 0.9."""
    replies = {
        "a": {"n": 10, "selections": [{"dice_sum": 9.0}, {"dice_sum": 5.0}]},
        "b": {"n": 30, "selections": [{"dice_sum": 6.0}, {"dice_sum": 18.0}]},
    }
    g, d = pick_gamma(replies, [0.0, 0.9])
    assert g == 0.9 and d == pytest.approx(0.575)


def test_gamma_auto_follows_the_runs_best_criterion():
    """Site a: 10 cases, mean Dice 0.9 at γ = 0 and 0.5 at γ = 0.9; site b: 30 cases, 0.4 and 0.6.
    Pooled cases: γ = 0 → (9 + 12)/40 = 0.525, γ = 0.9 → (5 + 18)/40 = 0.575 → 0.9.
    Mean of per-site means: γ = 0 → (0.9 + 0.4)/2 = 0.65, γ = 0.9 → (0.5 + 0.6)/2 = 0.55 → 0.
    FedSM's γ = auto takes the criterion of ``eval.best_criterion``."""
    # Prepare
    replies = {
        "a": {"n": 10, "selections": [{"dice_sum": 9.0}, {"dice_sum": 5.0}]},
        "b": {"n": 30, "selections": [{"dice_sum": 12.0}, {"dice_sum": 18.0}]},
        "empty": {"n": 0, "selections": [{"dice_sum": 0.0}, {"dice_sum": 0.0}]},
    }
    # Execute / Assert: the function
    assert pick_gamma(replies, [0.0, 0.9], "cases") == (0.9, pytest.approx(0.575))
    assert pick_gamma(replies, [0.0, 0.9], "sites") == (0.0, pytest.approx(0.65))
    # Execute / Assert: the method, by the run's eval.best_criterion
    for criterion, expected in (("cases", 0.9), ("sites", 0.0)):
        cfg = tiny_config("fedsm", rounds=1)
        cfg = dataclasses.replace(
            cfg,
            eval=dataclasses.replace(cfg.eval, best_criterion=criterion),
            params={"fedsm": {"gamma_grid": [0.0, 0.9]}},
        )
        assert FedSM(cfg).pick_gamma(replies) == expected


def _by_top(dice_sum_by_top: list[float]) -> dict:
    return {"dice_sum": sum(dice_sum_by_top), "dice_sum_by_top": dice_sum_by_top}


def test_pick_gamma_per_model_chooses_each_models_threshold_on_its_own_cases():
    """Two personalized models, grid (0, 1).  Summed Dice of the cases whose top class is model 0 / 1:
    γ = 0 (to the PMs): site a (10 cases) 6 / 2, site b (30 cases) 3 / 20; γ = 1 (all to the global
    model): a 4 / 3, b 9 / 15.  Pooled cases: model 0: γ 0 → 9/40, γ 1 → 13/40 → 1; model 1: γ 0 →
    22/40, γ 1 → 18/40 → 0.  Dice (13 + 22)/40 = 0.875, above the best common γ: γ 0 → 31/40,
    γ 1 → 31/40 (a tie: 0, 0.775).  Per-site means: model 0: γ 0 → (6/10 + 3/30)/2 = 0.35, γ 1 →
    (0.4 + 0.3)/2 = 0.35 (a tie → the grid's first, 0); model 1: γ 0 → (0.2 + 20/30)/2 = 0.4333,
    γ 1 → (0.3 + 0.5)/2 = 0.4 → 0."""
    replies = {
        "a": {"n": 10, "selections": [_by_top([6.0, 2.0]), _by_top([4.0, 3.0])]},
        "b": {"n": 30, "selections": [_by_top([3.0, 20.0]), _by_top([9.0, 15.0])]},
        "empty": {"n": 0, "selections": [_by_top([0.0, 0.0]), _by_top([0.0, 0.0])]},
    }
    gammas, dice = pick_gamma_per_model(replies, [0.0, 1.0], "cases")
    assert gammas == [1.0, 0.0] and dice == pytest.approx(35 / 40)
    assert pick_gamma(replies, [0.0, 1.0], "cases") == (0.0, pytest.approx(31 / 40))
    gammas, dice = pick_gamma_per_model(replies, [0.0, 1.0], "sites")
    assert gammas == [0.0, 0.0] and dice == pytest.approx(0.35 + (0.2 + 20 / 30) / 2)
    with pytest.raises(ValueError, match="best_criterion"):
        pick_gamma_per_model(replies, [0.0, 1.0], "median")


def test_gamma_margin_keeps_the_global_model_unless_a_personalized_model_wins_by_the_margin():
    """The replies of the test above with the cases' top classes: site a 4 / 6 cases of top class 0 / 1,
    site b 10 / 20, so 14 / 26 of the 40 pooled cases.  Model 1 chose γ 0 (22/40 against 18/40 at γ 1):
    a gain of 4/40 over 26/40 cases' weight = 4/26 = 0.1538 in the mean Dice of its cases.  Margin 0.15
    keeps γ 0 (Dice 35/40 as without a margin); margin 0.16 sets γ 1 (Dice (13 + 18)/40 = 31/40).  Model 0
    chose γ 1 already (no margin needed).  Per-site means, margin 0.04: model 0's γ 0 ties γ 1 at 0.35
    (gain 0 < 0.04 → 1); model 1: gain (0.4333 − 0.4) = 1/30 over the weight (6/10 + 20/30)/2 = 19/30:
    (1/30)/(19/30) = 1/19 = 0.0526 ≥ 0.04 → keeps 0; margin 0.06 → 1."""
    replies = {
        "a": {"n": 10, "n_by_top": [4, 6], "selections": [_by_top([6.0, 2.0]), _by_top([4.0, 3.0])]},
        "b": {"n": 30, "n_by_top": [10, 20], "selections": [_by_top([3.0, 20.0]), _by_top([9.0, 15.0])]},
        "empty": {"n": 0, "n_by_top": [0, 0], "selections": [_by_top([0.0, 0.0]), _by_top([0.0, 0.0])]},
    }
    assert pick_gamma_per_model(replies, [0.0, 1.0], "cases", margin=0.15) == ([1.0, 0.0], pytest.approx(35 / 40))
    assert pick_gamma_per_model(replies, [0.0, 1.0], "cases", margin=0.16) == ([1.0, 1.0], pytest.approx(31 / 40))
    assert pick_gamma_per_model(replies, [0.0, 1.0], "sites", margin=0.04)[0] == [1.0, 0.0]
    assert pick_gamma_per_model(replies, [0.0, 1.0], "sites", margin=0.06)[0] == [1.0, 1.0]
    assert pick_gamma_per_model(replies, [0.0, 1.0], "sites")[0] == [0.0, 0.0]  # no margin: the tie keeps γ 0
    with pytest.raises(ValueError, match="needs 1.0 in the γ grid"):
        pick_gamma_per_model(replies, [0.0, 0.5], "cases", margin=0.01)


def test_gamma_margin_is_refused_where_it_cannot_apply():
    """``fedsm.gamma_margin`` outside [0, 1], with one γ, or with a grid without 1.0: one ConfigError naming the fix."""
    for fedsm, message in (
        ({"gamma_margin": -0.1}, "must be in \\[0, 1\\]"),
        ({"gamma_margin": 0.01, "gamma": 0.9}, "applies to fedsm.gamma = 'auto-per-model'"),
        ({"gamma_margin": 0.01, "gamma_grid": [0.0, 0.5]}, "with 1.0 in fedsm.gamma_grid"),
    ):
        cfg = dataclasses.replace(tiny_config("fedsm"), params={"fedsm": fedsm})
        with pytest.raises(ConfigError, match=message):
            FedSM(cfg)
    assert (
        FedSM(dataclasses.replace(tiny_config("fedsm"), params={"fedsm": {"gamma_margin": 0.01}})).params.gamma_margin
        == 0.01
    )


def test_gamma_margin_default_applies_only_where_the_per_model_thresholds_do():
    """Unset, ``fedsm.gamma_margin`` is the default profile's 0.01 with ``gamma = "auto-per-model"`` and 1.0 in
    the grid, and 0 wherever a margin cannot apply (one γ, a grid without 1.0) or under the reference profile
    (its literal settings know no margin); a value the user sets is kept."""
    assert FedSMParams().resolved().gamma_margin == DEFAULT_GAMMA_MARGIN == 0.01
    for unset_elsewhere in (
        {"profile": "reference"},
        {"profile": "reference", "gamma": "auto-per-model"},
        {"gamma": 0.9},
        {"gamma": "auto"},
        {"gamma_grid": (0.0, 0.5, 0.9)},
    ):
        assert FedSMParams(**unset_elsewhere).resolved().gamma_margin == 0.0, unset_elsewhere
    assert FedSMParams(gamma_margin=0.0).resolved().gamma_margin == 0.0
    assert FedSMParams(gamma_margin=0.05).resolved().gamma_margin == 0.05
    resolved = FedSM(tiny_config("fedsm")).params
    assert resolved.gamma == "auto-per-model" and resolved.gamma_margin == 0.01
    assert FedSM(dataclasses.replace(tiny_config("fedsm"), params={"fedsm": {"gamma": 0.9}})).params.gamma_margin == 0


def test_pick_gamma_per_model_is_never_below_one_common_gamma():
    """Property: one common γ is one choice of the per-model vector, and the per-model choice maximizes
    the (separable) validation Dice, so its Dice ≥ the best common γ's, on random replies, both criteria."""
    g = torch.Generator().manual_seed(0)
    grid = [0.0, 0.5, 0.9, 1.0]
    for _ in range(50):
        replies = {}
        for s in range(3):
            n = int(torch.randint(0, 6, (1,), generator=g))
            replies[f"s{s}"] = {
                "n": n,
                "selections": [_by_top((torch.rand(4, generator=g) * n / 4).tolist()) for _ in grid],
            }
        if not any(r["n"] for r in replies.values()):
            continue
        for criterion in ("cases", "sites"):
            assert pick_gamma_per_model(replies, grid, criterion)[1] >= pick_gamma(replies, grid, criterion)[1] - 1e-12


def test_route_reply_check_names_what_is_malformed():
    """A route reply of 2 sites (K = 2, 3 models), 4 cases, grid (0, 1): honest it passes; each way a
    hostile site could break the server's γ choice or reports is refused with a PayloadError naming it."""
    config = {"sites": ["a", "b"], "num_classes": 2, "mode": "gate", "gammas": [0.0, 1.0]}
    sel = {"gamma": 0.0, "dice_sum": 3.0, "counts": [0, 2, 2], "dice_sum_by_top": [1.0, 2.0]}
    honest = {
        "n": 4,
        "routing_acc": 0.5,
        "dice_sum_per_model": [3.0, 2.5, 1.0],
        "n_by_top": [2, 2],
        "selections": [sel, sel],
    }
    check_route_metrics(config, honest)
    check_route_metrics({**config, "gamma_per_model": [0.0, 1.0]}, {**honest, "selections": [sel] * 3})
    check_route_metrics({**config, "num_classes": 3, "mode": "argmax"}, {**honest, "selections": [{**sel}]})
    attacks = [
        ({**honest, "n": "4"}, "n = 4 is not a case count"),
        ({**honest, "routing_acc": 2.0}, "routing_acc"),
        ({**honest, "dice_sum_per_model": [3.0, 2.5]}, "dice_sum_per_model is not 3 sums"),
        ({**honest, "dice_sum_per_model": [3.0, 2.5, float("nan")]}, "dice_sum_per_model"),
        ({**honest, "n_by_top": [2, 1]}, "n_by_top is not 2 counts adding up to n = 4"),
        ({**honest, "n_by_top": None}, "n_by_top is not 2 counts"),
        ({**honest, "n_by_top": [2.0, 2.0]}, "n_by_top is not 2 counts"),
        ({**honest, "selections": [sel]}, "1 selections, expected 2"),
        ({**honest, "selections": [{}, {}]}, "dice_sum is not in"),
        ({**honest, "selections": [{**sel, "dice_sum": 1e9}, sel]}, "dice_sum is not in"),
        ({**honest, "selections": [{**sel, "counts": [0, 2, 1]}, sel]}, "counts are not 3 counts adding up to n = 4"),
        ({**honest, "selections": [{**sel, "dice_sum_by_top": [2.0]}, sel]}, "dice_sum_by_top is not 2 sums"),
        ({**honest, "selections": [{**sel, "dice_sum_by_top": [3.0, 3.0]}, sel]}, "adding up to its dice_sum"),
    ]
    for metrics, message in attacks:
        with pytest.raises(PayloadError, match=message):
            check_route_metrics(config, metrics)


def test_optimizer_moments_round_trip():
    # Prepare: one Adam step on a tiny linear model
    torch.manual_seed(0)
    m = torch.nn.Linear(2, 1)
    opt = torch.optim.Adam(m.parameters())
    m(torch.ones(1, 2)).sum().backward()
    opt.step()
    mom = optimizer_moments(opt, m)
    assert set(mom) == {f"{p}/{k}" for p in ("weight", "bias") for k in ("step", "exp_avg", "exp_avg_sq")}
    # Execute: set them on a fresh optimizer
    opt2 = torch.optim.Adam(m.parameters())
    set_optimizer_moments(opt2, m, {k: v * 2 for k, v in mom.items()})
    # Assert
    torch.testing.assert_close(opt2.state[m.weight]["exp_avg"], 2 * mom["weight/exp_avg"])


# ------------------------------------------------------- server round, no engine
class _FakeTransport:
    """Answers 'train' tasks with canned arrays; sites in ``drop`` do not reply."""

    def __init__(self, replies, drop=()):
        self.replies, self.drop, self.sent = replies, set(drop), {}

    def ask(self, tasks, optional=False):
        self.sent = tasks
        return {s: self.replies[s] for s in tasks if s not in self.drop}


def _ctx(transport, sites):
    from fedseg.seams.algorithm import ServerContext

    return ServerContext(transport=transport, sites=tuple(sites), cfg=tiny_config("fedsm"), init_arrays=None)


def _reply(s, g, p, sel, m, n):
    arrays = {
        "global/w": torch.tensor([g]),
        f"personal/{s}/w": torch.tensor([p]),
        "selector/w": torch.tensor([sel]),
        "selector_optim/w/exp_avg": torch.tensor([m]),
        "selector_optim/w/exp_avg_sq": torch.tensor([m * m]),
        "selector_optim/w/step": torch.tensor(4.0 * n),
    }
    return Reply(arrays=arrays, metrics={"loss": 0.5}, num_samples=n)


@pytest.mark.parametrize("selector_weighting,q", [("samples", (0.25, 0.75)), ("even", (0.5, 0.5))])
def test_server_round_averages_selector_moments_with_the_selector_weights_and_softpulls(selector_weighting, q):
    """n = (1, 3): global with n_k/n = (0.25, 0.75) → 0.25·0 + 0.75·4 = 3.
    Selector and its moments with the same weights q (n_k/n, or 1/K by default):
    selector q·(8, 4), exp_avg q·(1, 2), exp_avg_sq q·(1, 4), step q·(4, 12).
    SoftPull with K = 2, λ = 0.7: p_a = 0.7·10 + 0.3·20 = 13, p_b = 0.7·20 + 0.3·10 = 17."""
    # Prepare
    cfg = tiny_config("fedsm")
    algo = FedSM(
        cfg.__class__(
            **{
                **cfg.__dict__,
                "params": {"fedsm": {"selector_weighting": selector_weighting, "selector_training": "fedavg"}},
            }
        )
    )
    state = {
        "global/w": torch.tensor([0.0]),
        "personal/a/w": torch.tensor([0.0]),
        "personal/b/w": torch.tensor([0.0]),
        "selector/w": torch.tensor([0.0]),
    }
    tr = _FakeTransport({"a": _reply("a", 0.0, 10.0, 8.0, 1.0, 1), "b": _reply("b", 4.0, 20.0, 4.0, 2.0, 3)})
    # Execute
    new, metrics = algo.server_round(_ctx(tr, "ab"), state, 1)
    # Assert
    qa, qb = q
    expect = {
        "global/w": 3.0,
        "selector/w": qa * 8 + qb * 4,
        "selector_optim/w/exp_avg": qa * 1 + qb * 2,
        "selector_optim/w/exp_avg_sq": qa * 1 + qb * 4,
        "selector_optim/w/step": qa * 4 + qb * 12,
        "personal/a/w": 13.0,
        "personal/b/w": 17.0,
    }
    for k, v in expect.items():
        assert new[k].item() == pytest.approx(v), k
    # each site was sent only its own personalized model; labels are positions in the federation
    assert "personal/b/w" not in tr.sent["a"].arrays and "personal/a/w" in tr.sent["a"].arrays
    assert tr.sent["b"].config["sites"] == ["a", "b"] and tr.sent["b"].config["num_classes"] == 2
    assert metrics["train_loss"] == {"a": 0.5, "b": 0.5}


def test_server_round_with_a_dropped_site_keeps_its_personalized_model():
    """c drops: global/selector averaged over a, b only; p_c unchanged (= 7); a, b SoftPull with K' = 2."""
    cfg = tiny_config("fedsm")
    algo = FedSM(cfg.__class__(**{**cfg.__dict__, "params": {"fedsm": {"selector_training": "fedavg"}}}))
    state = {
        "global/w": torch.tensor([0.0]),
        "selector/w": torch.tensor([0.0]),
        **{f"personal/{s}/w": torch.tensor([7.0]) for s in "abc"},
    }
    tr = _FakeTransport(
        {"a": _reply("a", 0.0, 10.0, 8.0, 1.0, 1), "b": _reply("b", 4.0, 20.0, 4.0, 2.0, 3)}, drop={"c"}
    )
    new, _ = algo.server_round(_ctx(tr, "abc"), state, 1)
    assert new["personal/c/w"].item() == 7.0
    assert new["global/w"].item() == pytest.approx(3.0)
    assert new["personal/a/w"].item() == pytest.approx(13.0)


@pytest.mark.parametrize(
    "method,fedsm,expected",
    [
        ("fedsm", {}, "flip"),
        ("fedsm-extra", {}, "none"),
        ("fedsm-ensemble", {}, "none"),
        ("fedsm", {"profile": "reference"}, "none"),
        ("fedsm-extra", {"selector_augment": "flip"}, "flip"),
        ("fedsm", {"selector_augment": "none"}, "none"),
    ],
)
def test_the_default_profile_flips_the_selectors_batches_only_where_the_label_is_the_site(method, fedsm, expected):
    """Default profile: flips for FedSM's Eq. 2 selector (a flip keeps the site); none for FedSM-extra and the
    ensemble, whose targets (which model segments an image best) a flip can change; reference profile: none;
    an explicit value wins everywhere."""
    from fedseg.algorithms import get_algorithm

    cfg = tiny_config(method, rounds=3)
    algo = get_algorithm(cfg.__class__(**{**cfg.__dict__, "params": {"fedsm": fedsm}}))
    assert algo.params.selector_augment == expected


def test_routing_accuracy_a_site_reports_must_be_a_fraction():
    """The best selector is the one with the highest mean routing accuracy the sites report: a training or
    selector-step reply whose ``routing_acc`` is not null, NaN (no validation cases) or in [0, 1] is refused
    (a deployed transport then rejects the reply), so one site cannot choose the best selector."""
    from fedseg.algorithms import get_algorithm
    from fedseg.foundation.errors import PayloadError
    from fedseg.foundation.messages import Reply, Task

    algo = get_algorithm(tiny_config("fedsm"))
    for kind in ("train", "selector_step"):
        for ok in (None, 0.0, 0.5, 1.0, float("nan")):
            algo.check_reply(Task(kind), Reply(metrics={"routing_acc": ok}))
        for bad in (1e30, -0.1, 1.5, "0.9"):
            with pytest.raises(PayloadError, match="routing_acc"):
                algo.check_reply(Task(kind), Reply(metrics={"routing_acc": bad}))


def test_softpull_and_weighted_mean_are_bitwise_the_per_tensor_sums():
    """`weighted_means` casts each model once and sums all tensors of a (row, model) term in one foreach
    operator; on the CPU that is the per-tensor loop ``acc = 0; acc += p_j · x_j`` (float64 for float32 and
    below) in the same order, so SoftPull and the weighted mean are bitwise what that loop gives."""
    from fedseg.foundation.arrays import normalize_weights, weighted_mean

    g = torch.Generator().manual_seed(0)

    def model() -> dict[str, torch.Tensor]:
        return {
            "w": torch.randn(5, 3, generator=g),
            "h": torch.randn(4, generator=g).to(torch.bfloat16),
            "d": torch.randn(2, generator=g, dtype=torch.float64),
            "n": torch.randint(0, 9, (1,), generator=g),
        }

    def loop(items, p):  # the reference: one add_ per tensor and term
        out = {}
        for name, ref in items[0].items():
            if not ref.is_floating_point():
                out[name] = ref.clone()
                continue
            acc = torch.zeros(ref.shape, dtype=torch.float64)
            for pk, it in zip(p, items):
                if pk != 0.0:
                    acc.add_(it[name].to(torch.float64), alpha=pk)
            out[name] = acc.to(ref.dtype)
        return out

    sites = {s: model() for s in "abcdef"}
    items = list(sites.values())
    counts = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0]
    got, want = weighted_mean(items, counts), loop(items, normalize_weights(counts))
    assert all(torch.equal(got[n], want[n]) and got[n].dtype == want[n].dtype for n in want)
    lam, k = 0.7, len(items)
    out = soft_pull(sites, lam)
    a = soft_pull_matrix(k, lam)
    for i, s in enumerate(sites):
        order = [i] + [j for j in range(k) if j != i]
        ref = loop([items[j] for j in order], normalize_weights([float(a[i, j]) for j in order]))
        assert list(out[s]) == list(ref) and all(torch.equal(out[s][n], ref[n]) for n in ref)
