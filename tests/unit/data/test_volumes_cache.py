"""The per-site cache of preprocessed volumes: a hit equals preprocessing, a changed plan or source file
misses, a corrupt entry is rebuilt."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from fedseg.data.spec import load_federation
from fedseg.data.volumes.cache import CACHE_DIR
from fedseg.data.volumes.load import load_volume_split, plan_federation, site_cache
from tests.runs.test_volumes_run import write_federation


@pytest.fixture(scope="module")
def fed_plan(tmp_path_factory):
    root = tmp_path_factory.mktemp("vol")
    fed = load_federation(write_federation(root, n=(2, 1, 1)))
    return fed, plan_federation(fed, log=lambda m: None)


def _same(a, b):
    assert a.case_ids == b.case_ids
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    for x, y in zip(a.affines, b.affines):
        assert (x == y).all()
    if a.originals is not None:
        for x, y in zip(a.originals, b.originals):
            assert (x.affine == y.affine).all() and x.shape == y.shape
        for x, y in zip(a.original_labels, b.original_labels):
            assert torch.equal(x, y)


def _load(fed, plan, split, setting, logs=None):
    site = fed.site("lps")
    cache = site_cache(setting, fed, site, plan, log=(logs.append if logs is not None else lambda m: None))
    return load_volume_split(fed, site, split, plan, cache), cache


def test_cache_hit_gives_the_preprocessed_tensors_bitwise(fed_plan, tmp_path):
    fed, plan = fed_plan
    for split in ("training", "testing"):
        plain, none = _load(fed, plan, split, "off")
        assert none is None
        cold, c1 = _load(fed, plan, split, str(tmp_path))
        warm, c2 = _load(fed, plan, split, str(tmp_path))
        assert (c1.hits, c1.stored) == (0, len(plain)) and (c2.hits, c2.stored) == (len(plain), 0)
        _same(cold, plain)
        _same(warm, plain)
    assert c2.folder.parent == tmp_path / "lps" and len(list(c2.folder.glob("*.safetensors"))) == 3


def test_auto_puts_the_cache_beside_the_datalist(fed_plan):
    fed, plan = fed_plan
    cache = site_cache("auto", fed, fed.site("lps"), plan)
    assert cache.root == fed.site("lps").datalist.parent / CACHE_DIR


def test_changed_plan_or_source_file_misses(fed_plan, tmp_path):
    fed, plan = fed_plan
    _load(fed, plan, "training", str(tmp_path))
    # a different target spacing (or intensity statistics) is another key: nothing is reused
    moved = dataclasses.replace(plan, target_spacing=[plan.target_spacing[0] * 1.1, *plan.target_spacing[1:]])
    ds, cache = _load(fed, moved, "training", str(tmp_path))
    assert (cache.hits, cache.stored) == (0, 2)
    _same(ds, _load(fed, moved, "training", "off")[0])
    # a patch size edited in the plan does not change the preprocessing: still a hit
    _, cache = _load(fed, dataclasses.replace(plan, patch_size=[8, 8, 8]), "training", str(tmp_path))
    assert cache.hits == 2
    # a source file rewritten (new modification time) is preprocessed again, the other case is read
    image = fed.site("lps").datalist.parent / "training0_img.nii.gz"
    st = image.stat()
    os.utime(image, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    _, cache = _load(fed, plan, "training", str(tmp_path))
    assert (cache.hits, cache.stored) == (1, 1) and not cache.rebuilt


@pytest.mark.parametrize("damage", ["truncate", "flip", "sidecar"])
def test_corrupt_entry_is_logged_and_rebuilt(fed_plan, tmp_path, damage):
    fed, plan = fed_plan
    _, cache = _load(fed, plan, "testing", str(tmp_path))
    arrays = next(cache.folder.glob("*.safetensors"))
    blob = bytearray(arrays.read_bytes())
    if damage == "truncate":
        arrays.write_bytes(bytes(blob[: len(blob) // 2]))
    elif damage == "flip":
        blob[-5] ^= 0xFF  # a voxel's bytes: same size, valid header
        arrays.write_bytes(bytes(blob))
    else:
        arrays.with_suffix(".json").write_text('{"version": 1, "key"')
    logs: list[str] = []
    ds, cache = _load(fed, plan, "testing", str(tmp_path), logs)
    assert (cache.hits, cache.stored, len(cache.rebuilt)) == (0, 1, 1)
    assert any("preprocessed again" in m for m in logs)
    _same(ds, _load(fed, plan, "testing", "off")[0])
    _, cache = _load(fed, plan, "testing", str(tmp_path))
    assert cache.hits == 1  # the rebuilt entry is good


def test_unwritable_cache_folder_is_logged_and_the_split_loads(fed_plan, tmp_path):
    fed, plan = fed_plan
    (tmp_path / "lps").write_text("a file where the cache folder would be")
    logs: list[str] = []
    ds, cache = _load(fed, plan, "testing", str(tmp_path), logs)
    assert cache.disabled and any("cannot write" in m for m in logs)
    _same(ds, _load(fed, plan, "testing", "off")[0])
