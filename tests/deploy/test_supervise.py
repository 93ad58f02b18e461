"""The deployment supervisor: automatic re-submission after an aborted job, rejoin of a restarted site.

The supervisor's admin session is a fake whose "jobs" are threads running fedseg's
real server half (:func:`fedseg.deployment.server.serve`) over the in-process byte
channel, so the checkpoint/resume path is the deployed one; only FLARE is absent
(tests/deploy/test_deploy_nvflare.py runs the same over FLARE).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from fedseg.deployment.params import DeployParams
from fedseg.deployment.server import serve
from fedseg.deployment.supervise import Supervisor
from fedseg.deployment.transport import DeployError, LoopbackChannel
from tests.deploy.test_deploy import _cfg, _prepare, _runtimes
from tests.support.helpers import assert_same_checkpoints, tiny_sites


class FakeAdmin:
    """Jobs are threads running ``serve`` over a loopback channel restricted to the job's sites."""

    def __init__(self, run_dir: Path, runtimes, abort_at: tuple[int, int] | None = None):
        self.run_dir, self.runtimes, self.abort_at = run_dir, runtimes, abort_at
        self.sessions = {s: f"{s}-token-0" for s in runtimes}
        self.jobs: dict[str, dict] = {}
        self.tasks = 0

    def connected_sites(self):
        return sorted(self.sessions)

    def site_sessions(self):
        return dict(self.sessions)

    def submit(self, folder):
        sites = json.loads((Path(folder) / "sites.json").read_text())
        job_id = f"job{len(self.jobs)}"
        chan = LoopbackChannel(self.runtimes)
        job = {"status": "RUNNING"}

        def call(site, op, payload, timeout):
            if site not in sites:
                raise ConnectionError(f"site {site} is not part of this job")
            if op == "task":
                self.tasks += 1
                if (
                    self.abort_at is not None
                    and self.tasks == self.abort_at[0]
                    and len(self.jobs) == self.abort_at[1] + 1
                ):
                    raise ConnectionError("FLARE aborted the job")  # with deploy.min_sites = 2 the job's main fails
            return chan(site, op, payload, timeout)

        def main():
            try:
                serve(self.run_dir, call, log=lambda m: None)
                job["status"] = "FINISHED:COMPLETED"
            except Exception:
                job["status"] = "FINISHED:EXECUTION_EXCEPTION"

        self.jobs[job_id] = job
        threading.Thread(target=main, daemon=True).start()
        return job_id

    def status(self, job_id):
        return self.jobs[job_id]["status"]

    def abort(self, job_id):
        pass


def _make_job(root: Path):
    def make(sites, attempt):
        folder = root / f"attempt-{attempt}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "sites.json").write_text(json.dumps(sites))
        return folder

    return make


def _supervisor(admin, tmp_path: Path, params=None, log=lambda m: None, poll_s: float = 0.05) -> Supervisor:
    """The supervisor of the two-site run in ``tmp_path / "run"``, submitting jobs made in ``tmp_path / "jobs"``."""
    return Supervisor(
        admin,
        tmp_path / "run",
        ["site1", "site2"],
        _make_job(tmp_path / "jobs"),
        params or PARAMS,
        log=log,
        poll_s=poll_s,
    )


PARAMS = DeployParams(round_deadline_s=30.0, setup_timeout_s=5.0, rejoin_wait_s=0.0, max_restarts=2)


