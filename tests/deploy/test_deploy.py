"""Deployed runs over an in-process byte channel: equality with simulation, faults, resume of every method.

The server half (:func:`fedseg.deployment.server.serve`), the site runtimes and the
wire format are the ones NVFlare carries; only the channel is a function call
(:class:`fedseg.deployment.transport.LoopbackChannel`), so these tests are fast.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
import torch

from fedseg.algorithms import REGISTRY
from fedseg.deployment.policy import SitePolicy
from fedseg.deployment.server import serve
from fedseg.deployment.site import SiteConfig, SiteRuntime
from fedseg.deployment.transport import DeployError, LoopbackChannel
from fedseg.deployment.wire import decode_reply, encode_reply
from fedseg.foundation.config import dump_toml
from fedseg.foundation.messages import Reply
from fedseg.simulation.runner import simulate
from fedseg.site.workload import workload_for
from tests.support.helpers import (
    assert_same_arrays,
    assert_same_checkpoints,
    every_method_config,
    load_arrays,
    same_arrays,
    server_state,
    tiny_config,
    tiny_sites,
)

HEADER = {
    "mode": "2d",
    "spatial_dims": 2,
    "in_channels": 1,
    "labels": {"fg": [1]},
    "image_size": None,
    "foreground_only": False,
}


def _cfg(rounds=2, **deploy):
    cfg = tiny_config("fedavg", rounds=rounds)
    return dataclasses.replace(cfg, params={**cfg.params, "deploy": {"round_deadline_s": 30.0, **deploy}})


def _workload(cfg):
    return workload_for(HEADER, cfg)


def _prepare(out: Path, cfg, names, run_id="run-1", stop_after=None):
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.toml").write_text(dump_toml(cfg.to_dict()))
    desc = {"run_id": run_id, "sites": list(names), "data": HEADER, "resume": False, "transport": "loopback"}
    if stop_after is not None:
        desc["stop_after"] = stop_after
    (out / "deploy.json").write_text(json.dumps(desc))


REHEARSAL = SitePolicy(secure_aggregation=False, min_sites=1, reproducible=True, evaluation="per_case")
"""The site policy of the tests that compare a deployment with its simulation bitwise: it joins any run and lets
the run seed drive the site's randomness (``reproducible``) and sends per-case scores (``evaluation``), as a
rehearsal's sites do."""


def _runtimes(tmp: Path, data, policy: SitePolicy = REHEARSAL):
    def loader(name, datalist, header, cfg):
        return data[name], _workload(cfg)

    return {
        n: SiteRuntime(SiteConfig(n, "(in memory)", str(tmp / "sites" / n)), loader=loader, policy=policy) for n in data
    }


def test_deployed_fedavg_equals_simulation_bitwise(tmp_path):
    """Same seed, same sites: the deployed path (bytes both ways) gives the simulation's weights and Dice bitwise.

    Tensors cross as raw safetensors bytes and sites keep models/optimizers in memory
    exactly as simulated sites do, so no number can change.
    """
    # Prepare
    cfg, data = _cfg(), tiny_sites(2)
    _prepare(tmp_path / "dep", cfg, list(data))
    # Execute
    dep = serve(tmp_path / "dep", LoopbackChannel(_runtimes(tmp_path, data)), log=lambda m: None)
    sim = simulate(cfg, _workload(cfg), tiny_sites(2), out=tmp_path / "sim", progress=False)
    # Assert
    assert_same_arrays(server_state(tmp_path / "dep"), server_state(tmp_path / "sim"))
    assert dep["per_site_dice"] == sim["per_site_dice"]
    assert dep["deploy"]["dropouts"] == [] and dep["deploy"]["wire_bytes"]["sent"] > 0
    assert (tmp_path / "dep" / "results.md").is_file()


def test_dead_site_is_left_out_and_run_finishes(tmp_path):
    """A site that is unreachable is dropped from every exchange; FedAvg averages the other (p = 1 for it).

    The result equals a simulation with the surviving site alone (same site index
    kept, since seeds follow the federation order — so compare weights to the
    deployment where only site1 is in the federation would be wrong; instead the
    final weights equal those of the same deployment where site2 sends a NaN reply,
    both being 'site1 only' aggregates).
    """
    # Prepare
    cfg, data = _cfg(), tiny_sites(2)
    _prepare(tmp_path / "a", cfg, list(data))
    _prepare(tmp_path / "b", cfg, list(data))

    def poison(op, blob):
        r = decode_reply(blob)
        return encode_reply(
            Reply(
                {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in r.arrays.items()},
                r.metrics,
                r.num_samples,
            )
        )

    # Execute
    dead = serve(tmp_path / "a", LoopbackChannel(_runtimes(tmp_path / "a", data), {"site2": "die"}), log=lambda m: None)
    nan = serve(
        tmp_path / "b", LoopbackChannel(_runtimes(tmp_path / "b", tiny_sites(2)), {"site2": poison}), log=lambda m: None
    )
    # Assert
    assert {d["site"] for d in dead["deploy"]["dropouts"]} == {"site2"}
    reasons = [d["reason"] for d in nan["deploy"]["dropouts"] if d["task"] == "train"]
    assert len(reasons) == 2 and all("non-finite values" in r for r in reasons)
    w_dead, w_nan = server_state(tmp_path / "a"), server_state(tmp_path / "b")
    assert all(torch.isfinite(v).all() for v in w_nan.values() if v.is_floating_point())
    assert same_arrays(w_dead, w_nan)


