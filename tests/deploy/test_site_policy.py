"""A deployed site's own policy, enforced whatever the server's job says; its release log; secure aggregation
on by default for deployments.

The tests act as the server: they write the run config the server sends (secure aggregation switched off, DP
below a site's floor, a method or task the site does not allow) and serve it over the in-process byte
channel the deployment tests use (:class:`fedseg.deployment.transport.LoopbackChannel`), with the
sites' runtimes holding their own policies.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging

import pytest

from fedseg.deployment.policy import SitePolicy, policy_from_dict, read_policy, write_policy
from fedseg.deployment.server import REFUSED, load_deploy_config, serve
from fedseg.deployment.site import SiteConfig, SiteRuntime
from fedseg.deployment.transport import DeployError, LoopbackChannel
from fedseg.deployment.wire import decode_reply, encode_task
from fedseg.foundation.config import PrivacyConfig, dump_toml
from fedseg.foundation.errors import ConfigError, PayloadError
from fedseg.foundation.messages import Task
from tests.deploy.test_deploy import HEADER, _prepare, _workload
from tests.support.helpers import tiny_config, tiny_sites

OPEN = SitePolicy(secure_aggregation=False, min_sites=2)
"""A policy that joins runs without secure aggregation and of two sites (the cheapest runs to test with)."""


def _cfg(method="fedavg", rounds=1, privacy=None):
    cfg = tiny_config(method, rounds=rounds)
    return dataclasses.replace(
        cfg,
        privacy=privacy or PrivacyConfig(),
        params={**cfg.params, "deploy": {"round_deadline_s": 30.0, "max_update_ratio": 0}},
    )


def _runtimes(tmp, data, policies):
    def loader(name, datalist, header, cfg):
        return data[name], _workload(cfg)

    return {
        n: SiteRuntime(SiteConfig(n, "(in memory)", str(tmp / "sites" / n)), loader=loader, policy=policies.get(n))
        for n in data
    }


def _setup_desc(cfg, sites=("site1", "site2", "site3"), run_id="run-1"):
    return json.dumps({"run_id": run_id, "sites": list(sites), "data": HEADER, "config_toml": dump_toml(cfg.to_dict())})


# ------------------------------------------------------------------ refusal at setup
def test_site_refuses_a_job_that_switches_secure_aggregation_off(tmp_path, caplog):
    """The server sends a run config with ``privacy.secure_aggregation = false``; site3's policy requires it
    (the default).  site3 refuses at setup — logged at the site, a reply the server logs as its dropout — and
    answers no task of the run; the other sites (no policy) train on and the run ends with results."""
    cfg, data = _cfg(), tiny_sites(3)
    _prepare(tmp_path / "dep", cfg, list(data))
    runtimes = _runtimes(tmp_path, data, {"site3": SitePolicy()})
    logs: list[str] = []
    with caplog.at_level(logging.WARNING, logger="fedseg.deployment.site"):
        res = serve(tmp_path / "dep", LoopbackChannel(runtimes), log=logs.append)
    why = "the run has privacy.secure_aggregation = false and the policy requires secure aggregation"
    assert any(why in r.getMessage() and "site3" in r.getMessage() for r in caplog.records), caplog.text
    assert any("site site3 left out of 'setup': refused the run" in m and why in m for m in logs), logs
    assert set(res["deploy"]["refused"]) == {"site3"} and why in res["deploy"]["refused"]["site3"]
    assert set(res["history"][0]["train_loss"]) == {"site1", "site2"}
    # site3 sent its refusal and answers to pings: no task reply, nothing of its data
    sent = [json.loads(line) for line in runtimes["site3"].release_log().read_text().splitlines()]
    assert sent[0]["op"] == "setup" and {e["op"] for e in sent if "sha256" in e} == {"setup", "ping"}
    assert all("refuses run" in e["error"] for e in sent if e["op"] == "task")


def test_all_sites_refusing_stops_the_run_cleanly_with_the_reasons(tmp_path):
    """Every site requires secure aggregation and the server switches it off: the run stops at setup with one
    DeployError naming each site's reason, and the server records the refusals (``refused.json``) so that its
    supervisor does not submit the same job again."""
    cfg, data = _cfg(), tiny_sites(2)
    _prepare(tmp_path / "dep", cfg, list(data))
    runtimes = _runtimes(tmp_path, data, {n: SitePolicy() for n in data})
    with pytest.raises(DeployError, match="site site1 refuses run run-1 by its policy") as e:
        serve(tmp_path / "dep", LoopbackChannel(runtimes), log=lambda m: None)
    assert "site site2 refuses" in str(e.value)
    assert set(json.loads((tmp_path / "dep" / REFUSED).read_text())) == {"site1", "site2"}
    assert not (tmp_path / "dep" / "checkpoints").exists()


@pytest.mark.parametrize(
    ("policy", "privacy", "method", "why"),
    [
        (SitePolicy(secure_aggregation=False, methods=("fedavg",)), None, "scaffold", "method 'scaffold' is not"),
        (
            SitePolicy(secure_aggregation=False, dp="sample"),
            PrivacyConfig(dp="off"),
            "fedavg",
            "privacy.dp = 'off' and the policy requires 'sample'",
        ),
        (
            SitePolicy(secure_aggregation=False, min_noise_multiplier=1.0),
            PrivacyConfig(dp="sample", noise_multiplier=0.5),
            "fedavg",
            "σ = 0.5 is below the policy's floor 1",
        ),
        (
            SitePolicy(secure_aggregation=False, max_epsilon=4.0),
            PrivacyConfig(dp="sample", epsilon=8.0),
            "fedavg",
            "privacy.epsilon = 8.0 is above the policy's ceiling 4",
        ),
        (
            SitePolicy(secure_aggregation=False, max_epsilon=8.0),
            PrivacyConfig(dp="sample", epsilon=8.0, budget_action="warn"),
            "fedavg",
            "budget_action = 'warn'",
        ),
        (SitePolicy(secure_aggregation=False, min_sites=4), None, "fedavg", "3 sites and the policy's minimum is 4"),
    ],
)
def test_site_refuses_a_run_below_each_floor(tmp_path, policy, privacy, method, why):
    """Acting as the server with only what it sends (the setup message): a run below any floor of the site's
    policy is refused with that floor named, and every later task of the run is answered with the refusal."""
    cfg = dataclasses.replace(_cfg(privacy=privacy), method=method)
    data = tiny_sites(3)
    rt = _runtimes(tmp_path, data, {"site1": policy})["site1"]
    reply = json.loads(rt.call("setup", _setup_desc(cfg).encode()))
    assert set(reply) == {"site", "refused"} and why in reply["refused"]
    with pytest.raises(PayloadError, match="refuses run run-1 by its policy"):
        rt.call("task", encode_task(Task("train", {}, {"round": 1})))
    assert rt.site is None


def test_site_takes_a_run_that_meets_its_floors_and_keeps_its_own_participant_minimum(tmp_path):
    """The same policy accepts a run at its floors; the site runs with secure aggregation as its policy says."""
    policy = SitePolicy(dp="sample", min_noise_multiplier=1.0, max_epsilon=50.0, methods=("fedavg",))
    cfg = _cfg(privacy=PrivacyConfig(secure_aggregation=True, dp="sample", noise_multiplier=1.0, epsilon=50.0))
    rt = _runtimes(tmp_path, tiny_sites(3), {"site1": policy})["site1"]
    reply = json.loads(rt.call("setup", _setup_desc(cfg).encode()))
    assert "refused" not in reply and reply["num_train"] == 6
    assert rt.site.cfg.privacy.secure_aggregation


def test_site_runs_with_its_own_participant_minimum_when_the_server_asks_for_fewer(tmp_path):
    """The server's job asks secure aggregation to sum with 2 sites; a site whose policy says 4 runs with 4
    (``privacy.secagg_min_sites``), and one whose policy says 2 keeps the server's 3."""
    cfg = _cfg(privacy=PrivacyConfig(secure_aggregation=True, secagg_min_sites=2))
    strict = _runtimes(tmp_path / "a", tiny_sites(4), {"site1": SitePolicy(min_sites=4)})["site1"]
    reply = json.loads(strict.call("setup", _setup_desc(cfg, ("site1", "site2", "site3", "site4")).encode()))
    assert "refused" not in reply and strict.site.cfg.privacy.secagg_min_sites == 4
    cfg3 = _cfg(privacy=PrivacyConfig(secure_aggregation=True, secagg_min_sites=3))
    lax = _runtimes(tmp_path / "b", tiny_sites(3), {"site1": SitePolicy(min_sites=2)})["site1"]
    reply = json.loads(lax.call("setup", _setup_desc(cfg3).encode()))
    assert "refused" not in reply and lax.site.cfg.privacy.secagg_min_sites == 3


