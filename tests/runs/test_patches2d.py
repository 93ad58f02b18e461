"""Volumes trained as 2D (``data.mode = "patches2d"``, federated gradient averaging's protocol), the
spec's intensity override, and the augmentation of training patches."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedseg.data.augment import patch_augmenter
from fedseg.data.spec import load_federation
from fedseg.data.volumes.load import (
    SliceDataset,
    VolumeDataset,
    load_volume_split,
    plan_federation,
    plan_for_run,
    with_spec_intensity,
)
from fedseg.foundation.config import ModelConfig, RunConfig, TrainConfig
from fedseg.foundation.errors import ConfigError
from fedseg.foundation.seeding import generator
from fedseg.simulation.runner import run
from fedseg.site.workload import segmentation_workload, workload_for
from tests.runs.test_volumes_run import SITES, write_federation


def patches2d_federation(root, intensity: str = "", **kw):
    """The two-site volume federation of ``test_volumes_run`` (RAS at 1.5 mm slices, LPS at 3 mm) as
    ``patches2d``, with ``intensity`` lines added to ``[data]``."""
    spec = write_federation(root, **kw)
    text = spec.read_text().replace(
        'mode = "3d"\nspatial_dims = 3', 'mode = "patches2d"\nspatial_dims = 2\n' + intensity
    )
    spec.write_text(text)
    return spec


def _spec(tmp_path, data: str):
    spec = tmp_path / "f.toml"
    spec.write_text(
        f'[data]\n{data}\nin_channels = 1\n[data.labels]\nfg = [1]\n[[sites]]\nname = "a"\ndatalist = "a.json"\n'
    )
    return spec


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ('mode = "3d"\nintensity = "hu"', r"data.intensity must be one of .* -> set intensity = \"auto\""),
        ('mode = "3d"\nintensity = "window"', r"needs data.window = \[low, high\] .* -> set e.g. window = \[0, 80\]"),
        ('mode = "3d"\nintensity = "window"\nwindow = [80, 0]', r"low < high, got \[80, 0\]"),
        (
            'mode = "3d"\nwindow = [0, 80]',
            r"data.window is set but data.intensity = 'auto' -> set intensity = \"window\"",
        ),
        ('mode = "2d"\nintensity = "zscore"', r"data.intensity only applies to volumes .* -> remove intensity"),
    ],
)
def test_intensity_keys_of_the_spec_are_refused_with_the_key_and_the_fix(tmp_path, data, match):
    with pytest.raises(ConfigError, match=match):
        load_federation(_spec(tmp_path, data))


def test_spec_intensity_overrides_the_plan(tmp_path):
    """A plan made from CT-like volumes chooses "ct"; the spec's window replaces it in the plan a run
    uses, and a fresh plan records the spec's choice; "ct" over a plan without pooled statistics is refused."""
    spec = write_federation(tmp_path)
    fed = load_federation(spec)
    plan = plan_federation(fed, log=lambda m: None)
    assert plan.intensity["channels"][0]["mode"] == "ct"
    spec.write_text(spec.read_text().replace('mode = "3d"', 'mode = "3d"\nintensity = "window"\nwindow = [-100, 100]'))
    windowed = load_federation(spec)
    logs = []
    window = {"channels": [{"name": "0", "mode": "window", "window": [-100.0, 100.0]}]}
    assert with_spec_intensity(plan, windowed, log=logs.append).intensity == window
    assert "data.intensity" in logs[0]
    assert plan_federation(windowed, log=lambda m: None).intensity == window
    zscored = with_spec_intensity(plan, windowed, log=lambda m: None)
    zscored.intensity = {"mode": "zscore"}
    spec.write_text(spec.read_text().replace('intensity = "window"\nwindow = [-100, 100]', 'intensity = "ct"'))
    with pytest.raises(
        ConfigError, match=r"asks for intensity 'ct' on channel 0 .* no pooled CT statistics .*`fedseg plan`"
    ):
        with_spec_intensity(zscored, load_federation(spec))


def test_patches2d_splits_keep_slice_spacing_and_original_grids(tmp_path):
    """Training is every axial slice of every training volume in the plan's in-plane grid (each scan keeps
    its slice spacing, so the LPS site's 8 slices of 3 mm stay 8); test cases stay volumes with their own grid."""
    fed = load_federation(patches2d_federation(tmp_path))
    assert fed.mode == "patches2d" and fed.spatial_dims == 2 and fed.volumes
    plan = plan_federation(fed, log=lambda m: None)
    train = load_volume_split(fed, fed.site("lps"), "training", plan)
    assert isinstance(train, SliceDataset)
    assert len(train) == 3 * SITES["lps"][1][2]  # 3 training volumes x 8 slices
    assert train.case_ids[1].endswith("#1") and train.images.dim() == 4
    assert train.labels.sum() > 0
    test = load_volume_split(fed, fed.site("lps"), "testing", plan)
    assert isinstance(test, VolumeDataset) and test.images.dim() == 5
    assert test.images.shape[-1] == SITES["lps"][1][2]
    assert np.allclose(np.abs(np.diag(test.affines[0])[:3]), [*plan.target_spacing[:2], 3.0])
    assert test.originals[0].shape == SITES["lps"][1]
    cfg = plan_for_run(RunConfig(federation=str(fed.path)), plan, log=lambda m: None, mode="patches2d")
    assert cfg.model.roi_size == (32, 32)  # median in-plane 22-24 voxels, at least twice the U-Net's 16
    assert cfg.model.channels == ModelConfig().channels  # the 2D network as configured


