"""Secure aggregation deployed (over the byte channel the deployment uses): equal to the simulation bitwise,
and a site that drops after masking is removed from the sum with its masks."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import tiny_config, tiny_sites
from fedseg.apps.deploy.server import serve
from fedseg.execution.remote.transport import LoopbackChannel
from fedseg.execution.remote.wire import decode_reply, encode_reply
from fedseg.foundation.config import PrivacyConfig
from fedseg.simulation.runner import simulate
from helpers import assert_same_arrays, server_state
from test_deploy import _prepare, _runtimes, _workload

pytest.importorskip("cryptography")
pytest.importorskip("Crypto")


def _cfg(method="fedavg", rounds=2):
    cfg = tiny_config(method, rounds=rounds)
    return dataclasses.replace(
        cfg,
        privacy=PrivacyConfig(secure_aggregation=True),
        params={**cfg.params, "deploy": {"round_deadline_s": 30.0, "max_update_ratio": 0}},
    )


@pytest.mark.parametrize("method", ["fedavg", "scaffold", pytest.param("fga", marks=pytest.mark.slow)])
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
    site2)."""
    cfg, data = _cfg(rounds=1), tiny_sites(3)
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


@pytest.mark.slow
def test_secure_aggregation_over_flare_equals_simulation(tmp_path):
    """FedAvg with secure aggregation over NVIDIA FLARE (provisioned kits, mutual TLS, site processes): the
    four steps of each exchange cross FLARE's channel and the run ends with the simulation's weights bitwise."""
    pytest.importorskip("nvflare", reason="NVIDIA FLARE is not installed")
    import torch
    from safetensors.torch import load_file

    from fedseg.apps.deploy.run import submit_run
    from test_deploy_nvflare import OVERRIDES, _prepared_run, _provision, _simulate_same

    overrides = [*OVERRIDES, "privacy.secure_aggregation=true", "deploy.max_update_ratio=0"]
    spec, run_toml, out, _, cluster = _prepared_run(tmp_path, "fedavg", overrides)
    _provision(cluster)
    with cluster:
        submit_run(cluster.kits["admin"], out, ["site1", "site2"], timeout=180)
    _simulate_same(tmp_path, spec, run_toml, overrides)
    a = load_file(str(out / "checkpoints" / "server.safetensors"))
    b = load_file(str(tmp_path / "sim" / "out" / "checkpoints" / "server.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
