"""Volume evaluation over each case's own extent: the extents a split records, the sliding windows a case
costs, what ``VolumeDataset.original_grid`` samples beyond an extent, scores equal to the padded path's
for a model blind to the padding, and 2D evaluation untouched."""

from __future__ import annotations

import dataclasses
import itertools
import json

import nibabel as nib
import numpy as np
import pytest
import torch
from torch import nn

from fedseg.algorithms import get_algorithm
from fedseg.data.spec import load_federation
from fedseg.data.volumes.geometry import Geometry, to_plan_grid
from fedseg.data.volumes.load import VolumeDataset, load_volume_split, pad_to_shape, plan_federation
from fedseg.data.volumes.plan import sliding_windows
from fedseg.foundation.config import EvalConfig, ModelConfig
from fedseg.site.batches import SiteData, batch_of
from fedseg.site.extent import window_shape
from fedseg.site.runtime import Site
from fedseg.site.workload import segmentation_workload
from tests.support.helpers import TINY_MODEL, tiny_config, tiny_sites

RAS = np.diag([1.0, 1.0, 1.0, 1.0])
LPS = np.array([[-1.0, 0, 0, 20.0], [0, -1.0, 0, 18.0], [0, 0, 1.0, -4.0], [0, 0, 0, 1]])
SHAPES = {  # split -> case shapes, (site "a" RAS, site "b" LPS: the same shapes, mirrored in-plane)
    "training": [(12, 10, 8), (10, 12, 6)],
    "validation": [(9, 11, 7)],
    "testing": [(12, 10, 8), (12, 10, 8), (8, 9, 5), (13, 7, 9)],
}
ROI = (8, 8, 6)


def _case(rng, shape):
    """A bright ellipsoid (HU 60) in soft tissue (HU 20) ringed by air (-1000), with noise."""
    grid = np.stack(np.meshgrid(*[np.linspace(-1, 1, s) for s in shape], indexing="ij"))
    r = np.sqrt((grid**2).sum(0))
    label = (r < 0.6).astype(np.int16)
    image = np.where(r < 0.6, 60, np.where(r < 1.2, 20, -1000)) + rng.normal(0, 5, shape)
    return np.round(image).astype(np.int16), label


def _write(root, mode="3d"):
    rng = np.random.default_rng(0)
    sites = []
    for name, affine in (("a", RAS), ("b", LPS)):
        lists = {}
        for split, shapes in SHAPES.items():
            lists[split] = []
            for k, shape in enumerate(shapes):
                image, label = _case(rng, shape)
                img, lab = root / name / f"{split}{k}_img.nii.gz", root / name / f"{split}{k}_lab.nii.gz"
                img.parent.mkdir(parents=True, exist_ok=True)
                nib.save(nib.Nifti1Image(image, affine), img)
                nib.save(nib.Nifti1Image(label, affine), lab)
                lists[split].append({"image": img.name, "label": lab.name})
        (root / name / "datalist.json").write_text(json.dumps(lists))
        sites.append(f'[[sites]]\nname = "{name}"\ndatalist = "{name}/datalist.json"\n')
    dims = 2 if mode == "patches2d" else 3
    spec = root / "fed.toml"
    spec.write_text(
        f'name = "ext"\n[data]\nmode = "{mode}"\nspatial_dims = {dims}\nin_channels = 1\n[data.labels]\nfg = [1]\n\n'
        + "\n".join(sites)
    )
    return load_federation(spec)


@pytest.fixture(scope="module")
def fed_plan(tmp_path_factory):
    fed = _write(tmp_path_factory.mktemp("ext"))
    return fed, plan_federation(fed, patch_voxels=8 * 8 * 4, log=lambda m: None)


