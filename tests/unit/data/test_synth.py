"""The synthetic multi-site generator."""

from __future__ import annotations

import json

import pytest
import torch

from fedseg.data.loading import load_split
from fedseg.data.spec import load_federation
from fedseg.data.synth import FUNDUS_COUNTS, split_sizes, synthesize
from fedseg.data.validate import validate_federation
from fedseg.foundation.errors import ConfigError

SCALE = 0.05


@pytest.fixture(scope="module")
def fundus(tmp_path_factory):
    return synthesize("fundus", tmp_path_factory.mktemp("fundus"), seed=0, scale=SCALE, size=32)


def _tree(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_seed_same_bytes_other_seed_differs(tmp_path, fundus):
    # Execute
    again = synthesize("fundus", tmp_path / "a", seed=0, scale=SCALE, size=32)
    other = synthesize("fundus", tmp_path / "b", seed=1, scale=SCALE, size=32)
    # Assert
    ref = _tree(fundus.parent)
    assert _tree(again.parent) == ref
    changed = _tree(other.parent)
    assert changed.keys() == ref.keys()
    assert changed["site1/images/train_0.png"] != ref["site1/images/train_0.png"]


def test_split_sizes_follow_table_1(fundus):
    # Prepare: paper counts x scale, rounded, floor 2
    expected = [[max(2, round(n * SCALE)) for n in row] for row in FUNDUS_COUNTS]
    # Execute
    counts = []
    for s in range(1, 7):
        d = json.loads((fundus.parent / f"site{s}" / "datalist.json").read_text())
        counts.append([len(d[k]) for k in ("training", "validation", "testing")])
    # Assert
    assert counts == expected == [list(r) for r in split_sizes("fundus", SCALE)]
    assert split_sizes("fundus", 1.0)[5] == (400, 200, 200)
    assert split_sizes("prostate", 1.0)[0] == (153, 77, 61)


def test_spec_validates_clean_and_cup_inside_disc(fundus):
    # Execute
    problems = validate_federation(fundus)
    fed = load_federation(fundus)
    # Assert
    assert problems == []
    assert fed.labels == {"disc": (1, 2), "cup": (2,)} and fed.in_channels == 3
    for site in fed.site_names:
        for split in ("training", "testing"):
            ds = load_split(fed, site, split)
            disc, cup = ds.labels[:, 0], ds.labels[:, 1]
            assert torch.all(cup <= disc)
            assert torch.all(disc.sum((1, 2)) > cup.sum((1, 2)))  # a disc rim around every cup
            assert torch.all(cup.sum((1, 2)) > 0)


def test_sites_visibly_differ(fundus):
    # Prepare
    fed = load_federation(fundus)
    # Execute: mean RGB colour over each site's training images
    means = torch.stack([load_split(fed, s, "training").images.mean((0, 2, 3)) for s in fed.site_names])
    # Assert: every pair of sites differs by > 0.05 in some channel
    gaps = (means[:, None] - means[None]).abs().amax(-1)
    assert gaps[~torch.eye(6, dtype=bool)].min() > 0.05


def test_prostate_preset(tmp_path):
    # Execute
    spec = synthesize("prostate", tmp_path, seed=3, scale=0.01, size=32)
    fed = load_federation(spec)
    # Assert
    assert validate_federation(spec) == []
    ds = load_split(fed, "site6", "training")
    assert ds.images.shape == (12, 1, 32, 32) and ds.labels.shape == (12, 1, 32, 32)
    assert torch.all(ds.labels.sum((1, 2, 3)) > 0)


def test_bad_arguments():
    # Execute / Assert
    with pytest.raises(ConfigError, match="unknown synthetic preset 'brain'"):
        synthesize("brain", "/nonexistent")
    with pytest.raises(ConfigError, match="seed"):
        synthesize("fundus", "/nonexistent", seed=-1)
