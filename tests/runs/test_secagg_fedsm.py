"""FedSM under secure aggregation: the server sums the global and the personalized models, each site forms its
own SoftPull model from the sum, validates it where it is, and releases its best one for the composite."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fedseg.site.secure as site_secure
from fedseg.algorithms import get_algorithm
from fedseg.algorithms.fedsm import secure as sm_secure
from fedseg.algorithms.softpull import soft_pull, soft_pull_from_sum
from fedseg.foundation.arrays import strip_prefix, weighted_mean
from fedseg.foundation.config import PrivacyConfig
from fedseg.foundation.errors import ConfigError
from fedseg.privacy import secagg
from fedseg.simulation.inprocess import InProcessTransport
from fedseg.simulation.runner import simulate
from tests.support.helpers import (
    assert_same_arrays,
    assert_same_checkpoints,
    load_arrays,
    server_state,
    site_state,
    tiny_config,
    tiny_sites,
)

pytest.importorskip("cryptography")
pytest.importorskip("Crypto")

QUIET = {"progress": False, "log": lambda m: None}
LAM = 0.5


def _cfg(rounds=2, secure=True, **fedsm):
    cfg = tiny_config("fedsm", rounds=rounds)
    params = {"fedsm": {"selector_width": 0.0625, "selector_hidden": 8, "lam": LAM, **fedsm}}
    return dataclasses.replace(cfg, params=params, privacy=PrivacyConfig(secure_aggregation=secure))


def test_soft_pull_from_the_sum_is_soft_pull():
    """Row k of Eq. 11 needs only S = Σ_k' w_k': Σ_{k'≠k} w_k' = S − w_k, so λ w_k + (1 − λ)/(K − 1)(S − w_k)
    is :func:`soft_pull`'s model for site k.  By hand for K = 3, λ = 0.5, scalars 1, 2, 6: site 1 gets
    0.5 · 1 + 0.25 · (2 + 6) = 2.5.  Integer tensors stay the site's own; with K = 1 nothing changes."""
    models = {
        s: {"w": torch.tensor([v]), "n": torch.tensor([i])} for i, (s, v) in enumerate(zip("abc", (1.0, 2.0, 6.0)))
    }
    total = {"w": torch.tensor([9.0], dtype=torch.float64), "n": torch.tensor([3])}
    pulled = soft_pull(models, 0.5)
    for s in "abc":
        mine = soft_pull_from_sum(models[s], total, 3, 0.5)
        torch.testing.assert_close(mine["w"], pulled[s]["w"])
        assert torch.equal(mine["n"], models[s]["n"])
    assert float(soft_pull_from_sum(models["a"], total, 3, 0.5)["w"]) == 2.5
    assert torch.equal(soft_pull_from_sum(models["a"], total, 1, 0.5)["w"], models["a"]["w"])


def _spy(monkeypatch, drop: tuple[str, int] | None = None):
    """Record each site's plain ``"train"`` reply before it is masked, every reply that reaches the server with
    its task, and each site's personalized model after its pull; ``drop`` = (site, round) loses that site's
    masked training reply on the way to the server."""
    plain: dict[int, dict] = {}
    arrived: list = []
    pulled: dict[int, dict] = {}
    real_mask, real_ask, real_pull = site_secure.mask_reply, InProcessTransport.ask, sm_secure.pull

    def mask_reply(site, task, reply):
        if task.kind == "train":
            plain.setdefault(task.config["round"], {})[site.name] = (dict(reply.arrays), reply.num_samples)
        return real_mask(site, task, reply)

    def ask(self, tasks, optional=False):
        replies = real_ask(self, tasks, optional)
        for s, r in list(replies.items()):
            task = tasks[s]
            if drop and task.kind == "train" and "secagg" in task.config and (s, task.config["round"]) == drop:
                del replies[s]
                continue
            arrived.append((task, r))
        return replies

    def pull(site, task):
        reply = real_pull(site, task)
        pulled.setdefault(task.config["round"], {})[site.name] = site.arrays("personal")
        return reply

    monkeypatch.setattr(site_secure, "mask_reply", mask_reply)
    monkeypatch.setattr(InProcessTransport, "ask", ask)
    monkeypatch.setattr(sm_secure, "pull", pull)
    return plain, arrived, pulled


def _check_round(plain_replies, pulled_models, summed, server_global, weighting="samples"):
    """The server's global model and each summed site's pulled model against the plain FedSM arithmetic on the
    same plain replies, within the fixed-point bound: Σ n_k w_k is decoded to within K·2^-(f+1) per value
    (K encodings of error ≤ 2^-(f+1) each), so the mean is within K·2^-(f+1)/Σ n_k; S = Σ w_{p,k} within
    K·2^-(f+1), so site k's λ w_k + (1 − λ)/(K − 1)(S − w_k) within (1 − λ)/(K − 1) · K·2^-(f+1).  Each side is
    then rounded to float32 on its own: one ulp more."""
    k = len(summed)
    n = [plain_replies[s][1] if weighting == "samples" else 1 for s in summed]
    glob = weighted_mean([strip_prefix("global", plain_replies[s][0]) for s in summed], n)
    q = secagg.quantization_bound(k, 32)
    for name, v in glob.items():
        err = (server_global[name].double() - v.double()).abs()
        assert bool((err <= q / sum(n) + torch.finfo(v.dtype).eps * v.double().abs()).all()), name
    personal = {s: strip_prefix(sm_secure.PERSONAL_SUM, plain_replies[s][0]) for s in summed}
    want = soft_pull(personal, LAM)
    for s in summed:
        for name, v in want[s].items():
            if not v.is_floating_point():
                continue
            err = (pulled_models[s][name].double() - v.double()).abs()
            bound = (1 - LAM) / (k - 1) * q + torch.finfo(v.dtype).eps * v.double().abs()
            assert bool((err <= bound).all()), (s, name, float(err.max()))


@pytest.mark.parametrize("selector", ["fga", "fedavg"])
def test_secure_fedsm_is_plain_fedsm_within_the_bound(monkeypatch, workload, tmp_path, selector):
    """Every round the global model and every site's SoftPull model equal the plain FedSM arithmetic on the same
    replies within the stated bound (:func:`_check_round`); the server receives only masked int64 arrays for the
    models and the selector's gradients (the synchronized selector weights at a lockstep round's end and the
    final release of the best personalized models aside), holds no personalized model, and the run's results
    match the plain run's to rounding."""
    plain, arrived, pulled = _spy(monkeypatch)
    cfg = _cfg(selector_training=selector)
    secure = simulate(cfg, workload, tiny_sites(3), out=tmp_path / "s", **QUIET)
    state = server_state(tmp_path / "s")
    assert not any(k.startswith("personal") for k in state)
    for rnd in (1, 2):
        assert sorted(plain[rnd]) == ["site1", "site2", "site3"]
    _check_round(plain[2], pulled[2], ["site1", "site2", "site3"], strip_prefix("global", state))
    for task, reply in arrived:
        clear_ok = task.kind == "fedsm_release" or (task.kind == "selector_step" and task.config.get("step") is None)
        masked = all(k.startswith("secagg/") and v.dtype == torch.int64 for k, v in reply.arrays.items())
        assert clear_ok or masked, (task.kind, sorted(reply.arrays)[:3])
    assert any(t.kind == "train" and r.arrays for t, r in arrived)
    monkeypatch.undo()
    ref = simulate(
        dataclasses.replace(cfg, privacy=PrivacyConfig()), workload, tiny_sites(3), out=tmp_path / "p", **QUIET
    )
    a = server_state(tmp_path / "p")
    for name, v in strip_prefix("global", a).items():
        torch.testing.assert_close(state[f"global/{name}"], v, rtol=1e-5, atol=1e-6)
    # the plain server's personalized model = the site's own, pulled; a second round of training moves them
    # apart by more than the bound where a parameter's true gradient is zero (a convolution's bias before
    # instance norm): Adam turns the rounding noise of such a gradient into steps of up to lr = 1e-3 either way
    lr = cfg.train.lr
    for s in ("site1", "site2", "site3"):
        mine = strip_prefix("model/personal", site_state(tmp_path / "s", s))
        for name, v in strip_prefix(f"personal/{s}", a).items():
            torch.testing.assert_close(mine[name], v, rtol=0, atol=2 * lr)
    assert secure["per_site_dice"] == pytest.approx(ref["per_site_dice"], abs=1e-4)
    assert sorted(r["name"] for r in secure["rows"]) == sorted(r["name"] for r in ref["rows"])


def test_a_site_dropped_from_the_sum_keeps_its_model(monkeypatch, workload):
    """site3's masked training reply of round 2 is lost: the sum is over site1 and site2 (their masks with
    site3 removed), the global model is their weighted mean, each of them pulls with K' = 2, and site3 keeps the
    model it trained (it is not pulled, as plain SoftPull leaves a site that did not reply); the run goes on."""
    plain, arrived, pulled = _spy(monkeypatch, drop=("site3", 2))
    history = []
    simulate(_cfg(rounds=2), workload, tiny_sites(3), on_round=history.append, **QUIET)
    assert sorted(pulled[2]) == ["site1", "site2"]
    assert set(history[1]["personal_loss"]) == {"site1", "site2"}
    glob = {}
    for task, _reply in arrived:  # the round-2 global model the server sent on: the one it validated
        if (
            task.kind == "evaluate"
            and task.config["split"] == "validation"
            and any(k.startswith("global/") for k in task.arrays)
        ):
            glob = strip_prefix("global", task.arrays)
    assert glob
    _check_round(plain[2], pulled[2], ["site1", "site2"], glob)


def test_secure_fedsm_resumes_bitwise(workload, tmp_path):
    """Stopped after round 1 and resumed, a secure FedSM run ends with the uninterrupted run's checkpoints
    bitwise: the keys change, the sums do not, and each site's personalized model and best one are saved with
    the site."""
    cfg = _cfg(rounds=2)
    simulate(cfg, workload, tiny_sites(3), out=tmp_path / "a", **QUIET)
    simulate(cfg, workload, tiny_sites(3), out=tmp_path / "b", stop_after=1, **QUIET)
    simulate(cfg, workload, tiny_sites(3), out=tmp_path / "b", resume=True, **QUIET)
    assert_same_checkpoints(tmp_path / "a", tmp_path / "b")


@pytest.mark.parametrize(
    ("method", "fedsm", "why"),
    [
        ("fedsm-extra", {}, "selector phase"),
        ("fedsm", {"personalization": "ditto"}, "fedsm.personalization = 'ditto'"),
        ("fedsm", {"selector_training": "fedaws"}, "class embedding"),
        ("fedsm", {"aggregation": "median"}, "fedsm.aggregation = 'median'"),
    ],
)
def test_fedsm_parts_that_need_one_sites_arrays_refuse(method, fedsm, why):
    cfg = dataclasses.replace(_cfg(**fedsm), method=method)
    with pytest.raises(ConfigError, match="cannot run with privacy.secure_aggregation = true") as e:
        get_algorithm(cfg)
    assert why in str(e.value)
    get_algorithm(_cfg())  # FedSM with SoftPull and the fga selector runs


def _deploy_cfg(rounds=2):
    cfg = _cfg(rounds=rounds)
    return dataclasses.replace(cfg, params={**cfg.params, "deploy": {"round_deadline_s": 30.0, "max_update_ratio": 0}})


def test_deployed_secure_fedsm_equals_simulation_bitwise(tmp_path):
    """Over the deployment's byte channel (fresh keys, bytes both ways, the sites' own runtimes) secure FedSM
    ends with the simulation's server state, test Dice and sites' personalized models bitwise: the masks cancel
    exactly and nothing else depends on the keys."""
    from fedseg.deployment.server import serve
    from fedseg.deployment.transport import LoopbackChannel
    from tests.deploy.test_deploy import _prepare, _runtimes, _workload

    cfg, data = _deploy_cfg(), tiny_sites(3)
    _prepare(tmp_path / "dep", cfg, list(data))
    dep = serve(tmp_path / "dep", LoopbackChannel(_runtimes(tmp_path, data)), log=lambda m: None)
    sim = simulate(cfg, _workload(cfg), tiny_sites(3), out=tmp_path / "sim", **QUIET)
    assert_same_arrays(server_state(tmp_path / "dep"), server_state(tmp_path / "sim"))
    assert dep["per_site_dice"] == sim["per_site_dice"]
    assert dep["deploy"]["dropouts"] == []


def test_deployed_site_lost_after_masking_is_left_out_of_the_round(tmp_path):
    """Deployed, site3's masked training reply of round 2 is lost after it masked: the survivors reveal its mask
    key, the round's global model is the mean over site1 and site2 and only they pull; the run finishes, and
    the composite still holds site3's released personalized model."""
    from fedseg.deployment.server import serve
    from fedseg.deployment.transport import LoopbackChannel
    from fedseg.deployment.wire import decode_reply
    from tests.deploy.test_deploy import _prepare, _runtimes

    seen = {"n": 0}

    def lose_second_masked_train(op, blob):
        if any(k.startswith(f"secagg/{sm_secure.PERSONAL_SUM}/") for k in decode_reply(blob).arrays):
            seen["n"] += 1
            if seen["n"] == 2:
                raise ConnectionError("site3 went down after masking")
        return blob

    cfg, data = _deploy_cfg(), tiny_sites(3)
    _prepare(tmp_path / "dep", cfg, list(data))
    channel = LoopbackChannel(_runtimes(tmp_path, data), {"site3": lose_second_masked_train})
    logs: list[str] = []
    dep = serve(tmp_path / "dep", channel, log=logs.append)
    assert any(d["site"] == "site3" and d["task"] == "train" for d in dep["deploy"]["dropouts"])
    assert set(dep["history"][1]["personal_loss"]) == {"site1", "site2"}
    assert set(dep["history"][0]["personal_loss"]) == {"site1", "site2", "site3"}
    best = load_arrays(tmp_path / "dep" / "checkpoints" / "best.safetensors")
    assert any(k.startswith("fedsm/personal/site3/") for k in best)


def test_replayed_masked_input_keeps_the_global_model_and_skips_the_pull(monkeypatch, workload, tmp_path):
    """site2 replays its round-1 masked ``"train"`` reply in round 2: the sum fails its check word, so FedSM keeps
    its round-1 global model bitwise, sends no SoftPull (each site keeps the personalized model it trained)
    and finishes the run."""
    from tests.runs.test_secagg_fedavg import _replay

    cfg, logs, pulls = _cfg(rounds=2), [], []
    simulate(cfg, workload, tiny_sites(3), out=tmp_path / "one", stop_after=1, **QUIET)
    _replay(monkeypatch, "site2", (1, 0), (2, 0), kind="train")
    real_ask = InProcessTransport.ask

    def ask(self, tasks, optional=False):
        pulls.extend(t.config["round"] for t in tasks.values() if t.kind == "fedsm_pull")
        return real_ask(self, tasks, optional)

    monkeypatch.setattr(InProcessTransport, "ask", ask)
    simulate(cfg, workload, tiny_sites(3), out=tmp_path / "two", progress=False, log=logs.append)
    assert any("exchange train-r2-" in m and "fails its check word" in m for m in logs)
    assert any("fedsm round 2: the global model keeps the previous weights; each site keeps" in m for m in logs)
    assert sorted(set(pulls)) == [1]
    one, two = server_state(tmp_path / "one"), server_state(tmp_path / "two")
    assert_same_arrays(strip_prefix("global", two), strip_prefix("global", one))
    assert strip_prefix("global", two)
