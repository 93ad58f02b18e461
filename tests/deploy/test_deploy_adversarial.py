"""A hostile site over the byte channel: whatever it sends, the run finishes without it.

One provisioned site rewrites its replies (:class:`fedseg.deployment.transport.LoopbackChannel`
with a fault function), one row per attack.  For every row:

* the run finishes (``serve`` returns results);
* the site is recorded in ``results.json["deploy"]["dropouts"]`` with the reason;
* an attack on training replies has no influence at all: the global model equals
  the run where the attacker is unreachable (FedAvg over the honest site alone),
  so it is finite and not the attacker's;
* an attack on evaluation replies changes no weight (they equal the honest run's)
  and no fake case is pooled into the reported Dice.
"""

from __future__ import annotations

import dataclasses
import json
import re
import struct
from pathlib import Path

import pytest
import torch

from fedseg.algorithms import REGISTRY
from fedseg.deployment.server import serve
from fedseg.deployment.transport import DeployError, LoopbackChannel
from fedseg.deployment.wire import decode_reply, decode_task, encode_reply
from fedseg.foundation.errors import ConfigError, PayloadError
from fedseg.foundation.messages import Reply
from tests.deploy.test_deploy import REHEARSAL, _prepare, _runtimes
from tests.support.helpers import same_arrays, server_state, tiny_config, tiny_sites


def _cfg(**deploy):
    cfg = tiny_config("fedavg", rounds=2)
    return dataclasses.replace(cfg, params={**cfg.params, "deploy": {"round_deadline_s": 30.0, **deploy}})


def _serve(out: Path, faults: dict) -> dict:
    cfg, data = _cfg(), tiny_sites(2)
    _prepare(out, cfg, list(data))
    res = serve(out, LoopbackChannel(_runtimes(out, data), faults), log=lambda m: None)
    assert res is not None, "the run did not finish"
    assert json.loads((out / "results.json").read_text())["deploy"]["dropouts"] == res["deploy"]["dropouts"]
    return res


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Runs to compare with: honest, and each site unreachable (computed once per module, on demand)."""
    cache: dict[str, tuple[dict, dict]] = {}

    def get(kind: str) -> tuple[dict, dict]:
        if kind not in cache:
            out = tmp_path_factory.mktemp(kind)
            res = _serve(out, {} if kind == "honest" else {kind: "die"})
            cache[kind] = (res, server_state(out))
        return cache[kind]

    return get


# ------------------------------------------------------------------ rewriters
def _training(fn):
    """Rewrite only training replies (they carry tensors), pass evaluation replies through."""

    def fault(op, blob):
        r = decode_reply(blob)
        return fn(r, blob) if r.arrays else blob

    return fault


def _evaluation(fn):
    """Rewrite only evaluation replies (``per_case`` metrics)."""

    def fault(op, blob):
        r = decode_reply(blob)
        if "per_case" not in r.metrics:
            return blob
        return encode_reply(Reply(r.arrays, {"per_case": fn(r.metrics["per_case"])}, r.num_samples))

    return fault


def _raw(header) -> bytes:
    """A blob of a safetensors header (any JSON text) and no tensor."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text


def _rewrite_metric(key: str, fn):
    """A fault that replaces the metric ``key`` of every reply that has it by ``fn(value)``."""

    def fault(op, blob):
        r = decode_reply(blob)
        if key not in r.metrics:
            return blob
        return encode_reply(Reply(r.arrays, {**r.metrics, key: fn(r.metrics[key])}, r.num_samples))

    return fault


def _huge_samples(r, blob):
    return encode_reply(Reply(r.arrays, r.metrics, 10**30))


def _huge_weights(r, blob):
    return encode_reply(
        Reply(
            {k: torch.full_like(v, 3e38) if v.is_floating_point() else v for k, v in r.arrays.items()},
            r.metrics,
            r.num_samples,
        )
    )


def _extra_tensor(r, blob):
    return encode_reply(Reply({**r.arrays, "global/backdoor": torch.ones(3)}, r.metrics, r.num_samples))


def _missing_tensor(r, blob):
    return encode_reply(Reply(dict(list(r.arrays.items())[1:]), r.metrics, r.num_samples))


def _metadata_list(r, blob):
    return _raw({"__metadata__": ["fedseg", "1"]})


def _nested_header(r, blob):
    return _raw(b"[" * 200_000 + b"]" * 200_000)


def _nested_metadata(r, blob):
    return _raw({"__metadata__": {"fedseg": "[" * 5000 + "]" * 5000}})


TRAINING_ATTACKS = [
    (
        "site2",
        _huge_samples,
        "claims 1000000000000000000000000000000 training samples, but the site declared 8 at setup",
    ),
    ("site2", _huge_weights, "update norm"),
    ("site2", _extra_tensor, "tensor names differ from the expected set (missing [], unexpected ['global/backdoor'])"),
    ("site1", _extra_tensor, "tensor names differ from the expected set (missing [], unexpected ['global/backdoor'])"),
    ("site2", _missing_tensor, "tensor names differ from the expected set (missing ["),
    ("site2", _metadata_list, "metadata is a list"),
    ("site2", _nested_header, "payload header nests 200000 levels deep"),
    ("site2", _nested_metadata, "payload metadata nests 5000 levels deep"),
]


