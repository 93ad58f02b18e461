"""The FedSM ensemble's selector objectives (Section 3.1.1; ``fedsm.ensemble_objective``), on hand-made
numbers.  The learning test on a federation is in ``tests/runs/test_fedsm_selector_learns.py``.

``"experts"`` (default): per image ℓ(a) = −log Σ_k ŷ_k exp(−(L_k − min L)/τ), ŷ = softmax(a).
Hand derivation of its gradient: ℓ = logsumexp(a) − logsumexp(a − L/τ) (the shift by min L is a
constant), and ∂ logsumexp(v)/∂v_k = softmax(v)_k, so ∂ℓ/∂a_k = ŷ_k − r_k with the posterior
r_k = ŷ_k e^{−L_k/τ} / Σ_j ŷ_j e^{−L_j/τ}.

``"mix"`` (the paper's): ℓ(a) = L(Σ_k ŷ_k h_k, y); its gradient is ∂ℓ/∂a_k = ŷ_k ⟨g, h_k − h⟩ with
g = ∂L/∂h at the mix h — proportional to ŷ_k, so it vanishes for a model whose weight has gone to 0,
however much better that model is.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedseg.algorithms.fedsm import FedSMParams
from fedseg.algorithms.softpull import ensemble_mix, experts_loss, image_losses
from fedseg.foundation.config import dataclass_from_dict
from fedseg.foundation.errors import ConfigError


def test_experts_loss_and_gradient_by_hand():
    """a = (0, ln 2, 0) → ŷ = (1/4, 1/2, 1/4); L = (0.3, 0.1, 0.2), τ = 0.1 → e^{−(L − 0.1)/τ} = (e^{−2}, 1, e^{−1}).
    Σ_k ŷ_k e^{…} = e^{−2}/4 + 1/2 + e^{−1}/4 = 0.625804 → ℓ = −ln 0.625804 = 0.468719;
    r = (0.033834, 0.5, 0.091970) / 0.625804 = (0.054065, 0.798973, 0.146963);
    ∂ℓ/∂a = ŷ − r = (0.195935, −0.298973, 0.103037): the best model (index 1) is pushed up."""
    # Prepare
    a = torch.tensor([[0.0, math.log(2.0), 0.0]], dtype=torch.float64, requires_grad=True)
    losses = torch.tensor([[0.3, 0.1, 0.2]], dtype=torch.float64)
    # Execute
    value = experts_loss(a, losses, 0.1)
    value.backward()
    # Assert
    assert float(value.detach()) == pytest.approx(0.468719, abs=1e-6)
    assert a.grad[0].tolist() == pytest.approx([0.195935, -0.298973, 0.103037], abs=1e-6)


def test_experts_loss_tends_to_the_cross_entropy_of_eq1_labels_as_tau_goes_to_0():
    """τ → 0: the posterior is one-hot on argmin L (Eq. 1's label) and ℓ → −log ŷ_{argmin L}; large τ: ℓ → 0
    and no gradient (the posterior equals the prior).  Loss gaps here are ≥ 0.05, τ = 1e-4: e^{−500} ≈ 0."""
    # Prepare
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 4, generator=g, dtype=torch.float64)
    losses = torch.tensor(
        [[0.3, 0.1, 0.2, 0.5], [0.1, 0.4, 0.3, 0.2], [0.6, 0.5, 0.2, 0.3], [0.2, 0.3, 0.4, 0.1], [0.3, 0.2, 0.1, 0.4]],
        dtype=torch.float64,
    )
    eq1 = losses.argmin(dim=1)
    # Execute / Assert
    assert eq1.tolist() == [1, 0, 2, 3, 2]
    assert float(experts_loss(a, losses, 1e-4)) == pytest.approx(float(F.cross_entropy(a, eq1)), rel=1e-12)
    big = a.clone().requires_grad_(True)
    experts_loss(big, losses, 1e6).backward()
    assert float(big.grad.abs().max()) < 1e-6


def test_experts_gradient_does_not_vanish_where_the_mix_gradient_does():
    """Selector saturated on the global model (ŷ_0 = 1 − 2e-6, ŷ_1 = ŷ_2 = 1e-6); model 1 is right everywhere
    (logits +8 on the mask, −8 elsewhere), the global model half wrong.  The mix loss's gradient on a_1 is
    ŷ_1 ⟨g, h_1 − h⟩: below 1e-5.  The experts objective (τ = 0.01) sees L_0 − L_1 ≈ 0.5 ≫ τ ln(1/ŷ_1) = 0.14:
    the posterior is on model 1 and ∂ℓ/∂a_1 = ŷ_1 − r_1 ≈ −1."""
    # Prepare
    from monai.losses import DiceLoss

    loss = DiceLoss(sigmoid=True)
    y = torch.zeros(1, 1, 8, 8)
    y[..., :4, :] = 1
    right = torch.where(y > 0, 8.0, -8.0)
    half = right.clone()
    half[..., :, :4] = -8.0  # misses half the mask
    wrong = -right
    outputs = [half, right, wrong]
    a = torch.tensor([[0.0, math.log(1e-6), math.log(1e-6)]], dtype=torch.float64)
    a = (a - torch.logsumexp(a, dim=1, keepdim=True)).float().requires_grad_(True)
    # Execute
    mix = loss(ensemble_mix(torch.softmax(a, dim=1), outputs), y)
    (g_mix,) = torch.autograd.grad(mix, a)
    experts = experts_loss(a, image_losses(outputs, y, loss), 0.01)
    (g_exp,) = torch.autograd.grad(experts, a)
    # Assert
    assert float(torch.softmax(a.detach(), 1)[0, 0]) > 0.99999
    assert abs(float(g_mix[0, 1])) < 1e-5
    assert float(g_exp[0, 1]) < -0.99


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"ensemble_objective": "moe"}, "fedsm.ensemble_objective = 'moe'; use 'experts' or 'mix'"),
        ({"ensemble_tau": 0.0}, "fedsm.ensemble_tau = 0.0 must be > 0"),
        ({"ensemble_tau": -1.0}, "fedsm.ensemble_tau = -1.0 must be > 0"),
    ],
)
def test_ensemble_settings_are_validated_naming_the_key(settings, message):
    with pytest.raises(ConfigError, match=message):
        dataclass_from_dict(FedSMParams, settings, "fedsm").validate()


def test_profiles_fill_in_the_ensemble_objective():
    """Default profile: the experts objective; reference profile: the paper's mix; an explicit value wins."""
    assert FedSMParams().resolved().ensemble_objective == "experts"
    assert FedSMParams(profile="reference").resolved().ensemble_objective == "mix"
    assert FedSMParams(ensemble_objective="mix").resolved().ensemble_objective == "mix"


def _replies(dice_sums: dict[str, tuple[float, int]]) -> dict[str, dict]:
    """``"route"`` replies of a mix composite: one selection (no γ) with the summed Dice of n cases."""
    return {
        s: {"n": n, "routing_acc": 0.0, "selections": [{"gamma": None, "dice_sum": d, "counts": [n]}]}
        for s, (d, n) in dice_sums.items()
    }


def test_ensemble_compares_its_selectors_by_the_validation_dice_of_the_mix():
    """The ensemble's final-vs-kept selector choice scores a selector by the assembled mix's validation
    Dice, not by routing accuracy (nor a score kept from training).  Site a: 2 cases summing 1.6,
    site b: 8 cases summing 4.0 → pooled cases (1.6 + 4.0) / 10 = 0.56; mean of per-site means
    (0.8 + 0.5) / 2 = 0.65.  FedSM scores by routing accuracy and keeps a known score."""
    from fedseg.algorithms import get_algorithm
    from tests.support.helpers import tiny_config

    replies = _replies({"a": (1.6, 2), "b": (4.0, 8)})
    ens = get_algorithm(tiny_config("fedsm-ensemble", rounds=3))
    assert ens.selector_criterion == "dice"
    assert ens.selector_score(replies, known=0.9) == pytest.approx(0.56)
    sites_cfg = tiny_config("fedsm-ensemble", rounds=3)
    sites_cfg = sites_cfg.__class__(**{**sites_cfg.__dict__, "eval": sites_cfg.eval.__class__(best_criterion="sites")})
    assert get_algorithm(sites_cfg).selector_score(replies, known=None) == pytest.approx(0.65)
    assert ens.selector_score(_replies({"a": (0.0, 0)}), known=None) is None
    fedsm = get_algorithm(tiny_config("fedsm", rounds=3))
    assert fedsm.selector_score(replies, known=0.9) == 0.9
    assert fedsm.selector_score(replies, known=None) == 0.0


def test_fedsm_extra_scores_its_selectors_by_dice_with_the_experts_objective_and_by_eq1_agreement_otherwise():
    """FedSM-extra's final-vs-kept selector choice: with Eq. 1's labels (the default ``"oracle"``),
    agreement with them (a kept score is used as kept; else the replies' 0.0); with the experts
    objective, the assembled composite's validation Dice (the replies of the ensemble test above:
    pooled 0.56), since that objective does not aim at Eq. 1's one-hot labels on near-ties."""
    import dataclasses

    from fedseg.algorithms import get_algorithm
    from tests.support.helpers import tiny_config

    replies = _replies({"a": (1.6, 2), "b": (4.0, 8)})
    cfg = tiny_config("fedsm-extra", rounds=3)
    extra = get_algorithm(dataclasses.replace(cfg, params={"fedsm": {"extra_objective": "experts"}}))
    assert extra.labels == "experts" and extra.selector_criterion == "dice"
    assert extra.selector_score(replies, known=0.9) == pytest.approx(0.56)
    oracle = get_algorithm(cfg)
    assert oracle.labels == "oracle" and oracle.selector_criterion == "routing_acc"
    assert oracle.selector_score(replies, known=0.9) == 0.9
    assert oracle.selector_score(replies, known=None) == 0.0


@pytest.mark.parametrize("objective", ["experts", "mix"])
def test_ensemble_runs_end_to_end_and_records_the_selectors_validation_dice(tmp_path, sites, workload, objective):
    """The whole method on three tiny sites (2 model rounds, 2 selector rounds, fga selector): the run's
    config holds the objective, the selector phase reports losses and routing, and the tested composite
    records the mix's validation Dice of the selector it chose (the final or the kept one)."""
    import dataclasses
    import json

    from safetensors.torch import load_file

    from fedseg.simulation.runner import simulate
    from tests.support.helpers import tiny_config

    # Prepare
    cfg = tiny_config("fedsm-ensemble", rounds=4)
    fedsm = {"selector_width": 0.0625, "selector_hidden": 8, "selector_rounds": 2, "ensemble_objective": objective}
    cfg = dataclasses.replace(cfg, params={"fedsm": fedsm})
    # Execute
    res = simulate(cfg, workload, sites, out=tmp_path, progress=False)
    # Assert
    assert res["config"]["fedsm"]["ensemble_objective"] == objective
    last = res["history"][-1]
    assert last["phase"] == "selector" and all(math.isfinite(v) for v in last["selector_loss"].values())
    meta = json.loads((tmp_path / "checkpoints/best.json").read_text())
    assembled = meta["fedsm"]["config"]["assembled"]
    assert meta["fedsm"]["config"]["mode"] == "mix"
    assert 0.0 <= assembled["selector_val_dice"] <= 1.0 and "selector_val_routing_acc" not in assembled
    best, server = (
        load_file(str(tmp_path / "checkpoints/best.safetensors")),
        load_file(str(tmp_path / "checkpoints/server.safetensors")),
    )
    sel = {k.removeprefix("fedsm/selector/"): v for k, v in best.items() if k.startswith("fedsm/selector/")}
    src = "selector/" if assembled["selector"] == cfg.rounds else "best_selector/"
    assert sel and all(torch.equal(v, server[src + k]) for k, v in sel.items())
