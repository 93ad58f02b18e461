"""Volumes read from a site's cache when they are used, so that a site holds only what one batch needs.

A training split of :class:`CachedVolumes` keeps, per case, the path of its cache entry
(:mod:`fedseg.data.volumes.cache`), its extent in the plan's grid, the value its image is padded with and
the positions of its foreground voxels; the voxels stay on disk.  A training batch is a :class:`CaseBatch`:
the workload's patch transform draws each patch's position exactly as it does on a batch of whole padded
volumes (the same draws from the same generator, foreground positions in the same order) and reads only the
patch, through safetensors' sliced reads.  Where the patch reaches past the case's extent (into the padding
every split carries up to the common shape of the federation), the image is filled with the case's lowest
value and the label channels with 0, as :func:`fedseg.data.volumes.splits.pad_to_common_shape` pads in
memory.  So a run that reads from the cache trains on the same patches, and reaches the same weights, as
one that holds every volume in memory.

Validation and test splits are :class:`CachedVolumes` too: a batch of them is read whole (sliding-window
inference needs the whole volume), and each case's label in its scan's own grid is read when its
prediction is scored.

Memory a site needs, reading from the cache: per training case its foreground positions (4 bytes per
foreground voxel of the plan's grid, 8 beyond 2^31 voxels) and a few numbers; per step one batch of
patches; per evaluation batch ``eval.batch_size`` whole volumes.  Holding the volumes in memory instead
takes ``4 × (C + L)`` bytes per voxel of the padded common shape for every case (C image channels, L label
channels), plus ``4 × L`` per voxel of each validation and test case's own grid.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from safetensors import safe_open
from torch.utils.data import Dataset

from fedseg.data.loading import label_channels
from fedseg.data.volumes.geometry import label_masks, region_scores, to_original_grid
from fedseg.foundation.errors import DataError

__all__ = ["CachedVolumes", "CaseBatch", "CaseFile"]


@dataclass(frozen=True)
class CaseFile:
    """One case in a site's cache, as a :class:`CachedVolumes` split refers to it."""

    case_id: str
    path: Path
    """The case's safetensors file (arrays ``image``, ``label``, and ``original_label`` for evaluation)."""
    extent: tuple[int, ...]
    """The case's spatial shape in the plan's grid (before padding)."""
    channels: int
    """Image channels."""
    fill: float
    """The image's lowest value: what padding holds."""
    foreground: np.ndarray
    """Flat indices (C order, over ``extent``) of the voxels where any label channel is set, ascending."""
    classes: tuple[np.ndarray, ...] = ()
    """Per label channel, the flat indices (C order, over ``extent``) of its voxels, ascending (class-balanced
    patches draw a class, then one of its voxels)."""

    @classmethod
    def of(cls, case_id: str, path: Path, image: np.ndarray, label: np.ndarray, labels: Mapping[str, Any]):
        """The reference to a case whose arrays (``image`` (C, *extent), integer ``label`` (*extent)) are in
        ``path``; ``labels`` maps label channels to label values (:func:`fedseg.data.loading.label_channels`)."""
        channels = label_channels(label, cast(dict[str, tuple[int, ...]], labels))
        fg = np.flatnonzero(channels.max(axis=0) > 0)
        index = np.int32 if label.size < 2**31 else np.int64
        return cls(
            case_id,
            Path(path),
            tuple(int(s) for s in label.shape),
            int(image.shape[0]),
            float(image.min()),
            fg.astype(index),
            tuple(np.flatnonzero(c > 0).astype(index) for c in channels),
        )

    @property
    def nbytes(self) -> int:
        """Bytes this reference holds (its foreground positions)."""
        return int(self.foreground.nbytes + sum(c.nbytes for c in self.classes))


def _unreadable(case: CaseFile, e: Exception) -> DataError:
    """The error of a cache entry that cannot be read (removed or rewritten while the site runs)."""
    return DataError(
        f"{case.path}: the cached case {case.case_id} cannot be read ({type(e).__name__}: {e}) -> the site's "
        "volume cache changed during the run; run again (the case is preprocessed again) or set "
        "volume_reads = 'memory'"
    )


def _open(case: CaseFile):
    try:
        return safe_open(str(case.path), framework="pt")
    except Exception as e:
        raise _unreadable(case, e) from e