# ------------------------------------------------------------------ per task
def test_site_refuses_task_kinds_its_policy_does_not_allow(tmp_path):
    """site2's policy answers training but not evaluation: its evaluation replies are refused (logged by the
    server as its dropouts), so the run's test scores hold site1's cases only; a release of its final model
    (FedSM's ``fedsm_release``) without consent is refused before any handler runs."""
    cfg, data = _cfg(rounds=2), tiny_sites(2)
    _prepare(tmp_path / "dep", cfg, list(data))
    strict = SitePolicy(secure_aggregation=False, min_sites=2, tasks=("train",), release_models=False)
    runtimes = _runtimes(tmp_path, data, {"site2": strict})
    logs: list[str] = []
    res = serve(tmp_path / "dep", LoopbackChannel(runtimes), log=logs.append)
    refused = [d for d in res["deploy"]["dropouts"] if d["site"] == "site2"]
    assert refused and all(d["task"] == "evaluate" for d in refused)
    assert all("task kind 'evaluate' is not among the policy's tasks ['train']" in d["reason"] for d in refused)
    assert set(res["history"][0]["train_loss"]) == {"site1", "site2"}
    assert res["num_cases"] == {"site1": 3, "site2": 0}
    with pytest.raises(PayloadError, match="releases this site's final model and the policy has release_models"):
        runtimes["site2"].call("task", encode_task(Task("fedsm_release", {}, {"site": "site2"})))


