"""Random augmentation of training patches with MONAI's transforms, seeded like every draw of a run.

:func:`patch_augmenter` returns a batch function: each case of a batch of images ``(B, C, *spatial)`` and
label channels ``(B, L, *spatial)`` (2D or 3D) goes through one MONAI ``Compose``, seeded once per batch
with a seed the caller draws from its (run seed, site, round) generator:

* a flip along each spatial axis, each with probability 1/2 (``RandFlipd``, image and label alike);
* when the patch is square in the axial plane (``square_plane``), a rotation by 90°, 180° or 270° in
  that plane with probability 1/2 (``RandRotate90d``; a non-square patch would change shape, so it is
  left out there);
* with probability 0.2, a rotation in the axial plane (the first two axes) by up to ±15° and a scaling
  by up to ±10 % per axis (``RandAffined``: the image bilinear with border padding, the label nearest
  with zeros, so its values stay in {0, 1});
* the image only: intensities scaled by up to ±10 % (``RandScaleIntensityd``, p = 0.5), shifted by up
  to ±0.1 (``RandShiftIntensityd``, p = 0.5) and gaussian noise of sd 0.05 (``RandGaussianNoised``,
  p = 0.15) — on normalized intensities (z-scores or [0, 1]).

nnU-Net's default augmentation has the same kinds of steps with similar ranges; rotations stay in-plane
because volumes are often anisotropic (thick slices).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["patch_augmenter"]

ROTATION = math.pi / 12
SCALE = 0.1


def _compose(spatial_dims: int, square_plane: bool = False):
    from monai.transforms import (
        Compose,
        RandAffined,
        RandFlipd,
        RandGaussianNoised,
        RandRotate90d,
        RandScaleIntensityd,
        RandShiftIntensityd,
    )

    both = ("image", "label")
    rotate = (ROTATION,) if spatial_dims == 2 else (0.0, 0.0, ROTATION)  # 3D: about the third (axial) axis
    return Compose(
        [
            *(RandFlipd(keys=both, prob=0.5, spatial_axis=a) for a in range(spatial_dims)),
            *([RandRotate90d(keys=both, prob=0.5, max_k=3, spatial_axes=(0, 1))] if square_plane else []),
            RandAffined(
                keys=both,
                prob=0.2,
                rotate_range=rotate,
                scale_range=(SCALE,) * spatial_dims,
                mode=("bilinear", "nearest"),
                padding_mode=("border", "zeros"),
            ),
            RandScaleIntensityd(keys="image", factors=0.1, prob=0.5),
            RandShiftIntensityd(keys="image", offsets=0.1, prob=0.5),
            RandGaussianNoised(keys="image", prob=0.15, std=0.05),
        ]
    )


def patch_augmenter(
    spatial_dims: int, square_plane: bool = False
) -> Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]:
    """``augment(x, y, seed) -> (x, y)``: the batch augmented case by case (module docstring), every random
    draw from MONAI's generators seeded with ``seed``; the same seed gives the same batch.  ``square_plane``:
    the patches' first two sides are equal, so in-plane 90° rotations keep their shape."""
    compose = _compose(spatial_dims, square_plane)

    def augment(x: torch.Tensor, y: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        compose.set_random_state(seed=int(seed) % 2**32)
        xs, ys = [], []
        for i in range(x.shape[0]):
            out = compose({"image": x[i], "label": y[i]})
            xs.append(torch.as_tensor(out["image"]).as_subclass(torch.Tensor).to(x.dtype))
            ys.append(torch.as_tensor(out["label"]).as_subclass(torch.Tensor).to(y.dtype))
        return torch.stack(xs), torch.stack(ys)

    return augment