@pytest.mark.parametrize("attacker, rewrite, reason", TRAINING_ATTACKS, ids=lambda x: getattr(x, "__name__", str(x)))
def test_training_attack_has_no_influence(tmp_path, reference, attacker, rewrite, reason):
    """Every poisoned training reply is rejected, so the global model is the honest site's FedAvg alone
    (bitwise the run where the attacker is unreachable), finite and not the attacker's."""
    # Execute
    res = _serve(tmp_path / "run", {attacker: _training(rewrite)})
    # Assert
    _, w_without = reference(attacker)
    w = server_state(tmp_path / "run")
    assert same_arrays(w, w_without)
    assert all(torch.isfinite(v).all() and v.abs().max() < 1e6 for v in w.values() if v.is_floating_point())
    drops = [d for d in res["deploy"]["dropouts"] if d["task"] == "train"]
    assert [(d["round"], d["site"]) for d in drops] == [(0, attacker), (1, attacker)]
    assert all(d["reason"].startswith("rejected: ") and reason in d["reason"] for d in drops), drops
    assert all(set(e["train_loss"]) == {"site1", "site2"} - {attacker} for e in res["history"])
    assert res["deploy"]["declared_samples"] == {
        "site1": {"training": 6, "validation": 3, "testing": 3},
        "site2": {"training": 8, "validation": 3, "testing": 3},
    }


EVAL_ATTACKS = [
    (
        lambda pc: {"not-a-candidate": next(iter(pc.values()))},
        r"scores \['not-a-candidate'\], but was asked for the candidates \['global'\]",
    ),
    (
        lambda pc: {k: [] for k in pc},
        r"rejected: .* 0 (validation|testing) cases scored for 'global', but the site declared 3 at setup",
    ),
    (
        lambda pc: {k: [[] for _ in v] for k, v in pc.items()},
        r"a case of 'global' is \[\], not a list of 1 metric scores",
    ),
    (
        lambda pc: {k: [[1.0]] * 5000 for k in pc},
        r"rejected: .* 5000 (validation|testing) cases scored for 'global', but the site declared 3 at setup",
    ),
    (lambda pc: {k: [[1.5] for _ in v] for k, v in pc.items()}, r"a score of 'global' is outside \[0, 1\]"),
]


@pytest.mark.parametrize(
    "rewrite, reason",
    EVAL_ATTACKS,
    ids=["unknown-candidate", "no-cases", "empty-case", "5000-fake-cases", "dice-above-1"],
)
def test_evaluation_attack_inflates_nothing(tmp_path, reference, rewrite, reason):
    """Forged evaluation scores are rejected: training is the honest run's bitwise, the attacker's cases are
    not pooled into the reported Dice, and validation scores (which pick the best round) are the honest site's."""
    # Execute
    res = _serve(tmp_path / "run", {"site2": _evaluation(rewrite)})
    # Assert
    _honest, w_honest = reference("honest")
    assert same_arrays(server_state(tmp_path / "run"), w_honest)
    assert res["num_cases"] == {"site1": 3, "site2": 0}
    assert res["global_dice"] == pytest.approx(res["per_site_dice"]["site1"]) and res["global_dice"] < 0.99
    for entry in res["history"]:
        assert list(entry["val_dice"]["global"]) == ["site1"]
    drops = res["deploy"]["dropouts"]
    assert {d["site"] for d in drops} == {"site2"} and {d["task"] for d in drops} == {"evaluate"}
    assert len(drops) == 3 and all(re.search(reason, d["reason"]) for d in drops), drops


AGGREGATE_ATTACKS = [
    (lambda m, n: ({"not-a-candidate": next(iter(m.values()))}, n), r"but was asked for the candidates \['global'\]"),
    (lambda m, n: (m, 5000), r"claims 5000 (validation|testing) cases, but the site declared 3 at setup"),
    (lambda m, n: ({k: [1.5 for _ in v] for k, v in m.items()}, n), r"a score of 'global' is outside \[0, 1\]"),
    (lambda m, n: ({k: "high" for k in m}, n), r"mean of 'global' is high, not one mean per metric"),
]


