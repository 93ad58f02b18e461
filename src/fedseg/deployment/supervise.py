"""Keep a deployed run going across job failures and site restarts.

NVIDIA FLARE 2.9 runs a fixed set of site job processes per job and has no job
snapshot/resume.  Two things therefore need a new job, and the supervisor (what
``fedseg deploy run`` and ``fedseg deploy rehearse`` run on the submitting side)
submits it on its own:

* **The job ended without results** (FLARE aborted it, the server's job process
  died, too few sites answered): re-submit from the last round checkpoint
  (``OUT/checkpoints``) with the sites connected after waiting up to
  ``deploy.rejoin_wait_s`` for the others, at most ``deploy.max_restarts`` times.
* **A site restarted** (it logged in to the FLARE server again with a new
  session token, so the job process that held its part of this job is gone): ask the
  server's engine to end the job after the current round (file
  ``OUT/control/restart``, read by :func:`fedseg.deployment.server.serve`), then
  re-submit from that round's checkpoint with the site back in (``deploy.rejoin``).
  Once the server has stopped (``OUT/control/stopped``), a job FLARE keeps open
  (the dead site's part of it) is aborted after ``deploy.shutdown_grace_s``, as one
  whose results are complete.

A resume by hand (``fedseg deploy run --resume OUT``, e.g. after the server
crashed) goes through the same supervisor and is recorded as a recovery too.

Between jobs nothing is lost: the server writes its whole state after every round
and every site its own; a resumed job reloads both (bitwise, tested).  A site that
is not in a job is left out of its exchanges (the dropout rule) and restores its
newest checkpoint when it is back.  Each job and each recovery is recorded in
``OUT/supervisor.json`` and ``results.json["deploy"]["jobs" / "recoveries"]``, a recovery with the
time from the end of the old job to the first round completed by the new one.
"""

from __future__ import annotations

import json
import os
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from tqdm.auto import tqdm

from fedseg.deployment.params import DeployParams
from fedseg.deployment.server import CONTROL_RESTART, CONTROL_STOPPED, REFUSED, read_deploy_json
from fedseg.deployment.transport import DeployError
from fedseg.foundation.errors import ConfigError
from fedseg.seams.checkpoint import read_progress, save_json

__all__ = ["JobAdmin", "Supervisor", "completed_round"]

RECORD = "supervisor.json"


class JobAdmin(Protocol):
    """What the supervisor needs from the federation's admin session (FLARE: :class:`fedseg.deployment.flare.Admin`)."""

    def connected_sites(self) -> list[str]: ...

    def site_sessions(self) -> dict[str, str]: ...

    def submit(self, job_folder: str | Path) -> str: ...

    def status(self, job_id: str) -> str: ...

    def abort(self, job_id: str) -> None: ...


def completed_round(run_dir: Path) -> int:
    """The last round the server checkpointed (0 before the first)."""
    try:
        progress = read_progress(Path(run_dir) / "checkpoints")
    except ConfigError:  # a damaged record: no round completed that the supervisor can count on
        return 0
    return 0 if progress is None else int(progress["round"])


