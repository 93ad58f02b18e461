"""Baselines and personalization comparators: FedProx, SCAFFOLD, FT, APFL, Per-FedAvg, pFedMe, Ditto.

Pure maths on hand-computed tensors first, then the papers' properties on tiny
federations (conftest ``tiny_sites``), then one end-to-end run and a resume check
per method, then bad settings.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from fedseg.algorithms import get_algorithm, known_sections
from fedseg.algorithms.apfl import alpha_gradient, alpha_step, mix_outputs, mix_parameters, mixture_gradients
from fedseg.algorithms.fedprox import proximal_term
from fedseg.algorithms.pfedme import inner_update, moreau_gradient, server_update
from fedseg.algorithms.scaffold import control_update, correction, server_control_update, server_model_update
from fedseg.foundation.arrays import strip_prefix, weighted_mean
from fedseg.foundation.config import load_run_config
from fedseg.foundation.errors import ConfigError
from fedseg.foundation.seeding import derive_seed
from fedseg.simulation.runner import build_engine, simulate
from fedseg.site.batches import SiteData
from fedseg.site.runtime import Site
from tests.support.helpers import assert_same_arrays, server_state, site_state, tiny_config, tiny_sites

PERSONAL = ["ft", "apfl", "perfedavg", "pfedme", "ditto"]
ALL = ["fedprox", "scaffold", *PERSONAL]


PAPERS_FEDAVG = {"weighting": "samples", "normalize": "none"}
"""The papers' FedAvg (p_k = n_k / n, the plain average), which FedProx at μ = 0, SCAFFOLD's first round, FT,
APFL's and Ditto's global models reduce to; FedAvg's defaults (sample weights, the step-normalized average) are
tested in tests/runs/test_fedavg_normalize.py."""


def cfg_with(method: str, rounds: int = 2, params: dict | None = None, **train):
    """A tiny config of ``method`` with ``params`` in its section; ``fedavg`` is the papers' unless ``params`` says."""
    section = {**PAPERS_FEDAVG, **(params or {})} if method == "fedavg" else params or {}
    cfg = tiny_config(method, rounds=rounds, **train)
    return dataclasses.replace(cfg, params={method: section})


def t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


# ------------------------------------------------------------------ pure maths
def test_proximal_term_value_and_gradient_on_a_linear_model():
    """FedProx Eq. 2 on a 2→1 linear layer.

    Value: w = [[1, 2]], b = [3], anchor 0, μ = 0.5 → μ/2 (1 + 4 + 9) = 3.5.
    Gradient of loss + term = g + μ (w − w0), where g is the plain loss gradient.
    """
    # Prepare
    torch.manual_seed(0)
    model = nn.Linear(2, 1).double()
    with torch.no_grad():
        model.weight.copy_(t(1.0, 2.0).reshape(1, 2))
        model.bias.copy_(t(3.0))
    zero = {k: torch.zeros_like(v) for k, v in model.named_parameters()}
    # Execute / Assert: the value
    assert float(proximal_term(dict(model.named_parameters()), zero, 0.5).detach()) == pytest.approx(3.5)
    # Execute: plain gradient and the proximal one from a shifted anchor
    x, y = torch.randn(5, 2, dtype=torch.float64), torch.randn(5, 1, dtype=torch.float64)
    anchor = {k: v.detach() + 0.3 for k, v in model.named_parameters()}
    g = torch.autograd.grad(nn.functional.mse_loss(model(x), y), list(model.parameters()))
    total = nn.functional.mse_loss(model(x), y) + proximal_term(dict(model.named_parameters()), anchor, 0.7)
    gp = torch.autograd.grad(total, list(model.parameters()))
    # Assert: g + μ (w − w0) = g − 0.7 · 0.3
    for (name, p), gi, gpi in zip(model.named_parameters(), g, gp):
        torch.testing.assert_close(gpi, gi + 0.7 * (p.detach() - anchor[name]), rtol=0, atol=1e-14)
        torch.testing.assert_close(gpi, gi - 0.21, rtol=0, atol=1e-14)