def test_slicewise_inference_predicts_every_slice_of_a_volume():
    """A 2D model on a batch of volumes: slice z of the output is the model's output on slice z."""
    torch.manual_seed(0)
    w = segmentation_workload(2, 1, ["fg"], slices=True)
    model = w.build_model().eval()
    x = torch.randn(2, 1, 32, 32, 5)
    with torch.no_grad():
        out = w.predict(model, x)
        assert out.shape == (2, 1, 32, 32, 5)
        assert torch.allclose(out[1, :, :, :, 3], model(x[1:2, :, :, :, 3])[0], atol=1e-5)


def test_pooled_crop_centres_a_patch_on_foreground_of_any_slice_of_the_batch():
    """With foreground_share = 1 every patch is centred on a foreground voxel drawn from the whole batch,
    so a batch with one foreground slice among eight gives eight patches holding foreground."""
    w = segmentation_workload(
        2,
        1,
        ["fg"],
        model=ModelConfig(roi_size=(8, 8)),
        train=TrainConfig(foreground_share=1.0),
        slices=True,
    )
    x = torch.zeros(8, 1, 32, 32)
    y = torch.zeros(8, 1, 32, 32)
    y[5, 0, 20:23, 4:7] = 1
    x[5] = y[5] * 7
    px, py = w.train_transform(x, y, generator(0, 1, 2, "train", "transform"))
    assert px.shape == (8, 1, 8, 8)
    assert bool((py.flatten(1).amax(1) > 0).all())
    assert torch.equal(px, py * 7)  # image and label cut from the same slice, at the same place


@pytest.mark.parametrize("square_plane", [False, True])
def test_augmentation_is_seeded_and_keeps_labels_aligned(square_plane):
    """Same seed, same batch; another seed, another batch.  Labels move with their images: the image is
    100 x label, so after any flip, rotation (90° ones too, on a square plane) or scaling thresholding
    the image at 50 gives back the label (intensity scale ±10 %, shift ±0.1 and noise sd 0.05 cannot
    cross 50), up to the voxels on the blob's edge where bilinear and nearest interpolation differ; a
    flip or 90° rotation applied to only one of them would leave the off-centre blob disjoint from
    itself.  The shape never changes."""
    aug = patch_augmenter(3, square_plane=square_plane)
    y = torch.zeros(4, 1, 16, 16, 8)
    y[:, 0, 2:7, 3:8, 1:4] = 1
    x = 100 * y
    a1, b1 = aug(x, y, 123)
    a2, b2 = aug(x, y, 123)
    assert torch.equal(a1, a2) and torch.equal(b1, b2)
    a3, _ = aug(x, y, 124)
    assert not torch.equal(a1, a3)
    moved = 0
    for seed in range(6):
        xa, ya = aug(x, y, seed)
        assert xa.shape == x.shape and ya.shape == y.shape
        assert set(torch.unique(ya).tolist()) <= {0.0, 1.0}
        inter = ((xa > 50) & (ya > 0)).sum().item()
        dice = 2 * inter / ((xa > 50).sum().item() + (ya > 0).sum().item())
        assert dice > 0.85
        moved += int(not torch.equal(ya, y))
    assert moved > 0


@pytest.mark.parametrize("dims", [2, 3])
def test_augmentation_without_metadata_equals_monai_with_it(dims):
    """The augmenter runs MONAI's transforms on plain tensors with metadata tracking off; that changes the
    container, not a value: every seed gives exactly the batch that the same ``Compose``, seeded the same
    way, gives on ``MetaTensor``s (tracking on, MONAI's default).  The process-wide switch is back on
    afterwards, and the outputs are plain tensors."""
    from monai.data import MetaTensor, get_track_meta

    from fedseg.data.augment import _compose

    shape = (12, 12, 8) if dims == 3 else (12, 12)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 1, *shape, generator=g)
    y = (torch.rand(3, 2, *shape, generator=g) > 0.6).float()
    aug = patch_augmenter(dims, square_plane=True)
    reference = _compose(dims, square_plane=True)
    for seed in range(12):
        xa, ya = aug(x, y, seed)
        assert get_track_meta() and type(xa) is torch.Tensor and type(ya) is torch.Tensor
        reference.set_random_state(seed=seed)
        for i in range(3):
            out = reference({"image": MetaTensor(x[i]), "label": MetaTensor(y[i])})
            assert isinstance(out["image"], MetaTensor)
            assert torch.equal(xa[i], out["image"].as_tensor()) and torch.equal(ya[i], out["label"].as_tensor())


