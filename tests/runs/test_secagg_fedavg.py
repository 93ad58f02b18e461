"""Secure aggregation in runs: FedAvg, FedProx, FWA and SCAFFOLD average securely, FGA each lockstep step's
gradients; methods that need one site's arrays at the server refuse the setting."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fedseg.site.secure as site_secure
from fedseg.algorithms import get_algorithm
from fedseg.algorithms import secure as server_secure
from fedseg.deployment.params import deploy_params
from fedseg.foundation.arrays import strip_prefix, weighted_mean
from fedseg.foundation.config import PrivacyConfig
from fedseg.foundation.errors import ConfigError
from fedseg.privacy import secagg
from fedseg.simulation.inprocess import InProcessTransport
from fedseg.simulation.runner import simulate
from tests.support.helpers import tiny_config, tiny_sites

pytest.importorskip("cryptography")
pytest.importorskip("Crypto")


def _secure(cfg, **privacy):
    return dataclasses.replace(cfg, privacy=PrivacyConfig(secure_aggregation=True, **privacy))


def _spy(monkeypatch):
    """Record each site's plain reply just before it is masked, every reply that reaches the server, and
    each secure sum the server computes."""
    plain, arrived, sums = {}, [], []
    real_mask, real_ask, real_secure_ask = site_secure.mask_reply, InProcessTransport.ask, server_secure.secure_ask

    def mask_reply(site, task, reply):
        plain[site.name] = (dict(reply.arrays), reply.num_samples)
        return real_mask(site, task, reply)

    def ask(self, tasks, optional=False):
        replies = real_ask(self, tasks, optional)
        arrived.extend(replies.values())
        return replies

    def secure_ask(ctx, tasks, weighting):
        plain.clear()
        result = real_secure_ask(ctx, tasks, weighting)
        sums.append((dict(plain), result.mean(), weighting))
        return result

    monkeypatch.setattr(site_secure, "mask_reply", mask_reply)
    monkeypatch.setattr(InProcessTransport, "ask", ask)
    for module in ("fedavg", "scaffold", "lockstep"):
        monkeypatch.setattr(f"fedseg.algorithms.{module}.secure_ask", secure_ask)
    return arrived, sums


@pytest.mark.parametrize("method", ["fedavg", "fedavg-even", "scaffold", "fga"])
def test_secure_average_equals_plain_average_within_bound(monkeypatch, workload, method):
    """Each round the securely summed mean is the plain weighted mean of the same replies to within the stated
    bound: |Σ n_k w_k / Σ n_k − fixed-point version| ≤ K·2^-(f+1)/Σ n_k, plus one float32 rounding of each (both
    are cast to float32 on their own).  The server never receives a float array from a site."""
    sites = tiny_sites(3)
    arrived, sums = _spy(monkeypatch)
    simulate(_secure(tiny_config(method, rounds=2)), workload, sites, progress=False, log=lambda m: None)
    assert len(sums) == 2 if method != "fga" else len(sums) > 2  # FGA: one sum per lockstep step
    for plain, mean, weighting in sums:
        names = sorted(plain)
        assert names == sorted(sites)
        weights = [plain[s][1] if weighting == "samples" else 1 for s in names]
        want = weighted_mean([plain[s][0] for s in names], weights)
        bound = secagg.quantization_bound(len(names), 32) / sum(weights)
        assert sorted(want) == sorted(mean)
        for k, v in want.items():
            err = (mean[k].double() - v.double()).abs()
            ulp = torch.finfo(v.dtype).eps * v.double().abs()
            assert bool((err <= bound + ulp).all()), (k, float(err.max()))
    for reply in arrived:  # what reached the server: masked integers only (FGA: and the synchronized weights,
        # which every site holds alike and which follow from the public averages, at the end of a round)
        plain_ok = method == "fga" and set(reply.arrays) == {k for k in reply.arrays if k.startswith("global/")}
        assert plain_ok or all(k.startswith("secagg/") and v.dtype == torch.int64 for k, v in reply.arrays.items())


@pytest.mark.parametrize("papers", [True, False])
def test_fedavg_secure_run_matches_plain_run(workload, tmp_path, papers):
    """Two rounds of FedAvg with secure aggregation end within rounding of the plain run (the per-round error
    ≤ 3·2^-33/Σn ≈ 2e-12 propagated through one more round of training), with the same results table;
    with it off (the default) the run is bitwise the plain run.  ``papers``: the papers' FedAvg
    (``weighting = "samples"``, ``normalize = "none"``).

    With the defaults (p_k = n_k / n, ``normalize = "steps"``; sites of 6, 8 and 10 cases take 2, 2 and 3 steps)
    the sites send their update per step and the server adds τ_eff = Σ p_k τ_k times its mean, where the plain run rescales
    each site's model: the two differ by float32 rounding of the weights (about 1e-8).  A convolution's bias
    that an instance norm follows has a zero gradient in exact arithmetic, so Adam turns such a difference into
    steps of up to lr; those biases do not change the output, so they are left out of the comparison of
    weights, not of the Dice."""
    sites = tiny_sites(3)
    quiet = {"progress": False, "log": lambda m: None}
    section = {"weighting": "samples", "normalize": "none"} if papers else {}
    cfg = dataclasses.replace(tiny_config("fedavg", rounds=2), params={"fedavg": section})
    plain = simulate(cfg, workload, sites, out=tmp_path / "p", **quiet)
    secure = simulate(_secure(cfg), workload, sites, out=tmp_path / "s", **quiet)
    from tests.support.helpers import server_state

    a, b = server_state(tmp_path / "p"), server_state(tmp_path / "s")
    assert sorted(a) == sorted(b)
    for k in a:
        if not papers and k.endswith(".conv.bias"):
            continue
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)
    assert plain["client_avg_dice"] == pytest.approx(secure["client_avg_dice"], abs=1e-4)


@pytest.mark.parametrize(
    ("method", "params", "why"),
    [
        ("autofedavg", {}, "β step"),
        ("cwt", {}, "next site"),
        ("fedsm-extra", {}, "selector phase"),
        ("ditto", {}, "on its own"),
        ("fedavg", {"fedavg": {"aggregation": "median"}}, "fedavg.aggregation = 'median'"),
        ("fedprox", {"fedprox": {"aggregation": "trimmed_mean"}}, "fedprox.aggregation = 'trimmed_mean'"),
    ],
)
def test_methods_needing_one_sites_arrays_refuse(method, params, why):
    cfg = _secure(dataclasses.replace(tiny_config(method), params=params))
    with pytest.raises(ConfigError, match="cannot run with privacy.secure_aggregation = true") as e:
        get_algorithm(cfg)
    assert why in str(e.value)
    get_algorithm(dataclasses.replace(cfg, privacy=PrivacyConfig()))  # fine without it


def test_summing_methods_accept_and_deploy_needs_update_rule_off():
    for method in ("fedavg", "fedavg-even", "fedprox", "fwa", "scaffold", "fga"):
        get_algorithm(_secure(tiny_config(method)))
    cfg = _secure(tiny_config("fedavg"))
    with pytest.raises(ConfigError, match="deploy.max_update_ratio=0"):
        deploy_params(cfg)
    deploy_params(dataclasses.replace(cfg, params={"deploy": {"max_update_ratio": 0}}))


def test_fraction_bits_validated():
    with pytest.raises(ConfigError, match="secagg_fraction_bits"):
        _secure(tiny_config("fedavg"), secagg_fraction_bits=60).validate()


def test_sites_send_their_plain_arrays_only_masked(workload, monkeypatch):
    """The masked input of one site differs from its encoding everywhere but by chance, and summing the
    masked inputs without the server's unmasking gives noise, not the sum."""
    arrived, sums = _spy(monkeypatch)
    simulate(_secure(tiny_config("fedavg", rounds=1)), workload, tiny_sites(3), progress=False, log=lambda m: None)
    masked = [r for r in arrived if r.arrays]
    assert len(masked) == 3
    (plain, mean, _), name = sums[0], next(iter(sums[0][1]))
    raw = sum(r.arrays["secagg/" + name].double() for r in masked) / sum(p[1] for p in plain.values()) / 2.0**32
    assert not torch.allclose(raw.float(), mean[name], atol=1.0)
    assert strip_prefix("global", mean)


