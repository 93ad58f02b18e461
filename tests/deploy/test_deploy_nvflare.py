"""End to end on NVIDIA FLARE: provisioned kits, mutual TLS, a server and site processes on 127.0.0.1."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("nvflare", reason="NVIDIA FLARE is not installed; `pip install nvflare` to run deployment tests")

from fedseg.data.synth import synthesize
from fedseg.deployment.run import LocalCluster, start_site, stop, submit_run, subset_spec
from fedseg.deployment.server import load_deploy_config, prepare_run
from fedseg.simulation.runner import run
from tests.support.rehearsals import OVERRIDES, POLICY

# Rehearsals that need no fault submit their runs to the shared cluster (fixture flare_cluster, tests/support/rehearsals.py);
# the drills start clusters of their own, one at a time (tests/conftest.py: flare_lock).


def _prepared_run(tmp_path, method: str, overrides: list[str], names=("site1", "site2")):
    """A tiny fundus federation, a deploy run folder for ``method`` and an unstarted local FLARE cluster."""
    spec = synthesize("fundus", tmp_path / "fed", scale=0.05, size=32)
    run_toml = tmp_path / "run.toml"
    run_toml.write_text(f'federation = "{spec}"\nmethod = "{method}"\nseed = 0\n')
    out = tmp_path / "out"
    prepare_run(load_deploy_config(run_toml, overrides), out, sites=list(names))
    from fedseg.data.spec import load_federation

    fed = load_federation(spec)
    cluster = LocalCluster(tmp_path / "nv", {n: fed.site(n).datalist for n in names}, tmp_path / "sites", policy=POLICY)
    return spec, run_toml, out, fed, cluster


def _provision(cluster) -> None:
    """Provision the cluster's kits, or skip where nvflare cannot provision (no working install)."""
    try:
        cluster.provision()
    except Exception as e:  # pragma: no cover - environment without a working nvflare
        pytest.skip(f"nvflare cannot provision here: {e}")


def _simulate_same(tmp_path, spec, run_toml, overrides, names=("site1", "site2")):
    """The in-process simulation of the same run on the same sites."""
    sim_spec = subset_spec(spec, list(names), tmp_path / "sim" / "federation.toml")
    return run(
        load_deploy_config(run_toml, [*overrides, "checkpoint_keep=final"], federation=str(sim_spec)),
        out=tmp_path / "sim" / "out",
        progress=False,
    )