def test_scaffold_control_update_and_server_steps_by_hand():
    """Option II: c_i⁺ = c_i − c + (x − y)/(K η) = 1 − 0.5 + (2 − 1)/(2 · 0.25) = 2.5.

    Server: η_g = 1 returns the weighted mean itself (bitwise); η_g = 0.5 with x = 0,
    y = (2, 4), p = (0.25, 0.75) gives 0.5 · 3.5 = 1.75.  c = 1 + 0.5 · (0.25·4 + 0.75·8) = 4.5.
    """
    # Execute
    c_new = control_update({"w": t(1.0)}, {"w": t(0.5)}, {"w": t(2.0)}, {"w": t(1.0)}, steps=2, lr=0.25)
    ys = [{"w": t(2.0)}, {"w": t(4.0)}]
    full = server_model_update({"w": t(0.0)}, ys, [0.25, 0.75], 1.0)
    half = server_model_update({"w": t(0.0)}, ys, [0.25, 0.75], 0.5)
    c = server_control_update({"w": t(1.0)}, [{"w": t(4.0)}, {"w": t(8.0)}], [0.25, 0.75], fraction=0.5)
    c0 = server_control_update(None, [{"w": t(4.0)}, {"w": t(8.0)}], [0.25, 0.75], fraction=1.0)
    # Assert
    assert float(c_new["w"]) == 2.5
    assert torch.equal(full["w"], weighted_mean(ys, [0.25, 0.75])["w"])
    assert float(half["w"]) == 1.75
    assert float(c["w"]) == 4.5 and float(c0["w"]) == 7.0
    assert float(correction({"w": t(3.0)}, {"w": t(1.0)})["w"]) == 2.0
    with pytest.raises(ValueError, match="at least one local step"):
        control_update({"w": t(1.0)}, {"w": t(0.5)}, {"w": t(2.0)}, {"w": t(1.0)}, steps=0, lr=0.1)


def test_apfl_mixing_endpoints_are_exact():
    """α = 0 gives the global model (weights and outputs) exactly, α = 1 the local one; α = 0.25 interpolates."""
    # Prepare
    v, w = {"a": t(1.0, 2.0), "n": torch.tensor([7])}, {"a": t(5.0, -2.0), "n": torch.tensor([3])}
    # Execute / Assert
    assert torch.equal(mix_parameters(v, w, 0.0)["a"], w["a"])
    assert torch.equal(mix_parameters(v, w, 1.0)["a"], v["a"])
    torch.testing.assert_close(mix_parameters(v, w, 0.25)["a"], t(4.0, -1.0))
    assert torch.equal(mix_parameters(v, w, 0.25)["n"], w["n"])  # integers are never mixed
    assert torch.equal(mix_outputs(v["a"], w["a"], 0.0), w["a"])
    assert torch.equal(mix_outputs(v["a"], w["a"], 1.0), v["a"])
    # α clipped to [0, 1]
    assert (
        alpha_step(0.1, 5.0, 0.1) == 0.0
        and alpha_step(0.9, -5.0, 0.1) == 1.0
        and alpha_step(0.5, 1.0, 0.1) == pytest.approx(0.4)
    )


def test_apfl_mixture_gradients_follow_the_chain_rule_by_hand():
    """v̄ = α v + (1 − α) w with α = 0.25, v = (1, 2), w = (5, −2), ∇f(v̄) = (4, −8):
    ∇_v f = α ∇f(v̄) = (1, −2); ∂f/∂α = ⟨v − w, ∇f(v̄)⟩ = (−4)(4) + (4)(−8) = −48 (float64).
    A parameter the gradient does not name (f does not reach it) gets zero and adds nothing to ∂f/∂α."""
    v, w = {"a": t(1.0, 2.0), "u": t(3.0)}, {"a": t(5.0, -2.0), "u": t(1.0)}
    g_v, g_a = mixture_gradients(v, w, {"a": t(4.0, -8.0)}, 0.25)
    assert torch.equal(g_v["a"], t(1.0, -2.0)) and torch.equal(g_v["u"], t(0.0))
    assert g_a.dtype == torch.float64 and float(g_a) == -48.0