def test_too_few_sites_stops_the_run_with_a_reason(tmp_path):
    """With deploy.min_sites = 2 and one site dead, setup refuses to start, naming the setting."""
    cfg, data = _cfg(min_sites=2), tiny_sites(2)
    _prepare(tmp_path / "a", cfg, list(data))
    with pytest.raises(DeployError, match="deploy.min_sites = 2"):
        serve(tmp_path / "a", LoopbackChannel(_runtimes(tmp_path, data), {"site2": "die"}), log=lambda m: None)


def test_hung_site_is_cut_off_at_the_deadline(tmp_path):
    """A site that never answers a task is left out after deploy.round_deadline_s (2 s here), not waited for.

    (The honest site answers under the same deadline: 2 s leaves a loaded 2-core machine ~40x its idle time.)"""
    # Prepare
    cfg, data = _cfg(rounds=1, round_deadline_s=2.0), tiny_sites(2)
    _prepare(tmp_path / "a", cfg, list(data))
    # Execute
    t0 = time.perf_counter()
    res = serve(tmp_path / "a", LoopbackChannel(_runtimes(tmp_path, data), {"site2": "hang"}), log=lambda m: None)
    took = time.perf_counter() - t0
    # Assert: train, validate and test exchanges each wait 2.2 s at most (site2 sleeps 32 s a task)
    assert {d["site"] for d in res["deploy"]["dropouts"]} == {"site2"}
    assert any("deadline of 2 s" in d["reason"] for d in res["deploy"]["dropouts"])
    assert took < 3 * 2.2 + 8


def test_dead_site_costs_one_deadline_then_only_a_ping(tmp_path):
    """A site that stops answering (every call hangs) is waited for once, up to round_deadline_s; after that
    each exchange only pings it (probe_timeout_s) before leaving it out, instead of waiting a deadline per
    exchange (3 rounds × train, validate, checkpoint would be ~8 deadlines)."""
    # Prepare
    cfg, data = _cfg(rounds=3, round_deadline_s=3.0, probe_timeout_s=0.1), tiny_sites(2)  # 3 s: margin for site1
    _prepare(tmp_path / "a", cfg, list(data))
    # Execute
    t0 = time.perf_counter()
    res = serve(tmp_path / "a", LoopbackChannel(_runtimes(tmp_path, data), {"site2": "freeze"}), log=lambda m: None)
    took = time.perf_counter() - t0
    # Assert
    drops = res["deploy"]["dropouts"]
    assert {d["site"] for d in drops} == {"site2"} and len(drops) >= 6
    assert "no answer within 3 s" in drops[0]["reason"]
    assert all("no answer to a ping within 0.1 s" in d["reason"] for d in drops[1:]), [d["reason"] for d in drops]
    assert took < 3.3 + 0.15 * len(drops) + 5, f"{took:.1f} s for {len(drops)} dropouts"  # not 3.3 s each
    assert all(set(e["train_loss"]) == {"site1"} for e in res["history"])


def test_site_rejoins_after_missing_a_round(tmp_path):
    """A site down in round 1 answers again in round 2 and is aggregated and evaluated there.  Round 1's
    aggregate is a model the site did not see leave training (it missed the round): its policy's guard refuses to
    evaluate it (fedseg.deployment.guard: a crafted probe looks the same to a site that was not there), a refusal
    the server records as a dropout of that evaluation, not of the site."""
    # Prepare
    cfg, data = _cfg(rounds=2), tiny_sites(2)
    _prepare(tmp_path / "a", cfg, list(data))
    chan = LoopbackChannel(_runtimes(tmp_path, data))
    state = {"tasks": 0}

    def call(site, op, payload, timeout):
        if op == "task" and site == "site2":
            state["tasks"] += 1
            if state["tasks"] == 1:  # its first training task (round 1)
                raise ConnectionError("site2 restarting")
        return chan(site, op, payload, timeout)

    # Execute
    res = serve(tmp_path / "a", call, log=lambda m: None)
    # Assert
    drops = res["deploy"]["dropouts"]
    assert [(d["round"], d["site"], d["task"]) for d in drops] == [(0, "site2", "train"), (0, "site2", "evaluate")]
    assert "did not see leave training" in drops[1]["reason"], drops
    assert set(res["history"][1]["train_loss"]) == {"site1", "site2"}
    assert set(res["history"][0]["train_loss"]) == {"site1"}
    assert set(res["history"][1]["val_dice"]["global"]) == {"site1", "site2"}
    assert set(res["history"][0]["val_dice"]["global"]) == {"site1"}


