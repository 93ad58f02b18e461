"""The intensity schemes as types: the plan's JSON read into one class per scheme and written back unchanged."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from fedseg.data.spec import INTENSITY_MODES
from fedseg.data.volumes.schemes import (
    SCHEMES,
    CTNormalization,
    RescaleNormalization,
    WindowNormalization,
    ZScoreNormalization,
    scheme_from_config,
)
from fedseg.foundation.errors import ConfigError

PLAN_OBJECTS = [
    {"mode": "ct", "lo": -48.0, "hi": 319.1, "mean": 61.7, "sd": 88.5, "weighting": "case", "bound": 0.0},
    {"mode": "ct", "lo": -100, "hi": 200, "mean": 50, "sd": 25},
    {"mode": "zscore"},
    {"mode": "zscore", "body": -500.0},
    {"mode": "zscore", "body": "all"},
    {"mode": "window", "window": [0.0, 80.0]},
    {"mode": "minmax"},
]


def test_every_spec_scheme_has_one_class():
    assert set(SCHEMES) == set(INTENSITY_MODES)
    assert all(cls.mode == name for name, cls in SCHEMES.items())


@pytest.mark.parametrize("obj", PLAN_OBJECTS, ids=lambda o: json.dumps(o))
def test_a_plans_scheme_is_written_back_as_it_was_read(obj):
    """A plan file read and written again keeps every scheme byte for byte (key order, ints, optional
    fields left out), and the class is the one its mode names."""
    scheme = scheme_from_config(obj)
    assert type(scheme) is SCHEMES[obj["mode"]]
    assert json.dumps(scheme.to_config()) == json.dumps(obj)
    assert scheme_from_config(scheme.to_config()) == scheme


@pytest.mark.parametrize(
    ("obj", "words"),
    [
        ({"mode": "hu"}, "unknown intensity mode 'hu'; use 'ct', 'zscore', 'window', 'minmax'"),
        ([1, 2], "an object with a mode"),
        ({"mode": "ct", "lo": 0, "hi": 1, "mean": 0}, "'ct' needs lo, hi, mean and sd"),
        ({"mode": "window", "window": [0]}, "'window' needs window = [lo, hi]"),
        ({"mode": "zscore", "body": "air"}, "body = 'air'; use a number"),
        ({"mode": "zscore", "body": True}, "body = True; use a number"),
    ],
)
def test_a_scheme_that_cannot_be_applied_is_refused_naming_the_field(obj, words):
    with pytest.raises(ConfigError, match="^plan.sites.a: .*" + re.escape(words)):
        scheme_from_config(obj, "plan.sites.a")


def test_each_scheme_maps_a_channel_as_its_definition_says():
    """By hand on x = [-1000, 0, 40, 3000]: CT (lo −100, hi 200, mean 50, sd 25) clips to [−100, 200] then
    (x − 50) / 25 = [−6, −2, −0.4, 6]; the window [−100, 100] gives (clip(x) + 100) / 200 = [0, 0.5, 0.7, 1];
    min-max gives (x + 1000) / 4000; z-score over the voxels above −500 takes the mean 1013.33 and the sd of
    [0, 40, 3000] and sets the air voxel to 0; ``"all"`` keeps it in."""
    x = np.array([-1000.0, 0.0, 40.0, 3000.0])
    np.testing.assert_allclose(CTNormalization(-100, 200, 50, 25)(x), [-6, -2, -0.4, 6], rtol=1e-6)
    np.testing.assert_allclose(WindowNormalization((-100, 100))(x), [0, 0.5, 0.7, 1], rtol=1e-6)
    np.testing.assert_allclose(RescaleNormalization()(x), (x + 1000) / 4000, rtol=1e-6)
    body = x[1:]
    z = ZScoreNormalization(-500.0)(x)
    np.testing.assert_allclose(z, [0, *((body - body.mean()) / body.std())], rtol=1e-5)
    np.testing.assert_allclose(ZScoreNormalization("all")(x), (x - x.mean()) / x.std(), rtol=1e-5)
    assert all(s(x).dtype == np.float32 for s in (CTNormalization(0, 1, 0, 1), RescaleNormalization()))
    assert not RescaleNormalization()(np.full(3, 7.0)).any()


def test_the_plan_log_names_the_body_of_a_zscore():
    assert ZScoreNormalization(-500.0).describe() == "zscore over values above -500"
    assert ZScoreNormalization("all").describe() == "zscore over every voxel"
    assert ZScoreNormalization().describe() == "zscore"


def test_a_planned_scheme_is_the_deciding_sites_view_of_the_channel():
    """What the plan makes of a channel alone: a z-score over the voxels above −500 on a CT-like channel,
    else over the non-zero ones; the spec's window; and a window scheme without the spec's window refused."""
    assert SCHEMES["zscore"].planned(ct_like=True, window=None) == ZScoreNormalization(-500.0)
    assert SCHEMES["zscore"].planned(ct_like=False, window=None) == ZScoreNormalization()
    assert SCHEMES["window"].planned(ct_like=True, window=(0, 80)).to_config() == {
        "mode": "window",
        "window": [0.0, 80.0],
    }
    assert SCHEMES["minmax"].planned(ct_like=False, window=None) == RescaleNormalization()
    with pytest.raises(ConfigError, match="data.window in the spec"):
        SCHEMES["window"].planned(ct_like=False, window=None)
