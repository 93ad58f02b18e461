"""FedSM's personalization ablation (FedSM paper Section 4.3, Table 6):
``fedsm.personalization = softpull | ft | apfl | perfedavg | pfedme | ditto``.

End to end on the tiny in-memory sites of ``conftest.py`` (2 rounds each)."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch
from safetensors.torch import load_file

from fedseg.algorithms import get_algorithm
from fedseg.algorithms.fedsm import PERSONALIZATIONS, FedSMParams
from fedseg.algorithms.personal import Personalization, PersonalizationBase
from fedseg.foundation.errors import ConfigError
from fedseg.foundation.messages import Reply
from fedseg.seams.algorithm import ServerContext
from fedseg.simulation.runner import simulate
from tests.support.helpers import assert_same_checkpoints, tiny_config, tiny_sites

METHODS = [p for p in PERSONALIZATIONS if p != "softpull"]


def _cfg(rounds: int = 2, **sections):
    return dataclasses.replace(tiny_config("fedsm", rounds=rounds), params=sections)


def _server(path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "checkpoints/server.safetensors"))


def _model(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) + 1 :]: v for k, v in state.items() if k.startswith(prefix + "/")}


@pytest.mark.parametrize("personalization", METHODS)
def test_every_personalization_runs_end_to_end_with_the_selector(tmp_path, sites, workload, personalization):
    """Each Table 6 row trains inside FedSM: the composite is reported, the selector is
    trained every round, and the stored personalized models are the method's own
    (site-specific: site 1's differs from site 2's, and from the global model)."""
    # Execute
    res = simulate(_cfg(fedsm={"personalization": personalization}), workload, sites, out=tmp_path, progress=False)
    # Assert: the composite and every model are candidates; the method is recorded
    assert {r["name"] for r in res["rows"]} == {"fedsm", "global", *(f"personal/{s}" for s in sites)}
    assert 0.0 <= res["client_avg_dice"] <= 1.0
    for e in res["history"]:
        assert e["phase"] == "joint"
        assert set(e["selector_loss"]) == set(sites) and set(e["routing_acc"]) == set(sites)
        assert set(e["personal_loss"]) == set(sites)
    state = _server(tmp_path)
    p1, p2, g = _model(state, "personal/site1"), _model(state, "personal/site2"), _model(state, "global")
    assert p1.keys() == g.keys()
    assert any(not torch.equal(p1[k], p2[k]) for k in p1 if p1[k].is_floating_point())
    assert any(not torch.equal(p1[k], g[k]) for k in p1 if p1[k].is_floating_point())


def test_softpull_is_the_default_and_mixes_the_models_the_sites_trained(tmp_path, sites, workload):
    """``personalization = softpull`` is the default (same server state bit for bit), and its server step
    is Eq. 11 on the models the sites trained: λ changes no site's training in round 1, so with λ = 1
    (no pull) personal/k is site k's trained model w_k, and with λ = 0.7 personal/k is
    0.7 w_k + 0.15 Σ_{j≠k} w_j (K = 3) while the global model is the same bit for bit."""

    # Prepare
    def run(name, **fedsm):
        simulate(_cfg(1, fedsm=fedsm), workload, tiny_sites(), out=tmp_path / name, progress=False)
        return _server(tmp_path / name)

    # Execute
    default = run("default", lam=0.7)
    pulled = run("softpull", lam=0.7, personalization="softpull")
    unpulled = run("unpulled", lam=1.0)
    # Assert: the default is SoftPull
    assert default.keys() == pulled.keys() and all(torch.equal(default[k], pulled[k]) for k in default)
    names = list(sites)
    trained = {s: _model(unpulled, f"personal/{s}") for s in names}
    g_pulled, g_unpulled = _model(pulled, "global"), _model(unpulled, "global")
    floats = [k for k, v in g_unpulled.items() if v.is_floating_point()]
    assert floats and all(torch.equal(g_pulled[k], g_unpulled[k]) for k in g_unpulled)  # λ touches no global
    for s in names:
        mine = _model(pulled, f"personal/{s}")
        assert any(not torch.equal(mine[k], trained[s][k]) for k in floats)  # pulled towards the others
        for k in floats:
            others = sum(trained[o][k].double() for o in names if o != s)
            want = 0.7 * trained[s][k].double() + 0.15 * others
            torch.testing.assert_close(mine[k].double(), want, rtol=0, atol=1e-6)


def test_bad_personalization_and_incompatible_settings_are_rejected():
    """A name outside Table 6 lists the choices; the method's own settings are validated
    from its own section; APFL's output mixture is no single model for the selector."""
    # Execute / Assert
    with pytest.raises(
        ConfigError,
        match=r"fedsm.personalization = 'fedprox'.*'softpull', 'ft', 'apfl', 'perfedavg', 'pfedme' or 'ditto'",
    ):
        get_algorithm(_cfg(fedsm={"personalization": "fedprox"}))
    with pytest.raises(ConfigError, match=r"ditto.lam = -1"):
        get_algorithm(_cfg(fedsm={"personalization": "ditto"}, ditto={"lam": -1.0}))
    with pytest.raises(ConfigError, match=r"apfl.mix = 'outputs' cannot be used inside FedSM"):
        get_algorithm(_cfg(fedsm={"personalization": "apfl"}, apfl={"mix": "outputs"}))


