"""Differential privacy: DP-SGD's per-sample clipping, its noise and Poisson sampling from the site's CSPRNG,
the accountant against Opacus' own, and DP-SGD in runs (ε recorded, budgets, refusals).  Attacks by the server
on the noise, the ledger and the budget: tests/deploy/test_dp_attacks.py."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch import nn

from fedseg.foundation.config import PrivacyConfig, RunConfig, SimulationConfig, load_run_config
from fedseg.foundation.errors import ConfigError, PayloadError
from fedseg.privacy import accountant
from fedseg.privacy.dp import clip_per_sample, per_sample_gradients, privatized_gradient, refuse_batch_norm
from fedseg.privacy.randomness import Randomness
from fedseg.simulation.runner import simulate
from fedseg.site.workload import segmentation_workload
from tests.support.helpers import (
    TINY_MODEL,
    assert_same_checkpoints,
    server_state,
    strip_times,
    tiny_config,
    tiny_sites,
)


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out - y).pow(2).mean()


def _dp_config(method: str = "fedavg", rounds: int = 2, **privacy) -> RunConfig:
    cfg = tiny_config(method, rounds=rounds)
    settings = {"dp": "sample", "noise_multiplier": 1.0, **privacy}
    cfg = dataclasses.replace(cfg, privacy=PrivacyConfig(**settings))
    cfg.validate()
    return cfg


@pytest.fixture
def wl():
    return segmentation_workload(2, 1, ["fg"], TINY_MODEL)


# ------------------------------------------------------------------ the mechanism
def test_per_sample_gradients_equal_one_backward_per_sample():
    """torch.func's per-sample gradients equal a plain backward pass of each sample alone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2))
    x, y = torch.randn(4, 5), torch.randn(4, 2)
    grads, losses = per_sample_gradients(model, _mse, x, y)
    for i in range(4):
        model.zero_grad()
        loss = _mse(model(x[i : i + 1]), y[i : i + 1])
        loss.backward()
        assert torch.allclose(losses[i], loss.detach())
        for name, p in model.named_parameters():
            assert torch.allclose(grads[name][i], p.grad, atol=1e-6), name


