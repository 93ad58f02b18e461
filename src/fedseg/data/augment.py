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

The patches are plain tensors with no geometry to carry, so the transforms run with MONAI's metadata
tracking off (``set_track_meta(False)``, restored afterwards): the same values as with ``MetaTensor``s, in
about half the time (every flip and intensity step otherwise copies and updates the metadata).  Seeding a
batch (:func:`reseed`) puts every transform's generator into the state MONAI's ``Compose.set_random_state``
gives it, reseeding the generators in place rather than building new ones (numpy builds a ``RandomState``
from OS entropy first, ~60 µs each, a dozen per batch).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import torch

__all__ = ["patch_augmenter"]

ROTATION = math.pi / 12
SCALE = 0.1

_TRACKING = threading.Lock()  # MONAI's metadata switch is one process-wide flag


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


def generators(compose) -> list[list]:
    """The random transforms of a MONAI ``Compose``, one group per transform in it: the transform and the random
    transforms it wraps (a dictionary transform's array transform, ``RandAffine``'s grid).  Seeds the
    ``Compose`` once, so that every one of them has a generator of its own (:func:`reseed` reseeds those)."""
    from monai.transforms import Randomizable

    compose.set_random_state(seed=0)

    def members(t, seen):
        if isinstance(t, Randomizable) and id(t) not in seen:
            seen.add(id(t))
            yield t
            for v in vars(t).values():
                yield from members(v, seen)

    groups = [list(members(t, set())) for t in compose.transforms if isinstance(t, Randomizable)]
    if any("R" not in vars(o) for g in groups for o in g):  # a generator shared with the class: not its own
        raise AssertionError("a random transform has no generator of its own")
    return groups


def reseed(compose, groups: list[list], seed: int) -> None:
    """``compose.set_random_state(seed=seed)`` with the generators reseeded in place (``groups`` from
    :func:`generators`): the same states.  MONAI seeds the ``Compose``'s generator with ``seed``, draws one
    ``uint32`` seed per random transform from it, and each transform seeds itself and the random transforms
    it wraps with that seed."""
    from monai.utils import MAX_SEED

    compose.R.seed(int(seed) % MAX_SEED)
    for group in groups:
        s = int(compose.R.randint(MAX_SEED, dtype="uint32")) % MAX_SEED
        for t in group:
            t.R.seed(s)


def patch_augmenter(
    spatial_dims: int, square_plane: bool = False
) -> Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]:
    """``augment(x, y, seed) -> (x, y)``: the batch augmented case by case (module docstring), every random
    draw from MONAI's generators seeded with ``seed``; the same seed gives the same batch.  ``square_plane``:
    the patches' first two sides are equal, so in-plane 90° rotations keep their shape."""
    from monai.data import get_track_meta, set_track_meta

    compose = _compose(spatial_dims, square_plane)
    groups = generators(compose)

    def augment(x: torch.Tensor, y: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = [], []
        with _TRACKING:
            tracking = get_track_meta()
            set_track_meta(False)  # plain tensors in and out (module docstring)
            try:
                reseed(compose, groups, int(seed) % 2**32)
                for i in range(x.shape[0]):
                    out = compose({"image": x[i], "label": y[i]})
                    xs.append(torch.as_tensor(out["image"]).as_subclass(torch.Tensor).to(x.dtype))
                    ys.append(torch.as_tensor(out["label"]).as_subclass(torch.Tensor).to(y.dtype))
            finally:
                set_track_meta(tracking)
        return torch.stack(xs), torch.stack(ys)

    return augment
