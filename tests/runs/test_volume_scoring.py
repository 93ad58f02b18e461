"""Scoring in the scan's own grid inside the region either mask can reach equals scoring the whole grid."""

from __future__ import annotations

import numpy as np
import torch

from fedseg.data.volumes.geometry import Geometry, region_scores, scoring_box, to_original_grid, to_original_region
from fedseg.site.workload import dice_metric, hd95_metric


def _oblique(shape=(30, 26, 12), spacing=(0.9, 1.1, 3.0), angle=0.4):
    """An affine rotated about z and about x (oblique), anisotropic, with an origin away from 0."""
    cz, sz = np.cos(angle), np.sin(angle)
    cx, sx = np.cos(angle / 2), np.sin(angle / 2)
    rot = np.array([[cz, -sz, 0], [sz, cz, 0], [0, 0, 1]]) @ np.array([[1, 0, 0], [0, cx, -sx], [0, sx, cx]])
    a = np.eye(4)
    a[:3, :3] = rot @ np.diag(spacing)
    a[:3, 3] = [-12.0, 7.0, 30.0]
    return Geometry(a, shape)


def test_region_scores_equal_whole_grid_scores():
    """Dice and HD95 (mm), of each thresholded channel and of the delivered label map, of predictions resampled into an oblique anisotropic scan grid: the region path
    (float32, only the voxels the label or a prediction above the threshold can reach) gives the whole
    grid's scores to float rounding, including a channel predicted where there is no label (HD95: the
    whole grid's diagonal) and a channel whose foreground touches the plan grid's edge."""
    g = torch.Generator().manual_seed(0)
    original = _oblique()
    plan_affine = np.eye(4)
    plan_affine[:3, :3] = np.diag([1.0, 1.0, 1.5])
    plan_affine[:3, 3] = [-30.0, -10.0, 20.0]
    plan_shape = (40, 40, 30)
    logits = torch.full((3, *plan_shape), -6.0)
    logits[0, 15:25, 12:22, 8:16] = 6.0  # a structure inside
    logits[1, 0:6, 30:40, 0:5] = 6.0  # touching the plan grid's edge
    logits[2, 20:23, 20:23, 10:12] = 6.0  # predicted, no label
    logits += torch.randn(logits.shape, generator=g)
    full = to_original_grid(logits, plan_affine, original)
    label = torch.zeros(3, *original.shape)
    label[0] = (torch.sigmoid(full[0]) > 0.5).float()
    label[0, 5:9, 5:9, 3:5] = 1.0  # a missed part
    label[1, 2:5, 2:4, 1:3] = 1.0
    dice, hd = dice_metric(0.5), hd95_metric(0.5)
    want_d = dice(full[None], label[None])
    want_h = hd(full[None], label[None], original.spacing)
    p, t = region_scores(logits, plan_affine, original, label, 0.5)
    assert p.dtype == torch.float32 and p.shape[1:] == t.shape[1:]
    assert np.prod(p.shape[1:]) < np.prod(original.shape)  # a region, not the whole grid
    torch.testing.assert_close(dice(p[None], t[None]), want_d, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        hd(p[None], t[None], original.spacing, field_of_view=original.shape), want_h, rtol=1e-6, atol=1e-6
    )
    assert float(want_h[0, 2]) > 30.0  # the whole grid's diagonal, not the region's
    # the delivered label map (b nested in a, c apart), made voxel by voxel from the region's logits: the
    # region still holds every voxel the map sets, so its scores are the whole grid's; b lit outside a is
    # a in the map, so a's Dice differs from the thresholded channel's
    nested = {"a": [1, 2], "b": [2], "c": [3]}
    dice_n, hd_n = dice_metric(0.5, 1.0, nested), hd95_metric(0.5, nested)
    want_dn = dice_n(full[None], label[None])
    assert float(want_dn[0, 0]) < float(want_d[0, 0]) - 1e-3
    torch.testing.assert_close(dice_n(p[None], t[None]), want_dn, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        hd_n(p[None], t[None], original.spacing, field_of_view=original.shape),
        hd_n(full[None], label[None], original.spacing),
        rtol=1e-6,
        atol=1e-6,
    )
    start, stop = scoring_box(logits, plan_affine, original, label)
    whole_region = to_original_region(logits, plan_affine, original, start, stop)
    torch.testing.assert_close(
        to_original_region(logits, plan_affine, original, start, stop, slab=3), whole_region, rtol=0, atol=1e-4
    )
    empty = scoring_box(torch.full((1, 4, 4, 4), -1.0), plan_affine, original)
    assert empty == ([0, 0, 0], [1, 1, 1])
