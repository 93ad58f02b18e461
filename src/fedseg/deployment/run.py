"""``fedseg deploy`` library functions: provision, start a server or a site, submit a run, rehearse.

All NVFlare specifics live in :mod:`fedseg.deployment.flare`; this module starts
processes, writes site configs and waits for results.  ``rehearse`` runs the whole
deployment on one machine: real provisioning (root CA, mutual TLS on every
connection), one server process and one process per site, all on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from fedseg.data.spec import load_federation
from fedseg.deployment.params import deploy_params
from fedseg.deployment.policy import POLICY_NAME, policy_from_dict, read_policy, write_policy
from fedseg.deployment.server import load_deploy_config, prepare_run
from fedseg.deployment.site import SITE_CONFIG_NAME, SiteConfig, write_site_config
from fedseg.deployment.supervise import Supervisor
from fedseg.foundation.config import toml_value
from fedseg.foundation.device import resolve_device
from fedseg.foundation.errors import ConfigError
from fedseg.privacy.identity import ROSTER_NAME, fingerprint, load_identity, read_roster
from fedseg.seams.checkpoint import save_json

__all__ = [
    "LocalCluster",
    "configure_site",
    "free_port",
    "provision",
    "rehearse",
    "show_roster",
    "submit_run",
    "terminate_as_interrupt",
]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def provision(sites: list[str], server: str, out: str | Path) -> dict[str, Path]:
    """Startup kits for ``server`` (``HOST:PORT``; the admin port is PORT+1) and each site, under ``out``."""
    from fedseg.deployment.flare import provision_kits

    if ":" not in server:
        raise ConfigError(f"--server {server!r} must be HOST:PORT, e.g. fl.example.org:8002")
    host, port = server.rsplit(":", 1)
    if not sites:
        raise ConfigError("--sites names no site; give e.g. --sites siteA,siteB")
    return provision_kits(out, sites, host, int(port), int(port) + 1)


def configure_site(
    kit: str | Path,
    datalist: str | Path,
    workdir: str | Path,
    name: str | None = None,
    device: str = "auto",
    policy: str | Path | None = None,
) -> Path:
    """Write ``<kit>/local/fedseg_site.json``: this site's datalist, working folder, device and policy file (never
    sent anywhere).  ``policy``: the site's policy file (checked); by default ``<kit>/local/fedseg_policy.json``,
    written with the defaults when it does not exist (:mod:`fedseg.deployment.policy`)."""

    resolve_device(device)  # --device cuda on a machine without CUDA stops here
    kit = Path(kit).resolve()
    if not (kit / "startup" / "fed_client.json").is_file():
        raise ConfigError(
            f"{kit} is not a site startup kit (no startup/fed_client.json); use a kit from `fedseg deploy provision`"
        )
    name = name or json.loads((kit / "startup" / "fed_client.json").read_text())["client"]["fqsn"]
    if not Path(datalist).is_file():
        raise ConfigError(f"datalist {datalist} does not exist; give this site's datalist JSON")
    Path(workdir).mkdir(parents=True, exist_ok=True)
    if policy is None:
        policy = kit / "local" / POLICY_NAME
        if not policy.is_file():
            write_policy(policy)
    policy = Path(policy).resolve()
    read_policy(policy)  # a bad policy stops here, one line per bad key
    if (kit / "startup" / "client.crt").is_file():  # a kit without its roster, or not the roster's, stops here
        load_identity(kit / "startup", name)
    return write_site_config(
        kit / "local" / SITE_CONFIG_NAME,
        SiteConfig(name, str(Path(datalist).resolve()), str(Path(workdir).resolve()), device, str(policy)),
    )


def show_roster(kit: str | Path) -> list[str]:
    """The federation's roster as a site kit holds it (``KIT/local/fedseg_roster.json``; or ``roster.json`` in the
    folder ``fedseg deploy provision`` wrote), one participant and its certificate's SHA-256 fingerprint a line,
    to compare out of band with the other sites' (every site's lines must be the same).  For a site kit the last
    line says whether the kit's own certificate is the one the roster pins for it; a kit whose certificate is not
    is a :class:`ConfigError`."""
    kit = Path(kit)
    path = kit / "local" / ROSTER_NAME
    if not path.is_file() and (kit / "roster.json").is_file():
        return read_roster(kit / "roster.json").lines()
    roster = read_roster(path)
    out = roster.lines()
    cert = kit / "startup" / "client.crt"
    if cert.is_file():
        name = json.loads((kit / "startup" / "fed_client.json").read_text())["client"]["fqsn"]
        fp = fingerprint(cert.read_bytes())
        if roster.sites.get(name) != fp:
            raise ConfigError(
                f"{kit}: this kit's certificate for site {name} (SHA-256 {fp}) is not the one its roster pins for it "
                f"({roster.sites.get(name)}); provision the federation again and give each site its own kit"
            )
        out.append(f"this kit: site {name}, its certificate is the roster's")
    return out


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Inside, SIGTERM and SIGHUP raise KeyboardInterrupt in the main thread as Ctrl-C does, so the ``finally``
    and ``__exit__`` blocks that stop the started server/site processes run (they are in sessions of their own
    and would otherwise be left running, re-parented to init).  Further signals during that cleanup are ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        for s in sigs:
            signal.signal(s, signal.SIG_IGN)
        raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")

    sigs = (signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.signal(s, handler) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _spawn(cmd: list[str], cwd: Path, logfile: Path, env: dict[str, str]) -> subprocess.Popen:
    logfile.parent.mkdir(parents=True, exist_ok=True)
    fh = open(logfile, "ab")
    return subprocess.Popen(cmd, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def start_server(kit: str | Path, env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen:
    from fedseg.deployment.flare import server_command

    kit = Path(kit).resolve()
    return _spawn(server_command(kit), kit, log or kit / "fedseg-server.log", {**os.environ, **(env or {})})


def start_site(kit: str | Path, env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen:
    from fedseg.deployment.flare import site_command

    kit = Path(kit).resolve()
    name = json.loads((kit / "startup" / "fed_client.json").read_text())["client"]["fqsn"]
    if not (kit / "local" / SITE_CONFIG_NAME).is_file():
        raise ConfigError(
            f"{kit} has no local/{SITE_CONFIG_NAME}; run `fedseg deploy site --kit {kit} --datalist ... --workdir ...`"
        )
    return _spawn(site_command(kit, name), kit, log or kit / "fedseg-site.log", {**os.environ, **(env or {})})


def _tree(pid: int) -> list[Any]:
    """The process and all its descendants (FLARE starts each job process in a process group of its own)."""
    import psutil

    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def signal_tree(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to a started server/site and every process under it (job processes included)."""
    import psutil

    for p in _tree(proc.pid):
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


