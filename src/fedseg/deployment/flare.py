"""NVIDIA FLARE (2.9, Collab API) carrier for deployed runs — the only module that imports nvflare.

* :class:`FedsegServer` is the server job component: its ``@collab.main`` runs
  fedseg's engine (:func:`fedseg.deployment.server.serve`) with a ``call`` that goes
  through each site's Collab proxy (one call per site, in parallel, with the
  round deadline as the call timeout).
* :class:`FedsegSite` is the site job component: it publishes one function,
  ``call(op, payload) -> bytes``, that hands the bytes to the site's long-lived
  :class:`fedseg.deployment.site.SiteRuntime`.  The runtime reads the site's data
  paths from ``<site kit>/local/fedseg_site.json`` — they never travel.
  Its identity for secure aggregation's signed keys is the kit's TLS certificate and key
  (``<site kit>/startup/client.crt``, ``client.key``, ``rootCA.pem``).
* :func:`make_job` builds the job folder.  fedseg must be installed at every
  participant, and each site's ``class_allow_list`` admits
  ``fedseg.deployment.flare.`` and ``nvflare.collab.``; FLARE's ``FedJob`` also
  copies the components' package (fedseg's source, ~0.3 MB) into ``app_*/custom``.
* :func:`provision_kits` (``nvflare.lighter``) and :class:`Admin` (a FLARE
  API session: wait for sites, submit, wait for the job) support ``fedseg deploy``.
  Provisioning also writes the federation's roster into every site kit
  (``local/fedseg_roster.json``, :func:`write_rosters`): the sites' names and certificate
  fingerprints, which a site checks every secure-aggregation peer against.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from nvflare.collab import collab

from fedseg.deployment.policy import SitePolicy
from fedseg.deployment.server import REFUSED, serve
from fedseg.deployment.site import SITE_CONFIG_NAME, SiteRuntime, read_site_config
from fedseg.deployment.transport import DeployError
from fedseg.privacy.identity import ROSTER_NAME, Roster, fingerprint

__all__ = ["Admin", "FedsegServer", "FedsegSite", "make_job", "provision_kits", "restrict"]

log = logging.getLogger("fedseg.deployment")
ADMIN_USER = "admin@fedseg.org"
ALLOW_PREFIXES = ("fedseg.deployment.flare.", "nvflare.collab.")


def use_thread_count() -> None:
    """``torch.set_num_threads($FEDSEG_TORCH_THREADS)`` when that is set: the rehearsal gives its server and
    sites the intra-op thread count of the process that started them, as a simulation there would use."""
    threads = os.environ.get("FEDSEG_TORCH_THREADS")
    if threads:
        torch.set_num_threads(int(threads))


class FedsegServer:
    """Server component: runs the prepared run in ``run_dir`` (a folder on the server machine)."""

    def __init__(self, run_dir: str = ""):
        self.run_dir = run_dir

    @collab.main
    def main(self):
        use_thread_count()
        proxies = {p.name: p for p in collab.clients}

        def call(site: str, op: str, payload: bytes, timeout: float) -> bytes:
            p = proxies.get(site)
            if p is None:
                raise ConnectionError(f"site {site} is not part of this job (connected: {sorted(proxies)})")
            out = p(timeout=timeout).call(op=op, payload=payload)
            if not isinstance(out, (bytes, bytearray)):
                raise ConnectionError(f"site {site} answered {type(out).__name__}, not bytes")
            return bytes(out)

        def say(msg: str) -> None:
            log.info(msg)
            print(msg, flush=True)

        try:
            results = serve(self.run_dir, call, log=say)
        except DeployError as e:
            if (Path(self.run_dir) / REFUSED).is_file():  # the sites' policies refused the run: a clean stop
                say(f"[deploy] the run stops: {e}")
                return None
            raise
        return None if results is None else {"client_avg_dice": results.get("client_avg_dice")}


class FedsegSite:
    """Site component: one published function that feeds bytes to the site runtime."""

    def __init__(self, config: str = ""):
        self.config = config
        self._runtime: SiteRuntime | None = None

    def _rt(self) -> SiteRuntime:
        if self._runtime is None:
            path = (
                self.config
                or os.environ.get("FEDSEG_SITE_CONFIG")
                or str(Path(collab.workspace.get_root_dir()) / "local" / SITE_CONFIG_NAME)
            )
            use_thread_count()
            kit = (
                Path(collab.workspace.get_root_dir()) / "startup"
            )  # its TLS identity signs its secure-aggregation keys
            config = read_site_config(path)
            # a site config that names no policy file: the policy's defaults (SiteRuntime alone would enforce none)
            self._runtime = SiteRuntime(config, identity=kit, policy=None if config.policy else SitePolicy())
        return self._runtime

    @collab.publish
    def call(self, op: str, payload: bytes) -> bytes:
        ctx = collab.context  # FLARE's call context: the caller is the authenticated origin of the request
        server = getattr(ctx.server, "name", None) or "server"
        if ctx.caller != server:
            name = (
                self._runtime.name
                if self._runtime is not None
                else getattr(getattr(ctx, "app", None), "name", "this site")
            )
            log.warning("site %s refused '%s' from %s: only the server calls a site", name, op, ctx.caller)
            raise PermissionError(
                f"site {name}: refused '{op}' from {ctx.caller!r}; only the server ({server!r}) may call a site"
            )
        return self._rt().call(op, payload)


def make_job(
    job_root: str | Path, run_dir: str | Path, sites: list[str], name: str = "fedseg", sync_timeout: float = 120.0
) -> Path:
    """Write the job folder for the run prepared in ``run_dir`` (path on the server) and return it."""
    from nvflare.collab.runtime.controller import CollabController
    from nvflare.collab.runtime.executor import CollabExecutor
    from nvflare.job_config.api import FedJob

    job = FedJob(name=name, min_clients=len(sites))
    sid = job.to_server(FedsegServer(str(Path(run_dir).resolve())), "_server")
    job.to_server(
        CollabController(server_obj_id=sid, collab_obj_ids=[], sync_task_timeout=sync_timeout, props={}),
        id="controller",
    )
    for s in sites:
        cid = job.to(FedsegSite(), s, id="_client")
        job.to(CollabExecutor(client_obj_id=cid, collab_obj_ids=[], props={}), s, id="executor", tasks=["*"])
    job_root = Path(job_root)
    job.export_job(str(job_root))
    return job_root / name


def provision_kits(
    out: str | Path, sites: list[str], host: str, fl_port: int, admin_port: int, project: str = "fedseg"
) -> dict[str, Path]:
    """Root CA + server, site and admin startup kits (mutual TLS) under ``out``; returns ``{participant: kit}``.

    Each kit's ``local/resources.json`` extends the class allow-list with fedseg's
    components, so jobs run without bring-your-own-code rights.
    """
    out = Path(out).resolve()
    participants: list[dict[str, Any]] = [
        {"name": host, "type": "server", "org": "fedseg", "fed_learn_port": fl_port, "admin_port": admin_port}
    ]
    participants += [{"name": s, "type": "client", "org": "fedseg"} for s in sites]
    participants.append({"name": ADMIN_USER, "type": "admin", "org": "fedseg", "role": "project_admin"})
    project_dict = {
        "api_version": 3,
        "name": project,
        "description": "fedseg deployment",
        "participants": participants,
        "builders": [
            {"path": "nvflare.lighter.impl.workspace.WorkspaceBuilder"},
            {"path": "nvflare.lighter.impl.static_file.StaticFileBuilder", "args": {"config_folder": "config"}},
            {"path": "nvflare.lighter.impl.cert.CertBuilder"},
            {"path": "nvflare.lighter.impl.signature.SignatureBuilder"},
        ],
    }
    ws = out / ".provision"  # the root CA's state: stays on the provisioning machine, owner-only
    ws.mkdir(parents=True, exist_ok=True, mode=0o700)
    ws.chmod(0o700)  # before anything is written into it: no window in which others can reach the CA key
    (ws / "project.yml").write_text(json.dumps(project_dict, indent=1))  # JSON is YAML
    env = {**os.environ, "HOME": str(ws)}
    proc = subprocess.run(
        [sys.executable, "-m", "nvflare.cli", "provision", "-p", str(ws / "project.yml"), "-w", str(ws), "--force"],
        cwd=ws,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"nvflare provision failed ({proc.returncode}): {proc.stdout[-2000:]} {proc.stderr[-2000:]}")
    prods = sorted((ws / project).glob("prod_*"))
    src = prods[-1]
    kits: dict[str, Path] = {}
    for p in participants:
        name = p["name"]
        role = "server" if p["type"] == "server" else ("admin" if p["type"] == "admin" else name)
        dest = out / role
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(src / name, dest)
        res_default = dest / "local" / "resources.json.default"
        if res_default.is_file():
            res = json.loads(res_default.read_text())
            allow = list(res.get("class_allow_list", []))
            res["class_allow_list"] = allow + [a for a in ALLOW_PREFIXES if a not in allow]
            (dest / "local" / "resources.json").write_text(json.dumps(res, indent=1))
        kits[role] = dest
    (out / "kits.json").write_text(
        json.dumps(
            {"server": f"{host}:{fl_port}", "admin_port": admin_port, "sites": sites, "admin_user": ADMIN_USER},
            indent=1,
        )
    )
    write_rosters(out, kits, sites, host, project)
    restrict(ws, everything=True)
    for kit in kits.values():
        restrict(kit)
    return kits


def write_rosters(out: Path, kits: dict[str, Path], sites: list[str], host: str, project: str) -> Roster:
    """The federation's roster (:class:`fedseg.privacy.identity.Roster`: each site's name and certificate
    fingerprint, the server's and the admin's, the root CA's), written into every site kit as
    ``local/fedseg_roster.json`` and beside the kits as ``roster.json`` (nothing secret)."""
    start = {role: kit / "startup" for role, kit in kits.items()}
    roster = Roster(
        sites={s: fingerprint((start[s] / "client.crt").read_bytes()) for s in sites},
        server={host: fingerprint((start["server"] / "server.crt").read_bytes())},
        admins={ADMIN_USER: fingerprint((start["admin"] / "client.crt").read_bytes())},
        root_ca=fingerprint((start["server"] / "rootCA.pem").read_bytes()),
        federation=project,
    )
    body = json.dumps(roster.to_json(), indent=1) + "\n"
    for s in sites:
        (kits[s] / "local").mkdir(parents=True, exist_ok=True)
        (kits[s] / "local" / ROSTER_NAME).write_text(body)
    (out / "roster.json").write_text(body)
    return roster


def restrict(folder: Path, everything: bool = False) -> None:
    """Owner-only access (folders 0700, files 0600; executables keep their owner's x bit).

    ``everything``: every file and folder under ``folder`` (the CA state of ``.provision``).
    Otherwise a kit: the kit folder, its ``startup/`` folder and its private keys (``*.key``),
    while certificates, configs and scripts stay as FLARE wrote them inside the now closed folder.
    """
    folder = Path(folder)
    paths = [folder, *folder.rglob("*")] if everything else [folder, folder / "startup", *folder.glob("startup/*.key")]
    for p in paths:
        if p.is_symlink() or not p.exists():
            continue
        if p.is_dir():
            p.chmod(0o700)
        else:
            p.chmod(0o700 if p.stat().st_mode & 0o100 else 0o600)


def server_command(kit: str | Path) -> list[str]:
    """The command that starts the FLARE server from its kit (what the kit's start.sh runs)."""
    return [
        sys.executable,
        "-u",
        "-m",
        "nvflare.private.fed.app.server.server_train",
        "-m",
        str(Path(kit).resolve()),
        "-s",
        "fed_server.json",
        "--set",
        "secure_train=true",
        "org=fedseg",
        "config_folder=config",
    ]


def site_command(kit: str | Path, name: str) -> list[str]:
    """The command that starts a FLARE site from its kit (what the kit's start.sh runs)."""
    return [
        sys.executable,
        "-u",
        "-m",
        "nvflare.private.fed.app.client.client_train",
        "-m",
        str(Path(kit).resolve()),
        "-s",
        "fed_client.json",
        "--set",
        "secure_train=true",
        f"uid={name}",
        "org=fedseg",
        "config_folder=config",
    ]


class Admin:
    """A FLARE API session from the admin kit: submit a job, wait for it."""

    def __init__(self, admin_kit: str | Path, timeout: float = 30.0):
        from nvflare.fuel.flare_api.flare_api import new_secure_session

        end = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < end:
            try:
                self.sess = new_secure_session(
                    ADMIN_USER, str(Path(admin_kit).resolve()), timeout=max(5.0, end - time.monotonic())
                )
                return
            except Exception as e:  # server still starting
                last = e
                time.sleep(1.0)
        raise ConnectionError(f"cannot log in to the FLARE server with {admin_kit}: {last}")

    def connected_sites(self) -> list[str]:
        info = self.sess.get_system_info()
        return sorted(c.name for c in info.client_info)

    def site_sessions(self) -> dict[str, str]:
        """``{site: session token}`` of the connected sites; a site that restarted logs in with a new token."""
        res = self.sess.api.do_command("check_status server")  # type: ignore[attr-defined]
        out: dict[str, str] = {}
        for item in res.get("data", []):
            rows = item.get("rows") if isinstance(item, dict) and item.get("type") == "table" else None
            if rows and "TOKEN" in rows[0] and "CLIENT" in rows[0]:
                i, j = rows[0].index("CLIENT"), rows[0].index("TOKEN")
                out.update({r[i]: r[j] for r in rows[1:]})
        return out

    def status(self, job_id: str) -> str:
        return str(self.sess.get_job_meta(job_id).get("status", ""))

    def submit(self, job_folder: str | Path) -> str:
        return self.sess.submit_job(str(job_folder))

    def wait(self, job_id: str, timeout: float = 0.0, poll: float = 0.5) -> dict[str, Any]:
        """Block until the job is done (or ``timeout`` s; 0 = no limit); returns its meta."""
        end = time.monotonic() + timeout if timeout else None
        while True:
            meta = self.sess.get_job_meta(job_id)
            status = str(meta.get("status", ""))
            if status.startswith("FINISHED"):
                return meta
            if end is not None and time.monotonic() > end:
                raise TimeoutError(f"job {job_id} not finished after {timeout:g} s (status {status})")
            time.sleep(poll)

    def abort(self, job_id: str) -> None:
        try:
            self.sess.abort_job(job_id)
        except Exception:
            pass

    def close(self) -> None:
        try:
            self.sess.close()
        except Exception:
            pass
