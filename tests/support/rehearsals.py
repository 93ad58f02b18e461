"""The NVIDIA FLARE cluster shared by the rehearsals that need no fault (fixture ``flare_cluster``,
tests/conftest.py): provisioned once (root CA, mutual TLS), one server process and one process per site on
127.0.0.1, and each test submits its own run to it as a new FLARE job, as a deployment takes one job after
another.  The drills that kill, freeze or restart processes start clusters of their own.

Its participants:

* ``site1``, ``site2``: sites of a small synthetic fundus federation (:attr:`SharedCluster.fundus`), with the
  rehearsals' policy :data:`POLICY`;
* ``site3``: a fundus site whose processes run modified code (:data:`HOSTILE_SITE`): every trained model it
  returns is 3e38 in every weight;
* ``ras``, ``lps``: the two sites of a tiny volume federation (:attr:`SharedCluster.volumes`);
* the server, whose processes record every reply it accepts (:data:`SERVER_RECORDER`): task kind, round,
  step, and the names and dtypes of the arrays, one JSON line each (:meth:`SharedCluster.replies_since`).

The cluster's logs and records are appended to by every job: a test reads what was added since its
:meth:`SharedCluster.mark`.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fedseg.deployment.policy import POLICY_NAME, SitePolicy, policy_from_dict, write_policy

OVERRIDES = [
    "model.channels=[4,8,16]",
    "model.strides=[2,2]",
    "model.num_res_units=1",
    "train.batch_size=4",
    "rounds=2",
    "deploy.round_deadline_s=60",
    "deploy.setup_timeout_s=90",
    "deploy.shutdown_grace_s=1",  # once results.json is complete, end the job rather than wait for FLARE's own end
    "privacy.secure_aggregation=false",  # a deployment's default is on; these runs equal a plain simulation
]
"""A tiny U-Net, 2 rounds, in the clear: the rehearsals' run settings (each test adds its own).  FLARE takes
8-12 s on this machine to end a job whose results are written; the supervisor aborts it after 1 s instead."""

POLICY = {"secure_aggregation": False, "min_sites": 2, "reproducible": True, "evaluation": "per_case"}
"""The sites' policy in these rehearsals: they join runs without secure aggregation too, of two sites, let the run
seed drive their randomness (``reproducible``, no site salt: a rehearsal compares deployment with simulation
bitwise) and send per-case scores."""

HOSTILE_SITE = """
# Loaded at interpreter start by every Python process of the hostile site (PYTHONPATH): its site runtime
# returns its trained weights replaced by 3e38 (finite but huge), as a site running modified code would.
import fedseg.deployment.site as _site
from fedseg.deployment.wire import decode_reply, encode_reply
from fedseg.foundation.messages import Reply

_call = _site.SiteRuntime.call


def _evil(self, op, payload):
    out = _call(self, op, payload)
    if op == "task":
        r = decode_reply(out)
        if r.arrays:
            out = encode_reply(Reply({k: v.clone().fill_(3e38) if v.is_floating_point() else v for k, v in r.arrays.items()}, r.metrics, r.num_samples))
    return out


_site.SiteRuntime.call = _evil
"""

SERVER_RECORDER = """
# Loaded at interpreter start by the FLARE server's processes (PYTHONPATH): every reply the deployed server
# accepts is recorded (its task, and its arrays' names and dtypes) as one JSON line.
import json as _json

import fedseg.deployment.transport as _transport

_ask = _transport.RemoteTransport.ask


def _recording_ask(self, tasks, optional=False):
    replies = _ask(self, tasks, optional)
    with open({path!r}, "a") as fh:
        for s, r in replies.items():
            t = tasks[s]
            entry = {{"site": s, "kind": t.kind, "round": t.config.get("round"), "step": t.config.get("step")}}
            entry["arrays"] = {{k: str(v.dtype) for k, v in r.arrays.items()}}
            fh.write(_json.dumps(entry) + "\\n")
    return replies


_transport.RemoteTransport.ask = _recording_ask
"""


def with_pythonpath(folder: Path) -> str:
    """``folder`` in front of this process's PYTHONPATH (so the started processes import this fedseg)."""
    return os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)