def test_apfl_alpha_gradient_matches_autograd_through_the_parameter_mixture():
    """d/dα f(α v + (1 − α) w) = ⟨v − w, ∇f(v̄)⟩ (APFL Eq. 10), checked against autograd on a linear model."""
    # Prepare
    g = torch.Generator().manual_seed(1)
    v = {
        "W": torch.randn(3, 2, generator=g, dtype=torch.float64),
        "b": torch.randn(3, generator=g, dtype=torch.float64),
    }
    w = {
        "W": torch.randn(3, 2, generator=g, dtype=torch.float64),
        "b": torch.randn(3, generator=g, dtype=torch.float64),
    }
    x, y = torch.randn(4, 2, generator=g, dtype=torch.float64), torch.randn(4, 3, generator=g, dtype=torch.float64)

    def f(p):
        return ((x @ p["W"].T + p["b"] - y) ** 2).mean()

    a = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    # Execute
    auto = torch.autograd.grad(f({k: a * v[k] + (1 - a) * w[k] for k in v}), a)[0]
    mixed = {k: (0.3 * v[k] + 0.7 * w[k]).requires_grad_(True) for k in v}
    grad_mixed = dict(zip(mixed, torch.autograd.grad(f(mixed), list(mixed.values()))))
    # Assert
    assert alpha_gradient(v, w, grad_mixed) == pytest.approx(float(auto), rel=1e-12)


def test_pfedme_updates_by_hand():
    """Inner step θ − η(g + λ(θ − w)) = 1 − 0.1 (0.5 + 2 (1 − 3)) = 1.35; Moreau gradient λ(w − θ) = 2 · 2 = 4.

    Server: β = 1 is the weighted mean bitwise; β = 0.5 gives 0.5 · 0 + 0.5 · 3.5 = 1.75; β = 2 extrapolates to 7.
    """
    # Execute / Assert
    assert float(inner_update({"w": t(1.0)}, {"w": t(0.5)}, {"w": t(3.0)}, lam=2.0, lr=0.1)["w"]) == pytest.approx(1.35)
    assert float(moreau_gradient({"w": t(3.0)}, {"w": t(1.0)}, lam=2.0)["w"]) == 4.0
    locals_ = [{"w": t(2.0)}, {"w": t(4.0)}]
    assert torch.equal(
        server_update({"w": t(0.0)}, locals_, [0.25, 0.75], 1.0)["w"], weighted_mean(locals_, [0.25, 0.75])["w"]
    )
    assert float(server_update({"w": t(0.0)}, locals_, [0.25, 0.75], 0.5)["w"]) == 1.75
    assert float(server_update({"w": t(0.0)}, locals_, [0.25, 0.75], 2.0)["w"]) == 7.0


@pytest.mark.parametrize("section", [{}, {"weighting": "samples"}])
def test_fedavg_even_config_toml_records_even_weighting(tmp_path, sites, workload, section):
    """The written config names the weighting fedavg-even runs, even when ``[fedavg]`` asks for another."""
    # Prepare
    cfg = dataclasses.replace(tiny_config("fedavg-even", rounds=1), params={"fedavg": section})
    # Execute
    engine = build_engine(cfg, workload, sites, out=tmp_path, progress=False)
    saved = load_run_config(tmp_path / "config.toml", [], known_sections())
    # Assert
    assert engine.algorithm.params.weighting == "even"
    assert saved.method == "fedavg-even" and saved.params["fedavg"]["weighting"] == "even"