# ------------------------------------------------------------------ aggregates-only evaluation
def test_aggregates_only_evaluation_sends_per_site_means_and_keeps_the_means(tmp_path):
    """site2 answers evaluations with each candidate's mean over its cases only: the server sees one mean per
    metric, never a case (what it sees is captured on the wire).  Each site's Dice and the pooled mean over
    all cases are those of the same run with per-case replies (a mean counted for each of the site's declared
    cases pools exactly), up to rounding; the per-case lists of site2 are its mean repeated."""
    cfg = _cfg(rounds=2)
    runs = {}
    wire: list[dict] = []

    def spy(op, blob):
        reply = decode_reply(blob)
        if "mean" in reply.metrics or "per_case" in reply.metrics:
            wire.append(reply.metrics)
        return blob

    same = dataclasses.replace(OPEN, reproducible=True)  # both runs train alike: the run seed drives the batches
    cases = dataclasses.replace(same, evaluation="per_case")
    for name, policy in (("cases", cases), ("means", dataclasses.replace(same, evaluation="aggregates"))):
        data = tiny_sites(2)
        _prepare(tmp_path / name, cfg, list(data))
        runtimes = _runtimes(tmp_path / name, data, {"site2": policy})
        faults = {"site2": spy} if name == "means" else {}
        runs[name] = serve(tmp_path / name, LoopbackChannel(runtimes, faults), log=lambda m: None)
    assert wire and all(set(m) == {"mean"} for m in wire)
    assert all(len(v) == 1 for m in wire for v in m["mean"].values())  # one mean per metric channel
    a, b = runs["cases"], runs["means"]
    assert b["deploy"]["aggregate_evaluation"] == ["site2"] and a["deploy"]["aggregate_evaluation"] == []
    for s in ("site1", "site2"):
        assert b["per_site_dice"][s] == pytest.approx(a["per_site_dice"][s], rel=1e-12, abs=1e-12)
    assert b["global_dice"] == pytest.approx(a["global_dice"], rel=1e-12)
    site2_cases = next(iter(b["per_case_dice"].values()))["site2"]
    assert len(site2_cases) == 3 and len(set(site2_cases)) == 1
    assert len(set(next(iter(a["per_case_dice"].values()))["site2"])) > 1


