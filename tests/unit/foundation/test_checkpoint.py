"""The checkpoint module's files on their own: best models round trip, saved order, damaged records.

(The commit protocol: ``tests/runs/test_engine.py``; the background writer: ``tests/runs/test_device.py``;
resume = uninterrupted run for every method: ``tests/runs/test_resume.py``.)
"""

from __future__ import annotations

import json

import pytest
import torch

from fedseg.foundation.arrays import layout_of
from fedseg.foundation.errors import ConfigError
from fedseg.seams.algorithm import Candidate
from fedseg.seams.checkpoint import (
    Best,
    best_files,
    load_best,
    load_checked,
    read_best_meta,
    read_progress,
    save_arrays,
    save_json,
)
from tests.support.helpers import assert_same_arrays


def _best() -> dict[str, Best]:
    g = {"w": torch.arange(3.0), "n": torch.tensor(2)}
    p = {"w": torch.ones(2, 2)}
    return {
        "global": Best(0.5, 2, Candidate("global", g)),
        "personal/site1": Best(0.75, 3, Candidate("personal/site1", p, "model", ("site1",), "site1", {"k": 1})),
    }


def test_best_models_round_trip_through_their_two_files(tmp_path):
    # Prepare
    arrays, meta = best_files(_best())
    save_arrays(arrays, tmp_path / "best.safetensors")
    save_json(meta, tmp_path / "best.json")
    # Execute
    back = load_best(tmp_path, layout_of(arrays))
    # Assert: names prefixed on disk, every record and array back as it was
    assert sorted(arrays) == ["global/n", "global/w", "personal/site1/w"]
    assert list(back) == ["global", "personal/site1"]
    for name, b in _best().items():
        got = back[name]
        assert (got.score, got.round) == (b.score, b.round)
        c, d = got.candidate, b.candidate
        assert (c.name, c.predictor, c.val_sites, c.home_site, c.config) == (
            d.name,
            d.predictor,
            d.val_sites,
            d.home_site,
            d.config,
        )
        assert_same_arrays(c.arrays, d.arrays, name)
    assert read_best_meta(tmp_path)["personal/site1"]["val_sites"] == ["site1"]


def test_a_loaded_state_keeps_the_order_it_was_saved_in(tmp_path):
    """A file gives its tensors back in its own order; the layout recorded at save time restores theirs, so a resumed
    run iterates over its state (and sums over it) as the uninterrupted run does."""
    state = {"b": torch.zeros(1), "a": torch.ones(1), "c": torch.full((2,), 2.0)}
    save_arrays(state, tmp_path / "s.safetensors")
    assert list(load_checked(tmp_path / "s.safetensors", None)) == ["a", "b", "c"]  # the file's order
    assert list(load_checked(tmp_path / "s.safetensors", layout_of(state))) == ["b", "a", "c"]


def test_missing_or_damaged_records_are_one_error_naming_the_file(tmp_path):
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    with pytest.raises(ConfigError, match="has no checkpoints/best.json"):
        load_best(ckpt)
    arrays, meta = best_files(_best())
    save_arrays(arrays, ckpt / "best.safetensors")
    del meta["global"]["predictor"]
    (ckpt / "best.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=r"best.json is damaged \(entries \['global'\]"):
        load_best(ckpt)
    (ckpt / "best.json").write_text("{not json")
    with pytest.raises(ConfigError, match="best.json is damaged"):
        read_best_meta(ckpt, fix="run it again")
    assert read_progress(ckpt) is None
    (ckpt / "progress.json").write_text('{"history": []}')
    with pytest.raises(ConfigError, match="progress.json is damaged"):
        read_progress(ckpt)