# ------------------------------------------------------ properties on tiny sites
def test_fedprox_with_mu_zero_equals_fedavg_bitwise(tmp_path, sites, workload):
    # Execute
    simulate(cfg_with("fedavg"), workload, sites, out=tmp_path / "fa", progress=False)
    simulate(cfg_with("fedprox", params={"mu": 0.0}), workload, sites, out=tmp_path / "fp", progress=False)
    simulate(cfg_with("fedprox", params={"mu": 1.0}), workload, sites, out=tmp_path / "fp1", progress=False)
    # Assert: μ = 0 is FedAvg bitwise; μ = 1 is not
    assert_same_arrays(server_state(tmp_path / "fa"), server_state(tmp_path / "fp"))
    assert any(not torch.equal(v, server_state(tmp_path / "fp1")[k]) for k, v in server_state(tmp_path / "fa").items())


@pytest.mark.parametrize("mode", ["step", "gradient"])
def test_scaffold_round_one_equals_fedavg_bitwise(tmp_path, sites, workload, mode):
    """With c = c_i = 0 the correction is 0 and η_g = 1 makes the server step the FedAvg mean."""
    # Execute
    simulate(cfg_with("fedavg", rounds=1), workload, sites, out=tmp_path / "fa", progress=False)
    res = simulate(
        cfg_with("scaffold", rounds=2, params={"correction": mode}),
        workload,
        sites,
        out=tmp_path / "sc",
        progress=False,
        stop_after=1,
    )
    # Assert
    assert res is None
    sc = server_state(tmp_path / "sc")
    assert_same_arrays(server_state(tmp_path / "fa"), {k: v for k, v in sc.items() if k.startswith("global/")})
    assert any(k.startswith("control/") for k in sc)  # c exists after round 1


def test_scaffold_step_and_gradient_corrections_agree_under_plain_sgd(tmp_path, sites, workload):
    """With SGD (momentum 0) w − η(g + c − c_i) and (w − ηg) − η(c − c_i) are the same update up to rounding,
    so after 3 rounds (corrections non-zero from round 2) the two modes give the same weights to ~1e-5;
    under Adam they differ (the corrections are preconditioned or not)."""
    # Prepare
    sgd = {"optimizer": "sgd", "momentum": 0.0, "lr": 0.05}
    # Execute
    simulate(
        cfg_with("scaffold", rounds=3, params={"correction": "step"}, **sgd),
        workload,
        sites,
        out=tmp_path / "s",
        progress=False,
    )
    simulate(
        cfg_with("scaffold", rounds=3, params={"correction": "gradient"}, **sgd),
        workload,
        sites,
        out=tmp_path / "g",
        progress=False,
    )
    simulate(
        cfg_with("scaffold", rounds=3, params={"correction": "step"}),
        workload,
        sites,
        out=tmp_path / "sa",
        progress=False,
    )
    simulate(
        cfg_with("scaffold", rounds=3, params={"correction": "gradient"}),
        workload,
        sites,
        out=tmp_path / "ga",
        progress=False,
    )
    # Assert
    a, b = server_state(tmp_path / "s"), server_state(tmp_path / "g")
    assert any(float(v.abs().max()) > 0 for k, v in a.items() if k.startswith("control/"))
    for k in a:
        if a[k].is_floating_point():
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    a, b = server_state(tmp_path / "sa"), server_state(tmp_path / "ga")
    assert any(
        float((a[k] - b[k]).abs().max()) > 1e-4 for k in a if k.startswith("global/") and a[k].is_floating_point()
    )


def identical_sites(n: int = 3) -> dict[str, SiteData]:
    """Sites with the same data, each training split one image repeated, so every batch order gives the same batches."""
    g = torch.Generator().manual_seed(3)
    x = torch.rand(1, 1, 16, 16, generator=g).repeat(4, 1, 1, 1)
    ds = TensorDataset(x, (x > 0.5).float())
    return {f"site{k + 1}": SiteData(ds, ds, ds) for k in range(n)}


