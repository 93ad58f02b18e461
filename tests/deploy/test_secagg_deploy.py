"""Secure aggregation deployed (over the byte channel the deployment uses): equal to the simulation bitwise,
and a site that drops after masking is removed from the sum with its masks."""

from __future__ import annotations

import dataclasses

import pytest

from fedseg.deployment.server import serve
from fedseg.deployment.transport import LoopbackChannel
from fedseg.deployment.wire import decode_reply, decode_task, encode_reply
from fedseg.foundation.arrays import strip_prefix
from fedseg.foundation.config import PrivacyConfig
from fedseg.simulation.runner import simulate
from tests.deploy.test_deploy import _prepare, _runtimes, _workload
from tests.support.helpers import assert_same_arrays, server_state, tiny_config, tiny_sites

pytest.importorskip("cryptography")
pytest.importorskip("Crypto")


def _cfg(method="fedavg", rounds=2, min_sites=3):
    cfg = tiny_config(method, rounds=rounds)
    return dataclasses.replace(
        cfg,
        privacy=PrivacyConfig(secure_aggregation=True, secagg_min_sites=min_sites),
        params={**cfg.params, "deploy": {"round_deadline_s": 30.0, "max_update_ratio": 0}},
    )


@pytest.mark.parametrize("method", ["fedavg", "scaffold", "fga"])
def test_deployed_secure_aggregation_equals_simulation_bitwise(tmp_path, method):
    """The masks cancel exactly and the keys do not enter the sum, so a deployment (fresh keys, bytes both
    ways) ends with the simulation's weights bitwise, as without secure aggregation."""
    cfg, data = _cfg(method), tiny_sites(3)
    _prepare(tmp_path / "dep", cfg, list(data))
    dep = serve(tmp_path / "dep", LoopbackChannel(_runtimes(tmp_path, data)), log=lambda m: None)
    sim = simulate(cfg, _workload(cfg), tiny_sites(3), out=tmp_path / "sim", progress=False, log=lambda m: None)
    assert_same_arrays(server_state(tmp_path / "dep"), server_state(tmp_path / "sim"))
    assert dep["per_site_dice"] == sim["per_site_dice"]
    assert dep["deploy"]["dropouts"] == []


def test_site_dropping_after_masking_is_removed_from_the_sum(tmp_path):
    """site3 masks its update and then its reply is lost (or arrives malformed and is rejected): the survivors
    reveal its mask key, the server removes its pairwise masks and the round's model is bitwise the one of a
    deployment where site3 was gone from the start of the exchange (the same fixed-point sum of site1 and
    site2).  Two sites are left when site3 is gone at the keys, so the sites accept masking with two
    (privacy.secagg_min_sites = 2; with the default 3 they refuse, tests/deploy/test_secagg_active.py)."""
    cfg, data = _cfg(rounds=1, min_sites=2), tiny_sites(3)
    logs = []

    def lose_masked(op, blob):
        if any(k.startswith("secagg/") for k in decode_reply(blob).arrays):
            raise ConnectionError("site3 went down after masking")
        return blob

    def gone_at_keys(op, blob):
        if "secagg" in decode_reply(blob).metrics and "c" in decode_reply(blob).metrics["secagg"]:
            raise ConnectionError("site3 down")
        return blob

    def malformed(op, blob):  # a masked reply whose dtype list does not name its arrays: rejected, left out
        reply = decode_reply(blob)
        if any(k.startswith("secagg/") for k in reply.arrays):
            reply.metrics["secagg"]["dtypes"] = {}
            return encode_reply(reply)
        return blob

    runs = {}
    for name, fault in (("late", lose_masked), ("early", gone_at_keys), ("malformed", malformed)):
        _prepare(tmp_path / name, cfg, list(data))
        runs[name] = serve(
            tmp_path / name,
            LoopbackChannel(_runtimes(tmp_path / name, tiny_sites(3)), {"site3": fault}),
            log=logs.append,
        )
    late = [d for d in runs["late"]["deploy"]["dropouts"] if d["site"] == "site3"]
    assert late and late[0]["task"] == "train"
    assert_same_arrays(server_state(tmp_path / "late"), server_state(tmp_path / "early"))
    assert_same_arrays(server_state(tmp_path / "malformed"), server_state(tmp_path / "early"))
    assert any("site site3 left out of the exchange: its masked input was rejected" in m for m in logs), logs
    assert set(runs["late"]["history"][0]["train_loss"]) == {"site1", "site2"}


