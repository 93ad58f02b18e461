"""The suite's tiers, its time limit for unit tests, the order of the FLARE tests and the shared fixtures.

The tests live in three tiers, one folder each, whose ``conftest.py`` marks every test in it:

* ``tests/unit/`` (laid out like ``src/fedseg``): one module or package at a time, on hand-made inputs or tiny
  in-memory federations; each test's call phase must finish within :data:`UNIT_LIMIT_S`
  (:func:`pytest_runtest_makereport`);
* ``tests/runs/`` (markers ``runs`` and ``slow``): whole engine runs end to end, in process;
* ``tests/deploy/`` (markers ``deploy`` and ``slow``): deployed runs, over the in-process byte channel and over
  NVIDIA FLARE processes.

``make test`` runs all three; ``make test-fast`` (``-m "not slow"``) the unit tier.  Helpers the test files share
are in ``tests/support/``.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import os
import tempfile
import time
from pathlib import Path

import pytest
import torch

from fedseg.site.batches import SiteData
from fedseg.site.workload import segmentation_workload
from tests.support.helpers import TINY_MODEL, tiny_sites

# Tiny models gain nothing from intra-op threads, and OpenMP spin-waiting makes them
# crawl when another process holds the second core.
torch.set_num_threads(1)

# A CPU's volume plan is made for a fixed throughput in tests (no probe): the same plan on every machine.
os.environ.setdefault("FEDSEG_CPU_GFLOPS", "20")


def _warm_up() -> None:
    """Pay once per test process what torch does on first use (its first optimizer step imports and builds about
    1.6 s of CPU work): otherwise whichever unit test steps an optimizer first would carry it past the limit."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()


_warm_up()


UNIT_LIMIT_S = float(os.environ.get("FEDSEG_UNIT_LIMIT_S", "2"))
"""The most CPU seconds of its process the call phase of a unit test may take (``FEDSEG_UNIT_LIMIT_S``; 2 unless
set): a test over it fails, to be made smaller or moved to ``tests/runs/``.  CPU time, not wall time, so that other
work on the machine's cores does not fail a unit test."""

TIERED = ("slow", "gpu")
"""Markers of the tests the limit leaves alone: ``slow`` (the tiers ``runs`` and ``deploy``) and ``gpu``."""


@pytest.fixture
def sites() -> dict[str, SiteData]:
    return tiny_sites()


@pytest.fixture
def workload():
    return segmentation_workload(2, 1, ["fg"], TINY_MODEL)


@pytest.fixture(scope="package")
def simulated(tmp_path_factory):
    """``simulated(cfg, num_sites=2) -> (results, run folder)``: ``cfg`` simulated on ``tiny_sites(num_sites)`` with
    the tiny segmentation workload, once per pytest process, for the tests that compare another run with it (a
    resumed run, a deployed run: ``tests.support.helpers.every_method_config``).  They read the folder and never
    write to it; each gets its own copy of the results."""
    from fedseg.simulation.runner import simulate

    runs: dict[str, tuple[dict, Path]] = {}

    def run(cfg, num_sites: int = 2):
        key = json.dumps([cfg.to_dict(), num_sites], sort_keys=True, default=str)
        if key not in runs:
            out = tmp_path_factory.mktemp("simulated") / "run"
            wl = segmentation_workload(2, 1, ["fg"], cfg.model)
            res = simulate(cfg, wl, tiny_sites(num_sites), out=out, progress=False, log=lambda m: None)
            runs[key] = (res, out)
        res, out = runs[key]
        return copy.deepcopy(res), out

    return run


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: skipped (with the reason) on machines without it.  Tests that start FLARE
    processes (:data:`FLARE_FIXTURES`) run first, next to each other, those on the shared cluster first (it starts
    once, and stops before the others start clusters of their own), and they are one ``xdist_group``: ``make test``
    distributes with ``--dist loadgroup``, which gives each group to one worker as one unit of work, the groups
    with the most tests first (the long poles start first: this one and ``every-method``), and the other tests one
    at a time to whichever worker is free."""
    flare = [i for i in items if any(f in getattr(i, "fixturenames", ()) for f in FLARE_FIXTURES)]
    if flare:
        shared = [i for i in flare if "flare_cluster" in i.fixturenames]
        block = shared + [i for i in flare if "flare_cluster" not in i.fixturenames]
        chosen = set(flare)
        items[:] = block + [i for i in items if i not in chosen]
        for item in block:
            item.add_marker(pytest.mark.xdist_group("flare"))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (a GPU); CI runs the CPU paths of the same code")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


_CPU_S = pytest.StashKey[float]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """The CPU seconds of this process a test's call phase takes (:func:`time.process_time`): other processes on
    the machine do not lengthen it, as they lengthen its wall time."""
    start = time.process_time()
    try:
        return (yield)
    finally:
        item.stash[_CPU_S] = time.process_time() - start


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A unit test (none of the markers :data:`TIERED`) whose call phase passed in more than :data:`UNIT_LIMIT_S`
    seconds of this process's CPU time fails, saying so."""
    report = yield
    cpu = item.stash.get(_CPU_S, 0.0)
    if (
        report.when == "call"
        and report.passed
        and cpu > UNIT_LIMIT_S
        and not any(item.get_closest_marker(m) for m in TIERED)
    ):
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} took {cpu:.2f} s of CPU time, over the unit tests' limit of {UNIT_LIMIT_S:g} s "
            "(FEDSEG_UNIT_LIMIT_S): make it smaller, or move it to tests/runs/ if it drives a whole run"
        )
    return report