def test_reseeding_in_place_gives_monai_generator_states():
    """:func:`fedseg.data.augment.reseed` reseeds the transforms' generators in place; every generator reachable
    from the ``Compose`` (the transforms and the random transforms they wrap) ends in exactly the state MONAI's
    own ``set_random_state`` gives it, seed after seed, and no generator is the class-wide default."""
    from monai.transforms import Randomizable

    from fedseg.data.augment import _compose, generators, reseed

    def states(compose):
        out, stack, seen = [], [compose], set()
        while stack:
            t = stack.pop()
            if id(t) in seen:
                continue
            seen.add(id(t))
            if isinstance(t, Randomizable):
                key, pos = t.R.get_state()[1:3]
                out.append((type(t).__name__, key.tobytes(), pos, t.R is not Randomizable.R))
            fields = t if isinstance(t, list | tuple) else list(vars(t).values())
            stack.extend(v for v in reversed(fields) if isinstance(v, Randomizable | list | tuple))
        return sorted(out)

    for dims in (2, 3):
        ours, theirs = _compose(dims, square_plane=True), _compose(dims, square_plane=True)
        groups = generators(ours)
        for seed in (0, 1, 123, 2**31 - 1, 2**32 - 1):
            reseed(ours, groups, seed)
            theirs.set_random_state(seed=seed)
            a, b = states(ours), states(theirs)
            assert len(a) >= 10 and a == b and all(own for *_, own in a)


def test_augment_setting_auto_is_on_for_volumes_and_off_for_2d_images(tmp_path):
    vol = load_federation(patches2d_federation(tmp_path))
    cfg = RunConfig(federation="x", train=TrainConfig(augment="auto"))
    planned = plan_for_run(cfg, plan_federation(vol, log=lambda m: None), log=lambda m: None, mode="patches2d")
    x, y = torch.zeros(2, 1, 40, 40), torch.zeros(2, 1, 40, 40)
    t = workload_for(vol, planned).train_transform
    assert t is not None and t(x, y, generator(0, 0, 0))[0].shape[2:] == planned.model.roi_size
    header = {"mode": "2d", "spatial_dims": 2, "in_channels": 1, "labels": {"fg": [1]}}
    assert workload_for(header, cfg).train_transform is None  # 2D images: unchanged
    on = RunConfig(federation="x", train=TrainConfig(augment="on"))
    assert workload_for(header, on).train_transform is not None


def test_fedavg_on_patches2d_scores_every_test_volume_once_in_its_own_grid(tmp_path):
    spec = patches2d_federation(tmp_path)
    logs = []
    results = run(
        spec,
        out=tmp_path / "run",
        overrides=["rounds=2", "train.local_steps=2", "train.batch_size=4", "model.num_res_units=0", "eval.every=1"],
        progress=False,
        log=logs.append,
    )
    assert any("2D patches of axial slices" in m for m in logs)
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["num_cases"] == {"ras": 1, "lps": 1}  # one test volume per site, each scored once
    assert saved["plan"]["target_spacing"] == results["plan"]["target_spacing"]
    assert 0.0 <= saved["client_avg_dice"] <= 1.0


def test_a_method_with_its_own_predictors_is_refused_on_patches2d_before_loading(tmp_path):
    spec = patches2d_federation(tmp_path)
    with pytest.raises(ConfigError, match=r"method 'fedsm' evaluates through its own predictors .* -> run a method"):
        run(spec, overrides=["method=fedsm"], progress=False, log=lambda m: None)
    assert not (tmp_path / "fed.plan.json").exists()  # refused before any site was fingerprinted


def test_training_patches_are_drawn_from_the_site_and_round_generator():
    """The crop and its augmentation draw only from the (run seed, site, round) generator: the same keys
    give the same patches bit for bit, another round other patches."""
    w = segmentation_workload(
        2,
        1,
        ["fg"],
        model=ModelConfig(roi_size=(16, 16)),
        train=TrainConfig(foreground_share=0.5),
        augment=True,
        slices=True,
    )
    x = torch.randn(6, 1, 40, 40)
    y = (x > 1).float()

    def patches(rnd):
        return w.train_transform(x, y, generator(7, 2, rnd, "train", "transform"))

    (a, la), (b, lb), (c, _) = patches(3), patches(3), patches(4)
    assert torch.equal(a, b) and torch.equal(la, lb)
    assert not torch.equal(a, c)