DEPLOYABLE = sorted(m for m, cls in REGISTRY.items() if not cls.needs_pooled_site)


@pytest.mark.xdist_group("every-method")  # its simulations are tests/runs/test_resume.py's: one worker runs both
@pytest.mark.parametrize("method", [*DEPLOYABLE, "fedsm+global-fga"])
def test_every_method_deployed_equals_simulation_and_resumes(tmp_path, simulated, method):
    """Each deployable method, unchanged, over the deployed path (wire bytes both ways, long-lived site
    runtimes): 2 rounds give the simulation's weights bitwise, and a server stopped after round 1 and
    resumed by new site runtimes (from their workdirs) ends bitwise where the uninterrupted run ends.

    This is the claim of docs/architecture.md that a transport never changes a number, checked for the
    per-site state each method keeps (SCAFFOLD controls, personalized models, Adam moments, selectors).
    """
    # Prepare
    cfg = every_method_config(method)
    _prepare(tmp_path / "dep", cfg, ["site1", "site2"])
    _prepare(tmp_path / "part", cfg, ["site1", "site2"], stop_after=1)
    # Execute
    dep = serve(tmp_path / "dep", LoopbackChannel(_runtimes(tmp_path / "d", tiny_sites(2))), log=lambda m: None)
    sim, sim_out = simulated(cfg)
    assert (
        serve(tmp_path / "part", LoopbackChannel(_runtimes(tmp_path / "p", tiny_sites(2))), log=lambda m: None) is None
    )
    desc = json.loads((tmp_path / "part" / "deploy.json").read_text())
    desc.update(resume=True, stop_after=None)
    (tmp_path / "part" / "deploy.json").write_text(json.dumps(desc))
    resumed = serve(tmp_path / "part", LoopbackChannel(_runtimes(tmp_path / "p", tiny_sites(2))), log=lambda m: None)
    # Assert
    assert dep["deploy"]["dropouts"] == []  # (a site dropped for a missed deadline would change the aggregate)
    assert_same_arrays(server_state(tmp_path / "dep"), server_state(sim_out), "deployed vs simulated")
    assert dep["per_site_dice"] == sim["per_site_dice"]
    assert_same_checkpoints(tmp_path / "part", tmp_path / "dep", sites=False)  # sites keep theirs in their workdirs
    for s in ("site1", "site2"):  # ... and their last checkpoints (round 2) are the same too
        a, b = (tmp_path / w / "sites" / s / "run-1" / "round-000002" for w in ("p", "d"))
        assert_same_arrays(load_arrays(a / f"{s}.safetensors"), load_arrays(b / f"{s}.safetensors"), s)
    assert resumed["per_site_dice"] == dep["per_site_dice"] and resumed["deploy"]["resumed"]


def test_prepared_deploy_run_writes_the_resolved_method_settings(tmp_path):
    """A deployed FedSM run with no [fedsm] settings writes them resolved into OUT/config.toml (γ per personalized
    model, the fga selector: the default profile), as a simulation does — the server and every site read that file."""
    from fedseg.algorithms import get_algorithm
    from fedseg.data.synth import synthesize
    from fedseg.deployment.server import load_deploy_config, prepare_run

    # Prepare
    spec = synthesize("fundus", tmp_path / "fed", scale=0.05, size=32, progress=False)
    run_toml = tmp_path / "run.toml"
    run_toml.write_text(f'federation = "{spec}"\nmethod = "fedsm"\nseed = 0\n')
    # Execute
    prepare_run(load_deploy_config(run_toml, []), tmp_path / "out", sites=["site1", "site2"])
    # Assert
    text = (tmp_path / "out" / "config.toml").read_text()
    assert "[fedsm]" in text and 'gamma = "auto-per-model"' in text and 'selector_training = "fga"' in text
    back = get_algorithm(load_deploy_config(tmp_path / "out" / "config.toml", []))
    assert back.params == get_algorithm(load_deploy_config(run_toml, [])).params


def test_rehearsal_processes_get_the_thread_count_of_the_process_that_starts_them(tmp_path):
    """A rehearsal's server and sites compute with this process's intra-op thread count (what a simulation
    here uses, the condition of bitwise equality with it) unless told another."""
    from fedseg.deployment.run import LocalCluster

    # Prepare
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        # Execute
        default = LocalCluster(tmp_path, {}, tmp_path / "sites").env
        given = LocalCluster(tmp_path, {}, tmp_path / "sites", threads=2).env
    finally:
        torch.set_num_threads(before)
    # Assert
    assert default["FEDSEG_TORCH_THREADS"] == default["OMP_NUM_THREADS"] == "3"
    assert given["FEDSEG_TORCH_THREADS"] == given["OMP_NUM_THREADS"] == "2"