def test_scaffold_corrections_stay_zero_on_identical_sites(tmp_path, workload):
    """Identical sites reach identical y, so every c_i equals c and c − c_i = 0 in every round; heterogeneous sites do not."""
    # Execute
    res = simulate(cfg_with("scaffold", rounds=3), workload, identical_sites(), out=tmp_path / "same", progress=False)
    het = simulate(cfg_with("scaffold", rounds=2), workload, tiny_sites(), progress=False)
    # Assert
    for e in res["history"]:
        assert all(v <= 1e-6 for v in e["correction_norm"].values()), e["correction_norm"]
    c_is = [strip_prefix("store/scaffold/c", site_state(tmp_path / "same", s)) for s in ("site1", "site2", "site3")]
    assert c_is[0] and any(float(v.abs().max()) > 0 for v in c_is[0].values())  # c_i itself is not trivially 0
    for other in c_is[1:]:
        assert_same_arrays(c_is[0], other)
    assert all(v > 1e-3 for v in het["history"][1]["correction_norm"].values())


def test_ft_with_zero_steps_equals_fedavg(tmp_path, sites, workload):
    """Weights: global = FedAvg's, personal = global.  Scores: with one evaluation (the last round) the
    best-round choice cannot differ (each personal model picks its round on its own site's validation
    split, the global model on all sites'), so the method's row is FedAvg's."""
    # Prepare
    once = {"eval": dataclasses.replace(tiny_config().eval, every=2)}
    # Execute
    fa = simulate(dataclasses.replace(cfg_with("fedavg"), **once), workload, sites, out=tmp_path / "fa", progress=False)
    ft = simulate(
        dataclasses.replace(cfg_with("ft", params={"steps": 0}), **once),
        workload,
        sites,
        out=tmp_path / "ft",
        progress=False,
    )
    simulate(cfg_with("ft", params={"steps": 3}), workload, sites, out=tmp_path / "ft3", progress=False)
    # Assert: the global model is FedAvg's; with 0 steps every personal model is the global one
    state = server_state(tmp_path / "ft")
    g = strip_prefix("global", state)
    assert_same_arrays(server_state(tmp_path / "fa"), {f"global/{k}": v for k, v in g.items()})
    for s in sites:
        assert_same_arrays(g, strip_prefix(f"personal/{s}", state))
    assert ft["per_site_dice"] == fa["per_site_dice"]
    assert ft["rows"][0]["per_site_dice"] == fa["rows"][0]["per_site_dice"]
    p3 = strip_prefix("personal/site1", server_state(tmp_path / "ft3"))
    assert any(not torch.equal(p3[k], g[k]) for k in g if g[k].is_floating_point())


def test_apfl_global_model_follows_fedavg_and_alpha_stays_in_unit_interval(tmp_path, sites, workload):
    """The w step is FedAvg's site step, so APFL's global weights equal FedAvg's bitwise; α is learned and clipped."""
    # Execute
    simulate(cfg_with("fedavg"), workload, sites, out=tmp_path / "fa", progress=False)
    res = simulate(cfg_with("apfl", params={"alpha_lr": 5.0}), workload, sites, out=tmp_path / "ap", progress=False)
    # Assert
    state = server_state(tmp_path / "ap")
    assert_same_arrays(server_state(tmp_path / "fa"), {k: v for k, v in state.items() if k.startswith("global/")})
    alphas = [a for e in res["history"] for a in e["alpha"].values()]
    assert all(0.0 <= a <= 1.0 for a in alphas)
    assert any(a != 0.5 for a in alphas)  # learned
    assert float(site_state(tmp_path / "ap", "site1")["store/apfl/alpha"]) == res["history"][-1]["alpha"]["site1"]