def test_aborted_job_is_resubmitted_from_its_last_checkpoint_and_ends_bitwise_as_uninterrupted(tmp_path):
    """The job dies in the middle of round 2 (a site call fails and deploy.min_sites = 2 stops the job's main,
    as when FLARE tears a job down); the supervisor re-submits it from the round-1 checkpoint, and the run ends with the weights of a
    run that was never interrupted: server and sites reload the same round's state."""
    # Prepare
    cfg = _cfg(rounds=4, min_sites=2)
    _prepare(tmp_path / "ref", cfg, ["site1", "site2"])
    _prepare(tmp_path / "run", cfg, ["site1", "site2"])
    serve(tmp_path / "ref", LoopbackChannel(_runtimes(tmp_path / "r", tiny_sites(2))), log=lambda m: None)
    admin = FakeAdmin(
        tmp_path / "run", _runtimes(tmp_path / "s", tiny_sites(2)), abort_at=(5, 0)
    )  # 5th task (train + evaluate per round): round 2
    sup = _supervisor(admin, tmp_path, poll_s=0.05)
    # Execute
    last = sup.run(timeout=120)
    # Assert
    assert len(admin.jobs) == 2 and last["from_round"] == 1
    assert [r["reason"] for r in sup.recoveries] == ["job ended FINISHED:EXECUTION_EXCEPTION"]
    assert sup.recoveries[0]["from_round"] == 1 and sup.recoveries[0]["recover_s"] > 0
    assert_same_checkpoints(tmp_path / "run", tmp_path / "ref", sites=False)
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["deploy"]["recoveries"][0]["after_job"] == "job0" and [j["job"] for j in res["deploy"]["jobs"]] == [
        "job0",
        "job1",
    ]


def test_restarted_site_rejoins_through_a_new_job_at_a_round_boundary(tmp_path):
    """site2 logs in again (new session token, as after a process restart) while job 0 runs: the supervisor asks
    the server to stop after the current round and re-submits from that checkpoint with both sites; the run
    finishes with results and a recovery record 'rejoin'."""
    # Prepare
    cfg = _cfg(rounds=6)
    _prepare(tmp_path / "run", cfg, ["site1", "site2"])
    admin = FakeAdmin(tmp_path / "run", _runtimes(tmp_path / "s", tiny_sites(2)))
    logs: list[str] = []
    sup = _supervisor(admin, tmp_path, log=logs.append, poll_s=0.05)
    original = admin.status

    def status(job_id):  # site2 restarts once the first job has completed a round
        if job_id == "job0" and (tmp_path / "run" / "checkpoints" / "progress.json").is_file():
            admin.sessions["site2"] = "site2-token-1"
        return original(job_id)

    admin.status = status
    # Execute
    sup.run(timeout=120)
    # Assert
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert len(admin.jobs) == 2 and admin.jobs["job0"]["status"] == "FINISHED:COMPLETED"
    assert sup.recoveries[0]["reason"] == "rejoin of ['site2']" and 1 <= sup.recoveries[0]["from_round"] < 6
    assert len(res["history"]) == 6 and res["deploy"]["resumed"]
    assert any("ending job job0" in m for m in logs)


def test_restarts_are_bounded_and_the_error_names_the_resume_command(tmp_path):
    """A job that fails every time without completing a round is re-submitted once; a second job without
    progress means a restart does not help, and the supervisor stops with the command that resumes the run."""
    # Prepare
    cfg = _cfg(rounds=3)
    _prepare(tmp_path / "run", cfg, ["site1", "site2"])
    admin = FakeAdmin(tmp_path / "run", _runtimes(tmp_path / "s", tiny_sites(2)))
    admin.submit_real = admin.submit

    def failing_submit(folder):
        job_id = f"job{len(admin.jobs)}"
        admin.jobs[job_id] = {"status": "FINISHED:ABORTED"}
        return job_id

    admin.submit = failing_submit
    sup = _supervisor(admin, tmp_path, poll_s=0.01)
    # Execute / Assert
    with pytest.raises(DeployError, match=r"two jobs in a row completed no round.*fedseg deploy run --resume"):
        sup.run(timeout=60)
    assert len(admin.jobs) == 2