def test_rehearsal_equals_simulation_and_refuses_a_foreign_kit(tmp_path, flare_cluster):
    """2 rounds of FedAvg deployed (server + 2 site processes, mutual TLS) give the simulation's weights bitwise;
    a site holding a kit from another provisioning (another root CA) never joins.

    Bitwise because tensors cross as raw safetensors bytes, each site process trains
    with one torch thread like the simulation, and the seeds follow the federation order.
    """
    # Prepare
    from fedseg.deployment.flare import Admin, provision_kits
    from fedseg.deployment.run import configure_site

    run_toml, out = flare_cluster.prepare(tmp_path, "fedavg", OVERRIDES)
    port = int(json.loads((flare_cluster.cluster.root / "kits" / "kits.json").read_text())["server"].rsplit(":", 1)[1])
    foreign = provision_kits(tmp_path / "foreign", ["intruder"], "localhost", port, port + 1)
    datalist = flare_cluster.cluster.site_data["site3"]
    configure_site(foreign["intruder"], datalist, tmp_path / "sites" / "intruder", "intruder")
    intruder = start_site(foreign["intruder"], flare_cluster.cluster.env, tmp_path / "intruder.log")
    try:
        # Execute
        t0 = time.perf_counter()
        flare_cluster.submit(out, timeout=75)
        took = time.perf_counter() - t0
        admin = Admin(flare_cluster.kits["admin"])
        connected = admin.connected_sites()
        admin.close()
    finally:
        stop(intruder, grace=0.5)
    sim = flare_cluster.simulate(tmp_path, run_toml, OVERRIDES)
    # Assert
    dep = json.loads((out / "results.json").read_text())
    a = load_file(str(out / "checkpoints" / "server.safetensors"))
    b = load_file(str(tmp_path / "sim" / "out" / "checkpoints" / "server.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert dep["per_site_dice"] == sim["per_site_dice"] and dep["deploy"]["dropouts"] == []
    assert connected == sorted(flare_cluster.cluster.site_data), f"an unprovisioned participant joined: {connected}"
    assert took < 75


def test_provision_writes_mtls_kits_that_allow_fedseg(tmp_path):
    """Kits for server, each site and the admin; mutual TLS in every config; fedseg's components on the allow-list."""
    # Execute
    from fedseg.deployment.run import provision

    kits = provision(["siteA", "siteB"], "localhost:18002", tmp_path / "kits")
    # Assert
    assert sorted(kits) == ["admin", "server", "siteA", "siteB"]
    client = json.loads((kits["siteA"] / "startup" / "fed_client.json").read_text())
    assert (
        client["client"]["connection_security"] == "mtls"
        and client["servers"][0]["service"]["target"] == "localhost:18002"
    )
    allow = json.loads((kits["siteB"] / "local" / "resources.json").read_text())["class_allow_list"]
    assert "fedseg.deployment.flare." in allow and "nvflare.collab." in allow
    assert (kits["siteA"] / "startup" / "rootCA.pem").read_bytes() == (
        kits["server"] / "startup" / "rootCA.pem"
    ).read_bytes()


def test_cli_deploy_errors_name_the_fix(tmp_path, capsys):
    """Bad deploy arguments fail with a message that says what to give."""
    from fedseg.cli import main

    assert main(["deploy", "provision", "--sites", "a", "--server", "nohostport", "--out", str(tmp_path)]) == 2
    assert "must be HOST:PORT" in capsys.readouterr().err
    assert main(["deploy", "run", "x.toml", "--kits", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "no kits.json" in capsys.readouterr().err


def test_fga_deployed_equals_simulation(tmp_path, flare_cluster):
    """20 FGA steps (10 rounds × 2 lockstep steps, float64) over NVIDIA FLARE with mutual TLS give the
    simulation's weights bitwise: one gradient exchange per step over the same channel as FedAvg's rounds."""
    # Prepare
    overrides = [o for o in OVERRIDES if not o.startswith("rounds=")] + ["rounds=10", "train.dtype=float64"]
    run_toml, out = flare_cluster.prepare(tmp_path, "fga", overrides)
    # Execute
    flare_cluster.submit(out, timeout=120)
    flare_cluster.simulate(tmp_path, run_toml, overrides)
    # Assert
    dep = json.loads((out / "results.json").read_text())
    assert sum(e["steps"] for e in dep["history"]) == 20 and all(e["in_sync"] for e in dep["history"])
    a = load_file(str(out / "checkpoints" / "server.safetensors"))
    b = load_file(str(tmp_path / "sim" / "out" / "checkpoints" / "server.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _wait_round(out, rnd: int, timeout: float) -> None:
    from fedseg.deployment.supervise import completed_round

    end = time.monotonic() + timeout
    while completed_round(out) < rnd:
        if time.monotonic() > end:
            raise TimeoutError(f"round {rnd} not reached in {timeout:g} s")
        time.sleep(0.2)


@pytest.mark.usefixtures("flare_lock")  # a cluster of its own
def test_hung_site_cut_off_and_killed_site_rejoins_over_flare(tmp_path):
    """Faults on real FLARE processes (mutual TLS, 127.0.0.1): site1 frozen (SIGSTOP on its processes) for longer
    than the round deadline is cut off and answers again once thawed; site2 killed mid-run is left out, and
    when restarted it logs in with a new session, the supervisor ends the job after the current round and
    re-submits it from that checkpoint with site2 back. The run finishes with every round.

    Sized so that the faults land mid-run: the freeze after round 2, the kill one round after the thaw (round
    4 or 5 of 10), and while site2 is out every round of the first job waits out the deadline (6 s) and the
    probe (2 s), so that job reaches the supervisor's restart request with rounds to spare."""
    import threading

    # Prepare
    overrides = [o for o in OVERRIDES if not o.startswith(("rounds=", "deploy.round_deadline_s"))] + [
        "rounds=10",
        "train.local_steps=20",
        "train.local_epochs=none",
        "deploy.round_deadline_s=6",
        "deploy.probe_timeout_s=2",
        "deploy.rejoin_wait_s=20",
        "eval.every=5",
    ]
    _spec, _run_toml, out, _, cluster = _prepared_run(tmp_path, "fedavg", overrides)
    _provision(cluster)
    with cluster:
        worker = threading.Thread(
            target=lambda: submit_run(cluster.kits["admin"], out, ["site1", "site2"], timeout=400, log=lambda m: None),
            daemon=True,
        )
        worker.start()
        # Execute: freeze site1 for longer than the deadline
        _wait_round(out, 2, 240)
        cluster.pause("site1")
        time.sleep(7)  # the deadline (6 s) and a little
        cluster.resume("site1")
        r = json.loads((out / "checkpoints" / "progress.json").read_text())["round"]
        _wait_round(out, r + 1, 60)
        # kill site2, then restart it
        cluster.kill("site2")
        t_kill = time.monotonic()
        time.sleep(1)
        cluster.start_site("site2")
        worker.join(400)
        t_end = time.monotonic()
    # Assert
    assert not worker.is_alive(), "the supervised run did not finish"
    res = json.loads((out / "results.json").read_text())
    drops = res["deploy"]["dropouts"]
    assert len(res["history"]) == 10
    assert any(d["site"] == "site1" and "timed out after 6" in d["reason"] for d in drops), drops
    assert any(d["site"] == "site2" for d in drops)
    assert set(res["history"][-1]["train_loss"]) == {"site1", "site2"}, "site2 did not rejoin"
    rec = res["deploy"]["recoveries"]
    assert rec and rec[-1]["reason"] == "rejoin of ['site2']" and rec[-1]["sites"] == ["site1", "site2"]
    assert len(res["deploy"]["jobs"]) >= 2
    print(f"kill -> end of run {t_end - t_kill:.1f} s; recoveries {rec}")


@pytest.mark.usefixtures("flare_lock")  # a cluster of its own
def test_server_killed_and_resumed_over_flare_equals_simulation(tmp_path):
    """The FLARE server process is killed mid-run (its job dies with it; the supervisor's admin session breaks);
    after a restart of the server, `fedseg deploy run --resume OUT` continues from the last round checkpoint as a
    new job, the sites reconnect by themselves and reload their checkpoints, and the final weights equal the
    uninterrupted simulation bitwise."""
    import threading

    from fedseg.deployment.run import deploy_run

    # Prepare
    overrides = [o for o in OVERRIDES if not o.startswith("rounds=")] + [
        "rounds=8",
        "train.local_steps=20",
        "train.local_epochs=none",
    ]
    spec, run_toml, out, _, cluster = _prepared_run(tmp_path, "fedavg", overrides)
    _provision(cluster)
    box: dict = {}

    def first():
        try:
            submit_run(cluster.kits["admin"], out, ["site1", "site2"], timeout=300, log=lambda m: None)
        except Exception as e:
            box["error"] = e

    with cluster:
        worker = threading.Thread(target=first, daemon=True)
        worker.start()
        # Execute: kill the server after round 2, restart it, resume
        _wait_round(out, 2, 240)
        cluster.kill("server")
        worker.join(120)
        killed_at = json.loads((out / "checkpoints" / "progress.json").read_text())["round"]
        cluster.start_server()
        t0 = time.monotonic()
        res = deploy_run(None, cluster.root / "kits", out, resume=True, timeout=300)
        resume_s = time.monotonic() - t0
    _simulate_same(tmp_path, spec, run_toml, overrides)
    # Assert
    assert not worker.is_alive() and "error" in box and killed_at < 8
    assert res is not None and res["deploy"]["resumed"] and len(res["history"]) == 8
    a = load_file(str(out / "checkpoints" / "server.safetensors"))
    b = load_file(str(tmp_path / "sim" / "out" / "checkpoints" / "server.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    print(f"server killed after round {killed_at}; restart + resume to the end took {resume_s:.1f} s")


def test_hostile_site_over_flare_is_rejected_and_the_run_finishes(tmp_path, flare_cluster):
    """site3's processes run modified code that sends 3e38 weights (averaged in, they would train every site to
    NaN the next round; tests/support/rehearsals.py: HOSTILE_SITE).  Over FLARE with mutual TLS the server rejects each
    such reply (update norm), the run finishes, and the global model is bitwise the simulation of site1 alone:
    site3 had no influence.  The network is MONAI's SegResNet named in the run config with [model.kwargs]: the
    server and the site processes build it from the run config they share."""
    # Prepare
    names = ["site1", "site3"]
    over = [
        *[o for o in OVERRIDES if not o.startswith("model.")],
        "model.name=segresnet",
        "model.kwargs={init_filters = 8, blocks_down = [1, 1, 1], blocks_up = [1, 1]}",
    ]
    run_toml, out = flare_cluster.prepare(tmp_path, "fedavg", over, names=names)
    # Execute
    flare_cluster.submit(out, names, timeout=150)
    flare_cluster.simulate(tmp_path, run_toml, over, names=("site1",))
    # Assert
    dep = json.loads((out / "results.json").read_text())
    a = load_file(str(out / "checkpoints" / "server.safetensors"))
    b = load_file(str(tmp_path / "sim" / "out" / "checkpoints" / "server.safetensors"))
    assert any("convInit" in k for k in a), sorted(a)[:3]  # SegResNet's layers
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    drops = [d for d in dep["deploy"]["dropouts"] if d["task"] == "train"]
    assert [(d["round"], d["site"]) for d in drops] == [(0, "site3"), (1, "site3")]
    assert all("update norm" in d["reason"] and "deploy.max_update_ratio = 10" in d["reason"] for d in drops), drops
    assert len(dep["history"]) == 2 and all(set(h["train_loss"]) == {"site1"} for h in dep["history"])


def test_rehearsal_on_a_running_cluster_needs_its_sites(tmp_path):
    """``rehearse(cluster=...)`` submits to a running cluster only when it has the run's sites with the
    federation's datalists, and takes no policy (the running sites keep theirs): one error naming the fix."""
    from fedseg.deployment.run import rehearse
    from fedseg.foundation.errors import ConfigError

    spec = synthesize("fundus", tmp_path / "fed", scale=0.05, size=32)
    run_toml = tmp_path / "run.toml"
    run_toml.write_text(f'federation = "{spec}"\nmethod = "fedavg"\n')
    cluster = LocalCluster(tmp_path / "nv", {"site1": tmp_path / "elsewhere.json"}, tmp_path / "sites")
    cluster.kits = {"admin": tmp_path / "admin"}  # as provisioned
    with pytest.raises(ConfigError, match=r"has no site \['site1', 'site2'\] with the datalist of federation"):
        rehearse(run_toml, 2, tmp_path / "out", cluster=cluster)
    with pytest.raises(ConfigError, match="give policy= only without cluster="):
        rehearse(run_toml, 2, tmp_path / "out", cluster=cluster, policy={"secure_aggregation": False})
    assert not (tmp_path / "out").exists()