class Supervisor:
    """Submit the run prepared in ``run_dir`` and re-submit it until it has results (see module docstring).

    Parameters
    ----------
    admin
        Admin session of the federation.
    run_dir
        The run folder (``OUT``), written by the server.
    sites
        The run's sites in federation order.
    make_job
        ``make_job(job_sites, attempt) -> job folder`` for a job over those sites.
    params
        The run's ``[deploy]`` settings.
    """

    def __init__(
        self,
        admin: JobAdmin,
        run_dir: str | Path,
        sites: list[str],
        make_job: Callable[[list[str], int], Path],
        params: DeployParams,
        log: Callable[[str], None] = print,
        poll_s: float = 1.0,
        progress: bool = False,
    ):
        self.admin = admin
        self.run_dir = Path(run_dir)
        self.sites = list(sites)
        self.make_job = make_job
        self.params = params
        self.log = log
        self.poll_s = poll_s
        self.progress = progress
        past = self._read_record()
        self.recoveries: list[dict[str, Any]] = list(past.get("recoveries", []))  # the run's, across submissions
        self.jobs: list[dict[str, Any]] = list(past.get("jobs", []))
        self._first_job = len(self.jobs)

    # ----------------------------------------------------------------- pieces
    def _read_record(self) -> dict[str, Any]:
        """The run's earlier jobs and recoveries; a damaged record (a crash of an older version mid-write) is set
        aside with a warning, since it is a log and the run itself does not depend on it."""
        record = self.run_dir / RECORD
        if not record.is_file():
            return {}
        try:
            past = json.loads(record.read_text())
            if (
                isinstance(past, dict)
                and isinstance(past.get("jobs", []), list)
                and isinstance(past.get("recoveries", []), list)
            ):
                return past
        except ValueError:
            pass
        aside = record.with_name(RECORD + ".damaged")
        os.replace(record, aside)
        self.log(f"[supervisor] warning: {record} was damaged; moved to {aside.name}, starting a new job record")
        return {}

    def _desc(self) -> dict[str, Any]:

        return read_deploy_json(self.run_dir)

    def _present(self, wait_s: float) -> list[str]:
        """Run sites connected now, after waiting up to ``wait_s`` for all of them (federation order)."""
        end = time.monotonic() + wait_s
        while True:
            have = set(self.admin.connected_sites())
            if set(self.sites) <= have or time.monotonic() >= end:
                return [s for s in self.sites if s in have]
            time.sleep(min(self.poll_s, 0.5))

    def _refused_since(self, t_wall: float) -> dict[str, str]:
        """``{site: why}`` when the server recorded, during the job started at ``t_wall``, that sites refused
        the run by their policies (:data:`fedseg.deployment.server.REFUSED`)."""
        path = self.run_dir / REFUSED
        try:
            if path.stat().st_mtime < t_wall - 1.0:
                return {}
            got = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        return {str(k): str(v) for k, v in got.items()} if isinstance(got, dict) else {}

    def _results_since(self, t_wall: float) -> bool:
        return self._written_since(self.run_dir / "results.json", t_wall)

    @staticmethod
    def _written_since(p: Path, t_wall: float) -> bool:
        return p.is_file() and p.stat().st_mtime >= t_wall - 1.0

    def _request_restart(self, reason: str) -> None:
        p = self.run_dir / CONTROL_RESTART
        p.parent.mkdir(parents=True, exist_ok=True)
        save_json({"reason": reason, "time": time.time()}, p)

    def _clear_restart(self) -> None:
        (self.run_dir / CONTROL_RESTART).unlink(missing_ok=True)
        (self.run_dir / CONTROL_STOPPED).unlink(missing_ok=True)

    def _save_record(self, results: bool = False) -> None:
        """Write ``OUT/supervisor.json``; with ``results`` also the run's finished ``results.json``."""
        save_json({"recoveries": self.recoveries, "jobs": self.jobs}, self.run_dir / RECORD)
        res = self.run_dir / "results.json"
        if results and res.is_file():
            data = json.loads(res.read_text())
            data.setdefault("deploy", {})["recoveries"] = self.recoveries
            data["deploy"]["jobs"] = self.jobs
            save_json(data, res)

    # ------------------------------------------------------------------- loop
    def run(self, timeout: float = 0.0) -> dict[str, Any]:
        """Block until the run has results (or stopped where ``deploy.json`` asks it to); returns the last job's record."""
        end = time.monotonic() + timeout if timeout else None
        need = min(self.params.min_sites, len(self.sites))
        job_sites = self._present(self.params.setup_timeout_s)
        if len(job_sites) < need:
            raise DeployError(
                f"only {job_sites} of the sites {self.sites} are connected after {self.params.setup_timeout_s:g} s "
                f"(deploy.min_sites = {self.params.min_sites}); start the sites with `fedseg deploy site`"
            )
        self._first_job = len(self.jobs)
        bar = tqdm(
            total=self._rounds(),
            initial=completed_round(self.run_dir),
            desc="deployed rounds",
            unit="round",
            disable=not self.progress,
            dynamic_ncols=True,
        )
        try:
            return self._loop(job_sites, need, end, timeout, bar)
        finally:
            bar.close()

    def _rounds(self) -> int | None:
        try:
            return int(tomllib.loads((self.run_dir / "config.toml").read_text())["rounds"])
        except (OSError, KeyError, ValueError, tomllib.TOMLDecodeError):
            return None

    def _loop(self, job_sites: list[str], need: int, end: float | None, timeout: float, bar: Any) -> dict[str, Any]:
        restarts = 0
        pending: dict[str, Any] | None = None  # a recovery whose first completed round is awaited
        if self._desc().get("resume") and self.jobs:  # a resume by hand (e.g. after a server crash) is a recovery too
            pending = {
                "after_job": self.jobs[-1]["job"],
                "reason": "resumed with `fedseg deploy run --resume`",
                "from_round": completed_round(self.run_dir),
                "sites": job_sites,
                "_t0": time.monotonic(),
            }
        while True:
            self._clear_restart()
            folder = self.make_job(job_sites, len(self.jobs))
            sessions = self.admin.site_sessions()
            t_wall = time.time()
            job_id = self.admin.submit(folder)
            record = {"job": job_id, "sites": job_sites, "from_round": completed_round(self.run_dir)}
            self.jobs.append(record)
            self._save_record()
            with (self.run_dir / "jobs.txt").open("a") as fh:
                fh.write(job_id + "\n")
            self.log(f"[supervisor] job {job_id} submitted with sites {job_sites} from round {record['from_round']}")
            rejoining: list[str] = []
            results_at: float | None = None
            done = ""  # what ended the run's part in this job: its results, or the stop asked for a rejoin
            while True:
                status = self.admin.status(job_id)
                if status.startswith("FINISHED"):
                    break
                if results_at is None and self._results_since(t_wall):
                    results_at, done = time.monotonic(), "its results"
                elif results_at is None and rejoining and self._written_since(self.run_dir / CONTROL_STOPPED, t_wall):
                    results_at, done = time.monotonic(), "its stop for the rejoin"
                if results_at is not None and time.monotonic() - results_at >= self.params.shutdown_grace_s:
                    # the run is complete (or stopped for a rejoin); FLARE may still wait for a site that died (it
                    # keeps the job open for minutes): nothing is left to wait for, so end the job instead
                    self.log(
                        f"[supervisor] job {job_id} is still {status} {self.params.shutdown_grace_s:g} s after {done} "
                        f"(deploy.shutdown_grace_s; a dead site can hold it open): aborting it"
                    )
                    self.admin.abort(job_id)
                    status = f"{status}, aborted after {done}"
                    break
                rnd = completed_round(self.run_dir)
                bar.n = rnd
                bar.set_postfix(job=job_id[:8], sites=len(job_sites), refresh=True)
                if pending is not None and rnd > pending["from_round"]:
                    pending["recover_s"] = round(time.monotonic() - pending.pop("_t0"), 3)
                    self.recoveries.append(pending)
                    self._save_record()
                    self.log(
                        f"[supervisor] recovered: round {rnd} done {pending['recover_s']:.1f} s after job {pending['after_job']} ended"
                    )
                    pending = None
                if self.params.rejoin and not rejoining:
                    now = self.admin.site_sessions()
                    rejoining = [
                        s for s in self.sites if s in now and (s not in job_sites or now[s] != sessions.get(s))
                    ]
                    if rejoining:
                        self._request_restart(f"sites {rejoining} (re)connected")
                        self.log(
                            f"[supervisor] sites {rejoining} (re)connected: ending job {job_id} after round {rnd + 1} to let them rejoin"
                        )
                if end is not None and time.monotonic() > end:
                    self.admin.abort(job_id)
                    raise TimeoutError(
                        f"run {self.run_dir} not finished after {timeout:g} s (job {job_id}, {status}); "
                        f"continue with `fedseg deploy run --resume {self.run_dir}`"
                    )
                time.sleep(self.poll_s)
            rnd = completed_round(self.run_dir)
            record.update(status=status, to_round=rnd)
            self._save_record()
            if self._results_since(t_wall):
                self._clear_restart()
                if pending is not None:  # the run ended within the first round after a recovery
                    pending["recover_s"] = None
                    self.recoveries.append({k: v for k, v in pending.items() if k != "_t0"})
                self._save_record(results=True)
                return record
            stop_after = self._desc().get("stop_after")
            if stop_after is not None and rnd >= int(stop_after) and not rejoining:
                return record
            refused = self._refused_since(t_wall)
            if refused:  # the sites' own policies refused the job: a new one would be refused the same way
                raise DeployError(
                    f"job {job_id} stopped: too few sites accepted the run; "
                    + "; ".join(refused.values())
                    + " — change the run config (or the sites change their policies), then submit it again"
                )
            t_end = time.monotonic()
            if rejoining:
                reason = f"rejoin of {rejoining}"
            else:
                restarts += 1
                mine = self.jobs[self._first_job :]  # this submission's jobs
                stalled = len(mine) >= 2 and all(j.get("to_round") == j["from_round"] for j in mine[-2:])
                if restarts > self.params.max_restarts or stalled:
                    why = (
                        "two jobs in a row completed no round (a cause that a restart does not remove, e.g. a site "
                        "failing at setup)"
                        if stalled
                        else f"deploy.max_restarts = {self.params.max_restarts} automatic restarts are used up"
                    )
                    raise DeployError(
                        f"job {job_id} ended {status} after round {rnd} without results, and {why}; read the server's job log "
                        f"(<server kit>/{job_id}/log.txt), fix the cause, then `fedseg deploy run --resume {self.run_dir}`"
                    )
                reason = f"job ended {status}"
                self.log(
                    f"[supervisor] job {job_id} ended {status} after round {rnd} without results: restart {restarts} of {self.params.max_restarts}"
                )
            job_sites = self._present(self.params.rejoin_wait_s)
            if len(job_sites) < need:
                job_sites = self._present(self.params.setup_timeout_s)
            if len(job_sites) < need:
                raise DeployError(
                    f"after job {job_id} only {job_sites} are connected (deploy.min_sites = {self.params.min_sites}); "
                    f"start the missing sites, then `fedseg deploy run --resume {self.run_dir}`"
                )
            if rnd > 0:
                desc = self._desc()
                desc["resume"] = True
                save_json(desc, self.run_dir / "deploy.json")
            if pending is None or rnd > pending["from_round"]:
                pending = {"after_job": job_id, "reason": reason, "from_round": rnd, "sites": job_sites, "_t0": t_end}
            else:  # the job submitted to recover ended before completing a round: the same recovery goes on
                pending.update(sites=job_sites, resubmitted=pending.get("resubmitted", 0) + 1)