def _site(ds: VolumeDataset, roi=ROI, batch_size: int = 1) -> Site:
    cfg = dataclasses.replace(
        tiny_config(), model=ModelConfig(roi_size=roi), eval=EvalConfig(batch_size=batch_size, hd95="on")
    )
    wl = segmentation_workload(3, 1, ["fg"], cfg.model, hd95=True)
    return Site("a", 0, SiteData(ds, ds, ds), wl, cfg, get_algorithm(cfg))


class Pointwise(nn.Module):
    """A 1×1×1 convolution (each output voxel a function of its own input voxel only) counting the windows
    it is shown and the shapes of the batches it is called with."""

    def __init__(self, weight: float, bias: float):
        super().__init__()
        self.conv = nn.Conv3d(1, 1, 1)
        with torch.no_grad():
            self.conv.weight.fill_(weight)
            self.conv.bias.fill_(bias)
        self.windows = 0

    def forward(self, x):
        self.windows += x.shape[0]
        return self.conv(x)


def test_extents_are_each_cases_own_plan_grid_shape(fed_plan, tmp_path):
    """Every case's spacing is the plan's (1 mm) and its axes are RAS or mirrored in-plane, so its plan
    grid has the case's own shape; the split is padded to the largest (and at least the patch) at the far
    end with each case's lowest value, the extent recorded before that.  ``patches2d`` validation and
    test volumes record theirs too; padding a split further (a deployed run's common shape) keeps them."""
    fed, plan = fed_plan
    for site in fed.sites:
        for split, shapes in SHAPES.items():
            ds = load_volume_split(fed, site, split, plan)
            assert ds.extents == shapes
            padded = [max([s[a] for s in shapes] + [plan.patch_size[a]]) for a in range(3)]
            assert list(ds.images.shape[2:]) == padded
            for i, ext in enumerate(ds.extents):
                inside = ds.images[(i, 0, *(slice(0, e) for e in ext))]
                assert torch.all(ds.images[i, 0] >= inside.min())
                beyond = torch.ones(padded, dtype=torch.bool)
                beyond[tuple(slice(0, e) for e in ext)] = False
                assert torch.all(ds.images[i, 0][beyond] == inside.min())  # the far end: that case's air
                assert torch.all(ds.labels[i, 0][beyond] == 0)
    ds = load_volume_split(fed, fed.sites[0], "testing", plan)
    pad_to_shape([ds], [20, 20, 12])
    assert list(ds.images.shape[2:]) == [20, 20, 12] and ds.extents == SHAPES["testing"]
    fed2d = _write(tmp_path, mode="patches2d")
    for split in ("validation", "testing"):
        assert load_volume_split(fed2d, fed2d.sites[1], split, plan).extents == SHAPES[split]
    assert getattr(load_volume_split(fed2d, fed2d.sites[1], "training", plan), "extents", None) is None  # slices


def test_sliding_windows_per_case_are_those_of_its_own_extent(fed_plan):
    """One predictor call per case (``eval.batch_size = 1``) is shown exactly MONAI's windows over the case's
    extent raised to the window (``ceil((V − P) / step) + 1`` per axis, :func:`sliding_windows`), not over
    the split's padded shape; with a larger ``eval.batch_size`` consecutive cases of one extent share a batch."""
    fed, plan = fed_plan
    ds = load_volume_split(fed, fed.sites[0], "testing", plan)
    site = _site(ds)
    padded = list(ds.images.shape[2:])
    model = Pointwise(1.0, 0.0)
    seen = []

    def predict(x):
        before = model.windows
        out = site.workload.predict(model, x)
        seen.append((tuple(x.shape), model.windows - before))
        return out

    site.score_cases(predict, "testing")
    expected = [sliding_windows(window_shape(e, ROI), ROI, site.cfg.eval.sw_overlap) for e in ds.extents]
    assert [w for _, w in seen] == expected
    assert [s[2:] for s, _ in seen] == [window_shape(e, ROI) for e in ds.extents]
    assert window_shape((8, 9, 5), ROI) == (8, 9, 6)  # the short axis raised to the window
    assert sum(expected) < len(ds) * sliding_windows(padded, ROI, site.cfg.eval.sw_overlap)
    assert window_shape((5, 20, 7), (8, 8)) == (8, 20, 7)  # an in-plane window (patches2d) leaves z alone
    grouped = [tuple(x.shape) for x, _ in _site(ds, batch_size=4).eval_batches("testing")]
    assert grouped == [(2, 1, 12, 10, 8), (1, 1, 8, 9, 6), (1, 1, 13, 8, 9)]


