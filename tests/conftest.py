"""Shared fixtures: tiny in-memory federations that train in well under a second."""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from fedseg.foundation.config import ModelConfig, RunConfig, TrainConfig
from fedseg.site.batches import SiteData
from fedseg.site.workload import segmentation_workload

# Tiny models gain nothing from intra-op threads, and OpenMP spin-waiting makes them
# crawl when another process holds the second core.
torch.set_num_threads(1)

# A CPU's volume plan is made for a fixed throughput in tests (no probe): the same plan on every machine.
os.environ.setdefault("FEDSEG_CPU_GFLOPS", "20")

TINY_MODEL = ModelConfig(channels=(4, 8, 16), strides=(2, 2), num_res_units=1)


def tiny_sites(num_sites: int = 3, n_train: int = 6, size: int = 16, seed: int = 0) -> dict[str, SiteData]:
    """Sites whose masks are bright pixels of a site-specific threshold (learnable, heterogeneous)."""
    g = torch.Generator().manual_seed(seed)
    data = {}
    for k in range(num_sites):

        def split(n: int) -> TensorDataset:
            x = torch.rand(n, 1, size, size, generator=g)
            return TensorDataset(x, (x > 0.3 + 0.1 * k).float())  # noqa: B023

        data[f"site{k + 1}"] = SiteData(split(n_train + 2 * k), split(3), split(3))
    return data


def tiny_config(method: str = "fedavg", rounds: int = 3, **train) -> RunConfig:
    return RunConfig(
        federation="(in memory)",
        method=method,
        rounds=rounds,
        model=TINY_MODEL,
        train=TrainConfig(batch_size=4, **train),
        checkpoint_keep="all",  # the tests read every site's state of finished runs (resume, bitwise equality)
    )


@pytest.fixture
def sites() -> dict[str, SiteData]:
    return tiny_sites()


@pytest.fixture
def workload():
    return segmentation_workload(2, 1, ["fg"], TINY_MODEL)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: skipped (with the reason) on machines without it.  Tests that start FLARE
    processes (:data:`FLARE_FIXTURES`) run first, one after another, those on the shared cluster first (it starts
    once, and stops before the others start clusters of their own): pytest-xdist's default distribution sends
    each worker a first chunk of consecutive tests (about an eighth of them on two workers), so they all go to
    the first worker while the other runs the rest."""
    flare = [i for i in items if any(f in getattr(i, "fixturenames", ()) for f in FLARE_FIXTURES)]
    if flare:
        shared = [i for i in flare if "flare_cluster" in i.fixturenames]
        block = shared + [i for i in flare if "flare_cluster" not in i.fixturenames]
        chosen = set(flare)
        items[:] = block + [i for i in items if i not in chosen]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (a GPU); CI runs the CPU paths of the same code")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def count_host_reads(monkeypatch, *files: str) -> dict[str, int]:
    """Count host reads of tensor values (``float(t)``, ``t.item()``, ``t.tolist()``) made directly
    by code in the source files whose path ends with one of ``files`` (e.g. ``"fedseg/site/runtime.py"``):
    each is a device synchronisation on a GPU.  Returns the live counter ``{"n": …}``."""
    calls = {"n": 0}
    ends = tuple(files) + tuple(f.replace("/", "\\") for f in files)

    def counted(real):
        def wrapper(t, *args, **kwargs):
            if sys._getframe(1).f_code.co_filename.endswith(ends):
                calls["n"] += 1
            return real(t, *args, **kwargs)

        return wrapper

    for name in ("__float__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
    return calls


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
    """The FLARE cluster shared by the rehearsals that need no fault (tests/rehearsals.py): provisioned and
    started by the first test that asks for it, stopped after the last (the hooks below); a test submits its
    own run to it.  It holds the FLARE lock while it runs."""
    pytest.importorskip(
        "nvflare", reason="NVIDIA FLARE is not installed; `pip install nvflare` to run deployment tests"
    )
    from rehearsals import SharedCluster

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