def test_method_settings_come_from_their_own_section():
    """``--set ditto.lam=0.5`` reaches FedSM's Ditto personalization and is recorded in describe()."""
    # Execute
    alg = get_algorithm(_cfg(fedsm={"personalization": "ditto"}, ditto={"lam": 0.5, "steps": 2}))
    # Assert
    assert alg.personal.params.lam == 0.5 and alg.personal.params.steps == 2
    assert alg.describe()["personalization"] == "ditto" and alg.describe()["ditto"]["lam"] == 0.5


def test_ft_with_zero_steps_personalized_models_are_the_received_global_model(tmp_path, sites, workload):
    """FT with ``ft.steps = 0`` fine-tunes nothing: θ_k = w_r, the global model the site
    received in round r.  So after round 2 every personal/<site> equals the global model
    after round 1 (read from a run stopped after round 1), bit for bit."""
    # Prepare
    cfg = _cfg(fedsm={"personalization": "ft"}, ft={"steps": 0})
    simulate(cfg, workload, sites, out=tmp_path / "r1", progress=False, stop_after=1)
    # Execute
    simulate(cfg, workload, tiny_sites(), out=tmp_path / "r2", progress=False)
    # Assert
    g1 = _model(_server(tmp_path / "r1"), "global")
    s2 = _server(tmp_path / "r2")
    for s in sites:
        p = _model(s2, f"personal/{s}")
        assert p.keys() == g1.keys() and all(torch.equal(p[k], g1[k]) for k in p)
    assert any(not torch.equal(_model(s2, "global")[k], g1[k]) for k in g1)


def test_apfl_with_fixed_alpha_zero_personalized_models_are_the_new_global_model(tmp_path, sites, workload):
    """APFL's personalized model is α v + (1 − α) w_{r+1}; with α fixed at 0 it is the new
    global model exactly (``torch.lerp`` with weight 0)."""
    # Execute
    simulate(
        _cfg(fedsm={"personalization": "apfl"}, apfl={"alpha": 0.0, "learn_alpha": False}),
        workload,
        sites,
        out=tmp_path,
        progress=False,
    )
    # Assert
    state = _server(tmp_path)
    g = _model(state, "global")
    for s in sites:
        p = _model(state, f"personal/{s}")
        assert all(torch.equal(p[k], g[k]) for k in p)


def test_ditto_resume_equals_uninterrupted(tmp_path, sites, workload):
    """Ditto's persistent personal model and optimizer live at the site: a run stopped
    after round 1 and resumed ends bitwise where the uninterrupted run does."""
    # Prepare
    cfg = _cfg(fedsm={"personalization": "ditto"})
    full = simulate(cfg, workload, sites, out=tmp_path / "full", progress=False)
    assert simulate(cfg, workload, tiny_sites(), out=tmp_path / "part", progress=False, stop_after=1) is None
    # Execute
    resumed = simulate(cfg, workload, tiny_sites(), out=tmp_path / "part", progress=False, resume=True)
    # Assert
    assert_same_checkpoints(tmp_path / "full", tmp_path / "part")
    assert full["client_avg_dice"] == resumed["client_avg_dice"]


def test_fedsm_extra_trains_the_selector_on_the_methods_models(tmp_path, sites, workload):
    """fedsm-extra with FT: the model rounds make FT's personalized models, the selector
    round then freezes them (phases models, selector) and the K + 1-class selector is trained."""
    # Execute
    cfg = dataclasses.replace(
        tiny_config("fedsm-extra", rounds=2), params={"fedsm": {"personalization": "ft", "selector_rounds": 1}}
    )
    res = simulate(cfg, workload, sites, out=tmp_path, progress=False)
    # Assert
    assert [e["phase"] for e in res["history"]] == ["models", "selector"]
    assert "selector_loss" not in res["history"][0] and set(res["history"][1]["selector_loss"]) == set(sites)
    assert set(res["history"][0]["personal_loss"]) == set(sites)


# ------------------------------------------------------- the Personalization protocol
class _Transport:
    """Answers FedSM's 'train' tasks with canned replies, keeping what was sent."""

    def __init__(self, replies):
        self.replies, self.sent = replies, {}

    def ask(self, tasks, optional=False):
        self.sent = tasks
        return {s: self.replies[s] for s in tasks}