@pytest.mark.parametrize("mix", ["parameters", "outputs"])
@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_apfl_personal_prediction_is_global_at_alpha_0_and_local_at_alpha_1(sites, workload, mix, alpha):
    """The candidate predictor of a site's APFL model, built from the server's candidates, at fixed α ∈ {0, 1}."""
    # Prepare: an APFL algorithm and a state with distinct global and personal weights
    cfg = cfg_with("apfl", params={"mix": mix})
    algo = get_algorithm(cfg)
    torch.manual_seed(0)
    w = workload.build_model().state_dict()
    torch.manual_seed(1)
    v = workload.build_model().state_dict()
    state = {
        **{f"global/{k}": x for k, x in w.items()},
        **{f"personal/site1/{k}": x for k, x in v.items()},
        "alpha/site1": torch.tensor([alpha], dtype=torch.float64),
    }
    ctx = type("Ctx", (), {"sites": ("site1",)})()
    cand = next(c for c in algo.candidates(state, ctx) if c.name == "personal/site1")
    site = Site("site1", 0, sites["site1"], workload, cfg, algo)
    x = sites["site1"].test.tensors[0]
    # Execute
    predict = algo.predictors()[cand.predictor](site, cand.arrays, cand.config)
    out = predict(x)
    ref = site.model_predictor(w if alpha == 0.0 else v, role="ref")(x)
    # Assert
    assert torch.equal(out, ref)


def test_ditto_global_equals_fedavg_and_lambda_zero_is_local_training(tmp_path, sites, workload):
    """Ditto's global weights are FedAvg's bitwise; with λ = 0 each personal model is plain local training
    (replayed here by hand: the seeded initial model, the ``personal`` stream, the run's optimizer)."""
    # Execute
    simulate(cfg_with("fedavg", rounds=2), workload, sites, out=tmp_path / "fa", progress=False)
    cfg = cfg_with("ditto", rounds=2, params={"lam": 0.0})
    simulate(cfg, workload, sites, out=tmp_path / "d0", progress=False)
    simulate(cfg_with("ditto", rounds=2, params={"lam": 1.0}), workload, sites, out=tmp_path / "d1", progress=False)
    # Assert: global trajectory
    assert_same_arrays(
        server_state(tmp_path / "fa"),
        {k: v for k, v in server_state(tmp_path / "d0").items() if k.startswith("global/")},
    )
    assert_same_arrays(
        server_state(tmp_path / "fa"),
        {k: v for k, v in server_state(tmp_path / "d1").items() if k.startswith("global/")},
    )
    # Assert: λ = 0 personal = local training from the initial model
    site = Site("site2", 1, sites["site2"], workload, cfg, get_algorithm(cfg))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(cfg.seed, "init", "global"))
        init = workload.build_model().state_dict()
    site.load("alone", init)
    for rnd in (1, 2):
        site.now(site.fit("alone", rnd, stream="personal"))
    ditto0 = strip_prefix("model/personal", site_state(tmp_path / "d0", "site2"))
    assert_same_arrays(site.arrays("alone"), ditto0)
    ditto1 = strip_prefix("model/personal", site_state(tmp_path / "d1", "site2"))
    assert any(not torch.equal(ditto0[k], ditto1[k]) for k in ditto0)


def test_pfedme_beta_one_is_the_plain_average_of_the_sites_models(tmp_path, sites, workload):
    """One round with β = 1: the new global model is Σ p_k w_k of the sites' local models exactly."""
    # Prepare: keep each site's local model (models/global at the site after round 1)
    simulate(cfg_with("pfedme", rounds=1), workload, sites, out=tmp_path / "b1", progress=False)
    simulate(cfg_with("pfedme", rounds=1, params={"beta": 0.5}), workload, sites, out=tmp_path / "b05", progress=False)
    locals_ = [strip_prefix("model/global", site_state(tmp_path / "b1", s)) for s in sites]
    n = [len(d.train) for d in sites.values()]
    # Execute
    expected = weighted_mean(locals_, n)
    g1 = strip_prefix("global", server_state(tmp_path / "b1"))
    g05 = strip_prefix("global", server_state(tmp_path / "b05"))
    # Assert
    assert_same_arrays(expected, g1)
    assert any(not torch.equal(g05[k], g1[k]) for k in g1)