@pytest.mark.parametrize(
    "rewrite, reason", AGGREGATE_ATTACKS, ids=["unknown-candidate", "5000-cases", "dice-above-1", "not-a-list"]
)
def test_forged_aggregate_scores_inflate_nothing(tmp_path, reference, rewrite, reason):
    """The same forgeries in the reply layout of the sites' default policy (``evaluation = "aggregates"``: each
    candidate's mean and the case count): the server checks the expanded means as it checks per-case scores, so
    training is the honest run's bitwise and no forged mean or case is pooled into the reported Dice."""
    cfg, data = _cfg(), tiny_sites(2)
    _prepare(tmp_path, cfg, list(data))

    def fault(op, blob):
        r = decode_reply(blob)
        if "mean" not in r.metrics:
            return blob
        means, n = rewrite(r.metrics["mean"], r.num_samples)
        return encode_reply(Reply(r.arrays, {**r.metrics, "mean": means}, n))

    policy = dataclasses.replace(REHEARSAL, evaluation="aggregates")
    res = serve(tmp_path, LoopbackChannel(_runtimes(tmp_path, data, policy), {"site2": fault}), log=lambda m: None)
    assert res is not None
    _honest, w_honest = reference("honest")
    assert same_arrays(server_state(tmp_path), w_honest)
    assert res["num_cases"] == {"site1": 3, "site2": 0}
    assert res["global_dice"] == pytest.approx(res["per_site_dice"]["site1"])
    drops = res["deploy"]["dropouts"]
    assert {(d["site"], d["task"]) for d in drops} == {("site2", "evaluate")}
    assert len(drops) == 3 and all(re.search(reason, d["reason"]) for d in drops), drops


# ---------------------------------------------------------- committed state
def test_poisoned_aggregate_is_never_checkpointed(tmp_path):
    """With the update-norm rule off, huge weights reach the aggregate: the server refuses to commit it
    (deploy.max_abs_value), the run stops with the reason, and no checkpoint of that round exists."""
    cfg, data = _cfg(max_update_ratio=0), tiny_sites(2)
    _prepare(tmp_path, cfg, list(data))
    with pytest.raises(DeployError, match="beyond deploy.max_abs_value = 1e\\+12; it is not checkpointed"):
        serve(
            tmp_path,
            LoopbackChannel(_runtimes(tmp_path, data), {"site2": _training(_huge_weights)}),
            log=lambda m: None,
        )
    assert not (tmp_path / "checkpoints" / "progress.json").exists()
    assert not (tmp_path / "checkpoints" / "server.safetensors").exists()


def _stopped_run(out: Path) -> None:
    cfg, data = _cfg(), tiny_sites(2)
    _prepare(out, cfg, list(data), stop_after=1)
    assert serve(out, LoopbackChannel(_runtimes(out, data)), log=lambda m: None) is None
    desc = json.loads((out / "deploy.json").read_text())
    desc.update(resume=True, stop_after=None)
    (out / "deploy.json").write_text(json.dumps(desc))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda w: {**w, next(iter(w)): torch.zeros(2, 2)}, r"has shape \[2, 2\] float32, expected"),
        (
            lambda w: {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in w.items()},
            "non-finite values in",
        ),
        (lambda w: {k: v.double() if v.is_floating_point() else v for k, v in w.items()}, "float64, expected"),
        (lambda w: dict(list(w.items())[1:]), r"names differ \(missing \["),
    ],
    ids=["wrong-shape", "nan", "wrong-dtype", "missing-name"],
)
def test_resume_refuses_a_damaged_checkpoint_naming_the_file(tmp_path, damage, message):
    """--resume checks the names, shapes and dtypes recorded at save time and finiteness, and names the file."""
    from safetensors.torch import save_file

    # Prepare
    _stopped_run(tmp_path)
    path = tmp_path / "checkpoints" / "server.safetensors"
    save_file({k: v.contiguous() for k, v in damage(server_state(tmp_path)).items()}, str(path))
    # Execute / Assert
    with pytest.raises(
        ConfigError, match=f"checkpoint file {re.escape(str(path))} is not the one this run saved: .*{message}"
    ):
        serve(tmp_path, LoopbackChannel(_runtimes(tmp_path, tiny_sites(2))), log=lambda m: None)


def test_resume_names_an_unreadable_checkpoint(tmp_path):
    _stopped_run(tmp_path)
    path = tmp_path / "checkpoints" / "best.safetensors"
    path.write_bytes(b"\x00" * 3)
    with pytest.raises(ConfigError, match=f"checkpoint file {re.escape(str(path))} cannot be read"):
        serve(tmp_path, LoopbackChannel(_runtimes(tmp_path, tiny_sites(2))), log=lambda m: None)


# --------------------------------------------------------------------- keys
def test_provisioned_private_keys_and_ca_state_are_owner_only(tmp_path):
    """Every private key and the CA state (``.provision/*/state``) is 0600 in 0700 folders; no shipped kit
    holds the CA state or any key but its own."""
    from fedseg.deployment.run import provision

    # Execute
    kits = provision(["siteA", "siteB"], "localhost:18002", tmp_path / "kits")
    # Assert
    root = tmp_path / "kits"
    secret = [p for p in root.rglob("*") if p.is_file() and (b"PRIVATE KEY" in p.read_bytes() or "state" in p.parts)]
    assert (
        any(p.name == "cert.json" for p in secret) and sum(p.suffix == ".key" for p in secret) >= 8
    )  # 4 kits + 4 copies
    for p in secret:
        assert p.stat().st_mode & 0o077 == 0, f"{p} is {oct(p.stat().st_mode)}"
        assert any(d.stat().st_mode & 0o077 == 0 for d in p.parents if root in d.parents), (
            f"every folder above {p} is open"
        )
    for d in [root / ".provision", *(root / ".provision").rglob("*")]:
        if d.is_dir():
            assert d.stat().st_mode & 0o077 == 0, f"{d} is {oct(d.stat().st_mode)}"
    for name, kit in kits.items():
        assert kit.stat().st_mode & 0o077 == 0 and (kit / "startup").stat().st_mode & 0o077 == 0
        keys = [p for p in kit.rglob("*") if p.is_file() and b"PRIVATE KEY" in p.read_bytes()]
        assert [p.name for p in keys] == [("server" if name == "server" else "client") + ".key"], keys
        assert not list(kit.rglob("cert.json")) and ".provision" not in {p.name for p in kit.rglob("*")}


