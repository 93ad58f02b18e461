"""Volumes read from the site's cache as they are used (``volume_reads``): the same patches, the same
weights, the same scores as volumes held in memory, with only per-case references held."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedseg.data.spec import load_federation
from fedseg.data.volumes.lazy import CachedVolumes
from fedseg.data.volumes.load import (
    MemoryBudget,
    load_volume_split,
    memory_budget,
    pad_to_shape,
    plan_federation,
    site_cache,
)
from fedseg.foundation.config import RunConfig
from fedseg.foundation.errors import ConfigError, DataError
from fedseg.simulation.runner import run
from fedseg.site.workload import _random_crop
from tests.runs.test_volumes_run import write_federation
from tests.support.helpers import assert_same_checkpoints


@pytest.fixture(scope="module")
def fed_plan(tmp_path_factory):
    root = tmp_path_factory.mktemp("lazy")
    fed = load_federation(write_federation(root, n=(3, 1, 1)))
    return fed, plan_federation(fed, log=lambda m: None)


def _both(fed, plan, split, folder, site="lps"):
    s = fed.site(site)
    memory = load_volume_split(fed, s, split, plan, site_cache(str(folder), fed, s, plan, log=lambda m: None))
    cached = load_volume_split(
        fed, s, split, plan, site_cache(str(folder), fed, s, plan, log=lambda m: None), MemoryBudget(0)
    )
    return memory, cached


def test_items_and_original_grid_equal_the_volumes_held_in_memory(fed_plan, tmp_path):
    fed, plan = fed_plan
    for split in ("training", "testing"):
        memory, cached = _both(fed, plan, split, tmp_path)
        assert isinstance(cached, CachedVolumes) and not isinstance(memory, CachedVolumes)
        assert cached.case_ids == memory.case_ids and cached.shape == list(memory.images.shape[2:])
        # padded further (to a federation's common shape): the image is filled with its lowest value, labels 0
        bigger = [s + 3 for s in cached.shape]
        pad_to_shape([memory, cached], bigger)
        for i in range(len(memory)):
            x, y = cached[i]
            assert torch.equal(x, memory.images[i]) and torch.equal(y, memory.labels[i])
        if split == "testing":
            pred = torch.randn(1, *bigger)
            p1, t1 = memory.original_grid(0, pred)
            p2, t2 = cached.original_grid(0, pred)
            assert torch.equal(p1, p2) and torch.equal(t1, t2)
            assert [o.shape for o in cached.originals] == [o.shape for o in memory.originals]


def test_patches_are_the_ones_cut_from_padded_volumes(fed_plan, tmp_path):
    """The crop draws each patch's place from the generator in the same order on a batch of padded volumes
    and on a batch of cached cases (foreground voxels listed in the same C order, the same padded shape), so
    with the same seed both give the same patches, including a patch larger than the volume along an axis
    (which reaches into the padding)."""
    fed, plan = fed_plan
    memory, cached = _both(fed, plan, "training", tmp_path)
    pad_to_shape([memory, cached], [s + 4 for s in cached.shape])
    idx = torch.tensor([2, 0, 1, 2])
    roi = [12, 9, cached.shape[2] + 2]  # longer than the volume along the last axis
    for share in (0.0, 0.5, 1.0):
        crop = _random_crop(roi, share)
        for seed in range(4):
            g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
            x1, y1 = crop(memory.images[idx], memory.labels[idx], g1, [memory.extents[i] for i in idx])
            batch = cached.batch(idx)
            x2, y2 = crop(batch, batch, g2)
            assert torch.equal(x1, x2) and torch.equal(y1, y2)
            assert torch.equal(g1.get_state(), g2.get_state())  # the same draws were taken
    # a held split keeps every voxel; a cached one its foreground positions only
    voxels = sum(int(np.prod(e)) for e in cached.extents)
    assert cached.nbytes <= 4 * voxels // 8 < memory.images.numel() * 4


@pytest.mark.parametrize("method", ["fedavg", "centralized"])
def test_a_run_reading_from_the_cache_equals_one_holding_the_volumes(tmp_path, method):
    spec = write_federation(tmp_path / "data", n=(3, 1, 1))
    common = [
        f"method={method}",
        "rounds=2",
        "train.local_steps=2",
        "train.batch_size=2",
        "train.foreground_share=0.5",
        "model.num_res_units=0",
        f"volume_cache={tmp_path / 'cache'}",
        "checkpoint_keep=all",  # every site's state is compared
    ]
    logs: list[str] = []
    results = {}
    for reads in ("memory", "cache"):
        results[reads] = run(
            spec, out=tmp_path / reads, overrides=[*common, f"volume_reads={reads}"], progress=False, log=logs.append
        )
    assert_same_checkpoints(tmp_path / "memory", tmp_path / "cache")
    assert results["memory"]["per_case_dice"] == results["cache"]["per_case_dice"]
    assert results["memory"]["per_case_hd95"] == results["cache"]["per_case_hd95"]
    assert any("training, validation, testing read from the cache as used" in m for m in logs)
    saved = json.loads((tmp_path / "cache" / "results.json").read_text())
    assert saved["config"]["volume_reads"] == "cache"


def test_auto_holds_what_fits_and_reads_the_rest_from_the_cache(fed_plan, tmp_path):
    fed, plan = fed_plan
    site = fed.site("ras")
    cache = site_cache(str(tmp_path), fed, site, plan, log=lambda m: None)
    held = load_volume_split(fed, site, "training", plan, cache, MemoryBudget(None))
    one = held.images[0].numel() * 4 + held.labels[0].numel() * 4  # the cases are of one shape here
    budget = MemoryBudget(int(2.5 * one))  # room for two of the three cases
    cached = load_volume_split(fed, site, "training", plan, cache, budget)
    assert isinstance(cached, CachedVolumes) and budget.used == 0 and budget.cached == ["training"]
    budget = MemoryBudget(3 * one)  # room for all three
    assert not isinstance(load_volume_split(fed, site, "training", plan, cache, budget), CachedVolumes)
    assert budget.used == 3 * one and budget.cached == []
    assert memory_budget("memory").limit is None and memory_budget("cache").limit == 0
    assert memory_budget("auto", sites=4).limit * 4 <= memory_budget("auto").limit
    # without a cache "auto" holds everything
    assert not isinstance(load_volume_split(fed, site, "training", plan, None, MemoryBudget(1)), CachedVolumes)


def test_cache_reads_without_a_cache_or_with_a_lost_file_name_the_fix(fed_plan, tmp_path):
    fed, plan = fed_plan
    site = fed.site("lps")
    with pytest.raises(ConfigError, match="volume_reads = 'cache'.*off"):
        load_volume_split(fed, site, "training", plan, None, MemoryBudget(0))
    with pytest.raises(ConfigError, match="volume_cache = 'off'"):
        RunConfig(federation="f.toml", volume_reads="cache", volume_cache="off").validate()
    with pytest.raises(ConfigError, match="volume_reads = 'disk'"):
        RunConfig(federation="f.toml", volume_reads="disk").validate()
    _, cached = _both(fed, plan, "training", tmp_path)
    cached.cases[0].path.unlink()  # the cache changed under a running site
    with pytest.raises(DataError, match=f"{cached.cases[0].path.name}.*run again"):
        cached[0]


def test_patches_stay_within_each_case_when_it_is_at_least_the_patch():
    """Volumes padded to one shape: every patch of a case at least as large as the patch lies inside the
    case's own extent (random corners drawn in [0, extent - patch], centred patches shifted back inside), so
    none holds padding; along an axis where the case is shorter than the patch, the patch starts at 0."""
    shape, roi = (20, 16, 12), [6, 6, 8]
    extents = [(20, 16, 12), (9, 7, 12), (12, 16, 5)]  # the last is shorter than the patch along z
    x = torch.full((3, 1, *shape), -1.0)
    y = torch.zeros(3, 1, *shape)
    for i, e in enumerate(extents):
        x[(i, 0, *(slice(0, v) for v in e))] = 1.0
        y[(i, 0, *(slice(v - 1, v) for v in e))] = 1.0  # foreground at the far corner of each case
    for share in (0.0, 1.0):
        crop = _random_crop(roi, share)
        for seed in range(20):
            px, py = crop(x, y, torch.Generator().manual_seed(seed), extents)
            assert (px[:2] == 1).all()  # within the case
            assert (px[2, 0, :, :, :5] == 1).all() and (px[2, 0, :, :, 5:] == -1).all()
            if share == 1.0:
                assert (py.flatten(1).sum(1) == 1).all()  # the centred foreground voxel is in every patch