def test_clipping_bounds_each_samples_contribution():
    """One sample with a gradient 10⁶ times the others' adds exactly C · g/||g|| to the sum (norm C), the
    others (norm < C) pass unscaled: changing that one sample moves the clipped sum by at most 2C — the
    sensitivity the Gaussian noise N(0, σ²C²) is scaled to (Abadi et al. 2016, Alg. 1)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x = torch.randn(4, 3) * 0.01
    y = torch.zeros(4, 1)
    x[0] = torch.tensor([1e6, -1e6, 1e6])
    clip = 1.0
    grads, _ = per_sample_gradients(model, _mse, x, y)
    summed, norms = clip_per_sample(grads, clip)
    assert norms[0] > 1e9 and bool((norms[1:] < clip).all())
    rest = {k: g[1:].sum(0) for k, g in grads.items()}
    first = {k: g[0] for k, g in grads.items()}
    contribution = {k: summed[k] - rest[k] for k in summed}
    c_norm = math.sqrt(sum(float(v.double().pow(2).sum()) for v in contribution.values()))
    assert c_norm == pytest.approx(clip, rel=1e-5)
    for k in first:  # same direction as the huge gradient
        assert torch.allclose(contribution[k], first[k] * (clip / norms[0]).float(), rtol=1e-4, atol=1e-5)
    # replacing the outlier by any other sample changes the sum by at most 2C
    x2 = x.clone()
    x2[0] = -x[0]
    summed2, _ = clip_per_sample(per_sample_gradients(model, _mse, x2, y)[0], clip)
    diff = math.sqrt(sum(float((summed[k] - summed2[k]).double().pow(2).sum()) for k in summed))
    assert diff <= 2 * clip + 1e-5


def test_noise_is_fresh_unless_seeded():
    """``dp_randomness = "os"``: the same run seed, site and draw position give other noise every time (a fresh
    OS key per draw); ``"seeded"``: bitwise the same noise for the same (seed, site, position), other noise for
    another seed."""
    torch.manual_seed(0)
    model = nn.Linear(6, 2)
    x, y = torch.randn(5, 6), torch.randn(5, 2)

    def grad(mode: str, seed: int) -> dict[str, torch.Tensor]:
        rand = Randomness(mode, seed, 0)
        return privatized_gradient(model, _mse, x, y, 1.0, 1.0, lambda n, s: rand.normal(n, s, "noise", 0))[0]

    a, b, c = grad("seeded", 1), grad("seeded", 1), grad("seeded", 2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not any(torch.equal(a[k], c[k]) for k in a)
    d, e = grad("os", 1), grad("os", 1)
    assert not any(torch.equal(d[k], e[k]) for k in d)


def test_csprng_gaussian_and_uniform_distributions():
    """The ChaCha20 → Box–Muller → sum-of-4 Gaussian is N(0, s²): for N = 200 000 draws the sample standard
    deviation is within 5 standard errors (5 · s/√(2N)) of s, the mean within 5 s/√N, and a Kolmogorov–Smirnov
    test against N(0, s²) does not reject at p = 10⁻⁶; the uniforms lie in the open interval (0, 1)."""
    from scipy import stats

    n, s = 200_000, 2.5
    z = Randomness("os", 0, 0).normal(n, s).numpy()
    assert z.dtype.name == "float64" and z.shape == (n,)
    assert abs(z.std() - s) < 5 * s / math.sqrt(2 * n)
    assert abs(z.mean()) < 5 * s / math.sqrt(n)
    assert stats.kstest(z / s, "norm").pvalue > 1e-6
    u = Randomness("os", 0, 0).uniform(n)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0


def test_poisson_sampling_includes_each_case_with_probability_q():
    """Poisson sampling at q: over T = 2 000 batches of n = 10 cases each case's inclusion count is Binomial(T, q);
    every case's frequency lies within 5 standard errors √(q(1−q)/T) of q, and batch sizes vary (not fixed-size
    batches)."""
    rand, n, q, t = Randomness("os", 0, 0), 10, 0.3, 2000
    counts = torch.zeros(n)
    sizes = set()
    for _ in range(t):
        idx = rand.poisson(n, q)
        counts[idx] += 1
        sizes.add(int(idx.numel()))
    se = math.sqrt(q * (1 - q) / t)
    assert bool(((counts / t - q).abs() < 5 * se).all())
    assert len(sizes) > 3


def test_noise_scale_is_sigma_clip_over_batch():
    """With zero per-sample gradients the privatized gradient is pure noise N(0, (σC/B)²) per element (B the
    expected batch size when given: an empty Poisson batch gives the noise over B too).  The
    sample standard deviation s of N = 60 000 such elements has a relative standard error 1/√(2N) ≈ 0.29 %;
    the test allows 5 standard errors (1.4 %), and a mean within 5 σ_mean = 5 (σC/B)/√N."""
    model = nn.Linear(300, 200)  # 60 200 parameters
    b, sigma, clip = 4, 1.5, 0.7
    x, y = torch.randn(b, 300), torch.randn(b, 200)

    def nothing(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return 0.0 * out.sum()

    g, _ = privatized_gradient(model, nothing, x, y, clip, sigma, Randomness("os", 0, 0).normal)
    flat = torch.cat([v.flatten() for v in g.values()]).double()
    n, expected = flat.numel(), sigma * clip / b
    assert flat.std().item() == pytest.approx(expected, rel=5 / math.sqrt(2 * n))
    assert abs(flat.mean().item()) < 5 * expected / math.sqrt(n)
    empty, value = privatized_gradient(
        model, nothing, x[:0], y[:0], clip, sigma, Randomness("os", 0, 0).normal, batch_size=b
    )
    flat = torch.cat([v.flatten() for v in empty.values()]).double()
    assert float(value) == 0.0 and flat.std().item() == pytest.approx(expected, rel=5 / math.sqrt(2 * n))


def test_batch_norm_refused():
    """DP-SGD with batch norm: one error naming model.norm = "instance", from the config and from a model."""
    with pytest.raises(ConfigError, match='model.norm = "instance"'):
        dataclasses.replace(_dp_config(), model=dataclasses.replace(TINY_MODEL, norm="batch")).validate()
    with pytest.raises(ConfigError, match='model.norm = "instance"'):
        refuse_batch_norm(nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)))


def test_settings_refused_with_the_fix(tmp_path):
    fed = tmp_path / "fed.toml"
    fed.write_text('[[sites]]\nname = "a"\ndatalist = "a.json"\n')
    with pytest.raises(ConfigError, match="privacy.epsilon"):
        load_run_config(fed, ["privacy.dp=sample"])
    with pytest.raises(ConfigError, match="simulation.vectorize=off"):
        dataclasses.replace(_dp_config(), simulation=SimulationConfig(vectorize="on")).validate()
    with pytest.raises(ConfigError, match="privacy.delta"):
        load_run_config(fed, ["privacy.dp=sample", "privacy.epsilon=8", "privacy.delta=2"])
    with pytest.raises(ConfigError, match="privacy.secure_aggregation = true"):
        load_run_config(fed, ["privacy.dp=client", "privacy.epsilon=8"])
    with pytest.raises(ConfigError, match="dp_randomness"):
        load_run_config(fed, ["privacy.dp=sample", "privacy.epsilon=8", "privacy.dp_randomness=seed"])
    cfg = load_run_config(fed, ["privacy.dp=sample", "privacy.epsilon=8", "privacy.delta=1e-5"])
    assert cfg.privacy.epsilon == 8.0 and cfg.privacy.noise_multiplier is None


def test_methods_outside_the_privatized_steps_refuse(wl):
    from fedseg.algorithms import get_algorithm

    with pytest.raises(ConfigError, match="privacy.dp = 'sample' is not available for apfl"):
        get_algorithm(_dp_config("apfl"))
    cfg = _dp_config("fedsm")
    with pytest.raises(ConfigError, match="fedsm.selector_training=fga"):
        get_algorithm(dataclasses.replace(cfg, params={"fedsm": {"selector_training": "fedavg"}}))


# -------------------------------------------------------------------- accountant
def test_derived_noise_multiplier_is_opacus_own():
    """σ from a target ε is ``opacus.accountants.utils.get_noise_multiplier``'s, and its ε is within Opacus'
    tolerance (0.01) below the target."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.utils import get_noise_multiplier

    sigma = accountant.noise_multiplier(4.0, 1e-5, 0.05, 200)
    assert sigma == get_noise_multiplier(target_epsilon=4.0, target_delta=1e-5, sample_rate=0.05, steps=200)
    acc = RDPAccountant()
    for _ in range(200):
        acc.step(noise_multiplier=sigma, sample_rate=0.05)
    assert 4.0 - 0.01 <= acc.get_epsilon(1e-5) <= 4.0