# ------------------------------------------------------------------ callers
def test_site_refuses_a_call_from_another_participant(tmp_path):
    """FLARE's call context names the authenticated caller: another site asking this one to train, restore or
    checkpoint is refused before the runtime sees the bytes; the server is served."""
    from types import SimpleNamespace

    from nvflare.collab.api.context import get_call_context, set_call_context

    from fedseg.deployment.flare import FedsegSite

    # Prepare
    site = FedsegSite()
    site._runtime = _runtimes(tmp_path, tiny_sites(1))["site1"]
    previous = get_call_context()

    def call_as(caller: str, op: str, payload: bytes = b"{}"):
        set_call_context(SimpleNamespace(caller=caller, server=SimpleNamespace(name="server")))
        try:
            return FedsegSite.call(site, op=op, payload=payload)
        finally:
            set_call_context(previous)

    # Execute / Assert
    for op in ("task", "restore", "checkpoint", "ping"):
        with pytest.raises(PermissionError, match=f"site site1: refused '{op}' from 'site2'; only the server"):
            call_as("site2", op)
    assert json.loads(call_as("server", "ping")) == {"site": "site1", "ready": False}


@pytest.mark.parametrize(
    "payload, message",
    [
        ({"round": -1}, "round -1 refused"),
        ({"round": 999999}, "round 999999 refused"),
        ({"round": "3"}, "round '3' refused"),
        ({"round": True}, "round True refused"),
        ({}, "round None refused"),
    ],
)
def test_site_refuses_checkpoints_of_impossible_rounds(tmp_path, payload, message):
    """After setup, checkpoint/restore take a round in 0..rounds only; the site's checkpoint listing stays intact."""
    from fedseg.foundation.config import dump_toml

    rt = _runtimes(tmp_path, tiny_sites(1))["site1"]
    rt.call(
        "setup",
        json.dumps(
            {"run_id": "run-1", "sites": ["site1"], "data": {}, "config_toml": dump_toml(_cfg().to_dict())}
        ).encode(),
    )
    for op in ("checkpoint", "restore"):
        with pytest.raises(PayloadError, match=message):
            rt.call(op, json.dumps(payload).encode())
    assert json.loads(rt.call("checkpoint", b'{"round": 2}')) == {"site": "site1", "round": 2}
    assert json.loads(rt.call("restore", b'{"round": 2}'))["restored"] == 2


@pytest.mark.parametrize("run_id", [".", "..", "../x", "a/b", "", "-x", "x" * 200, 7, None])
def test_site_refuses_run_ids_that_are_not_plain_names(tmp_path, run_id):
    rt = _runtimes(tmp_path, tiny_sites(1))["site1"]
    with pytest.raises(PayloadError, match="is not a plain name"):
        rt.call("setup", json.dumps({"run_id": run_id, "sites": ["site1"], "data": {}, "config_toml": ""}).encode())
    assert not (tmp_path / "sites").exists() or not any((tmp_path / "sites").rglob("config.toml"))


# ------------------------------------------------------------ control files
def test_torn_last_dropouts_line_is_skipped_with_a_warning(tmp_path):
    """A crash mid-append leaves half a line in dropouts.jsonl: the resumed run skips it, warns, and ends with results."""
    # Prepare: a run stopped after round 1 with site2 unreachable, then a torn line
    cfg, data = _cfg(), tiny_sites(2)
    _prepare(tmp_path, cfg, list(data), stop_after=1)
    assert serve(tmp_path, LoopbackChannel(_runtimes(tmp_path, data), {"site2": "die"}), log=lambda m: None) is None
    with (tmp_path / "dropouts.jsonl").open("a") as fh:
        fh.write('{"round": 1, "site": "si')
    desc = json.loads((tmp_path / "deploy.json").read_text())
    desc.update(resume=True, stop_after=None)
    (tmp_path / "deploy.json").write_text(json.dumps(desc))
    logged: list[str] = []
    # Execute
    res = serve(tmp_path, LoopbackChannel(_runtimes(tmp_path, tiny_sites(2))), log=logged.append)
    # Assert
    assert res is not None and [d["site"] for d in res["deploy"]["dropouts"]] == ["site2"] * len(
        res["deploy"]["dropouts"]
    )
    assert len(res["deploy"]["dropouts"]) >= 3
    assert any("dropouts.jsonl line" in m and "torn or malformed" in m for m in logged)


