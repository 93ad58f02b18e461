"""Class-balanced patch sampling (nnU-Net's: a class present in the case first, then one of its voxels)."""

from __future__ import annotations

import numpy as np
import torch

from fedseg.data.volumes.lazy import CaseFile
from fedseg.site.workload import _random_crop

LABELS = {"organ": [1, 2], "lesion": [2]}


def _organ_with_lesion() -> np.ndarray:
    """A 40³ label: an organ ball of radius 12 (value 1) holding a ball of radius √11 of 2.4 % of its voxels (value 2)."""
    idx = np.indices((40, 40, 40)).astype(float)
    organ = ((idx - 20) ** 2).sum(0) <= 12**2
    lesion = organ & (((idx - [[[[22]]], [[[20]]], [[[20]]]]) ** 2).sum(0) <= 11)
    label = organ.astype(np.int64) + lesion
    assert 0.022 < lesion.sum() / organ.sum() < 0.025
    return label


def test_a_small_lesion_centres_a_fifth_of_the_patches():
    """With half the patches forced to foreground (nnU-Net forces one patch of its batch of 2), drawing the
    class first centres 1/2 × 1/2 = 25 % of the patches on the lesion; drawing from the union of the label
    channels (the organ holds the lesion) would centre 1/2 × 1/1.023 × 0.023 ≈ 1.1 %.  The draws are seeded:
    the same generator seed gives the same patches.  A case file lists each channel's voxels as
    ``torch.nonzero`` does, so cached cases are cut at the same places."""
    label = _organ_with_lesion()
    y = torch.from_numpy(np.stack([np.isin(label, v) for v in LABELS.values()]).astype(np.float32))[None]
    x = torch.zeros(1, 1, 40, 40, 40)
    x[:, :, :, :, :] = torch.arange(40 * 40 * 40, dtype=torch.float32).reshape(1, 1, 40, 40, 40)
    roi = (8, 8, 8)
    crop = _random_crop(roi, foreground_share=0.5)
    g = torch.Generator().manual_seed(0)
    n, on_lesion = 2000, 0
    for _ in range(n):
        _, py = crop(x, y, g)
        on_lesion += int(py[0, 1, 4, 4, 4] > 0)  # the patch's centre voxel
    share = on_lesion / n
    assert 0.2 <= share <= 0.3, share
    again = crop(x, y, torch.Generator().manual_seed(0))[0]
    first = crop(x, y, torch.Generator().manual_seed(0))[0]
    assert torch.equal(again, first)

    case = CaseFile.of("c", "unused.safetensors", np.zeros((1, 40, 40, 40), np.float32), label, LABELS)
    for c in range(2):
        listed = torch.nonzero(y[0, c] > 0).numpy()
        assert np.array_equal(np.stack(np.unravel_index(case.classes[c], case.extent), 1), listed)