# ------------------------------------------------------------------ release log
def test_release_log_lists_every_reply_sent_and_survives_restore(tmp_path):
    """Every reply that left site1 (the bytes the server received, captured on the channel) has one line in
    its release log, in order, with the sha256 of those bytes, the operation, the task kind and the round;
    the log lives beside the run folders, so a restore of a round checkpoint keeps it whole."""
    cfg, data = _cfg(rounds=2), tiny_sites(2)
    _prepare(tmp_path / "dep", cfg, list(data))
    runtimes = _runtimes(tmp_path, data, {"site1": OPEN})
    received: list[tuple[str, str]] = []
    inner = LoopbackChannel(runtimes)

    def channel(site, op, payload, timeout):
        out = inner(site, op, payload, timeout)
        if site == "site1":
            received.append((op, hashlib.sha256(out).hexdigest()))
        return out

    serve(tmp_path / "dep", channel, log=lambda m: None)
    rt = runtimes["site1"]
    log = [json.loads(line) for line in rt.release_log().read_text().splitlines()]
    assert [(e["op"], e["sha256"]) for e in log] == received
    tasks = [e for e in log if e["op"] == "task"]
    assert {e["kind"] for e in tasks} >= {"train", "evaluate"} and {
        e["round"] for e in tasks if e["kind"] == "train"
    } == {1, 2}
    assert all(e["to"] == "server" and e["run_id"] == "run-1" and e["bytes"] > 0 for e in log)
    before = rt.release_log().read_text()
    rt.call("restore", b'{"round": 1}')
    after = rt.release_log().read_text()
    assert after.startswith(before) and len(after.splitlines()) == len(before.splitlines()) + 1


# ------------------------------------------------------------------ the policy file
def test_policy_file_errors_name_each_bad_key_and_its_fix(tmp_path):
    """One error lists every bad key on a line of its own with the value it takes and the default."""
    path = tmp_path / "policy.json"
    path.write_text(
        json.dumps({"secure_aggregation": "yes", "dp": "strong", "min_sites": 0, "methods": [], "colour": 1})
    )
    with pytest.raises(ConfigError) as e:
        read_policy(path)
    lines = str(e.value).splitlines()
    assert len(lines) == 5
    assert 'secure_aggregation = "yes"; give true or false (default: true' in lines[0]
    assert "dp = \"strong\"; give 'off' or 'sample' or 'client'" in lines[1]
    assert "min_sites = 0; give an integer >= 1 (default: 3" in lines[2]
    assert "methods = []; give a non-empty list of names" in lines[3] and '"*" (any)' in lines[3]
    assert "unknown key 'colour'; remove it" in lines[4]
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        read_policy(path)
    with pytest.raises(ConfigError, match="does not exist; write one"):
        read_policy(tmp_path / "none.json")
    with pytest.raises(ConfigError, match="not an object"):
        policy_from_dict([1])


def test_policy_defaults_round_trip_and_deploy_site_writes_them(tmp_path):
    """The defaults written to a file read back equal; "*" stands for any method or task."""
    path = write_policy(tmp_path / "p.json")
    assert read_policy(path) == SitePolicy()
    assert json.loads(path.read_text())["methods"] == "*"
    custom = SitePolicy(methods=("fedavg",), tasks=("train", "evaluate"), evaluation="aggregates", max_epsilon=8.0)
    assert read_policy(write_policy(tmp_path / "q.json", custom)) == custom


