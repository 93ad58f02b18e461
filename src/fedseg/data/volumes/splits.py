"""A volume federation's splits as datasets in the plan's grid, and their padding to a common shape.

:class:`VolumeDataset` holds cases in the plan's grid with what scoring in each scan's own grid needs;
:class:`SliceDataset` the axial slices of ``patches2d`` training.  Every split is padded at the far end
of each axis (:func:`pad_to_shape`, :func:`pad_to_common_shape`), so the origin, and with it every affine,
stays.
"""

from __future__ import annotations

import numpy as np
import torch

from fedseg.data.loading import SegmentationDataset
from fedseg.data.volumes.geometry import region_scores, to_original_grid
from fedseg.data.volumes.lazy import CachedVolumes
from fedseg.foundation.errors import DataError

__all__ = [
    "SliceDataset",
    "VolumeDataset",
    "pad_far_end",
    "pad_to_common_shape",
    "pad_to_shape",
    "slice_dataset",
    "split_shape",
]


class VolumeDataset(SegmentationDataset):
    """Cases in the plan's grid, padded to one shape, with what is needed to score in each scan's own grid.

    Attributes (beside :class:`SegmentationDataset`'s)
    -----------
    affines : list of np.ndarray
        The plan-grid affine of every case.
    originals : list of Geometry or None
        The scan's own grid (validation and test splits).
    original_labels : list of torch.Tensor or None
        The label channels (L, X, Y, Z) in the scan's own grid (validation and test splits).
    extents : list of tuple of int or None
        Every case's own spatial shape in the plan's grid, before the padding at the far end (None: every
        case fills the padded shape).  Evaluation runs its sliding windows over this region only
        (:meth:`fedseg.site.runtime.Site.eval_batches`).
    """

    def __init__(self, images, labels, case_ids, affines, originals=None, original_labels=None, *, extents=None):
        super().__init__(images, labels, case_ids)
        self.affines = affines
        self.originals = originals
        self.original_labels = original_labels
        self.extents = extents

    def original_grid(
        self, i: int, prediction: torch.Tensor, threshold: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(prediction, label)`` of case ``i`` in its scan's own grid: the prediction (logits, C × plan
        grid: the padded shape or any region from the origin covering the case's extent) resampled linearly
        back through the inverse of the plan's resampling and reorientation.  A scan voxel past the last
        plan voxel of the region (by less than half a plan voxel, where the plan's shape rounds the scan's
        field of view down) takes the region's border value.

        With ``threshold`` (of the sigmoid) only the region of the scan's grid that the label or a
        prediction above the threshold can reach is resampled and returned, on the prediction's device in
        float32 (:func:`fedseg.data.volumes.geometry.scoring_box`): Dice and HD95 (given the whole grid's
        shape) are those of the whole grid."""
        if self.originals is None:
            raise ValueError("this split keeps no original geometry (training split)")
        if threshold is not None:
            return region_scores(prediction, self.affines[i], self.originals[i], self.original_labels[i], threshold)
        pred = to_original_grid(prediction, self.affines[i], self.originals[i], mode="bilinear")
        return pred.to(prediction.device), self.original_labels[i].to(prediction.device, torch.float32)


class SliceDataset(SegmentationDataset):
    """The axial slices of volumes in the plan's in-plane grid: images ``(S, C, X, Y)``, labels
    ``(S, L, X, Y)``, case ids ``<volume id>#<z>``; every slice of every volume, none of the padding."""


def slice_dataset(images: list[np.ndarray], labels: list[np.ndarray], ids: list[str], patch: list[int]) -> SliceDataset:
    xs, ys, sids = [], [], []
    for x, lab, cid in zip(images, labels, ids):
        for z in range(x.shape[-1]):
            xs.append(x[..., z])
            ys.append(lab[..., z])
            sids.append(f"{cid}#{z}")
    shape = [max([im.shape[1 + a] for im in xs] + [patch[a]]) for a in range(2)]
    x, y = pad_far_end(xs, ys, shape)
    return SliceDataset(x, y, sids)


def split_shape(ds: VolumeDataset | SliceDataset | CachedVolumes) -> list[int]:
    """The padded spatial shape of a volume split (two axes for a split of slices)."""
    return list(ds.shape) if isinstance(ds, CachedVolumes) else list(ds.images.shape[2:])


def pad_far_end(images: list[np.ndarray], labels: list[np.ndarray], shape: list[int]):
    """Stack ``(C, *spatial)`` images and ``(L, *spatial)`` label channels padded at the far end of each axis
    to ``shape`` (the origin, and so the affine, stays): images with each volume's lowest value (air), labels
    with 0.  Returns float32 tensors ``(N, C, *shape)`` and ``(N, L, *shape)``."""
    x = np.zeros((len(images), images[0].shape[0], *shape), dtype=np.float32)
    y = np.zeros((len(labels), labels[0].shape[0], *shape), dtype=np.float32)
    for i, (im, lab) in enumerate(zip(images, labels)):
        region: tuple[int | slice, ...] = (i, slice(None), *(slice(0, s) for s in im.shape[1:]))
        x[i] = im.min()
        x[region] = im
        y[region] = lab
    return torch.from_numpy(x), torch.from_numpy(y)


def _pad_split(ds: VolumeDataset | SliceDataset | CachedVolumes, shape: list[int]) -> None:
    if isinstance(ds, CachedVolumes):
        ds.shape = list(shape)
    elif list(ds.images.shape[2:]) != list(shape):
        ds.images, ds.labels = pad_far_end(list(ds.images.numpy()), list(ds.labels.numpy()), list(shape))


def pad_to_shape(sets: list[VolumeDataset | SliceDataset | CachedVolumes], shape: list[int]) -> None:
    """Pad volume splits in place at the far end of each axis to ``shape`` (at least each split's own); a
    split of slices (``patches2d`` training) to its first two axes, as :func:`pad_to_common_shape` does."""
    for ds in sets:
        own = split_shape(ds)
        target = list(shape)[: len(own)]
        if any(s < h for s, h in zip(target, own)):
            raise DataError(f"volume shape {list(shape)} is smaller than a split's {own}")
        _pad_split(ds, target)


def pad_to_common_shape(data: dict) -> dict:
    """Pad every volume split of every site at the far end of each axis to one shape (so that pooled
    training, e.g. centralized, can stack them); the affines stay valid because the origin does not move.
    Slice splits (``patches2d``) share the volumes' in-plane shape."""
    sets = [
        ds
        for d in data.values()
        for ds in (d.train, d.val, d.test)
        if isinstance(ds, (VolumeDataset, SliceDataset, CachedVolumes))
    ]
    shapes = [split_shape(ds) for ds in sets]
    shape = [max(s[a] for s in shapes if len(s) > a) for a in range(max(len(s) for s in shapes))]
    for ds, own in zip(sets, shapes):
        _pad_split(ds, shape[: len(own)])
    return data
