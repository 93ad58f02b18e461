"""Volumes with their geometry: federated statistics, the plan, the round trip into the plan's grid and back."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedseg.data.volumes.fingerprint import check_fingerprint, combine_moments, site_fingerprint, site_histogram
from fedseg.data.volumes.geometry import Geometry, to_original_grid, to_plan_grid
from fedseg.data.volumes.intensity import normalize_volume
from fedseg.data.volumes.plan import Plan, make_plan, target_spacing
from fedseg.foundation.errors import ConfigError, DataError


def _site(rng, n, shape, spacing, offset, scale):
    """n CT-like cases: air (-1000) around a box of foreground whose HU follow a skewed law per site."""
    out = []
    for _ in range(n):
        lab = np.zeros(shape, np.int64)
        c = [s // 2 for s in shape]
        lab[c[0] - 5 : c[0] + 5, c[1] - 4 : c[1] + 6, max(0, c[2] - 3) : c[2] + 3] = 1
        img = np.full(shape, -1000.0)
        img[lab > 0] = np.round(offset + rng.gamma(2.0, scale, size=int((lab > 0).sum())))
        out.append((img[None], lab, np.diag([*spacing, 1.0])))
    return out


@pytest.fixture(scope="module")
def uneven_sites():
    rng = np.random.default_rng(7)
    return {
        "small": _site(rng, 2, (24, 24, 10), (0.8, 0.8, 5.0), -50, 10.0),
        "large": _site(rng, 6, (30, 28, 16), (0.6, 0.6, 2.0), 40, 40.0),
        "mid": _site(rng, 3, (26, 26, 12), (1.0, 1.0, 3.0), 150, 5.0),
    }


def _ask(sites):
    """The histogram exchange over in-process sites: each answers from its own cases only."""
    return lambda requests, weighting, names: {k: site_histogram(sites[k], requests, weighting) for k in names}


def _ct(plan):
    return plan.intensity["channels"][0]


def _fg(cases):
    return np.concatenate([img[0][lab > 0].astype(np.float64) for img, lab, _ in cases])


def test_pooled_statistics_equal_pooled_voxels_and_beat_averaged_percentiles(uneven_sites):
    """The plan's voxel-weighted CT statistics are those of the pooled foreground voxels, without pooling them.

    Mean and sd: Chan's combination of (count, mean, M2) is an identity, so the pooled values match
    ``np.mean``/``np.std`` of the concatenated voxels to float64 rounding (≤ 1e-9 relative).
    Percentiles: the counts narrow an interval around each target rank until it holds one integer, so on
    integer HU they equal ``np.percentile`` of the pooled voxels.  Averaging each site's percentile
    weighted by its case count (FednnU-Net's rule) is not a percentile of the pooled data: with sites of
    different sizes and intensity laws it misses by several HU.
    """
    fps = {k: site_fingerprint(v) for k, v in uneven_sites.items()}
    plan = make_plan(fps, _ask(uneven_sites), weighting="voxel", log=lambda m: None)
    pooled = np.concatenate([_fg(v) for v in uneven_sites.values()])
    ct = _ct(plan)
    assert ct["mode"] == "ct" and ct["weighting"] == "voxel" and ct["bound"] == 0.0
    assert math.isclose(ct["mean"], pooled.mean(), rel_tol=1e-9)
    assert math.isclose(ct["sd"], pooled.std(), rel_tol=1e-9)
    true_lo, true_hi = np.percentile(pooled, [0.5, 99.5])
    assert ct["lo"] == pytest.approx(true_lo, abs=1e-9) and ct["hi"] == pytest.approx(true_hi, abs=1e-9)
    n_cases = {k: len(v) for k, v in uneven_sites.items()}
    avg = [
        sum(n_cases[k] * np.percentile(_fg(v), q) for k, v in uneven_sites.items()) / sum(n_cases.values())
        for q in (0.5, 99.5)
    ]
    assert max(abs(avg[0] - true_lo), abs(avg[1] - true_hi)) > 10


def test_combined_moments_by_hand():
    """Parts {1, 2, 3} (n 3, mean 2, M2 = 1 + 0 + 1 = 2) and {10} (n 1, mean 10, M2 0): δ = 8, so
    mean = 2 + 8·1/4 = 4 and M2 = 2 + 0 + 64·3·1/4 = 50, the M2 of {1, 2, 3, 10} about 4 (9 + 4 + 1 + 36)."""
    assert combine_moments([{"count": 3, "mean": 2.0, "m2": 2.0}, {"count": 1, "mean": 10.0, "m2": 0.0}]) == (
        4,
        4.0,
        50.0,
    )
    assert combine_moments([{"count": 0, "mean": 0.0, "m2": 0.0}]) == (0, 0.0, 0.0)


@pytest.mark.parametrize(
    "bad, reason",
    [
        ({"foreground": {"count": -3}}, "count"),
        ({"foreground": {"mean": float("nan")}}, "not finite"),
        ({"cases": []}, "no training case"),
        ({"cases": [{"spacing": [0.8, -1, 2], "shape": [4, 4, 4]}]}, "spacing"),
        ({"foreground": {"count": 0}}, "no foreground"),
        ({"version": 99}, "version"),
        ({"by_case": {"count": 99}}, "more cases"),
    ],
)
def test_hostile_fingerprint_is_rejected_and_plan_uses_the_others(uneven_sites, bad, reason):
    fps = {k: site_fingerprint(v) for k, v in uneven_sites.items()}
    hostile = dict(fps["mid"])
    for k, v in bad.items():
        if k in ("foreground", "by_case"):  # per-channel statistics
            ch = dict(hostile["channels"][0])
            ch[k] = {**ch[k], **v}
            hostile["channels"] = [ch]
        else:
            hostile[k] = v
    fps["mid"] = hostile
    assert reason in check_fingerprint(hostile)
    logged = []
    plan = make_plan(fps, _ask(uneven_sites), weighting="voxel", log=logged.append)
    assert plan.sites == ["large", "small"] and "mid" in plan.rejected
    pooled = np.concatenate([_fg(uneven_sites[k]) for k in ("small", "large")])
    assert math.isclose(_ct(plan)["mean"], pooled.mean(), rel_tol=1e-9)
    assert any("mid" in m for m in logged)


def test_histogram_of_wrong_length_is_rejected(uneven_sites):
    fps = {k: site_fingerprint(v) for k, v in uneven_sites.items()}

    def hist(requests, weighting, names):
        out = _ask(uneven_sites)(requests, weighting, names)
        if "small" in out:  # the search starts again without the rejected site
            out["small"] = [c[:-1] for c in out["small"]]
        return out

    plan = make_plan(fps, hist, log=lambda m: None)
    assert "small" in plan.rejected and "bins" in plan.rejected["small"]


def test_no_usable_site_is_one_error(uneven_sites):
    fps = {k: {"version": 1} for k in uneven_sites}
    with pytest.raises(DataError, match="no site sent a usable fingerprint"):
        make_plan(fps, lambda r, w, n: {}, log=lambda m: None)


def test_anisotropy_rule_takes_the_tenth_percentile():
    """nnU-Net's rule: median spacing (0.7, 0.7, 5) has z > 3 × in-plane and the median z extent in voxels
    (40·5/5 = 40) is under a third of the in-plane ones (512·0.7/0.7 = 512), so z takes the 10th percentile
    of the z spacings (1.5 here) instead of the median."""
    spacings = np.array([[0.7, 0.7, 5.0]] * 8 + [[0.7, 0.7, 1.5]] * 2)
    shapes = np.array([[512, 512, 40]] * 10)
    got = target_spacing(spacings, shapes)
    assert got[:2] == [0.7, 0.7]
    assert got[2] == pytest.approx(np.percentile(spacings[:, 2], 10))
    iso = target_spacing(np.array([[1.0, 1.0, 1.2]] * 5), np.array([[100, 100, 90]] * 5))
    assert iso == [1.0, 1.0, 1.2]


def _blob_label(shape, affine, radius_mm=9.0):
    """An ellipsoid and an inner sphere defined in millimetres, sampled on the voxel grid of ``affine``."""
    idx = np.stack(np.meshgrid(*[np.arange(s) for s in shape], indexing="ij"), -1).reshape(-1, 3)
    world = idx @ affine[:3, :3].T + affine[:3, 3]
    r = np.linalg.norm((world - [2.0, -3.0, 4.0]) / [1.0, 0.8, 1.3], axis=1)
    lab = np.where(r < radius_mm, 1, 0) + np.where(r < radius_mm / 2, 1, 0)
    return lab.reshape(shape)


def _dice(a, b):
    return 2 * (a & b).sum() / (a.sum() + b.sum())


def _oblique(spacing, angle):
    c, s = math.cos(angle), math.sin(angle)
    rot = np.array([[c, -s, 0], [s, c, 0], [0, 0, 1.0]])
    aff = np.eye(4)
    aff[:3, :3] = rot @ np.diag(spacing)
    return aff


@pytest.mark.parametrize(
    "name, affine, shape, target, exact",
    [
        (
            "flipped",
            np.array([[-1.0, 0, 0, 20], [0, -1.0, 0, 18], [0, 0, 2.0, -20], [0, 0, 0, 1]]),
            (40, 36, 20),
            (1, 1, 2),
            True,
        ),
        (
            "permuted",
            np.array([[0, 0, 2.0, -20], [-1.0, 0, 0, 20], [0, 1.0, 0, -18], [0, 0, 0, 1]]),
            (40, 36, 20),
            (2, 1, 1),
            True,
        ),
        (
            "anisotropic",
            np.diag([0.7, 0.7, 4.0, 1.0]) + np.array([[0, 0, 0, -14], [0, 0, 0, -14], [0, 0, 0, -20], [0, 0, 0, 0]]),
            (40, 40, 10),
            (0.9, 0.9, 1.5),
            False,
        ),
        (
            "oblique",
            _oblique((0.8, 0.8, 2.5), 0.3) + np.array([[0, 0, 0, -10], [0, 0, 0, -20], [0, 0, 0, -12], [0, 0, 0, 0]]),
            (48, 48, 12),
            (0.8, 0.8, 2.5),
            False,
        ),
    ],
)
def test_label_round_trip_through_the_plan_grid(name, affine, shape, target, exact):
    """A label carried into the plan's grid (nearest) and back into its own grid (nearest) scores Dice
    ≥ 0.95 against itself; where only the orientation differs (axes flipped or permuted, spacing kept) the
    resampling is a permutation of voxels, so it comes back exactly (Dice 1)."""
    lab = _blob_label(shape, affine)
    assert (lab == 2).sum() > 20
    img = np.zeros((1, *shape), np.float32)
    _, plan_lab, plan_affine = to_plan_grid(img, lab, affine, target)
    onehot = torch.from_numpy(np.stack([plan_lab >= 1, plan_lab == 2]).astype(np.float32))
    back = to_original_grid(onehot, plan_affine, Geometry(affine, shape), mode="nearest").numpy() > 0.5
    for ch, want in enumerate([lab >= 1, lab == 2]):
        d = _dice(back[ch], want)
        assert d == 1.0 if exact else d >= 0.95, (name, ch, d)


def test_intensity_modes():
    x = np.array([[[[-1000.0, 0.0], [40.0, 3000.0]]]])
    ct = normalize_volume(x, "ct", {"lo": -100, "hi": 200, "mean": 50, "sd": 25})
    assert ct.min() == pytest.approx(-6.0) and ct.max() == pytest.approx(6.0)
    w = normalize_volume(x, "window", {"window": [-100, 100]})
    assert w.min() == 0 and w.max() == 1
    z = normalize_volume(np.array([[[[0.0, 2.0], [4.0, 6.0]]]]), "zscore")
    assert z.flat[0] == 0 and z[z != 0].mean() == pytest.approx(0, abs=1e-6)
    with pytest.raises(ValueError, match="unknown intensity"):
        normalize_volume(x, "hu")


def test_plan_fills_only_what_the_run_left_unset():
    """``eval.every`` unset takes the plan's interval and ``model.channels``/``strides`` unset the plan's U-Net;
    set to any value, the one an unset setting has in a run without a plan included (every round; the 2D
    U-Net's levels), each is kept."""
    from fedseg.data.volumes.load import plan_for_run
    from fedseg.foundation.config import UNET_CHANNELS, UNET_STRIDES, EvalConfig, ModelConfig, RunConfig

    plan = Plan([1.0, 1.0, 2.0], [64, 64, 32], [32, 32, 16], [16, 32], [[2, 2, 2]], {"mode": "zscore"}, eval_every=5)
    quiet = dict(log=lambda m: None)
    unset = RunConfig(federation="f.toml", rounds=20)
    assert unset.eval.every is None and all(unset.is_eval_round(r) for r in range(1, 21))
    planned = plan_for_run(unset, plan, **quiet)
    assert planned.eval.every == 5
    assert planned.model.levels() == ((16, 32), ((2, 2, 2),))
    assert unset.model.levels() == (UNET_CHANNELS, UNET_STRIDES)
    shipped = ModelConfig(channels=UNET_CHANNELS, strides=UNET_STRIDES)
    kept = plan_for_run(RunConfig(federation="f.toml", model=shipped), plan, **quiet)
    assert kept.model.levels() == (UNET_CHANNELS, UNET_STRIDES)
    for every in (1, 3):
        explicit = RunConfig(federation="f.toml", rounds=20, eval=EvalConfig(every=every))
        assert plan_for_run(explicit, plan, **quiet).eval.every == every
    # without a plan interval and without case counts to derive one, an unset interval becomes 1
    plan.eval_every = None
    assert plan_for_run(unset, plan, **quiet).eval.every == 1


def test_plan_file_refuses_edits_that_do_not_fit(tmp_path):
    good = Plan([1.0, 1.0, 2.0], [64, 64, 32], [32, 32, 16], [16, 32], [[2, 2, 2]], {"mode": "zscore"})
    good.check()
    bad = Plan([1.0, 1.0, 2.0], [64, 64, 32], [33, 32, 16], [16, 32], [[2, 2, 2]], {"mode": "zscore"})
    with pytest.raises(ConfigError, match="not divisible"):
        bad.check()
    with pytest.raises(ConfigError, match="unknown key"):
        Plan.from_json({**good.to_json(), "spacing": [1, 1, 1]})