def test_fedavg_run_records_epsilon_equal_to_opacus(wl, tmp_path):
    """A 2-round FedAvg run with DP-SGD completes and records ε per site per round (history) and for the
    run (results["privacy"]); each equals Opacus' RDP accountant stepped independently here with the
    site's σ, q = B / n_k and its privatized steps."""
    from opacus.accountants import RDPAccountant

    sites = tiny_sites(2)
    cfg = _dp_config(rounds=2, epsilon=None, noise_multiplier=1.3)
    res = simulate(cfg, wl, sites, out=tmp_path / "run", progress=False, log=lambda m: None)
    priv = res["privacy"]
    assert priv["dp"] == "sample" and priv["stopped_after_round"] is None
    assert [sorted(h["epsilon"]) for h in res["history"]] == [["site1", "site2"]] * 2
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["privacy"]["sites"] == priv["sites"]
    assert "ε per site: site1" in (tmp_path / "run" / "results.md").read_text()
    for name, data in sites.items():
        n = len(data.train)
        per_round = math.ceil(n / cfg.train.batch_size)
        rec = priv["sites"][name]
        assert rec["steps"] == 2 * per_round and rec["sample_rate"] == cfg.train.batch_size / n
        acc = RDPAccountant()
        for r in range(2):
            for _ in range(per_round):
                acc.step(noise_multiplier=1.3, sample_rate=cfg.train.batch_size / n)
            assert res["history"][r]["epsilon"][name] == pytest.approx(acc.get_epsilon(cfg.privacy.delta), rel=1e-12)
        assert rec["epsilon"] == pytest.approx(acc.get_epsilon(cfg.privacy.delta), rel=1e-12)