def test_fga_secure_run_matches_plain_run(workload):
    """FGA's averaged gradient at each lockstep step is a secure sum; the run ends within rounding of the plain
    one (float64 weights: each step's average is off by ≤ 3·2^-33/Σb, which Adam turns into weight changes
    far below 1e-8 over a round)."""
    sites = tiny_sites(3)
    quiet = {"progress": False, "log": lambda m: None}
    cfg = tiny_config("fga", rounds=1, dtype="float64")
    history = {"plain": [], "secure": []}
    plain = simulate(cfg, workload, sites, on_round=history["plain"].append, **quiet)
    secure = simulate(_secure(cfg), workload, sites, on_round=history["secure"].append, **quiet)
    assert history["plain"][0]["steps"] == history["secure"][0]["steps"] > 1
    assert history["secure"][0]["in_sync"]
    assert plain["client_avg_dice"] == pytest.approx(secure["client_avg_dice"], abs=1e-6)


def test_secure_run_resumes_bitwise(tmp_path, workload):
    """Keys are fresh every exchange and not saved, yet a resumed secure run equals the uninterrupted one bit
    for bit: the unmasked sum does not depend on the keys."""
    from tests.support.helpers import assert_same_checkpoints

    cfg, quiet = _secure(tiny_config("fedavg", rounds=2)), {"progress": False, "log": lambda m: None}
    simulate(cfg, workload, tiny_sites(3), out=tmp_path / "full", **quiet)
    assert simulate(cfg, workload, tiny_sites(3), out=tmp_path / "part", stop_after=1, **quiet) is None
    simulate(cfg, workload, tiny_sites(3), out=tmp_path / "part", resume=True, **quiet)
    assert_same_checkpoints(tmp_path / "full", tmp_path / "part")