class SharedCluster:
    """The shared cluster (see the module docstring); started by :meth:`start`, stopped by :meth:`close`."""

    FUNDUS_SITES = ("site1", "site2", "site3")
    VOLUME_SITES = ("ras", "lps")

    def __init__(self, root: Path, lock: Any):
        self.root = Path(root)
        self.lock = lock
        self.cluster: Any = None
        self.starts = 0
        self.fundus: Path | None = None
        self.volumes: Path | None = None
        self.replies = self.root / "server_replies.jsonl"

    # ----------------------------------------------------------------- life
    def _data(self) -> None:
        if self.fundus is None:
            from fedseg.data.synth import synthesize
            from tests.runs.test_volumes_run import write_federation

            self.fundus = synthesize("fundus", self.root / "fed", scale=0.05, size=32)
            self.volumes = write_federation(self.root / "vol", n=(2, 1, 1))

    def alive(self) -> bool:
        return self.cluster is not None and all(p.poll() is None for p in self.cluster.procs.values())

    def start(self) -> None:
        """Provision and start the cluster unless it runs (a cluster with a dead process is started anew)."""
        from fedseg.data.spec import load_federation
        from fedseg.deployment.run import LocalCluster, start_server, start_site

        if self.alive():
            return
        self.close()
        self.lock.acquire()
        try:
            self._data()
            fundus, volumes = load_federation(self.fundus), load_federation(self.volumes)
            site_data = {n: fundus.site(n).datalist for n in self.FUNDUS_SITES}
            site_data.update({n: volumes.site(n).datalist for n in self.VOLUME_SITES})
            self.starts += 1
            cluster = LocalCluster(self.root / f"nv{self.starts}", site_data, self.root / "sites", policy=POLICY)
            self.cluster = cluster
            cluster.provision()
            code = {"server": (SERVER_RECORDER.format(path=str(self.replies))), "site3": HOSTILE_SITE}
            env = {}
            for who, text in code.items():
                (self.root / who).mkdir(exist_ok=True)
                (self.root / who / "sitecustomize.py").write_text(text)
                env[who] = {**cluster.env, "PYTHONPATH": with_pythonpath(self.root / who)}
            logs = cluster.root / "logs"
            cluster.procs["server"] = start_server(cluster.kits["server"], env["server"], logs / "server.log")
            for name in site_data:
                if name in env:
                    cluster.procs[name] = start_site(cluster.kits[name], env[name], logs / f"{name}.log")
                else:
                    cluster.start_site(name)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop every process of the cluster and release the FLARE lock (nothing when it is not running)."""
        if self.cluster is None:
            return
        try:
            self.cluster.__exit__(None, None, None)
        finally:
            self.cluster = None
            self.lock.release()

    # ------------------------------------------------------------- per test
    @property
    def kits(self) -> dict[str, Path]:
        return self.cluster.kits

    def prepare(self, tmp_path: Path, method: str, overrides: list[str], names=("site1", "site2")) -> tuple[Path, Path]:
        """A deploy run folder for ``method`` on the fundus sites ``names``: ``(run config, run folder)``."""
        from fedseg.deployment.server import load_deploy_config, prepare_run

        run_toml = tmp_path / "run.toml"
        run_toml.write_text(f'federation = "{self.fundus}"\nmethod = "{method}"\nseed = 0\n')
        out = tmp_path / "out"
        prepare_run(load_deploy_config(run_toml, overrides), out, sites=list(names))
        return run_toml, out

    def submit(self, out: Path, names=("site1", "site2"), timeout: float = 120.0, **kw: Any) -> dict[str, Any]:
        """Submit the run prepared in ``out`` and supervise it until it has results (``submit_run``).

        Each rehearsal is a federation of its own: the sites' records of what they masked across runs (the
        replay guard of ``fedseg.site.secure.Record``, kept in each site's work folder) are cleared first, as
        they would be for a new federation's sites; a record that persists across one rehearsal's jobs (a
        supervisor's restarts) is untouched."""
        from fedseg.deployment.run import submit_run
        from fedseg.site.secure import RECORD_NAME

        for record in (self.root / "sites").glob(f"*/{RECORD_NAME}"):
            record.unlink()
        return submit_run(self.kits["admin"], out, list(names), timeout=timeout, **kw)

    def simulate(self, tmp_path: Path, run_toml: Path, overrides: list[str], names=("site1", "site2")) -> dict:
        """The in-process simulation of the same run on the same sites (``tmp_path/sim/out``)."""
        from fedseg.deployment.run import subset_spec
        from fedseg.deployment.server import load_deploy_config
        from fedseg.simulation.runner import run

        sim_spec = subset_spec(self.fundus, list(names), tmp_path / "sim" / "federation.toml")
        return run(
            load_deploy_config(run_toml, [*overrides, "checkpoint_keep=final"], federation=str(sim_spec)),
            out=tmp_path / "sim" / "out",
            progress=False,
        )

    @contextlib.contextmanager
    def policy(self, policy: SitePolicy, names=("site1", "site2")) -> Iterator[None]:
        """Inside, ``names`` keep ``policy`` (their policy files rewritten; each job's site processes read them
        when the job starts); afterwards the rehearsals' :data:`POLICY` again."""
        try:
            for n in names:
                write_policy(self.kits[n] / "local" / POLICY_NAME, policy)
            yield
        finally:
            for n in names:
                write_policy(self.kits[n] / "local" / POLICY_NAME, policy_from_dict(POLICY, "policy"))

    # ------------------------------------------------------- what was added
    def _files(self) -> dict[str, Path]:
        files = {p.stem: p for p in (self.cluster.root / "logs").glob("*.log")}
        files["replies"] = self.replies
        return files

    def mark(self) -> dict[str, int]:
        """How far every log and the reply record reach now."""
        return {k: p.stat().st_size if p.is_file() else 0 for k, p in self._files().items()}

    def since(self, mark: dict[str, int], name: str, expect: str | None = None, wait_s: float = 10.0) -> str:
        """The text log ``name`` (``server``, a site, ``replies``) gained since ``mark``; with ``expect``, waited
        for up to ``wait_s`` seconds to contain it (a job process's last lines reach the log as it ends)."""
        path = self._files()[name]
        end = time.monotonic() + wait_s
        while True:
            with path.open("rb") as fh:
                fh.seek(mark.get(name, 0))
                text = fh.read().decode(errors="replace")
            if expect is None or expect in text or time.monotonic() > end:
                return text
            time.sleep(0.2)

    def replies_since(self, mark: dict[str, int]) -> list[dict[str, Any]]:
        """The replies the server accepted since ``mark`` (one dict each, see :data:`SERVER_RECORDER`)."""
        return [json.loads(line) for line in self.since(mark, "replies").splitlines() if line.strip()]
