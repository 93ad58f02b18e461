"""FedAvg's step-normalized average (``fedavg.normalize = "steps"``, FedNova) and its defaults."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fedseg.algorithms import get_algorithm
from fedseg.foundation.arrays import is_float
from fedseg.foundation.config import TrainConfig
from fedseg.foundation.errors import ConfigError
from fedseg.foundation.messages import Reply
from fedseg.simulation.inprocess import InProcessTransport
from fedseg.simulation.runner import simulate
from tests.support.helpers import same_arrays, server_state, tiny_config, tiny_sites

QUIET = {"progress": False, "log": lambda m: None}


def _spy(monkeypatch, edit=None):
    """Record every train task's arrays and the replies to it; ``edit(name, reply)`` may change a reply."""
    seen: list[tuple[dict, dict]] = []
    real = InProcessTransport.ask

    def ask(self, tasks, optional=False):
        replies = real(self, tasks, optional)
        if all(t.kind == "train" for t in tasks.values()):
            if edit is not None:
                replies = {s: edit(s, r) for s, r in replies.items()}
            seen.append(({s: dict(t.arrays) for s, t in tasks.items()}, dict(replies)))
        return replies

    monkeypatch.setattr(InProcessTransport, "ask", ask)
    return seen


def test_defaults_are_sample_weights_and_the_step_normalized_average():
    """``fedavg`` runs with p_k = n_k / n and ``normalize = "steps"``; ``fedavg-even`` keeps the plain average
    with p_k = 1/K."""
    p = get_algorithm(tiny_config("fedavg")).params
    assert (p.weighting, p.normalize) == ("samples", "steps")
    even = get_algorithm(tiny_config("fedavg-even")).params
    assert (even.weighting, even.normalize) == ("even", "none")


def test_step_normalized_average_with_even_weights_by_hand(monkeypatch, workload, tmp_path):
    """Sites of 6, 8 and 10 cases at batch 4 and one epoch take τ = 2, 2 and 3 steps; with p_k = 1/3,
    τ̄ = Σ p_k τ_k = 7/3 and w_1 = w_0 + τ̄ Σ_k p_k (w^(k) − w_0) / τ_k, computed here in float64 from the sites'
    replies; the plain average would be w_0 + Σ_k p_k (w^(k) − w_0)."""
    seen = _spy(monkeypatch)
    cfg = dataclasses.replace(tiny_config("fedavg", rounds=1), params={"fedavg": {"weighting": "even"}})
    simulate(cfg, workload, tiny_sites(3), out=tmp_path / "r", **QUIET)
    ((tasks, replies),) = seen
    start = next(iter(tasks.values()))
    taus = {"site1": 2, "site2": 2, "site3": 3}
    assert {s: r.metrics["steps"] for s, r in replies.items()} == taus
    got = server_state(tmp_path / "r")
    moved_differently = False
    for k, w0 in start.items():
        if not is_float(w0):
            continue
        w0 = w0.double()
        want = w0 + 7 / 3 * sum((replies[s].arrays[k].double() - w0) / t / 3 for s, t in taus.items())
        plain = w0 + sum((replies[s].arrays[k].double() - w0) / 3 for s in taus)
        torch.testing.assert_close(got[k].double(), want, rtol=1e-5, atol=1e-7)
        moved_differently |= not torch.allclose(want, plain, rtol=1e-5, atol=1e-7)
    assert moved_differently  # the normalization changed the average


def test_default_sample_weighted_step_normalized_average_by_hand(monkeypatch, workload, tmp_path):
    """FedAvg's default, FedNova's standard form: sites of 6, 8 and 10 cases (n = 24) take τ = 2, 2 and 3 steps at batch 4 and one
    epoch; with p_k = n_k / n = 1/4, 1/3 and 5/12, τ_eff = Σ p_k τ_k = 1/2 + 2/3 + 5/4 = 29/12 and
    w_1 = w_0 + τ_eff Σ_k p_k (w^(k) − w_0) / τ_k, computed here in float64 from the sites' replies (not τ̄ of
    even weights, 7/3, and not the plain average w_0 + Σ_k p_k (w^(k) − w_0))."""
    seen = _spy(monkeypatch)
    simulate(tiny_config("fedavg", rounds=1), workload, tiny_sites(3), out=tmp_path / "r", **QUIET)
    ((tasks, replies),) = seen
    start = next(iter(tasks.values()))
    taus = {"site1": 2, "site2": 2, "site3": 3}
    p = {"site1": 1 / 4, "site2": 1 / 3, "site3": 5 / 12}
    assert {s: r.metrics["steps"] for s, r in replies.items()} == taus
    assert {s: r.num_samples for s, r in replies.items()} == {"site1": 6, "site2": 8, "site3": 10}
    got = server_state(tmp_path / "r")
    unlike = {"even": False, "plain": False}
    for k, w0 in start.items():
        if not is_float(w0):
            continue
        w0 = w0.double()
        step = {s: (replies[s].arrays[k].double() - w0) / t for s, t in taus.items()}
        want = w0 + 29 / 12 * sum(p[s] * step[s] for s in taus)
        even_scale = w0 + 7 / 3 * sum(p[s] * step[s] for s in taus)
        plain = w0 + sum(p[s] * (replies[s].arrays[k].double() - w0) for s in taus)
        torch.testing.assert_close(got[k].double(), want, rtol=1e-5, atol=1e-7)
        unlike["even"] |= not torch.allclose(want, even_scale, rtol=1e-5, atol=1e-7)
        unlike["plain"] |= not torch.allclose(want, plain, rtol=1e-5, atol=1e-7)
    assert unlike == {"even": True, "plain": True}  # the scale is τ_eff, and the normalization changed the average