def test_seeded_mode_same_weights_and_resume_bitwise(wl, tmp_path):
    """``privacy.dp_randomness = "seeded"`` (the test mode): the same seed gives bitwise the same checkpoint, a
    resumed run equals an uninterrupted one (the draw count that keys the noise is saved with the sites, the
    privacy ledger continues from its file), the results record ε against the server as ∞, and a run without
    DP gives other weights."""
    sites = tiny_sites(2)
    cfg = _dp_config(rounds=2, dp_randomness="seeded")
    quiet = {"progress": False, "log": lambda m: None}
    a = simulate(cfg, wl, sites, out=tmp_path / "a", **quiet)
    simulate(cfg, wl, sites, out=tmp_path / "b", stop_after=1, **quiet)
    b = simulate(cfg, wl, sites, out=tmp_path / "b", resume=True, **quiet)
    assert_same_checkpoints(tmp_path / "a", tmp_path / "b")
    assert strip_times(a["privacy"]) == strip_times(b["privacy"])
    assert a["privacy"]["dp_randomness"] == "seeded" and a["privacy"]["epsilon_against_server"] == "inf"
    assert a["privacy"]["sites"]["site1"]["steps"] == 4  # both rounds' bookings, the first read back on resume
    no_dp = simulate(dataclasses.replace(cfg, privacy=PrivacyConfig()), wl, sites, out=tmp_path / "c", **quiet)
    assert "privacy" not in no_dp
    other = server_state(tmp_path / "c")
    assert any(not torch.equal(v, other[k]) for k, v in server_state(tmp_path / "a").items())


def test_budget_exhausted_stops_cleanly_with_checkpoint(wl, tmp_path):
    """With σ = 1 and a budget that one round fits but two do not, the run stops before round 2 with the
    round-1 checkpoint saved, tests its models, and says which setting to raise; a budget that not even
    one round fits is refused before training.  With ``budget_action = "warn"`` the server trains on, and
    each site refuses the first step past its budget itself (naming privacy.epsilon)."""
    sites = tiny_sites(2)
    lines: list[str] = []
    one_round = accountant.epsilon([(1.0, 4 / 6, 2)], 1e-5)
    two_rounds = accountant.epsilon([(1.0, 4 / 6, 4)], 1e-5)
    budget = (one_round + two_rounds) / 2
    cfg = _dp_config(rounds=3, epsilon=budget)
    res = simulate(cfg, wl, sites, out=tmp_path / "run", progress=False, log=lines.append)
    assert res["privacy"]["stopped_after_round"] == 1
    assert all(v["epsilon"] <= budget for v in res["privacy"]["sites"].values())
    progress = json.loads((tmp_path / "run" / "checkpoints" / "progress.json").read_text())
    assert progress["round"] == 1 and len(res["history"]) == 1
    assert res["client_avg_dice"] is not None
    assert any("privacy.epsilon" in line and "stops after round 1" in line for line in lines)
    with pytest.raises(PayloadError, match="privacy.epsilon"):
        simulate(
            dataclasses.replace(cfg, rounds=2, privacy=dataclasses.replace(cfg.privacy, budget_action="warn")),
            wl,
            sites,
            progress=False,
            log=lines.append,
        )
    with pytest.raises(ConfigError, match="not even one round fits"):
        simulate(
            dataclasses.replace(cfg, privacy=dataclasses.replace(cfg.privacy, epsilon=one_round / 2)),
            wl,
            sites,
            progress=False,
            log=lines.append,
        )