def _replay(monkeypatch, site: str, source: tuple[int, int], target: tuple[int, int], kind: str | None = None):
    """``site`` sends, for the exchange at (round, step) ``target``, the masked reply it sent at ``source``
    (of tasks of ``kind``, or of any kind)."""
    real, saved = site_secure.mask_reply, {}

    def mask_reply(s, task, reply):
        out = real(s, task, reply)
        at = (task.config.get("round"), task.config.get("step") or 0)
        if s.name != site or (kind is not None and task.kind != kind):
            return out
        if at == source:
            saved["reply"] = out
        if at == target:
            return saved["reply"]
        return out

    monkeypatch.setattr(site_secure, "mask_reply", mask_reply)


@pytest.mark.parametrize("method", ["fedavg", "scaffold"])
def test_replayed_masked_input_is_detected_and_round_keeps_the_model(monkeypatch, workload, tmp_path, method):
    """site2 replays its round-1 masked model in round 2.  Its masks belong to round 1's exchange, so round 2's
    unmasked check word is noise (wrong with probability 1 − 2^-64): the server logs the exchange that failed
    and what to do, drops the sum, and the global model (SCAFFOLD: and control variate) after round 2 is
    bitwise the one after round 1; the run finishes."""
    cfg, logs = _secure(tiny_config(method, rounds=2)), []
    simulate(cfg, workload, tiny_sites(3), out=tmp_path / "one", stop_after=1, progress=False, log=lambda m: None)
    _replay(monkeypatch, "site2", (1, 0), (2, 0))
    simulate(cfg, workload, tiny_sites(3), out=tmp_path / "two", progress=False, log=logs.append)
    from tests.support.helpers import assert_same_arrays, server_state

    failed = [m for m in logs if "fails its check word" in m]
    assert len(failed) == 1 and "exchange train-r2-" in failed[0] and "check the sites' logs" in failed[0]
    assert any("round 2: the global model" in m and "previous" in m for m in logs)
    one, two = server_state(tmp_path / "one"), server_state(tmp_path / "two")
    for part in ("global", "control"):
        assert_same_arrays(strip_prefix(part, two), strip_prefix(part, one))
    assert strip_prefix("global", two)


def test_fga_replayed_masked_gradient_skips_that_step_only(monkeypatch, workload):
    """site2 replays step 0's masked gradient at step 1: that step's sum is rejected and no site applies a
    gradient for it, so the sites stay in lockstep (identical weights and optimizer digests) and the round ends."""
    logs, history = [], []
    _replay(monkeypatch, "site2", (1, 0), (1, 1))
    simulate(
        _secure(tiny_config("fga", rounds=1)),
        workload,
        tiny_sites(3),
        on_round=history.append,
        progress=False,
        log=logs.append,
    )
    assert next(m for m in logs if "fails its check word" in m).count("fga_step-r1-s1-") == 1
    assert any("fga_step round 1 step 1: no gradient is applied" in m for m in logs)
    assert history[0]["in_sync"] and history[0]["steps"] > 1
