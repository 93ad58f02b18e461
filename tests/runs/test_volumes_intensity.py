"""Intensities of volumes per channel and per site, and the exact pooled percentiles."""

from __future__ import annotations

import json
import math

import nibabel as nib
import numpy as np
import pytest

from fedseg.data.spec import load_federation
from fedseg.data.validate import validate_federation
from fedseg.data.volumes.fingerprint import CT_AIR, site_fingerprint, site_histogram
from fedseg.data.volumes.intensity import HISTOGRAM_BINS, channel_schemes, normalize_case
from fedseg.data.volumes.load import plan_federation, read_channels, training_cases, with_spec_intensity
from fedseg.data.volumes.plan import make_plan
from fedseg.foundation.errors import ConfigError, DataError

SHAPE = (16, 16, 6)


def _box(i: int = 0) -> np.ndarray:
    """A box of foreground, smaller for every case index ``i`` (so cases weigh differently by voxel)."""
    lab = np.zeros(SHAPE, np.int64)
    lab[4:12, 3 : 13 - 3 * (i % 3), 1:5] = 1
    return lab


def _ct_site(rng, n, offset, scale, integer=True, extra=None):
    """CT-like cases: air at −1000 around a foreground of skewed HU (integers, or floats as a resampled
    export stores them); ``extra`` puts one voxel of that value into the first case's foreground."""
    out = []
    for i in range(n):
        lab = _box(i)
        img = np.full(SHAPE, -1000.0)
        vals = offset + rng.gamma(2.0, scale, size=int(lab.sum()))
        img[lab > 0] = np.round(vals) if integer else vals
        if extra is not None and i == 0:
            img[tuple(np.argwhere(lab > 0)[0])] = extra
        out.append((img[None], lab, np.diag([1.0, 1.0, 2.0, 1.0])))
    return out


def _ask(sites, sent=None):
    """The histogram exchange, each site answering from its own cases; ``sent`` records every reply."""

    def ask(requests, weighting, names):
        replies = {k: site_histogram(sites[k], requests, weighting) for k in names}
        if sent is not None:
            sent.append(replies)
        return replies

    return ask


def _plan(sites, **kw):
    fps = {k: site_fingerprint(v) for k, v in sites.items()}
    return make_plan(fps, _ask(sites, kw.pop("sent", None)), log=kw.pop("log", lambda m: None), **kw)


def _fg(sites, names=None):
    return [
        img[0][lab > 0].astype(np.float64) for k, v in sites.items() if names is None or k in names for img, lab, _ in v
    ]