def test_restarts_are_bounded_by_max_restarts_when_jobs_progress(tmp_path):
    """Jobs that each complete a round and then fail are re-submitted deploy.max_restarts (2) times, no more."""
    # Prepare
    cfg = _cfg(rounds=10, min_sites=2)
    _prepare(tmp_path / "run", cfg, ["site1", "site2"])
    admin = FakeAdmin(tmp_path / "run", _runtimes(tmp_path / "s", tiny_sites(2)))
    real_submit = admin.submit

    def submit(folder):  # every job fails at its 2nd round's first task (train + evaluate per round = 4 tasks)
        admin.abort_at = (admin.tasks + 5, len(admin.jobs))
        return real_submit(folder)

    admin.submit = submit
    sup = _supervisor(admin, tmp_path, poll_s=0.02)
    # Execute / Assert
    with pytest.raises(DeployError, match=r"max_restarts = 2 automatic restarts are used up"):
        sup.run(timeout=60)
    assert len(admin.jobs) == 3 and [j["to_round"] - j["from_round"] for j in sup.jobs] == [1, 1, 1]


def test_command_returns_after_the_results_even_if_the_job_never_ends(tmp_path):
    """A site that died can keep FLARE's job open long after the server wrote results.json (measured: more than
    5 minutes).  The supervisor waits deploy.shutdown_grace_s for the job to end, then aborts it and returns."""
    import time

    # Prepare
    cfg = _cfg(rounds=2)
    _prepare(tmp_path / "run", cfg, ["site1", "site2"])
    admin = FakeAdmin(tmp_path / "run", _runtimes(tmp_path / "s", tiny_sites(2)))
    aborted: list[str] = []
    admin.status = lambda job_id: "RUNNING"  # the job never finishes by itself
    admin.abort = aborted.append
    logs: list[str] = []
    params = DeployParams(round_deadline_s=30.0, setup_timeout_s=5.0, rejoin_wait_s=0.0, shutdown_grace_s=0.5)
    sup = _supervisor(admin, tmp_path, params=params, log=logs.append, poll_s=0.05)
    # Execute
    last = sup.run(timeout=60)
    done = time.time()
    # Assert
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert aborted == ["job0"] and last["status"] == "RUNNING, aborted after its results"
    assert done - (tmp_path / "run" / "results.md").stat().st_mtime < 0.5 + 2.0
    assert res["deploy"]["jobs"][0]["status"] == "RUNNING, aborted after its results"
    assert any("aborting it" in m for m in logs)


def test_job_stopped_for_a_rejoin_is_ended_when_flare_keeps_it_open(tmp_path):
    """site2 restarts while job 0 runs; the server stops after the current round on the supervisor's request,
    but FLARE keeps the job open (the old site2's part of it is dead; over FLARE on this 2-core machine it took 9 s to end it).
    The supervisor aborts it deploy.shutdown_grace_s after the server's stop record and re-submits at once;
    before, it waited for FLARE (here: forever, until the run's timeout)."""
    # Prepare
    cfg = _cfg(rounds=6)
    _prepare(tmp_path / "run", cfg, ["site1", "site2"])
    admin = FakeAdmin(tmp_path / "run", _runtimes(tmp_path / "s", tiny_sites(2)))
    aborted: list[str] = []
    admin.abort = aborted.append
    original = admin.status

    def status(job_id):  # site2 restarts once job 0 has completed a round; job 0 never ends by itself
        if job_id == "job0":
            if (tmp_path / "run" / "checkpoints" / "progress.json").is_file():
                admin.sessions["site2"] = "site2-token-1"
            return "RUNNING"
        return original(job_id)

    admin.status = status
    logs: list[str] = []
    params = DeployParams(round_deadline_s=30.0, setup_timeout_s=5.0, rejoin_wait_s=0.0, shutdown_grace_s=0.2)
    sup = _supervisor(admin, tmp_path, params=params, log=logs.append, poll_s=0.05)
    # Execute
    sup.run(timeout=60)
    # Assert
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert aborted == ["job0"] and len(admin.jobs) == 2
    assert sup.jobs[0]["status"] == "RUNNING, aborted after its stop for the rejoin"
    assert sup.recoveries[0]["reason"] == "rejoin of ['site2']" and len(res["history"]) == 6
    assert any("after its stop for the rejoin" in m and "aborting it" in m for m in logs), logs