def test_what_original_grid_samples_beyond_a_cases_extent():
    """A scan at (0.9, 1.3, 2.7) mm, axes permuted and flipped, resampled to a 1.1 × 1.1 × 2.0 mm plan.
    MONAI's ``Spacing`` makes the plan grid ``round(ptp + 1)`` voxels along each axis, where ``ptp`` is the
    span of the scan's voxel centres in plan voxels, starting at the first centre; so the centres lie in
    ``[0, E − 1 + 1/2]``, ``E`` the extent.  A centre past ``E − 1`` falls between the last plan voxel of
    the case and the first voxel of padding, and linear resampling mixes the two: with the split's padded
    shape, what the model predicts on padding reaches that thin shell of scan voxels (and nothing else does).
    Cut to its extent, the prediction is resampled with border values there, as if the last plan voxel were
    repeated: the same as the padded prediction with its padding replaced by that repetition."""
    affine = np.array([[0, 1.3, 0, -5.0], [-0.9, 0, 0, 7.0], [0, 0, -2.7, 20.0], [0, 0, 0, 1]])
    shape = (17, 13, 7)
    x, _lab, plan_affine = to_plan_grid(np.zeros((1, *shape), np.float32), None, affine, (1.1, 1.1, 2.0))
    extent = x.shape[1:]
    centres = np.array(list(itertools.product(*[range(s) for s in shape]))).T
    plan_idx = (np.linalg.inv(plan_affine) @ affine @ np.vstack([centres, np.ones((1, centres.shape[1]))]))[:3]
    assert plan_idx.min() > -1e-9
    past = plan_idx.max(axis=1) - (np.array(extent) - 1)
    assert np.all(past < 0.5) and np.any(past > 0.05)  # a shell exists here, less than half a voxel thick
    shell = torch.from_numpy((plan_idx > (np.array(extent)[:, None] - 1 + 1e-6)).any(axis=0).reshape(shape))
    assert 0 < int(shell.sum()) < shell.numel()

    padded = [e + 3 for e in extent]
    ds = VolumeDataset(
        torch.zeros(1, 1, *padded), torch.zeros(1, 1, *padded), ["c"], [plan_affine], [Geometry(affine, shape)],
        [torch.zeros(1, *shape)], extents=[tuple(extent)],
    )  # fmt: skip
    inside = torch.randn(1, *extent, generator=torch.Generator().manual_seed(0))
    frames = {}
    for fill in (-50.0, 50.0):
        frame = torch.full((1, *padded), fill)
        frame[(slice(None), *(slice(0, e) for e in extent))] = inside
        frames[fill] = ds.original_grid(0, frame)[0][0]
    differs = (frames[-50.0] - frames[50.0]).abs() > 1e-4
    assert torch.any(differs) and not torch.any(differs & ~shell)  # padding reaches the shell only
    cut = ds.original_grid(0, inside)[0][0]
    assert torch.allclose(cut[~shell], frames[50.0][~shell], atol=1e-5)
    replicated = nn.functional.pad(inside[None], [p for e, s in zip(reversed(extent), reversed(padded)) for p in (0, s - e)], mode="replicate")[0]  # fmt: skip
    assert torch.allclose(cut, ds.original_grid(0, replicated)[0][0], atol=1e-5)