def test_percentiles_are_exact_on_integer_data_and_stay_put_beside_one_extreme_voxel():
    """Voxel-weighted: the counts narrow (lo, hi] to the bin where the cumulative count reaches the rank,
    4096-fold a round, until a bin is at most 1 wide and holds one integer: that integer is the order
    statistic, so the percentiles equal ``np.percentile`` of the pooled voxels (linear interpolation
    between ranks ⌊h⌋ and ⌊h⌋ + 1).  One site adding a voxel at 1e6 widens the first bins to 244 but a
    second round brings them under 1: the percentiles are again numpy's of the pooled voxels (which moved
    by at most one rank), where a 4096-bin histogram's bins are 244 HU wide.
    Case-weighted (nnU-Net): each voxel of a case with n foreground voxels weighs 1/n; the percentile
    equals numpy's weighted ``inverted_cdf`` and the mean and sd those of the weighted voxels.
    Every reply is a list of counts (numbers of voxels, or sums of 1/n), never a voxel value."""
    rng = np.random.default_rng(3)
    sites = {"a": _ct_site(rng, 2, -50, 10.0), "b": _ct_site(rng, 5, 40, 40.0), "c": _ct_site(rng, 3, 150, 5.0)}
    sent: list = []
    plain = _plan(sites, weighting="voxel", sent=sent)
    pooled = np.concatenate(_fg(sites))
    ct = plain.intensity["channels"][0]
    assert [ct["lo"], ct["hi"]] == pytest.approx(np.percentile(pooled, [0.5, 99.5]).tolist(), abs=1e-9)
    assert ct["bound"] == 0.0 and len(sent) == 1  # a pooled range under 4096: bins under 1 at once
    assert all(isinstance(v, int) for r in sent for counts in r.values() for c in counts for v in c)

    rng = np.random.default_rng(3)  # the same draws: site b has one voxel at 1e6 in place of one value
    sites = {
        "a": _ct_site(rng, 2, -50, 10.0),
        "b": _ct_site(rng, 5, 40, 40.0, extra=1e6),
        "c": _ct_site(rng, 3, 150, 5.0),
    }
    sent.clear()
    outlier = _plan(sites, weighting="voxel", sent=sent).intensity["channels"][0]
    assert len(sent) == 2
    pooled2 = np.concatenate(_fg(sites))
    assert [outlier["lo"], outlier["hi"]] == pytest.approx(np.percentile(pooled2, [0.5, 99.5]).tolist(), abs=1e-9)
    step = 100.0 / (pooled.size - 1)  # replacing one voxel moves an order statistic by at most one rank
    for got, q in zip((outlier["lo"], outlier["hi"]), (0.5, 99.5)):
        assert np.percentile(pooled, q - step) - 1e-9 <= got <= np.percentile(pooled, q + step) + 1e-9
    edges = np.linspace(pooled2.min(), pooled2.max(), HISTOGRAM_BINS + 1)
    assert edges[1] - edges[0] > 200  # what one fixed histogram would have been off by

    case = _plan(sites, weighting="case").intensity["channels"][0]
    fgs = _fg(sites)
    x, w = np.concatenate(fgs), np.concatenate([np.full(f.size, 1.0 / f.size) for f in fgs])
    want = [float(np.percentile(x, q, weights=w, method="inverted_cdf")) for q in (0.5, 99.5)]
    assert [case["lo"], case["hi"]] == pytest.approx(want, abs=1e-9) and case["weighting"] == "case"
    mean = np.average(x, weights=w)
    assert math.isclose(case["mean"], np.mean([f.mean() for f in fgs]), rel_tol=1e-9)
    assert abs(case["mean"] - outlier["mean"]) > 1  # the weighting matters: cases differ in size
    assert math.isclose(case["sd"], math.sqrt(np.average((x - mean) ** 2, weights=w)), rel_tol=1e-9)


def test_float_percentiles_within_the_stated_bound():
    """Float data stop after three rounds: the interval then is (max − min) / 4096³ wide (1e-8 HU here) and
    holds the order statistic, so the plan's percentile is within its recorded ``bound`` of numpy's."""
    rng = np.random.default_rng(5)
    sites = {k: _ct_site(rng, 2, off, 20.0, integer=False) for k, off in (("a", -30), ("b", 60))}
    ct = _plan(sites, weighting="voxel").intensity["channels"][0]
    pooled = np.concatenate(_fg(sites))
    span = pooled.max() - pooled.min()
    assert 0 < ct["bound"] <= 1.01 * span / HISTOGRAM_BINS**3
    for got, want in zip((ct["lo"], ct["hi"]), np.percentile(pooled, [0.5, 99.5])):
        assert abs(got - want) <= ct["bound"]


def test_a_site_answering_counts_above_its_declared_total_is_left_out():
    """Acting as a hostile site: it answers the histogram request with counts that add up to more voxels
    than its fingerprint declared; the plan leaves it out, says why, and pools the others exactly."""
    rng = np.random.default_rng(1)
    sites = {k: _ct_site(rng, 2, off, 10.0) for k, off in (("a", 0), ("b", 50), ("evil", 900))}
    honest = _ask(sites)

    def ask(requests, weighting, names):
        out = honest(requests, weighting, names)
        if "evil" in out:
            out["evil"] = [[10**6] * len(c) for c in out["evil"]]
        return out

    fps = {k: site_fingerprint(v) for k, v in sites.items()}
    plan = make_plan(fps, ask, weighting="voxel", log=lambda m: None)
    assert "evil" in plan.rejected and "more than the declared" in plan.rejected["evil"]
    pooled = np.concatenate(_fg(sites, ("a", "b")))
    assert plan.intensity["channels"][0]["lo"] == pytest.approx(np.percentile(pooled, 0.5))