def test_equal_steps_keep_the_plain_average_bitwise(workload, tmp_path):
    """With every site taking the same τ steps, τ̄ / τ_k = 1: the normalized average is the plain one, bit for
    bit (local steps instead of epochs)."""
    train = TrainConfig(batch_size=4, local_epochs=None, local_steps=2)
    runs = {}
    for normalize in ("steps", "none"):
        cfg = dataclasses.replace(
            tiny_config("fedavg", rounds=2), train=train, params={"fedavg": {"normalize": normalize}}
        )
        simulate(cfg, workload, tiny_sites(3), out=tmp_path / normalize, **QUIET)
        runs[normalize] = server_state(tmp_path / normalize)
    assert same_arrays(runs["steps"], runs["none"])


def test_a_site_that_reports_other_steps_does_not_scale_the_global_step(monkeypatch, workload, tmp_path):
    """The server counts each site's steps from the run's settings and the site's case count: a site that
    reports 1,000 steps (as if its update were a tiny part of its work) leaves the global model bitwise as it is."""

    def lie(name: str, reply: Reply) -> Reply:
        if name != "site1":
            return reply
        return Reply(reply.arrays, {**reply.metrics, "steps": 1000}, reply.num_samples)

    simulate(tiny_config("fedavg", rounds=1), workload, tiny_sites(3), out=tmp_path / "honest", **QUIET)
    seen = _spy(monkeypatch, lie)
    simulate(tiny_config("fedavg", rounds=1), workload, tiny_sites(3), out=tmp_path / "lied", **QUIET)
    assert seen[0][1]["site1"].metrics["steps"] == 1000
    assert same_arrays(server_state(tmp_path / "honest"), server_state(tmp_path / "lied"))


def test_an_unknown_normalization_is_refused_naming_the_setting():
    cfg = dataclasses.replace(tiny_config("fedavg"), params={"fedavg": {"normalize": "tau"}})
    with pytest.raises(ConfigError, match="fedavg.normalize"):
        get_algorithm(cfg)


def test_client_level_dp_with_even_weights_scales_the_clipped_updates_by_the_steps(workload, tmp_path):
    """``privacy.dp = "client"`` under secure aggregation with the step-normalized average and even weights
    (client-level DP refuses p_k = n_k / n, the default: its sensitivity holds for the plain mean): each site clips its update to
    C, adds its noise share (σ = 10⁻⁶: negligible) and divides by its τ_k; the server adds τ̄ times the mean.
    Sites of 6, 8 and 10 cases take τ = 2, 2, 3, so the global step has norm ≤ τ̄ · (1/K) Σ_k C / τ_k
    = 7/3 · (1/2 + 1/2 + 1/3) / 3 · C = 28/27 C, where the plain mean of clipped updates is bounded by C."""
    from fedseg.foundation.arrays import strip_prefix
    from fedseg.foundation.config import PrivacyConfig
    from fedseg.foundation.seeding import derive_seed

    clip = 1e-3
    cfg = dataclasses.replace(
        tiny_config("fedavg", rounds=1),
        params={"fedavg": {"weighting": "even"}},
        privacy=PrivacyConfig(dp="client", noise_multiplier=1e-6, clip=clip, secure_aggregation=True),
    )
    simulate(cfg, workload, tiny_sites(3), out=tmp_path / "run", **QUIET)
    with torch.random.fork_rng(devices=[]):  # the engine's seeded initial weights (Engine.init_arrays)
        torch.manual_seed(derive_seed(cfg.seed, "init", "global"))
        w0 = workload.build_model().state_dict()
    w1 = strip_prefix("global", server_state(tmp_path / "run"))
    moved = sum(float((w1[k].double() - w0[k].double()).pow(2).sum()) for k in w0 if w0[k].is_floating_point())
    assert 0 < moved**0.5 <= 28 / 27 * clip * (1 + 1e-3)