def test_control_files_survive_a_crash_mid_write(tmp_path, monkeypatch):
    """deploy.json, supervisor.json and results.json go through a temp file + fsync + rename: a crash
    before the rename leaves the previous file whole."""
    from fedseg.deployment import supervise
    from fedseg.execution.results import write_results
    from fedseg.seams.checkpoint import save_json

    for name in ("deploy.json", "supervisor.json", "results.json"):
        save_json({"run_id": "run-1", "v": 1}, tmp_path / name)

    def crash(fd):
        raise OSError("disk full (simulated crash before the rename)")

    monkeypatch.setattr("os.fsync", crash)
    with pytest.raises(OSError):
        save_json({"run_id": "run-1", "v": 2}, tmp_path / "deploy.json")
    with pytest.raises(OSError):
        supervise.Supervisor(None, tmp_path, ["site1"], None, _params())._save_record()
    with pytest.raises(OSError):
        write_results({"method": "fedavg", "seed": 0}, tmp_path)
    for name in ("deploy.json", "supervisor.json", "results.json"):
        assert json.loads((tmp_path / name).read_text()) == {"run_id": "run-1", "v": 1}, name


def _params():
    from fedseg.deployment.params import DeployParams

    return DeployParams()


def test_damaged_deploy_json_is_named_and_damaged_supervisor_record_set_aside(tmp_path):
    """A torn deploy.json (an older version crashed mid-write) gets one error naming the file and the fix; a torn
    supervisor.json (a log) is moved aside with a warning and the supervisor starts a new record."""
    from fedseg.deployment.server import read_deploy_json
    from fedseg.deployment.supervise import Supervisor

    (tmp_path / "deploy.json").write_text('{"run_id": "fedavg-12')
    with pytest.raises(
        ConfigError, match=f"{re.escape(str(tmp_path / 'deploy.json'))} is damaged .* restore it from a backup"
    ):
        read_deploy_json(tmp_path)
    (tmp_path / "deploy.json").write_text('{"run_id": "..", "sites": []}')
    with pytest.raises(ConfigError, match="lacks a plain run_id"):
        read_deploy_json(tmp_path)
    (tmp_path / "supervisor.json").write_text('{"jobs": [{"job": "a')
    logged: list[str] = []
    sup = Supervisor(None, tmp_path, ["site1"], None, _params(), log=logged.append)
    assert sup.jobs == [] and (tmp_path / "supervisor.json.damaged").is_file()
    assert any("supervisor.json was damaged" in m for m in logged)


# ---------------------------------------------------------------- processes
ORPHAN_SCRIPT = """
import sys, time
from pathlib import Path
from fedseg.deployment import run as R

class Cluster(R.LocalCluster):  # rehearse's cluster, with sleepers in place of FLARE's processes
    def provision(self):
        self.kits = {"server": self.root}
    def _sleeper(self, name):
        return R._spawn([sys.executable, "-c", "import time; time.sleep(120)"], self.root, self.root / f"{name}.log", {})
    def start_server(self):
        self.procs["server"] = self._sleeper("server")
    def start_site(self, name):
        self.procs[name] = self._sleeper(name)

root = Path(sys.argv[1])
with R.terminate_as_interrupt(), Cluster(root, {"site1": "", "site2": ""}, root / "w") as c:
    print(" ".join(str(p.pid) for p in c.procs.values()), flush=True)
    time.sleep(120)
"""