def test_fedprox_fga_and_fedsm_run_with_dp_sample(wl):
    """FedProx (its proximal term added after the noise), FGA (privatized exchanged gradients) and FedSM
    (global, personalized models and selector, on the same batches) train with DP-SGD and count every
    privatized step; FedSM's steps fall on the round's batches only (three models on each)."""
    sites = tiny_sites(2)
    for method in ("fedprox", "fga", "fedsm"):
        cfg = _dp_config(method, rounds=1, budget_action="warn")
        res = simulate(cfg, wl, sites, progress=False, log=lambda m: None)
        steps = {s: v["steps"] for s, v in res["privacy"]["sites"].items()}
        per_round = {s: math.ceil(len(d.train) / cfg.train.batch_size) for s, d in sites.items()}
        if method == "fedprox":
            assert steps == per_round
        elif method == "fga":  # lockstep: every site takes the largest site's steps
            assert set(steps.values()) == {max(per_round.values())}
        else:  # global + personalized models, then the selector's lockstep steps, on the same batches
            assert steps == {s: 2 * per_round[s] + max(per_round.values()) for s in sites}
            batches = {s: v["batches"] for s, v in res["privacy"]["sites"].items()}
            assert batches == {s: max(per_round.values()) for s in sites}


# ------------------------------------------------------------------ client level
def test_client_level_dp_clips_each_update_and_accounts_per_round(wl, tmp_path):
    """``privacy.dp = "client"`` with FedAvg-even under secure aggregation: each site sends w + clip(w_k − w, C)
    + its noise share N(0, σ²C²/K) masked, so with negligible noise (σ = 10⁻⁶) the mean update has norm ≤ C;
    ε per site is Opacus' for q = 1 and one update per round at σ (every site survived: σ√(K/K))."""
    from opacus.accountants import RDPAccountant

    from fedseg.foundation.arrays import strip_prefix

    sites = tiny_sites(3)
    clip = 1e-3
    cfg = dataclasses.replace(
        tiny_config("fedavg-even", rounds=1),
        privacy=PrivacyConfig(dp="client", noise_multiplier=1e-6, clip=clip, secure_aggregation=True),
    )
    res = simulate(cfg, wl, sites, out=tmp_path / "run", progress=False, log=lambda m: None)
    from fedseg.algorithms import get_algorithm
    from fedseg.foundation.seeding import derive_seed

    with torch.random.fork_rng(devices=[]):  # the engine's seeded initial weights (Engine.init_arrays)
        torch.manual_seed(derive_seed(cfg.seed, "init", "global"))
        w0 = wl.build_model().state_dict()
    w1 = strip_prefix("global", server_state(tmp_path / "run"))
    moved = math.sqrt(
        sum(float((w1[k].double() - w0[k].double()).pow(2).sum()) for k in w0 if w0[k].is_floating_point())
    )
    assert 0 < moved <= clip * (1 + 1e-3)
    acc = RDPAccountant()
    acc.step(noise_multiplier=1e-6, sample_rate=1.0)
    assert res["privacy"]["sites"]["site1"]["epsilon"] == pytest.approx(acc.get_epsilon(1e-5))
    with pytest.raises(ConfigError, match="fedavg.weighting = 'even'"):  # the papers' weights n_k / n
        get_algorithm(dataclasses.replace(cfg, method="fedavg", params={"fedavg": {"weighting": "samples"}}))


def test_lockstep_overshoot_stops_cleanly_before_a_site_refuses(wl):
    """FGA with sites of 6, 8 and 10 cases (2, 2 and 3 batches a round): lockstep takes 3 steps a round at every
    site, more than the smaller sites planned their σ for.  Each site's forecast repeats what it booked in the
    last round, so the server stops before the round a site would refuse (its own budget), every site ends
    within privacy.epsilon and no site refuses a step."""
    cfg = _dp_config("fga", rounds=4, epsilon=8.0, noise_multiplier=None)
    lines: list[str] = []
    res = simulate(cfg, wl, tiny_sites(3), progress=False, log=lines.append)
    assert res["privacy"]["stopped_after_round"] == 2
    assert all(v["epsilon"] <= 8.0 for v in res["privacy"]["sites"].values())
    assert all(v["steps"] == 6 for v in res["privacy"]["sites"].values())