class _FlareLock:
    """One NVIDIA FLARE cluster at a time on this machine: an flock on a file in the temp folder, held while any
    holder in this process holds it (a rehearsal's own cluster inside the shared cluster's life takes it again
    without waiting for itself)."""

    def __init__(self) -> None:
        self.holders = 0
        self.fh = None

    @contextlib.contextmanager
    def held(self):
        self.acquire()
        try:
            yield
        finally:
            self.release()

    def acquire(self) -> None:
        if self.holders == 0:
            self.fh = (Path(tempfile.gettempdir()) / "fedseg-tests-flare.lock").open("w")
            fcntl.flock(self.fh, fcntl.LOCK_EX)
        self.holders += 1

    def release(self) -> None:
        self.holders -= 1
        if self.holders == 0 and self.fh is not None:
            fcntl.flock(self.fh, fcntl.LOCK_UN)
            self.fh.close()
            self.fh = None


FLARE_LOCK = _FlareLock()
FLARE_FIXTURES = ("flare_lock", "flare_cluster")
"""Tests that use one of these start FLARE processes: they run first, next to each other, the ones on the shared
cluster first (:func:`pytest_collection_modifyitems`)."""


@pytest.fixture
def flare_lock():
    """One NVIDIA FLARE cluster at a time on this machine: a test that starts FLARE processes of its own holds
    this lock (an flock on a file in the temp folder) for its whole run, so pytest workers never run two
    clusters at once (two clusters on two cores have made a site's job fail to start)."""
    with FLARE_LOCK.held():
        yield


_SHARED: dict = {}


@pytest.fixture
def flare_cluster(tmp_path_factory):
    """The FLARE cluster shared by the rehearsals that need no fault (tests/support/rehearsals.py): provisioned and
    started by the first test that asks for it, stopped after the last (the hooks below); a test submits its
    own run to it.  It holds the FLARE lock while it runs."""
    pytest.importorskip(
        "nvflare", reason="NVIDIA FLARE is not installed; `pip install nvflare` to run deployment tests"
    )
    from tests.support.rehearsals import SharedCluster

    if "cluster" not in _SHARED:
        _SHARED["cluster"] = SharedCluster(tmp_path_factory.mktemp("flare"), FLARE_LOCK)
    shared = _SHARED["cluster"]
    try:
        shared.start()
    except Exception as e:  # pragma: no cover - environment without a working nvflare
        if "provision" in str(e):
            pytest.skip(f"nvflare cannot provision here: {e}")
        raise
    return shared


def pytest_runtest_teardown(item, nextitem):
    """Stop the shared FLARE cluster after the last test of a run of tests that use it."""
    if "flare_cluster" in getattr(item, "fixturenames", ()) and (
        nextitem is None or "flare_cluster" not in getattr(nextitem, "fixturenames", ())
    ):
        shared = _SHARED.get("cluster")
        if shared is not None:
            shared.close()


def pytest_unconfigure(config):
    """Stop the shared FLARE cluster if a test run ends while it runs (interrupted)."""
    shared = _SHARED.get("cluster")
    if shared is not None:
        shared.close()