def test_configure_site_writes_the_default_policy_and_checks_a_given_one(tmp_path):
    """``fedseg deploy site`` writes the defaults into the kit's local/ folder and names the file in the site
    config; a policy given with --policy is checked before anything starts."""
    from fedseg.deployment.run import configure_site
    from fedseg.deployment.site import read_site_config

    kit = tmp_path / "kit"
    (kit / "startup").mkdir(parents=True)
    (kit / "startup" / "fed_client.json").write_text(json.dumps({"client": {"fqsn": "site1"}}))
    datalist = tmp_path / "dl.json"
    datalist.write_text("{}")
    cfg = read_site_config(configure_site(kit, datalist, tmp_path / "work"))
    assert cfg.policy == str((kit / "local" / "fedseg_policy.json").resolve())
    assert read_policy(cfg.policy) == SitePolicy()
    bad = tmp_path / "bad.json"
    bad.write_text('{"evaluation": "none"}')
    with pytest.raises(ConfigError, match="evaluation = \"none\"; give 'per_case' or 'aggregates'"):
        configure_site(kit, datalist, tmp_path / "work", policy=bad)


# ------------------------------------------------------------------ deployment defaults
def test_deployments_default_to_secure_aggregation(tmp_path):
    """A run config that does not set ``privacy.secure_aggregation`` deploys with it (and with the update-ratio
    rule off, which compares single sites' updates); a method whose server reads each site's reply stops with
    the setting that deploys it in the clear and the policy key its sites need; an explicit false is kept."""
    run = tmp_path / "run.toml"
    run.write_text('federation = "fed.toml"\nmethod = "fedavg"\n')
    (tmp_path / "fed.toml").write_text('name = "x"\n[data]\nmode = "2d"\n[data.labels]\nfg = [1]\n')
    cfg = load_deploy_config(run)
    assert cfg.privacy.secure_aggregation and cfg.params["deploy"]["max_update_ratio"] == 0
    with pytest.raises(ConfigError, match='privacy.secure_aggregation=false.*"secure_aggregation": false'):
        load_deploy_config(run, method="ditto")
    clear = load_deploy_config(run, ["privacy.secure_aggregation=false"], method="ditto")
    assert not clear.privacy.secure_aggregation and "max_update_ratio" not in clear.params.get("deploy", {})
    with pytest.raises(ConfigError, match="deploy.max_update_ratio=0.*--set privacy.secure_aggregation=false"):
        load_deploy_config(run, ["deploy.max_update_ratio=10"])


def test_fedsm_selector_gradients_in_the_clear_are_warned_about_at_both_ends(tmp_path, caplog):
    """FedSM with ``selector_training = "fga"`` and no secure aggregation: at setup every site warns that its
    selector gradient of every step reaches the server in the clear, and the server logs the same (the sites
    here stop answering after setup: the warnings come before any task)."""
    cfg = _cfg("fedsm")
    cfg = dataclasses.replace(cfg, params={**cfg.params, "fedsm": {"selector_training": "fga"}})
    data = tiny_sites(2)
    _prepare(tmp_path / "dep", cfg, list(data))
    inner = LoopbackChannel(_runtimes(tmp_path, data, {"site1": OPEN}))

    def channel(site, op, payload, timeout):
        if op == "task":
            raise ConnectionError(f"site {site} is gone")
        return inner(site, op, payload, timeout)

    logs: list[str] = []
    with caplog.at_level(logging.WARNING, logger="fedseg.deployment.site"), pytest.raises(DeployError):
        serve(tmp_path / "dep", channel, log=logs.append)
    assert "site site1: fedsm.selector_training = 'fga'" in caplog.text
    assert "selector gradient of every step to the server in the clear" in caplog.text
    assert any(m.startswith("[deploy] warning: fedsm.selector_training = 'fga'") for m in logs), logs


