"""Shared fixtures: tiny in-memory federations that train in well under a second."""

from __future__ import annotations

import fcntl
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from fedseg.foundation.config import ModelConfig, RunConfig, TrainConfig
from fedseg.site.runtime import SiteData
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
    )


@pytest.fixture
def sites() -> dict[str, SiteData]:
    return tiny_sites()


@pytest.fixture
def workload():
    return segmentation_workload(2, 1, ["fg"], TINY_MODEL)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: skipped (with the reason) on machines without it."""
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


@pytest.fixture
def flare_lock():
    """One NVIDIA FLARE cluster at a time on this machine: a test that starts FLARE processes holds this lock
    (an flock on a file in the temp folder) for its whole run, so pytest workers never run two clusters at
    once (two clusters on two cores have made a site's job fail to start)."""
    with (Path(tempfile.gettempdir()) / "fedseg-tests-flare.lock").open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