def test_sigterm_on_rehearse_stops_the_processes_it_started(tmp_path):
    """rehearse's server and site processes run in sessions of their own (so a terminal's Ctrl-C reaches only
    the command); a SIGTERM to the command must still stop them, not leave them re-parented to init."""
    import signal
    import subprocess
    import sys

    import psutil

    # Prepare
    proc = subprocess.Popen([sys.executable, "-c", ORPHAN_SCRIPT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    pids = [int(x) for x in proc.stdout.readline().split()]
    assert len(pids) == 3 and all(psutil.pid_exists(p) for p in pids)
    # Execute
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=30)
    # Assert
    assert rc != 0

    def alive(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    assert not [p for p in pids if alive(p)]


METRIC_ATTACKS = [
    (
        lambda m: {k: v for k, v in m.items() if k != "loss"},
        r"metrics keys differ from the expected set \(missing \['loss'\], unexpected \[\]\)",
    ),
    (lambda m: {**m, "loss": "0.1; rm -rf /"}, "metrics loss is a string, expected a number"),
    (lambda m: {**m, "extra": [1, 2]}, r"unexpected \['extra'\]"),
]


@pytest.mark.parametrize("rewrite, reason", METRIC_ATTACKS, ids=["missing-loss", "loss-as-string", "extra-key"])
def test_training_metrics_with_another_layout_are_rejected(tmp_path, reference, rewrite, reason):
    """Algorithms read training metrics (a loss, step counts): a reply whose metric keys or value kinds differ
    from every other reply to the same task is rejected (a missing key would be a KeyError, a string a
    TypeError in the server's code)."""
    res = _serve(
        tmp_path / "run",
        {"site2": _training(lambda r, blob: encode_reply(Reply(r.arrays, rewrite(r.metrics), r.num_samples)))},
    )
    assert same_arrays(server_state(tmp_path / "run"), reference("site2")[1])
    drops = [d for d in res["deploy"]["dropouts"] if d["task"] == "train"]
    assert len(drops) == 2 and all(re.search(reason, d["reason"]) for d in drops), drops


def test_forged_fedsm_routing_replies_are_rejected_and_the_run_finishes(tmp_path):
    """FedSM's server picks γ (here one per personalized model) from the sites' ``"route"`` replies; a site
    whose route replies lack the sums it reads (a KeyError in the server's code before the check) is
    rejected with the reason, and the run finishes with its composite."""
    cfg = dataclasses.replace(
        tiny_config("fedsm", rounds=2),
        params={"fedsm": {"selector_width": 0.0625, "gamma": "auto-per-model"}, "deploy": {"round_deadline_s": 30.0}},
    )
    data = tiny_sites(2)
    _prepare(tmp_path, cfg, list(data))

    forge = _rewrite_metric("selections", lambda sel: [{} for _ in sel])
    res = serve(tmp_path, LoopbackChannel(_runtimes(tmp_path, data), {"site2": forge}), log=lambda m: None)
    assert res is not None and "fedsm" in {r["name"] for r in res["rows"]}
    drops = [d for d in res["deploy"]["dropouts"] if d["task"] == "route"]
    assert drops and {d["site"] for d in drops} == {"site2"}
    assert all("route reply: a selection's" in d["reason"] for d in drops), drops  # γ's and the test report's
    assert any("route reply: a selection's dice_sum is not in" in d["reason"] for d in drops), drops
    assert set(res["fedsm"]["per_site"]) == {"site1"}  # the routing on test of the sites that answered validly
    best = json.loads((tmp_path / "checkpoints/best.json").read_text())["fedsm"]["config"]
    assert len(best["gamma_per_model"]) == 2


def _fails_after(n_tasks: int):
    """A site that answers its first ``n_tasks`` tasks, then sends bytes that decode to nothing (rejected)."""
    seen = {"n": 0}

    def fault(op, blob):
        seen["n"] += 1
        return blob if seen["n"] <= n_tasks else b"\x07not a payload"

    return fault


@pytest.mark.parametrize("start", [0, 3], ids=["from-the-first-task", "after-three-tasks"])
@pytest.mark.parametrize("method", sorted(m for m, cls in REGISTRY.items() if not cls.needs_pooled_site))
def test_every_method_finishes_when_a_site_goes_bad_mid_run(tmp_path, method, start):
    """Whatever exchange a site stops answering validly in — a method's first exchange (Auto-FedAvg's
    ``describe``, FedSM's setup), a training round, one step of a lockstep exchange (FGA, Auto-FedAvg's β
    steps) — its later replies are rejected and every deployable method finishes with the sites that answer
    (deploy.min_sites = 1): no KeyError in a server half reading the replies, finite weights, the site
    recorded in ``dropouts``."""
    cfg = dataclasses.replace(_cfg(), method=method, rounds=2)
    if method.startswith("fedsm"):
        cfg = dataclasses.replace(cfg, params={**cfg.params, "fedsm": {"selector_width": 0.0625, "selector_rounds": 1}})
    data = tiny_sites(3)
    _prepare(tmp_path, cfg, list(data))
    res = serve(
        tmp_path, LoopbackChannel(_runtimes(tmp_path, data), {"site3": _fails_after(start)}), log=lambda m: None
    )
    assert res is not None, "the run did not finish"
    drops = res["deploy"]["dropouts"]
    assert drops and {d["site"] for d in drops} == {"site3"}, drops
    state = server_state(tmp_path)
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def _down_for(site: str, tasks: set[int], chan: LoopbackChannel):
    """A call function: ``site`` is unreachable for its task calls numbered in ``tasks`` (1-based)."""
    seen = {"n": 0}

    def call(s, op, payload, timeout):
        if op == "task" and s == site:
            seen["n"] += 1
            if seen["n"] in tasks:
                raise ConnectionError(f"{site} restarting")
        return chan(s, op, payload, timeout)

    return call


def test_fga_site_that_misses_a_step_is_resynced_and_back_in_sync_next_round(tmp_path):
    """FGA keeps every site's weights and Adam state equal only if each applies every averaged gradient.
    site3 is unreachable for its second task of round 1 (step 1): it is left out of the rest of round 1
    (gradients averaged over site1 and site2), marked stale, and the round ends with site1's weights and
    optimizer state kept for it; with step 0 of round 2 it receives both, and at the end of round 2 all three
    sites' state digests are equal again (``in_sync``), site3's gradients are in the average
    (``train_loss`` has it) and no resync entry is left in the checkpoint."""
    cfg = dataclasses.replace(_cfg(), method="fga", rounds=2)
    data = tiny_sites(3)
    _prepare(tmp_path, cfg, list(data))
    res = serve(tmp_path, _down_for("site3", {2}, LoopbackChannel(_runtimes(tmp_path, data))), log=lambda m: None)
    first, second = res["history"]
    assert first["stale"] == ["site3"] and first["in_sync"]  # the two sites that finished the round agree
    assert "stale" not in second and second["in_sync"], second
    assert set(second["train_loss"]) == {"site1", "site2", "site3"}
    assert [(d["round"], d["site"]) for d in res["deploy"]["dropouts"]] == [(0, "site3")]
    assert not [k for k in server_state(tmp_path) if k.startswith("resync/")]


def test_fga_without_the_resync_a_site_that_missed_a_step_stays_out_of_sync(tmp_path, monkeypatch):
    """The resync is what brings site3 back: with the resync arrays dropped from its step-0 task, the same
    run ends round 2 with different digests (the run still finishes, with the warning)."""
    import fedseg.algorithms.fga as fga
    from fedseg.algorithms.gradients import FGAEquivalenceWarning

    real = fga.lockstep_round

    def no_resync(*args, **kwargs):
        kwargs["state"] = fga.without_resync(kwargs.get("state") or {}, fga.ROLE)
        return real(*args, **kwargs)

    monkeypatch.setattr(fga, "lockstep_round", no_resync)
    cfg = dataclasses.replace(_cfg(), method="fga", rounds=2)
    data = tiny_sites(3)
    _prepare(tmp_path, cfg, list(data))
    with pytest.warns(FGAEquivalenceWarning, match="different weights or optimizer states"):
        res = serve(tmp_path, _down_for("site3", {2}, LoopbackChannel(_runtimes(tmp_path, data))), log=lambda m: None)
    assert res["history"][1]["in_sync"] is False


def test_autofedavg_learns_the_weights_of_the_sites_that_answer(tmp_path):
    """Auto-FedAvg with site3 unreachable from the start: β is learned and α used over site1 and site2
    (α sums to 1 over them), site3's row of β keeps its initial value, and the run finishes."""
    cfg = dataclasses.replace(_cfg(), method="autofedavg", rounds=2)
    cfg = dataclasses.replace(cfg, params={**cfg.params, "autofedavg": {"interval": 1, "steps": 2}})
    data = tiny_sites(3)
    _prepare(tmp_path, cfg, list(data))
    res = serve(tmp_path, LoopbackChannel(_runtimes(tmp_path, data), {"site3": "die"}), log=lambda m: None)
    for entry in res["history"]:
        assert entry["alpha_learned"] and entry["left_out"] == ["site3"]
        assert set(entry["alpha"]) == {"site1", "site2"} and abs(sum(entry["alpha"].values()) - 1) < 1e-9
    state = server_state(tmp_path)
    beta, beta0 = state["autofedavg/beta/*"], state["autofedavg/beta0/*"]
    assert beta[2] == beta0[2] and not torch.equal(beta[:2], beta0[:2])


@pytest.mark.parametrize("method, key", [("fga", "grad/"), ("fedsm", "grad/"), ("scaffold", "dc/")])
def test_a_site_sending_a_huge_tensor_the_server_did_not_send_is_rejected(tmp_path, method, key):
    """A reply's tensors that its task did not send are updates too: a lockstep step's gradient (FGA, FedSM's
    default ``fga`` selector) and SCAFFOLD's control change ``dc`` (added to the server's control variate c,
    which steers every site's local steps).  A site that scales them by 10⁴ (finite, so no NaN check catches
    it) while its model update stays honest is rejected by the update-norm rule (their norm against the
    median of the other sites'), and the run finishes (lockstep sites in sync)."""
    cfg = dataclasses.replace(_cfg(), method=method, rounds=2)
    if method == "fedsm":
        cfg = dataclasses.replace(cfg, params={**cfg.params, "fedsm": {"selector_width": 0.0625}})
    data = tiny_sites(3)
    _prepare(tmp_path, cfg, list(data))

    def scale(op, blob):
        r = decode_reply(blob)
        if not any(k.startswith(key) for k in r.arrays):
            return blob
        arrays = {k: v * 1e4 if k.startswith(key) else v for k, v in r.arrays.items()}
        return encode_reply(Reply(arrays, r.metrics, r.num_samples))

    res = serve(tmp_path, LoopbackChannel(_runtimes(tmp_path, data), {"site2": scale}), log=lambda m: None)
    drops = res["deploy"]["dropouts"]
    assert drops and {d["site"] for d in drops} == {"site2"}
    assert all("update norm" in d["reason"] for d in drops), drops
    assert all(e.get("in_sync", e.get("selector_in_sync", True)) for e in res["history"])


def test_a_site_claiming_more_lockstep_steps_is_rejected(tmp_path):
    """An FGA round lasts as many steps as its longest site claims (``fga.steps = "max"``): a site claiming
    10⁶ steps per round would hold every site in the round for ever.  The claim follows from the run's
    settings and the training count the site declared at setup, so another claim is rejected and the round
    has the honest sites' steps (3: ⌈10 / 4⌉ batches of the largest honest site, one epoch)."""
    cfg = dataclasses.replace(_cfg(), method="fga", rounds=1)
    data = tiny_sites(3)
    _prepare(tmp_path, cfg, list(data))

    claim = _rewrite_metric("steps_per_round", lambda n: 10**6)
    res = serve(tmp_path, LoopbackChannel(_runtimes(tmp_path, data), {"site1": claim}), log=lambda m: None)
    drops = res["deploy"]["dropouts"]
    assert [d["site"] for d in drops] == ["site1"] and "claims 1000000 steps per round" in drops[0]["reason"]
    assert res["history"][0]["steps"] == 3


def test_autofedavg_layers_are_not_chosen_by_a_site_naming_tensors_the_model_lacks(tmp_path):
    """Layer-wise Auto-FedAvg learns one β row per parameter the sites report at ``describe``; site1 (first in
    the federation, whose list was taken before) names a tensor the model does not have: its list is not
    used, and β's layers are the model's parameters (those the honest site reports)."""
    cfg = dataclasses.replace(_cfg(), method="autofedavg", rounds=1)
    cfg = dataclasses.replace(cfg, params={**cfg.params, "autofedavg": {"granularity": "layer", "interval": 1}})
    data = tiny_sites(2)
    _prepare(tmp_path, cfg, list(data))

    forge = _rewrite_metric("parameters", lambda names: ["backdoor.weight"])
    serve(tmp_path, LoopbackChannel(_runtimes(tmp_path, data), {"site1": forge}), log=lambda m: None)
    state = server_state(tmp_path)
    layers = {k.removeprefix("autofedavg/beta/") for k in state if k.startswith("autofedavg/beta/")}
    params = {k.removeprefix("global/") for k in state if k.startswith("global/")}
    assert "backdoor.weight" not in layers and layers and layers <= params


def test_cwt_visit_with_a_huge_update_is_rejected_against_the_other_sites_last_visits(tmp_path):
    """CWT asks one site at a time, so an exchange has no other reply to compare an update with: the
    reference is then the other sites' last accepted updates of the same task kind.  site2 returns
    w + 10⁴·(w' − w): each of its visits after site1's first is rejected and skipped (the model goes on
    to site3 unchanged), and the run finishes with finite weights."""
    cfg = dataclasses.replace(_cfg(), method="cwt", rounds=2)
    data = tiny_sites(3)
    _prepare(tmp_path, cfg, list(data))
    sent: dict[str, torch.Tensor] = {}

    def amplify(op, blob):
        r = decode_reply(blob)
        arrays = {
            k: sent[k] + 1e4 * (v - sent[k]) if k in sent and v.is_floating_point() else v for k, v in r.arrays.items()
        }
        return encode_reply(Reply(arrays, r.metrics, r.num_samples))

    chan = LoopbackChannel(_runtimes(tmp_path, data), {"site2": amplify})

    def call(site, op, payload, timeout):
        if op == "task" and site == "site2":  # remember what the server sent it, to amplify the update
            sent.clear()
            sent.update({k: v for k, v in decode_task(payload).arrays.items() if v.is_floating_point()})
        return chan(site, op, payload, timeout)

    res = serve(tmp_path, call, log=lambda m: None)
    drops = [d for d in res["deploy"]["dropouts"] if d["task"] == "train"]
    assert len(drops) == 2 and {d["site"] for d in drops} == {"site2"}
    assert all("update norm" in d["reason"] for d in drops), drops
    assert all(e["skipped"] == ["site2"] for e in res["history"])
    state = server_state(tmp_path)
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def test_honest_site_with_many_more_cases_is_not_rejected(tmp_path):
    """Two honest sites in epoch mode, 4 and 400 training cases at batch 4: 1 and 100 local Adam steps a round.
    The large site's update ‖w_k − w‖ is ~20× the small one's (measured: 1.13 against 0.055 in round 1), so a
    plain norm rule with ratio 10 rejected the site holding 99 % of the data every round.  Compared per
    √(local step) (steps from the declared counts, 1 and 100) the ratio is ~2: no site is left out, and each
    round's aggregate holds both sites.  A hostile reply scaled by 1e4 is still rejected (the tests above)."""
    # Prepare
    data = {"site1": tiny_sites(1, n_train=4, seed=1)["site1"], "site2": tiny_sites(1, n_train=400, seed=2)["site1"]}
    cfg = _cfg()
    _prepare(tmp_path / "dep", cfg, list(data))
    # Execute
    res = serve(tmp_path / "dep", LoopbackChannel(_runtimes(tmp_path / "dep", data)), log=lambda m: None)
    # Assert
    assert res["deploy"]["dropouts"] == [], [d["reason"] for d in res["deploy"]["dropouts"]]
    assert all(set(e["train_loss"]) == {"site1", "site2"} for e in res["history"])