def _round(algo, extra=None):
    """One server round of ``algo`` over sites a (n = 1) and b (n = 3): they send global 0 and 4,
    personal 10 and 20, selector 8 and 4 (and ``extra[s]``); the state holds w_r = 1, personal 0."""
    sent = {"a": (0.0, 10.0, 8.0, 1), "b": (4.0, 20.0, 4.0, 3)}
    replies = {
        s: Reply(
            arrays={
                "global/w": torch.tensor([g]),
                f"personal/{s}/w": torch.tensor([p]),
                "selector/w": torch.tensor([sel]),
                **(extra or {}).get(s, {}),
            },
            metrics={"loss": 0.5, "personal_loss": 0.25},
            num_samples=n,
        )
        for s, (g, p, sel, n) in sent.items()
    }
    state = {"global/w": torch.tensor([1.0]), "selector/w": torch.tensor([0.0])}
    state.update({f"personal/{s}/w": torch.tensor([0.0]) for s in "ab"})
    tr = _Transport(replies)
    ctx = ServerContext(transport=tr, sites=("a", "b"), cfg=algo.cfg, init_arrays=None)
    new, metrics = algo.server_round(ctx, state, 1)
    return new, metrics, tr


@pytest.mark.parametrize("personalization", list(PERSONALIZATIONS))
def test_fedsm_takes_every_personalization_through_the_protocol(personalization):
    """Every ``fedsm.personalization`` is a :class:`Personalization` built with its own section's
    settings, and FedSM's server round hands the replies to its server step (no name dispatch).
    Sites a, b with n = (1, 3), global models 0 and 4, personalized 10 and 20, w_r = 1:

    * global: n_k/n mean 0.25·0 + 0.75·4 = 3; pFedMe with β = 0.5: (1 − β) w_r + β·3 = 2;
    * personalized: SoftPull (λ = 0.7, Eq. 11) 0.7·10 + 0.3·20 = 13 and 0.7·20 + 0.3·10 = 17;
      APFL (α = 0.25, 0.5) α v + (1 − α) w_{r+1}: 0.25·10 + 0.75·3 = 4.75 and 0.5·20 + 0.5·3 = 11.5;
      FT, Per-FedAvg, pFedMe, Ditto: as sent, 10 and 20.

    Only SoftPull's server holds the personalized models and sends each site its own."""
    # Prepare
    cfg = _cfg(fedsm={"personalization": personalization, "selector_training": "fedavg"}, pfedme={"beta": 0.5})
    algo = get_algorithm(cfg)
    extra = {"a": {"alpha": torch.tensor([0.25], dtype=torch.float64)}, "b": {"alpha": torch.tensor([0.5])}}
    # Execute
    new, metrics, tr = _round(algo, extra if personalization == "apfl" else None)
    # Assert
    assert isinstance(algo.personal, Personalization) and algo.personal.name == personalization
    expect = {
        "softpull": (3.0, 13.0, 17.0),
        "apfl": (3.0, 4.75, 11.5),
        "pfedme": (2.0, 10.0, 20.0),
    }.get(personalization, (3.0, 10.0, 20.0))
    got = (new["global/w"].item(), new["personal/a/w"].item(), new["personal/b/w"].item())
    assert got == pytest.approx(expect)
    assert ("personal/a/w" in tr.sent["a"].arrays) == (personalization == "softpull")
    assert "personal/b/w" not in tr.sent["a"].arrays
    assert metrics["personal_loss"] == {"a": 0.25, "b": 0.25}
    assert algo.label() == ("FedSM" if personalization == "softpull" else f"FedSM ({algo.personal.title})")


def test_the_choices_of_fedsm_personalization_are_the_mapping_of_implementations():
    """The ``Literal`` the config loader checks lists exactly the implementations FedSM can build."""
    assert typing.get_args(typing.get_type_hints(FedSMParams)["personalization"]) == tuple(PERSONALIZATIONS)


def test_fedsm_takes_a_personalization_outside_the_mapping():
    """Any object with a site step and a server step serves FedSM: here one whose server step stores
    twice the global mean as every personalized model (3 → 6)."""

    class Doubled(PersonalizationBase):
        name = "doubled"
        title = "Doubled"

        def personal_model(self, own, new_global, reply):
            return {k: 2 * v for k, v in new_global.items()}

    # Prepare
    algo = get_algorithm(_cfg(fedsm={"selector_training": "fedavg"}))
    algo.personal = Doubled(None)
    # Execute
    new, _, _ = _round(algo)
    # Assert
    assert isinstance(algo.personal, Personalization)
    assert new["global/w"].item() == pytest.approx(3.0)
    assert new["personal/a/w"].item() == pytest.approx(6.0) and new["personal/b/w"].item() == pytest.approx(6.0)
    assert algo.label() == "FedSM (Doubled)"