def test_each_channel_is_normalized_on_its_own():
    """T2 ~ N(1000, 100) beside ADC ~ N(10, 1): each channel is z-scored with its own mean and sd, so each
    has mean 0 and sd 1 (pooled over both, ADC would keep sd 0.002)."""
    rng = np.random.default_rng(0)
    sites = {}
    for k in ("s1", "s2"):
        img = np.stack([rng.normal(1000, 100, SHAPE), rng.normal(10, 1, SHAPE)])
        sites[k] = [(img, _box(), np.eye(4))]
    plan = _plan(sites, channel_names=["T2", "ADC"])
    assert [c["name"] for c in plan.intensity["channels"]] == ["T2", "ADC"]
    assert [c["mode"] for c in plan.intensity["channels"]] == ["zscore", "zscore"]
    x = normalize_case(sites["s1"][0][0], plan.intensity, "s1")
    for c in range(2):
        assert abs(float(x[c].mean())) < 1e-4 and float(x[c].std()) == pytest.approx(1.0, abs=1e-4)


def test_scheme_per_site_one_float_ct_site_and_the_body():
    """Three scanners: an integer CT site, a float CT site (values resampled, no longer integers) and an MR
    site.  Both CT sites get ``ct`` with statistics pooled over the two of them (the MR site's values are
    not in them); the MR site a z-score over its non-zero voxels; the decision is printed naming the sites.
    A CT site told to use ``zscore`` (a site's own ``intensity``) takes it over the body: the voxels above
    −500, so air at −1000 is neither in the mean nor the sd and is set to 0."""
    rng = np.random.default_rng(2)
    mr = [(np.where(_box() > 0, rng.normal(300, 30, SHAPE), rng.normal(80, 5, SHAPE))[None], _box(), np.eye(4))]
    sites = {"ct": _ct_site(rng, 2, 20, 10.0), "ctfloat": _ct_site(rng, 2, 30, 10.0, integer=False), "mr": mr}
    logged: list[str] = []
    plan = _plan(sites, log=logged.append, weighting="voxel")
    schemes = {k: channel_schemes(plan.intensity, k, 1)[0] for k in sites}
    assert schemes["ct"]["mode"] == schemes["ctfloat"]["mode"] == "ct" and schemes["ct"] == schemes["ctfloat"]
    assert schemes["mr"] == {"mode": "zscore"}
    pooled = np.concatenate(_fg(sites, ("ct", "ctfloat")))
    assert schemes["ct"]["mean"] == pytest.approx(pooled.mean())
    assert any("ct at ct, ctfloat" in m and "zscore at mr" in m for m in logged)

    own = _plan(sites, intensity={"ct": ["zscore"], "ctfloat": ["auto"], "mr": ["auto"]})
    z = channel_schemes(own.intensity, "ct", 1)[0]
    assert z == {"mode": "zscore", "body": CT_AIR}
    img = sites["ct"][0][0]
    x = normalize_case(img, own.intensity, "ct")[0]
    body = img[0] > CT_AIR
    assert abs(float(x[body].mean())) < 1e-4 and float(x[body].std()) == pytest.approx(1.0, abs=1e-4)
    assert (x[~body] == 0).all()
    assert channel_schemes(own.intensity, "ctfloat", 1)[0]["mode"] == "ct"


def _nii(path, data, affine):
    nib.save(nib.Nifti1Image(np.asarray(data), affine), str(path))
    return path.name