@pytest.mark.parametrize("site_index", [0, 1])
def test_a_pointwise_model_scores_the_same_over_the_extent_as_over_the_padded_shape(fed_plan, site_index):
    """A 1×1×1 convolution's output at a voxel is a function of that voxel's input alone, so inside a case's
    extent it is the same whatever padding or window surrounds it, and MONAI's sliding-window blend of one
    value ``v`` from every window covering the voxel, ``Σ wᵢ v / Σ wᵢ``, is ``v`` again (to rounding).  Every
    scan here is at the plan's spacing with its axes only mirrored, so each scan voxel centre is exactly one
    plan voxel inside the extent (no shell past ``E − 1``, see the test above): ``original_grid`` reads the
    same logits in both paths, so Dice and HD95 are equal — while the extent path runs fewer windows."""
    fed, plan = fed_plan
    ds = load_volume_split(fed, fed.sites[site_index], "testing", plan)
    padded_ds = VolumeDataset(ds.images, ds.labels, ds.case_ids, ds.affines, ds.originals, ds.original_labels)
    assert padded_ds.extents is None  # the padded shape: every case predicted over the split's shape
    # threshold halfway between the mean foreground and background intensity (normalized units)
    fg = ds.images[ds.labels > 0].mean()
    bg = torch.cat([ds.images[i, 0][tuple(slice(0, e) for e in ext)].flatten() for i, ext in enumerate(ds.extents)])
    model = Pointwise(1.0, -float(fg + bg[bg < fg].mean()) / 2)
    scores = {}
    for name, d in (("extent", ds), ("padded", padded_ds)):
        site = _site(d)
        model.windows = 0
        dice, extra = site.score_cases(lambda x, s=site: s.workload.predict(model, x), "testing", test_metrics=True)
        scores[name] = (dice, extra["hd95"], model.windows)
    (d_e, h_e, w_e), (d_p, h_p, w_p) = scores["extent"], scores["padded"]
    assert torch.all(d_e > 0.3) and torch.any(d_e < 1.0)  # a real segmentation, not a trivial one
    assert torch.allclose(d_e, d_p, atol=1e-12, rtol=0) and torch.allclose(h_e, h_p, atol=1e-9, rtol=0)
    assert w_e < w_p
    # a split without original grids (training) is scored in the plan's grid: over each extent, which for
    # this model is the padded path's score (air beyond an extent is predicted background, as labelled)
    train = load_volume_split(fed, fed.sites[site_index], "training", plan)
    padded_train = VolumeDataset(train.images, train.labels, train.case_ids, train.affines)
    got = [_site(d).score(lambda x: model(x), "training") for d in (train, padded_train)]
    assert torch.all(got[0] > 0.3) and torch.allclose(got[0], got[1], atol=1e-12, rtol=0)


def test_2d_evaluation_is_unchanged(workload):
    """2D images record no extents: ``eval_batches`` yields ``eval.batch_size`` stored cases at a time, and
    the scores are bitwise those of the workload's metric on those batches."""
    data = tiny_sites()["site1"]
    cfg = dataclasses.replace(tiny_config(), eval=EvalConfig(batch_size=3))
    site = Site("site1", 0, data, workload, cfg, get_algorithm(cfg))
    model = workload.build_model()
    model.eval()
    n = len(data.val)
    batches = list(site.eval_batches("val"))
    assert [x.shape[0] for x, _ in batches] == [min(3, n - s) for s in range(0, n, 3)]
    with torch.no_grad():
        want = []
        for k, start in enumerate(range(0, n, 3)):
            x, y = batch_of(data.val, torch.arange(start, min(n, start + 3)))
            assert torch.equal(batches[k][0], x) and torch.equal(batches[k][1], y)
            want.append(workload.metric(workload.predict(model, x), y).double())
        got = site.score(lambda x: workload.predict(model, x), "val")
    assert torch.equal(got, torch.cat(want))
    assert TINY_MODEL.roi_size is None