def test_secure_aggregation_over_flare_equals_simulation(tmp_path, flare_cluster):
    """FedAvg with secure aggregation over NVIDIA FLARE (provisioned kits, mutual TLS, site processes): the
    four steps of each exchange cross FLARE's channel, every site signs its keys with its kit's certificate
    (RSA, as FLARE provisions) and checks the other's, and the run ends with the simulation's (unsigned)
    weights bitwise.  The rehearsal has two sites, so they accept masking with two (privacy.secagg_min_sites =
    2): the protocol, the signatures and the consistency check are what it tests."""
    import torch
    from safetensors.torch import load_file

    from tests.support.rehearsals import OVERRIDES

    overrides = [
        *OVERRIDES,
        "privacy.secure_aggregation=true",
        "privacy.secagg_min_sites=2",
        "deploy.max_update_ratio=0",
    ]
    run_toml, out = flare_cluster.prepare(tmp_path, "fedavg", overrides)
    mark = flare_cluster.mark()
    flare_cluster.submit(out, timeout=180)
    flare_cluster.simulate(tmp_path, run_toml, overrides)
    a = load_file(str(out / "checkpoints" / "server.safetensors"))
    b = load_file(str(tmp_path / "sim" / "out" / "checkpoints" / "server.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    for name in ("site1", "site2"):
        signs = f"site {name}: signs its secure-aggregation keys with its kit's certificate"
        assert signs in flare_cluster.since(mark, name, expect=signs)


def test_secure_fedsm_over_flare_equals_simulation_and_the_server_sees_only_masks(tmp_path, flare_cluster):
    """FedSM (SoftPull, the lockstep ``fga`` selector) with secure aggregation over NVIDIA FLARE (provisioned
    kits, mutual TLS, site processes): 2 rounds end with the simulation's server state and test Dice bitwise,
    and every reply the FLARE server accepted (recorded by the server's processes, tests/support/rehearsals.py:
    SERVER_RECORDER) carried only masked int64 arrays (``secagg/…``) but the synchronized selector weights at a
    lockstep round's end and the final release of the best personalized models, as in process
    (``tests/runs/test_secagg_fedsm.py``)."""
    import json

    import torch
    from safetensors.torch import load_file

    from tests.support.rehearsals import OVERRIDES

    overrides = [
        *OVERRIDES,
        "privacy.secure_aggregation=true",
        "privacy.secagg_min_sites=2",  # the rehearsal's two sites
        "deploy.max_update_ratio=0",
        "fedsm.selector_width=0.0625",
        "fedsm.selector_hidden=8",
    ]
    run_toml, out = flare_cluster.prepare(tmp_path, "fedsm", overrides)
    mark = flare_cluster.mark()
    flare_cluster.submit(out, timeout=180)
    replies = flare_cluster.replies_since(mark)
    sim = flare_cluster.simulate(tmp_path, run_toml, overrides)
    dep = json.loads((out / "results.json").read_text())
    a = load_file(str(out / "checkpoints" / "server.safetensors"))
    b = load_file(str(tmp_path / "sim" / "out" / "checkpoints" / "server.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert not any(k.startswith("personal") for k in a)
    assert dep["per_site_dice"] == sim["per_site_dice"] and dep["deploy"]["dropouts"] == []
    kinds = {e["kind"] for e in replies if e["arrays"]}
    assert {"train", "selector_step", "fedsm_release"} <= kinds, kinds
    for e in replies:
        clear_ok = e["kind"] == "fedsm_release" or (e["kind"] == "selector_step" and e["step"] is None)
        masked = all(k.startswith("secagg/") and v == "torch.int64" for k, v in e["arrays"].items())
        assert clear_ok or masked, (e["kind"], e["round"], e["step"], sorted(e["arrays"])[:3])
    assert sum(1 for e in replies if e["kind"] == "train" and e["arrays"]) == 4  # 2 sites × 2 rounds, masked


def _fedsm_cfg(rounds=2):
    cfg = _cfg("fedsm", rounds=rounds)
    fedsm = {"selector_width": 0.0625, "selector_hidden": 8}
    return dataclasses.replace(cfg, params={**cfg.params, "fedsm": fedsm})


class _ReplayChannel(LoopbackChannel):
    """The byte channel, but ``site``'s masked ``"train"`` reply of round 2 is the bytes it carried in round 1
    (a site or its transport resending an old message); records every task's (kind, round) sent."""

    def __init__(self, runtimes, site: str):
        super().__init__(runtimes)
        self.site, self.saved, self.sent = site, {}, []

    def __call__(self, site, op, payload, timeout):
        out = super().__call__(site, op, payload, timeout)
        if op != "task":
            return out
        task = decode_task(payload)
        self.sent.append((task.kind, task.config.get("round")))
        if site == self.site and task.kind == "train" and "secagg" in task.config:
            self.saved.setdefault(task.config["round"], out)
            if task.config["round"] == 2:
                return self.saved[1]
        return out


@pytest.mark.parametrize("method", ["fedavg", "fedsm"])
def test_deployed_replayed_masked_input_is_rejected_and_the_round_keeps_the_model(tmp_path, method):
    """Deployed (bytes both ways), site2's channel resends in round 2 the masked training reply it carried in
    round 1.  The bytes are a well-formed masked input, so the server accepts them, but their masks belong to
    round 1's exchange: the unmasked check word is noise (right with probability 2^-64).  The deployed server
    logs the failed exchange and what to do, drops the sum, and the run completes with the global model after
    round 2 bitwise the one after round 1 (a deployment of the same run stopped there); FedSM also sends no
    SoftPull in round 2, so each site keeps the personalized model it trained."""
    cfg = _fedsm_cfg() if method == "fedsm" else _cfg(method)
    names = ["site1", "site2", "site3"]
    _prepare(tmp_path / "one", cfg, names, stop_after=1)
    serve(tmp_path / "one", LoopbackChannel(_runtimes(tmp_path / "one", tiny_sites(3))), log=lambda m: None)
    _prepare(tmp_path / "two", cfg, names)
    logs: list[str] = []
    channel = _ReplayChannel(_runtimes(tmp_path / "two", tiny_sites(3)), "site2")
    dep = serve(tmp_path / "two", channel, log=logs.append)
    failed = [m for m in logs if "fails its check word" in m]
    assert len(failed) == 1 and "exchange train-r2-" in failed[0] and "check the sites' logs" in failed[0], logs
    assert any("round 2: the global model" in m and "previous" in m for m in logs), logs
    assert len(dep["history"]) == 2 and dep["per_site_dice"]
    one, two = server_state(tmp_path / "one"), server_state(tmp_path / "two")
    assert strip_prefix("global", two)
    assert_same_arrays(strip_prefix("global", two), strip_prefix("global", one))
    if method == "fedsm":
        assert sorted({r for kind, r in channel.sent if kind == "fedsm_pull"}) == [1]
        assert any(kind == "fedsm_release" for kind, _ in channel.sent)