def stop(proc: subprocess.Popen, grace: float = 3.0) -> None:
    """Terminate a started server/site: its process group and every descendant (SIGTERM, then SIGKILL after ``grace`` s)."""
    import psutil

    procs = _tree(proc.pid)
    groups = {proc.pid}
    for p in procs:
        try:
            groups.add(os.getpgid(p.pid))
        except (ProcessLookupError, PermissionError):
            pass
    if proc.poll() is None:
        for p in procs:
            try:
                p.terminate()
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=grace)
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    for g in groups:  # stragglers of the groups
        try:
            os.killpg(g, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(5.0)
    except subprocess.TimeoutExpired:
        pass


def submit_run(
    admin_kit: str | Path,
    run_dir: str | Path,
    sites: list[str],
    timeout: float = 0.0,
    job_root: str | Path | None = None,
    log: Callable[[str], None] = print,
    progress: bool = False,
) -> dict[str, Any]:
    """Submit the run prepared in ``run_dir`` and supervise it until it has results (automatic re-submission
    after an aborted job, rejoin of restarted sites: :mod:`fedseg.deployment.supervise`); returns the last job's record."""
    from fedseg.deployment.flare import Admin, make_job

    run_dir = Path(run_dir).resolve()
    root = Path(job_root or run_dir / "job")
    params = deploy_params(load_deploy_config(run_dir / "config.toml"))
    admin = Admin(admin_kit)
    try:

        def job(job_sites: list[str], attempt: int) -> Path:
            return make_job(root / f"attempt-{attempt}", run_dir, job_sites)

        return Supervisor(admin, run_dir, sites, job, params, log=log, progress=progress).run(timeout)
    finally:
        admin.close()


class LocalCluster:
    """Server + site processes on 127.0.0.1 from freshly provisioned kits (mutual TLS).

    Use as a context manager; every process group it started is killed on exit.  The server and the sites
    compute with ``threads`` intra-op threads (``FEDSEG_TORCH_THREADS``, ``OMP_NUM_THREADS``); by default
    this process's :func:`torch.get_num_threads`, the count a simulation started here uses, so that their
    weights equal that simulation's bit for bit.  ``policy``: settings of every site's policy file (the
    others keep their defaults, :mod:`fedseg.deployment.policy`).
    """

    def __init__(
        self,
        root: str | Path,
        site_data: dict[str, str | Path],
        workdir: str | Path,
        threads: int | None = None,
        policy: dict[str, Any] | None = None,
    ):
        self.policy = policy_from_dict(policy or {}, "policy")
        if threads is None:
            threads = torch.get_num_threads()
        self.root = Path(root).resolve()
        self.site_data = dict(site_data)
        self.workdir = Path(workdir).resolve()
        self.env = {
            "HOME": str(self.root / "home"),
            "FEDSEG_TORCH_THREADS": str(threads),
            "OMP_NUM_THREADS": str(threads),
            "NVFLARE_POC_WORKSPACE": str(self.root / "poc"),
        }
        self.procs: dict[str, subprocess.Popen] = {}
        self.kits: dict[str, Path] = {}

    def provision(self) -> None:
        from fedseg.deployment.flare import provision_kits

        (self.root / "home").mkdir(parents=True, exist_ok=True)
        port = free_port()
        admin_port = free_port()
        self.kits = provision_kits(self.root / "kits", list(self.site_data), "localhost", port, admin_port)
        for name, dl in self.site_data.items():
            write_policy(self.kits[name] / "local" / POLICY_NAME, self.policy)
            configure_site(self.kits[name], dl, self.workdir / name, name)

    def start_server(self) -> None:
        self.procs["server"] = start_server(self.kits["server"], self.env, self.root / "logs" / "server.log")

    def start_site(self, name: str) -> None:
        self.procs[name] = start_site(self.kits[name], self.env, self.root / "logs" / f"{name}.log")

    def kill(self, name: str) -> None:
        """Stop a participant and its job processes (SIGTERM, SIGKILL after 0.5 s)."""
        p = self.procs.pop(name, None)
        if p is not None:
            stop(p, grace=0.5)

    def pause(self, name: str) -> None:
        """Freeze a participant and its job processes (SIGSTOP): a hung site."""
        signal_tree(self.procs[name], signal.SIGSTOP)

    def resume(self, name: str) -> None:
        """Let a paused participant go on (SIGCONT)."""
        signal_tree(self.procs[name], signal.SIGCONT)

    def __enter__(self) -> LocalCluster:
        if not self.kits:
            self.provision()
        self.start_server()
        for name in self.site_data:
            self.start_site(name)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name in [n for n in self.procs if n != "server"] + ["server"]:
            self.kill(name)


def rehearse(
    config: str | Path,
    sites: int,
    out: str | Path,
    overrides: list[str] | None = None,
    timeout: float = 0.0,
    stop_after: int | None = None,
    progress: bool = False,
    policy: dict[str, Any] | None = None,
    cluster: LocalCluster | None = None,
    **fields: Any,
) -> dict[str, Any] | None:
    """Run ``config`` deployed on this machine: the first ``sites`` sites of its federation, each in its own
    process, a server process, mutual TLS, 127.0.0.1 only.  Writes ``OUT/results.json`` like a simulation.
    ``policy``: settings of every site's policy (default: the policy's defaults).  ``cluster``: a running
    :class:`LocalCluster` whose sites include these sites with the federation's datalists: the run is one
    more job on it (its sites keep their policies) instead of a cluster started and stopped for this run."""
    cfg = load_deploy_config(config, overrides, **fields)
    fed = load_federation(cfg.federation)
    if not 1 <= sites <= len(fed.sites):
        raise ConfigError(f"--sites {sites}: the federation has {len(fed.sites)} sites; give 1..{len(fed.sites)}")
    names = list(fed.site_names[:sites])
    site_data: dict[str, str | Path] = {n: fed.site(n).datalist for n in names}
    if cluster is not None:
        if policy is not None:
            raise ConfigError("rehearse: give policy= only without cluster= (a running cluster's sites keep theirs)")
        other = [n for n in names if Path(cluster.site_data.get(n, "")).resolve() != Path(site_data[n]).resolve()]
        if other or not cluster.kits:
            raise ConfigError(
                f"rehearse: the cluster at {cluster.root} has no site {other} with the datalist of federation "
                f"{fed.name}; start a LocalCluster with these sites' datalists, or leave cluster= out"
            )
    out = Path(out).resolve()
    desc = prepare_run(cfg, out, sites=names)
    desc["transport"] = "nvflare-rehearsal"
    if stop_after is not None:
        desc["stop_after"] = stop_after
    save_json(desc, out / "deploy.json")
    with terminate_as_interrupt():
        if cluster is not None:
            submit_run(cluster.kits["admin"], out, names, timeout=timeout, progress=progress)
        else:
            with LocalCluster(out / "nvflare", site_data, out / "sites", policy=policy) as started:
                submit_run(started.kits["admin"], out, names, timeout=timeout, progress=progress)
    res = out / "results.json"
    return json.loads(res.read_text()) if res.is_file() else None


def subset_spec(spec: str | Path, names: list[str], out: str | Path) -> Path:
    """A copy of federation ``spec`` with only ``names`` (absolute datalist paths): the simulation twin of a rehearsal."""
    fed = load_federation(spec)
    raw = tomllib.loads(Path(spec).read_text())
    lines = [f"name = {toml_value(str(raw.get('name', fed.name)) + '-subset')}", "", "[data]"]
    for k, v in raw["data"].items():
        if k != "labels":
            lines.append(f"{k} = {toml_value(v)}")
    lines.append("\n[data.labels]")
    for k, v in raw["data"]["labels"].items():
        lines.append(f"{k} = {toml_value(v)}")
    for n in names:
        lines += ["", "[[sites]]", f"name = {toml_value(n)}", f"datalist = {toml_value(str(fed.site(n).datalist))}"]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return out


def deploy_run(
    config: str | Path | None,
    kits: str | Path,
    out: str | Path,
    overrides: list[str] | None = None,
    resume: bool = False,
    timeout: float = 0.0,
    progress: bool = False,
    **fields: Any,
) -> dict[str, Any] | None:
    """Submit a run to a provisioned deployment (``kits/admin`` logs in) and wait; ``OUT`` must be a path the
    server process can write (run this on the server machine or on a shared folder)."""
    kits = Path(kits)
    info_path = kits / "kits.json"
    if not info_path.is_file():
        raise ConfigError(f"{kits} has no kits.json; give the folder written by `fedseg deploy provision`")
    sites = json.loads(info_path.read_text())["sites"]
    out = Path(out).resolve()
    if resume:
        cfg = load_deploy_config(out / "config.toml", overrides)
    elif config is None:
        raise ConfigError("give a run config, or --resume OUT to continue a deployed run")
    else:
        cfg = load_deploy_config(config, overrides, **fields)
    desc = prepare_run(cfg, out, sites=None if resume else sites, resume=resume)
    submit_run(kits / "admin", out, desc["sites"], timeout=timeout, progress=progress)
    res = out / "results.json"
    return json.loads(res.read_text()) if res.is_file() else None


def foreground(proc: subprocess.Popen) -> int:
    """Wait for a started server/site; Ctrl-C (or SIGTERM, SIGHUP) stops its whole process tree."""
    try:
        with terminate_as_interrupt():
            return proc.wait()
    except KeyboardInterrupt:
        stop(proc)
        return 130