# ------------------------------------------------------------- end to end
@pytest.mark.parametrize(
    "method,params",
    [
        ("fedprox", {}),
        ("scaffold", {}),
        ("ft", {}),
        ("apfl", {}),
        ("apfl", {"mix": "outputs"}),
        ("perfedavg", {}),
        ("perfedavg", {"variant": "hf"}),
        ("perfedavg", {"variant": "hf", "hvp": "finite_difference"}),
        ("pfedme", {}),
        ("ditto", {}),
    ],
)
def test_end_to_end_on_a_tiny_federation(sites, workload, method, params):
    """Every method trains, reports its row, and personalization methods report the model × site matrix."""
    # Execute
    res = simulate(cfg_with(method, rounds=2, params=params), workload, sites, progress=False)
    # Assert
    assert res["method"] == method
    assert 0.0 <= res["client_avg_dice"] <= 1.0 and 0.0 <= res["global_dice"] <= 1.0
    assert all(e["train_loss"][s] is not None for e in res["history"] for s in sites)
    names = [r["name"] for r in res["rows"]]
    if method in PERSONAL:
        assert names == ["global", *(f"personal/{s}" for s in sites)]
        for r in res["rows"]:
            assert set(r["per_site_dice"]) == set(sites)  # each personal model on every site
        for r in res["rows"][1:]:
            assert res["per_site_dice"][r["home_site"]] == r["per_site_dice"][r["home_site"]]
    else:
        assert names == ["global"]


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "method,key,value,match",
    [
        ("fedprox", "mu", -1.0, "fedprox.mu"),
        ("fedprox", "weighting", "median", "fedprox.weighting"),
        ("scaffold", "server_lr", 0.0, "scaffold.server_lr"),
        ("scaffold", "correction", "momentum", "scaffold.correction"),
        ("ft", "steps", -2, "ft.steps"),
        ("apfl", "alpha", 1.5, r"apfl.alpha .*\[0, 1\]"),
        ("apfl", "mix", "logits", "apfl.mix"),
        ("perfedavg", "variant", "so", "perfedavg.variant"),
        ("perfedavg", "hvp", "exact", "perfedavg.hvp"),
        ("pfedme", "beta", 0.0, "pfedme.beta .*freezes the global model"),
        ("pfedme", "inner_steps", 0, "pfedme.inner_steps"),
        ("ditto", "lam", -0.1, "ditto.lam"),
    ],
)
def test_bad_settings_are_rejected_with_the_key_named(method, key, value, match):
    with pytest.raises(ConfigError, match=match):
        get_algorithm(cfg_with(method, params={key: value}))


def test_unknown_key_in_a_method_section_is_rejected():
    with pytest.raises(ConfigError, match=r"\[ditto\] has unknown key\(s\) \['lambda'\]"):
        get_algorithm(cfg_with("ditto", params={"lambda": 0.1}))


@pytest.mark.parametrize("method", ["fedavg", "fedprox", "fedsm"])
@pytest.mark.parametrize("rule", ["median", "trimmed_mean"])
def test_robust_aggregation_in_simulation_is_the_rule_over_the_sites_models(tmp_path, sites, workload, method, rule):
    """After round 1 the global model is the coordinate-wise rule over the three sites' trained models
    (each site's checkpoint keeps the model it sent); trim 0.34 drops ⌊0.34·3⌋ = 1 site at each end,
    so the trimmed mean is then the median too."""
    # Execute
    simulate(
        cfg_with(method, rounds=1, params={"aggregation": rule, "trim": 0.34}),
        workload,
        sites,
        out=tmp_path,
        progress=False,
    )
    # Assert
    glob = strip_prefix("global", server_state(tmp_path))
    models = [strip_prefix("model/global", site_state(tmp_path, s)) for s in sites]
    assert models[0].keys() == glob.keys()
    for k, v in glob.items():
        if v.is_floating_point():
            assert torch.allclose(v, torch.stack([m[k] for m in models]).median(dim=0).values, rtol=0, atol=1e-6), k


@pytest.mark.parametrize("method", ["fedavg", "fedprox", "fedsm"])
def test_bad_aggregation_setting_names_the_key(method):
    with pytest.raises(ConfigError, match=rf"{method}.aggregation = 'avg'"):
        get_algorithm(cfg_with(method, params={"aggregation": "avg"}))