def test_channel_files_spec_and_overrides(tmp_path):
    """A datalist image as a list of files (one per channel, nnU-Net's _0000/_0001) is read as one case of
    those channels; a channel file off the label's grid or the wrong number of files is one error naming
    the file; the spec names the channels, gives each its scheme and a site its own, and the plan follows."""
    rng = np.random.default_rng(4)
    aff = np.diag([1.0, 1.0, 2.0, 1.0])
    sites = []
    for s in ("s1", "s2"):
        d = tmp_path / s
        d.mkdir()
        cases = []
        for i in range(2):
            lab = _box()
            ct = np.where(lab > 0, rng.integers(20, 80, SHAPE), -1000).astype(np.int16)
            mr = rng.normal(10, 1, SHAPE).astype(np.float32)
            cases.append(
                {
                    "image": [_nii(d / f"c{i}_0000.nii.gz", ct, aff), _nii(d / f"c{i}_0001.nii.gz", mr, aff)],
                    "label": _nii(d / f"c{i}.nii.gz", lab.astype(np.uint8), aff),
                }
            )
        (d / "datalist.json").write_text(json.dumps({"training": cases, "validation": cases[:1], "testing": cases[:1]}))
        sites.append(f'[[sites]]\nname = "{s}"\ndatalist = "{s}/datalist.json"\n')
    spec = tmp_path / "fed.toml"
    head = '[data]\nmode = "3d"\nin_channels = 2\nchannels = ["CT", "PET"]\n[data.labels]\nlesion = [1]\n'
    spec.write_text(head + "".join(sites))
    fed = load_federation(spec)
    image, label, _ = next(training_cases(fed, fed.sites[0]))
    assert image.shape == (2, *SHAPE) and label.shape == SHAPE
    plan = plan_federation(fed, log=lambda m: None)
    assert [(c["name"], c["mode"]) for c in plan.intensity["channels"]] == [("CT", "ct"), ("PET", "zscore")]

    spec.write_text(
        head.replace("lesion = [1]\n", "lesion = [1]\n").replace(
            "[data.labels]", '[data.intensity]\nPET = "minmax"\n[data.labels]'
        )
        + sites[0]
        + sites[1]
        + 'intensity = {CT = "zscore"}\n'
    )
    fed = load_federation(spec)
    assert fed.intensity_for("s1") == ["auto", "minmax"] and fed.intensity_for("s2") == ["zscore", "minmax"]
    logged: list[str] = []
    spec_plan = with_spec_intensity(plan, fed, log=logged.append)
    assert channel_schemes(spec_plan.intensity, "s1", 2)[0]["mode"] == "ct"
    assert [s["mode"] for s in channel_schemes(spec_plan.intensity, "s2", 2)] == ["zscore", "minmax"]
    assert logged and "CT at s2: zscore" in logged[0]

    other = tmp_path / "s1" / "shifted.nii.gz"
    nib.save(nib.Nifti1Image(np.zeros(SHAPE, np.float32), np.diag([1.0, 1.0, 3.0, 1.0])), str(other))
    first, lab = tmp_path / "s1" / "c0_0000.nii.gz", tmp_path / "s1" / "c0.nii.gz"
    with pytest.raises(DataError, match="shifted.nii.gz: channel file .* not on the grid"):
        read_channels([first, other], lab, 2)
    with pytest.raises(DataError, match="lists 1 channel file"):
        read_channels([first], lab, 2)
    dl = tmp_path / "s1" / "datalist.json"
    entries = json.loads(dl.read_text())
    entries["training"][0]["image"][1] = other.name
    dl.write_text(json.dumps(entries))
    (problem,) = validate_federation(spec)  # `fedseg validate` names the file and the fix
    assert problem.file == str(other) and "not on the grid" in problem.message and "resample" in problem.fix
    bad = tmp_path / "bad.toml"
    bad.write_text(head.replace('["CT", "PET"]', '["CT"]') + sites[0])
    with pytest.raises(ConfigError, match="data.channels names 1 channel"):
        load_federation(bad)
    bad.write_text(head + sites[0] + 'intensity = {MR = "zscore"}\n')
    with pytest.raises(ConfigError, match="names channel 'MR'"):
        load_federation(bad)
