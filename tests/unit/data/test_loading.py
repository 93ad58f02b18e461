"""Loading splits into tensors: shapes, ranges, label channels, orientation, modes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedseg.data.loading import SegmentationDataset, load_split
from fedseg.data.spec import load_federation
from fedseg.foundation.errors import ConfigError, DataError


def test_png_split_shapes_range_and_nested_channels(png_federation):
    # Prepare
    fed = load_federation(png_federation)
    # Execute
    ds = load_split(fed, "site1", "training")
    # Assert
    assert isinstance(ds, SegmentationDataset) and len(ds) == 2
    assert ds.images.shape == (2, 3, 16, 16) and ds.labels.shape == (2, 2, 16, 16)
    assert ds.images.dtype == torch.float32 and ds.labels.dtype == torch.float32
    assert 0 <= ds.images.min() and ds.images.max() <= 1
    assert set(ds.labels.unique().tolist()) == {0.0, 1.0}
    disc, cup = ds.labels[:, 0], ds.labels[:, 1]
    assert torch.all(cup <= disc) and cup.sum() < disc.sum()  # cup inside disc
    assert ds.case_ids == ["images/training_0.png", "images/training_1.png"]
    image, label = ds[1]
    assert image.shape == (3, 16, 16) and label.shape == (2, 16, 16)


def test_png_orientation_kept_for_non_square_pair(tmp_path, h):
    # Prepare: a 12 x 20 (H x W) grey image and a label marking its top-left 3 x 7 block
    image = (np.arange(12 * 20).reshape(12, 20) % 251).astype(np.uint8)
    label = np.zeros((12, 20), np.uint8)
    label[:3, :7] = 1
    h.write_site(tmp_path, "s", {k: [(image, label)] for k in ("training", "validation", "testing")})
    fed = load_federation(h.write_spec(tmp_path, sites=("s",), in_channels=1, labels={"fg": [1]}))
    # Execute
    ds = load_split(fed, "s", "train")
    # Assert: (H, W) as PIL/numpy see it, image and label aligned
    assert ds.images.shape == (1, 1, 12, 20)
    np.testing.assert_allclose(ds.images[0, 0].numpy(), image / 255.0, atol=1e-6)
    np.testing.assert_array_equal(ds.labels[0, 0].numpy(), label)


def test_resize_to_image_size(tmp_path, h):
    # Prepare
    pair = h.disc_cup_pair(16, 24)
    h.write_site(tmp_path, "s", {k: [pair] for k in ("training", "validation", "testing")})
    fed = load_federation(h.write_spec(tmp_path, sites=("s",), image_size=(8, 12)))
    # Execute
    ds = load_split(fed, fed.sites[0], "validation")
    # Assert: labels resized with nearest stay binary and nested
    assert ds.images.shape == (1, 3, 8, 12) and ds.labels.shape == (1, 2, 8, 12)
    assert set(ds.labels.unique().tolist()) == {0.0, 1.0}
    assert torch.all(ds.labels[:, 1] <= ds.labels[:, 0])


@pytest.mark.parametrize("channels, in_channels, word", [(1, 3, "grey"), (3, 1, "RGB")])
def test_channel_mismatch_raises_naming_file(tmp_path, h, channels, in_channels, word):
    # Prepare
    image, label = h.disc_cup_pair()
    image = image[..., 0] if channels == 1 else image
    h.write_site(tmp_path, "s", {k: [(image, label)] for k in ("training", "validation", "testing")})
    fed = load_federation(h.write_spec(tmp_path, sites=("s",), in_channels=in_channels))
    # Execute
    with pytest.raises(DataError) as err:
        load_split(fed, "s", "training")
    # Assert
    msg = str(err.value)
    assert msg.startswith("s: ") and "training_0.png" in msg and word in msg and f"in_channels = {in_channels}" in msg


def test_unknown_site_and_split(png_federation):
    # Prepare
    fed = load_federation(png_federation)
    # Execute / Assert
    with pytest.raises(ConfigError, match="no site named"):
        load_split(fed, "nosite", "training")
    with pytest.raises(ConfigError, match="unknown split 'holdout'"):
        load_split(fed, "site1", "holdout")


def _volume(shape=(8, 10, 5), fg_slices=(1, 3), seed=0):
    rng = np.random.default_rng(seed)
    image = rng.normal(100.0, 30.0, shape).astype(np.float32)
    label = np.zeros(shape, np.uint8)
    for z in fg_slices:
        label[2:5, 3:7, z] = 1
    return image, label


@pytest.mark.parametrize("foreground_only, expected_z", [(True, [1, 3]), (False, [0, 1, 2, 3, 4])])
def test_nifti_slices_mode(tmp_path, h, foreground_only, expected_z):
    # Prepare
    image, label = _volume()
    h.write_site(tmp_path, "s", {k: [(image, label)] for k in ("training", "validation", "testing")}, suffix=".nii.gz")
    fed = load_federation(
        h.write_spec(
            tmp_path,
            sites=("s",),
            mode="slices",
            in_channels=1,
            labels={"prostate": [1]},
            foreground_only=foreground_only,
        )
    )
    # Execute
    ds = load_split(fed, "s", "testing")
    # Assert: one 2D case per kept slice, min-max scaled per volume, labels aligned to slices
    assert ds.images.shape == (len(expected_z), 1, 8, 10) and ds.labels.shape == (len(expected_z), 1, 8, 10)
    assert ds.case_ids == [f"images/testing_0.nii.gz#{z}" for z in expected_z]
    scaled = (image - image.min()) / (image.max() - image.min())
    np.testing.assert_allclose(ds.images[:, 0].numpy(), np.moveaxis(scaled[..., expected_z], -1, 0), atol=1e-6)
    np.testing.assert_array_equal(ds.labels[:, 0].numpy(), np.moveaxis(label[..., expected_z], -1, 0))


def test_3d_mode_stacks_volumes_and_needs_one_size(tmp_path, h):
    # Prepare
    a, b = _volume((8, 10, 6)), _volume((8, 10, 6), seed=1)
    c = _volume((6, 10, 6), seed=2)
    h.write_site(tmp_path, "s", {"training": [a, b], "validation": [a, c], "testing": [a]}, suffix=".nii.gz")
    spec = h.write_spec(tmp_path, sites=("s",), mode="3d", in_channels=1, labels={"prostate": [1]})
    fed = load_federation(spec)
    # Execute
    ds = load_split(fed, "s", "training")
    # Assert
    assert ds.images.shape == (2, 1, 8, 10, 6) and ds.labels.shape == (2, 1, 8, 10, 6)
    assert float(ds.images.min()) == 0.0 and float(ds.images.max()) == 1.0
    with pytest.raises(DataError, match="set data.image_size"):
        load_split(fed, "s", "validation")
    # Execute: with a 3-entry image_size the odd volume is resized
    fed = load_federation(
        h.write_spec(tmp_path, sites=("s",), mode="3d", in_channels=1, labels={"prostate": [1]}, image_size=(4, 5, 3))
    )
    ds = load_split(fed, "s", "validation")
    # Assert
    assert ds.images.shape == (2, 1, 4, 5, 3) and set(ds.labels.unique().tolist()) <= {0.0, 1.0}