def test_flare_rehearsal_sites_refuse_a_job_without_secure_aggregation(tmp_path, flare_cluster):
    """Over NVIDIA FLARE (provisioned kits, mutual TLS, a server and two site processes): the sites keep the
    default policy ``fedseg deploy site`` writes (secure aggregation required; each job's site processes read
    the policy file when the job starts) and the server submits a run with ``privacy.secure_aggregation =
    false``.  Both sites refuse at setup and log why; the server logs each refusal, records them and ends the
    job; the supervisor stops with the reasons instead of re-submitting."""
    from tests.support.rehearsals import OVERRIDES

    _run_toml, out = flare_cluster.prepare(tmp_path, "fedavg", OVERRIDES)
    mark = flare_cluster.mark()
    with (
        flare_cluster.policy(SitePolicy()),  # the defaults, as `fedseg deploy site` writes them
        pytest.raises(DeployError, match="too few sites accepted the run") as e,
    ):
        flare_cluster.submit(out, timeout=90, log=lambda m: None)
    why = "the run has privacy.secure_aggregation = false and the policy requires secure aggregation"
    assert why in str(e.value)
    assert set(json.loads((out / REFUSED).read_text())) == {"site1", "site2"}
    assert len(json.loads((out / "supervisor.json").read_text())["jobs"]) == 1  # not re-submitted
    server_log = flare_cluster.since(mark, "server", expect="[deploy] the run stops")
    assert "site site1 left out of 'setup': refused the run" in server_log
    assert "[deploy] the run stops" in server_log and "FATAL_SYSTEM_ERROR" not in server_log  # a clean end
    for name in ("site1", "site2"):
        site_log = flare_cluster.since(mark, name, expect=why)
        assert f"site {name} refuses run" in site_log and why in site_log


# ------------------------------------------------------------------ every privacy setting has a site rule
def _settings_table() -> dict[str, str]:
    """docs/privacy.md's table "Settings the server ships, and what the site does with them": {setting: rule}."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "privacy.md").read_text()
    section = text.split("### Settings the server ships, and what the site does with them", 1)[1].split("\n#", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 3 and cells[0] not in ("setting", "---"):
            rows[cells[0]] = cells[1]
    return rows


def test_every_privacy_setting_is_pinned_checked_or_harmless_in_the_docs_table():
    """Each field of ``privacy`` (PrivacyConfig) has a row in docs/privacy.md's table of what a deployed site
    does with the settings the server ships; each row names a setting that exists (a run config field, a field
    of its section, or a field of a method's or the deployment's parameters) or a task kind, and says "pinned",
    "checked against policy `field`" with fields of :class:`SitePolicy`, or "harmless".  A new privacy setting
    without a row fails here."""
    import re

    from fedseg.algorithms.fedsm.params import FedSMParams
    from fedseg.deployment.params import DeployParams
    from fedseg.foundation.config import RunConfig

    rows = _settings_table()
    missing = [f"privacy.{f.name}" for f in dataclasses.fields(PrivacyConfig) if f"`privacy.{f.name}`" not in rows]
    assert not missing, f"add a row for {missing} to docs/privacy.md's settings table"
    top = {f.name: f for f in dataclasses.fields(RunConfig)}
    sections = {"fedsm": FedSMParams, "deploy": DeployParams}
    policy_fields = {f.name for f in dataclasses.fields(SitePolicy)}
    for setting, rule in rows.items():
        assert re.match(r"(pinned|checked against policy `\w+`|harmless)", rule), (setting, rule)
        named = set(re.findall(r"policy `(\w+)`", rule))
        assert named <= policy_fields, (setting, named - policy_fields)
        m = re.fullmatch(r"task `(\w+)`|`([\w.]+)`", setting)
        assert m, setting
        if m.group(2):
            head, _, tail = m.group(2).partition(".")
            if not tail:
                assert head in top, setting
                continue
            cls = sections.get(head) or top[head].default_factory  # type: ignore[misc]
            assert tail in {f.name for f in dataclasses.fields(cls)}, setting