def read_region(
    case: CaseFile, labels: Mapping[str, Any], starts: Sequence[int], size: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The image ``(C, *size)`` and label channels ``(L, *size)`` of ``case`` from ``starts``: what lies in
    the case's extent read from its file, the rest filled (image: ``case.fill``, labels: 0)."""
    inside = [slice(min(a, e), min(a + n, e)) for a, n, e in zip(starts, size, case.extent)]
    dest = tuple(slice(0, s.stop - s.start) for s in inside)
    x = np.full((case.channels, *size), case.fill, dtype=np.float32)
    y = np.zeros((len(labels), *size), dtype=np.float32)
    if all(s.stop > s.start for s in inside):
        f = _open(case)
        try:
            img = f.get_slice("image")[(slice(None), *inside)]
            lab = f.get_slice("label")[tuple(inside)]
        except Exception as e:
            raise _unreadable(case, e) from e
        x[(slice(None), *dest)] = img.numpy()
        y[(slice(None), *dest)] = label_channels(lab.numpy().astype(np.int64), cast(dict[str, tuple[int, ...]], labels))
    return torch.from_numpy(x), torch.from_numpy(y)


class CachedVolumes(Dataset):
    """A split of volumes whose voxels stay in the site's cache (module docstring).

    Items are ``(image (C, *shape), label channels (L, *shape))`` padded to :attr:`shape`, as a
    :class:`fedseg.data.volumes.load.VolumeDataset`'s are.  Validation and test splits also carry the plan-grid
    ``affines`` and the scans' own grids (``originals``) and score through :meth:`original_grid`.
    """

    def __init__(
        self,
        cases: Sequence[CaseFile],
        labels: Mapping[str, Any],
        shape: Sequence[int],
        affines: Sequence[np.ndarray] | None = None,
        originals: Sequence[Any] | None = None,
    ):
        self.cases = list(cases)
        self.labels = dict(labels)
        self.shape = [int(s) for s in shape]
        self.case_ids = [c.case_id for c in self.cases]
        self.affines = list(affines) if affines is not None else None
        self.originals = list(originals) if originals is not None else None

    @property
    def extents(self) -> list[tuple[int, ...]]:
        """Each case's spatial shape in the plan's grid, before padding."""
        return [c.extent for c in self.cases]

    @property
    def nbytes(self) -> int:
        """Bytes the split holds in memory (foreground positions)."""
        return sum(c.nbytes for c in self.cases)

    def __len__(self) -> int:
        return len(self.cases)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return read_region(self.cases[int(i)], self.labels, [0] * len(self.shape), self.shape)

    def read(self, idx: torch.Tensor | Sequence[int], size: Sequence[int] | None = None):
        """Cases ``idx`` from the origin, ``size`` voxels along each axis (default: :attr:`shape`, the padded
        items), stacked: ``(B, C, *size)`` images and ``(B, L, *size)`` label channels."""
        size = list(self.shape if size is None else size)
        xs, ys = zip(*(read_region(self.cases[int(i)], self.labels, [0] * len(size), size) for i in idx))
        return torch.stack(xs), torch.stack(ys)

    def batch(self, idx: torch.Tensor | Sequence[int]) -> CaseBatch:
        """Cases ``idx`` as a :class:`CaseBatch` (nothing read yet)."""
        return CaseBatch(self, [int(i) for i in idx])

    def original_grid(
        self, i: int, prediction: torch.Tensor, threshold: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(prediction, label)`` of case ``i`` in its scan's own grid, as
        :meth:`fedseg.data.volumes.load.VolumeDataset.original_grid` gives it (the label read from the cache)."""
        if self.originals is None or self.affines is None:
            raise ValueError("this split keeps no original geometry (training split)")
        case = self.cases[i]
        f = _open(case)
        try:
            lab = f.get_tensor("original_label").numpy().astype(np.int64)
        except Exception as e:
            raise _unreadable(case, e) from e
        label = torch.from_numpy(label_masks(lab, self.labels))
        del lab
        if threshold is not None:
            return region_scores(prediction, self.affines[i], self.originals[i], label, threshold)
        pred = to_original_grid(prediction, self.affines[i], self.originals[i], mode="bilinear")
        return pred.to(prediction.device), label.to(prediction.device, torch.float32)

    @staticmethod
    def concat(splits: Sequence[CachedVolumes]) -> CachedVolumes:
        """The training cases of several splits of one shape as one split (pooled training)."""
        shapes = {tuple(s.shape) for s in splits}
        if len(shapes) != 1:
            raise ValueError(f"splits of different shapes {sorted(shapes)} cannot be pooled; pad them to one first")
        return CachedVolumes([c for s in splits for c in s.cases], splits[0].labels, splits[0].shape)


class CaseBatch:
    """Cases of a :class:`CachedVolumes` split chosen for one training step, read only where a patch is cut.

    ``place(tensor, cast)`` moves what is read to the run's device (and with ``cast`` to its dtype), as the
    training loop moves a batch of in-memory volumes."""

    def __init__(self, split: CachedVolumes, idx: Sequence[int], place=None):
        self.split = split
        self.cases = [split.cases[i] for i in idx]
        self.place = place or (lambda t, cast: t)

    def __len__(self) -> int:
        return len(self.cases)

    @property
    def extents(self) -> list[tuple[int, ...]]:
        """Each case's own spatial shape (before padding)."""
        return [c.extent for c in self.cases]

    @property
    def spatial(self) -> tuple[int, ...]:
        """The padded spatial shape every case of the batch is seen in."""
        return tuple(self.split.shape)

    def foreground_count(self, i: int) -> list[int]:
        """Voxels of each label channel in case ``i``."""
        return [int(c.size) for c in self.cases[i].classes]

    def foreground_at(self, i: int, label: int, k: int) -> list[int]:
        """The ``k``-th voxel of label channel ``label`` in case ``i`` (C order, as ``torch.nonzero`` lists
        them), as coordinates."""
        c = self.cases[i]
        return [int(v) for v in np.unravel_index(int(c.classes[label][k]), c.extent)]

    def regions(self, cuts: Sequence[tuple[int, Sequence[int]]], size: Sequence[int]):
        """The stacked patches ``(B, C, *size)``, ``(B, L, *size)`` cut at ``(case, starts)`` for each item of
        ``cuts``, on the run's device."""
        xs, ys = zip(*(read_region(self.cases[i], self.split.labels, starts, size) for i, starts in cuts))
        return self.place(torch.stack(xs), True), self.place(torch.stack(ys), True)
