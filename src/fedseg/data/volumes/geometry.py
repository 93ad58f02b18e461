"""Where a volume's voxels are in the patient: reading the affine, one orientation, one spacing, and back.

A scanner stores a volume as an array plus an affine that maps voxel indices to millimetres in the
patient (NIfTI's sform/qform).  Two sites' arrays are comparable only once both are in one orientation
(RAS: the first axis runs to the patient's Right→left… here, towards Right as MONAI's ``Orientation``
defines it) and on one voxel spacing; fedseg brings every volume into the plan's grid with MONAI's
``Orientation`` and ``Spacing`` (images interpolated linearly, labels nearest) and keeps the original
affine and shape of every case, so that a prediction is resampled back into the scan's own grid and
scored there (:func:`to_original_grid`).

Arrays here are channel-first ``(C, X, Y, Z)`` in the file's axis order; labels are integer ``(X, Y, Z)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from fedseg.data import labelmap
from fedseg.data.readers import NON_FINITE_FIX, non_finite, non_finite_message
from fedseg.foundation.errors import DataError

if TYPE_CHECKING:
    from monai.data import MetaTensor
    from nibabel.spatialimages import SpatialImage

__all__ = [
    "Geometry",
    "check_pair",
    "label_masks",
    "read_case",
    "read_channels",
    "read_volume",
    "scoring_box",
    "spacing_of",
    "to_original_grid",
    "to_original_region",
    "to_plan_grid",
]


@dataclass(frozen=True)
class Geometry:
    """The grid of one volume: its voxel → millimetre affine (4 × 4) and its spatial shape."""

    affine: np.ndarray
    shape: tuple[int, int, int]

    @property
    def spacing(self) -> tuple[float, float, float]:
        """Voxel size along each array axis, in mm (the column norms of the affine's 3 × 3 part)."""
        return spacing_of(self.affine)

    def to_json(self) -> dict:
        return {"affine": np.asarray(self.affine, dtype=np.float64).tolist(), "shape": list(self.shape)}

    @classmethod
    def from_json(cls, d: dict) -> Geometry:
        shape = cast(tuple[int, int, int], tuple(int(s) for s in d["shape"]))
        return cls(np.asarray(d["affine"], dtype=np.float64), shape)


def spacing_of(affine: np.ndarray) -> tuple[float, float, float]:
    """Voxel spacing (mm) of each array axis from a 4 × 4 affine."""
    a = np.asarray(affine, dtype=np.float64)[:3, :3]
    return cast(tuple[float, float, float], tuple(float(v) for v in np.sqrt((a * a).sum(axis=0))))


def read_volume(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Read a NIfTI volume with its affine.

    Returns ``(array, affine)``: the array as stored, (X, Y, Z) or (X, Y, Z, C), and the 4 × 4
    voxel → mm affine in RAS+ world coordinates (nibabel's convention).

    Raises
    ------
    DataError
        The file cannot be read, is not 3D (or 3D with channels), or its affine is missing, not
        finite or not invertible — each naming the file and the fix.
    """
    import nibabel as nib  # deferred like every reader of image files

    path = Path(path)
    try:
        img = cast("SpatialImage", nib.load(str(path)))  # NIfTI: an image with an affine and data
        arr = np.asarray(img.dataobj)
    except Exception as e:  # nibabel raises several types for a bad file
        raise DataError(f"{path}: cannot be read as NIfTI ({type(e).__name__}: {e}) -> re-save it as .nii.gz") from None
    if arr.ndim not in (3, 4):
        raise DataError(
            f"{path}: has {arr.ndim} dimensions {arr.shape}; a 3D volume (X, Y, Z) or (X, Y, Z, C) is expected "
            "-> store one volume per file (split 4D series, e.g. keep the T2 channel)"
        )
    affine = img.affine
    if affine is None or not np.isfinite(affine).all() or abs(np.linalg.det(np.asarray(affine)[:3, :3])) < 1e-12:
        raise DataError(
            f"{path}: its affine (voxel to mm) is missing or not invertible -> re-save the file with its "
            "scanner geometry (e.g. from the DICOM series with SimpleITK or dcm2niix)"
        )
    return arr, np.asarray(affine, dtype=np.float64)


def check_pair(image_path: str | Path, image_affine: np.ndarray, image_shape, label_path, label_affine, label_shape):
    """Refuse an image and label that are not on one grid, naming both files.

    Shapes must be equal and affines equal to 1e-3 mm (scanner exports round the affine)."""
    if tuple(image_shape) != tuple(label_shape):
        raise DataError(
            f"{label_path}: label shape {tuple(label_shape)} differs from image shape {tuple(image_shape)} "
            f"of {image_path} -> save the label in the image's grid (same shape and affine)"
        )
    if not np.allclose(image_affine, label_affine, atol=1e-3):
        raise DataError(
            f"{label_path}: label affine differs from the affine of {image_path} (the label is not in the "
            "image's grid) -> resample the label onto the image (nearest neighbour) and save it with the image's affine"
        )


def _meta(array: np.ndarray, affine: np.ndarray) -> MetaTensor:
    from monai.data import MetaTensor

    return MetaTensor(torch.as_tensor(np.ascontiguousarray(array)), affine=torch.as_tensor(affine, dtype=torch.float64))


def to_plan_grid(
    image: np.ndarray, label: np.ndarray | None, affine: np.ndarray, spacing: tuple[float, float, float]
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """Reorient to RAS and resample to ``spacing`` (mm).

    Parameters
    ----------
    image
        ``(C, X, Y, Z)`` float32.
    label
        ``(X, Y, Z)`` integer, or None.
    affine
        The case's 4 × 4 affine.
    spacing
        Target voxel spacing of the RAS axes.

    Returns
    -------
    (image, label, affine)
        The image resampled with (tri)linear interpolation, the label with nearest neighbour (its values
        stay in the label set), and the affine of the new grid.
    """
    from monai.transforms import Orientation, Spacing

    orient = Orientation(axcodes="RAS", labels=(("L", "R"), ("P", "A"), ("I", "S")))  # nibabel's RAS+
    img = cast("MetaTensor", orient(_meta(image.astype(np.float32), affine)))
    # MONAI's transforms return a MetaTensor for a MetaTensor input (their hints say Tensor)
    img = cast("MetaTensor", Spacing(pixdim=spacing, mode="bilinear", padding_mode="border")(img))
    new_affine = np.asarray(img.affine, dtype=np.float64)
    lab = None
    if label is not None:
        lab_t = cast("MetaTensor", orient(_meta(label[None].astype(np.float32), affine)))
        lab_t = cast("MetaTensor", Spacing(pixdim=spacing, mode="nearest", padding_mode="zeros")(lab_t))
        lab = np.rint(np.asarray(lab_t.as_tensor()[0])).astype(np.int64)
        if lab.shape != tuple(img.shape[1:]):  # both grids follow from the same affine and shape
            raise AssertionError(f"label grid {lab.shape} differs from image grid {tuple(img.shape[1:])}")
    return np.asarray(img.as_tensor(), dtype=np.float32), lab, new_affine


def to_original_grid(
    array: torch.Tensor, affine: np.ndarray, original: Geometry, mode: str = "bilinear"
) -> torch.Tensor:
    """Resample ``array`` (C, X, Y, Z) on the grid ``affine`` into the scan's own grid ``original``.

    The inverse of :func:`to_plan_grid` (and of any crop or pad recorded in ``affine``): every voxel of the
    original grid takes the value at its millimetre position in ``array`` (linear interpolation for
    probabilities or logits, ``mode="nearest"`` for labels).  Points outside ``array`` take the border value.
    """
    from monai.transforms import SpatialResample

    src = _meta(array.detach().cpu().float().numpy(), affine)
    # MONAI's dtype hint omits torch dtypes, which SpatialResample takes; the output is a MetaTensor
    resample = SpatialResample(mode=mode, padding_mode="border", dtype=torch.float64)  # type: ignore[arg-type]
    out = resample(src, dst_affine=torch.as_tensor(original.affine, dtype=torch.float64), spatial_size=original.shape)
    return cast("MetaTensor", out).as_tensor().float()


def _bounds(array: torch.Tensor, above: float, slab: int = 8) -> tuple[list[int], list[int]] | None:
    """``(first, last)`` index per spatial axis of the voxels where ``array`` (C, X, Y, Z) exceeds ``above``
    in any channel, or None; read ``slab`` planes of the first axis at a time (no mask of the whole grid)."""
    x_hit: list[int] = []
    y_any = torch.zeros(array.shape[2], dtype=torch.bool, device=array.device)
    z_any = torch.zeros(array.shape[3], dtype=torch.bool, device=array.device)
    for i in range(0, array.shape[1], slab):
        m = (array[:, i : i + slab] > above).any(dim=0)  # (slab, Y, Z)
        xs = torch.nonzero(m.flatten(1).any(dim=1)).flatten()
        if len(xs):
            x_hit += [i + int(xs[0]), i + int(xs[-1])]
            y_any |= m.any(dim=2).any(dim=0)
            z_any |= m.any(dim=1).any(dim=0)
    if not x_hit:
        return None
    ys, zs = torch.nonzero(y_any).flatten(), torch.nonzero(z_any).flatten()
    return [min(x_hit), int(ys[0]), int(zs[0])], [max(x_hit), int(ys[-1]), int(zs[-1])]


def scoring_box(
    prediction: torch.Tensor,
    affine: np.ndarray,
    original: Geometry,
    label: torch.Tensor | None = None,
    margin: int = 1,
    above: float = 0.0,
) -> tuple[list[int], list[int]]:
    """``(start, stop)`` in the scan's own grid of every voxel a prediction resampled from ``affine`` can set.

    ``prediction`` (C, *plan grid): its voxels above ``above`` (the threshold's logit) are the foreground in
    the plan's grid.  Linear interpolation
    gives an original voxel a convex combination of the plan voxels around its position, so it can exceed
    the threshold only within one plan voxel of a voxel that does: the box is the plan box widened by one
    voxel, its 8 corners carried to the original grid's indices, widened by ``margin``; a plan box touching
    the plan grid's edge reaches the original grid's edge on that side (points beyond the plan grid take its
    border value).  ``label`` (L, *original grid) adds its own box.  Never empty (one voxel at the origin).
    """
    shape = list(original.shape)
    boxes: list[tuple[list[float], list[float]]] = []
    b = _bounds(prediction, above)
    if b is not None:
        size = prediction.shape[1:]
        lo = [float(v - 1) if v > 0 else -1e7 for v in b[0]]
        hi = [float(v + 1) if v < n - 1 else 1e7 for v, n in zip(b[1], size)]
        corners = np.array(list(np.ndindex(2, 2, 2)), dtype=np.float64)
        pts = np.where(corners == 0, np.array(lo), np.array(hi))
        to_original = np.linalg.inv(np.asarray(original.affine, dtype=np.float64)) @ np.asarray(affine, np.float64)
        idx = (to_original[:3, :3] @ pts.T).T + to_original[:3, 3]
        boxes.append((np.floor(idx.min(axis=0)).tolist(), np.ceil(idx.max(axis=0)).tolist()))
    if label is not None:
        lb = _bounds(label, 0.5)
        if lb is not None:
            boxes.append(([float(v) for v in lb[0]], [float(v) for v in lb[1]]))
    if not boxes:
        return [0, 0, 0], [1, 1, 1]
    start = [max(0, int(min(bx[0][a] for bx in boxes)) - margin) for a in range(3)]
    stop = [min(shape[a], int(max(bx[1][a] for bx in boxes)) + margin + 1) for a in range(3)]
    return start, [max(s + 1, e) for s, e in zip(start, stop)]


def to_original_region(
    array: torch.Tensor,
    affine: np.ndarray,
    original: Geometry,
    start: Sequence[int],
    stop: Sequence[int],
    slab: int = 32,
) -> torch.Tensor:
    """:func:`to_original_grid` of the region ``[start, stop)`` of the scan's own grid only, on ``array``'s
    device in float32 (the same values to float rounding: the region's voxels sit at the same millimetre
    positions, its affine the original's shifted by ``start``), ``slab`` planes of the first axis at a time."""
    from monai.transforms import SpatialResample

    shift = np.eye(4)
    shift[:3, 3] = [float(v) for v in start]
    region = np.asarray(original.affine, dtype=np.float64) @ shift
    src = _meta_tensor(array.detach().float(), affine)
    resample = SpatialResample(mode="bilinear", padding_mode="border", dtype=np.float32)
    size = [int(e) - int(s) for s, e in zip(start, stop)]
    parts = []
    for x0 in range(0, size[0], slab):  # a slab of the region at a time: its sampling grid stays small
        part = region.copy()
        part[:3, 3] = region[:3, 3] + region[:3, 0] * x0
        out: Any = resample(
            src,
            dst_affine=torch.as_tensor(part, dtype=torch.float64),
            spatial_size=[min(slab, size[0] - x0), size[1], size[2]],
        )
        parts.append(out.as_tensor().float())
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def label_masks(label: np.ndarray, labels: Any) -> np.ndarray:
    """Label channels ``(L, *spatial)`` of an integer label map as one byte a voxel (``uint8`` 0/1): channel
    ``c`` is ``isin(label, values_c)`` (:func:`fedseg.data.labelmap.channels`), as
    :func:`fedseg.data.loading.label_channels` gives them in float32."""
    return labelmap.channels(label, dict(labels)).astype(np.uint8)


def region_scores(
    prediction: torch.Tensor, affine: np.ndarray, original: Geometry, label: torch.Tensor, threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prediction, label)`` in the region of the scan's grid either can set (:func:`scoring_box`): the
    prediction (logits, C × plan grid) resampled there on its device in float32, the label channels
    (L × scan grid) cut to it and moved to that device.  The region holds every voxel where any channel is
    lit, so the delivered label map (:mod:`fedseg.data.labelmap`, which the metric makes of these logits
    voxel by voxel) is background outside it: its channels are scored over the region alone, never the
    whole grid."""
    cut = math.log(threshold / (1.0 - threshold))  # sigmoid(z) > threshold  <=>  z > logit(threshold)
    start, stop = scoring_box(prediction, affine, original, label, above=cut)
    region = tuple(slice(s, e) for s, e in zip(start, stop))
    pred = to_original_region(prediction, affine, original, start, stop)
    return pred, label[(slice(None), *region)].to(prediction.device, torch.float32)


def _meta_tensor(t: torch.Tensor, affine: np.ndarray):
    from monai.data import MetaTensor

    return MetaTensor(t, affine=torch.as_tensor(affine, dtype=torch.float64))


def read_case(image_path: str | Path, label_path: str | Path, in_channels: int, label_values=None):
    """Read one volume case: ``(image (C, X, Y, Z) in file units, label (X, Y, Z) int64, affine)``.

    Every problem is one :class:`DataError` naming the file and the fix: unreadable, not 3D, missing or
    non-invertible affine, image and label not on one grid, a NaN or infinite voxel, the wrong channel
    count, label values outside ``label_values``.
    """
    image, affine = read_volume(image_path)
    label, label_affine = read_volume(label_path)
    if label.ndim == 4 and label.shape[-1] == 1:
        label = label[..., 0]
    if label.ndim != 3:
        raise DataError(f"{label_path}: label has shape {label.shape}; one integer label map (X, Y, Z) is expected")
    image = image[None] if image.ndim == 3 else np.moveaxis(image, -1, 0)
    check_pair(image_path, affine, image.shape[1:], label_path, label_affine, label.shape)
    if image.shape[0] != in_channels:
        raise DataError(
            f"{image_path}: has {image.shape[0]} channel(s) but in_channels = {in_channels} -> "
            "keep the channels the spec declares or set data.in_channels"
        )
    bad = non_finite(image)
    if bad:
        raise DataError(non_finite_message(image_path, bad, image.size, NON_FINITE_FIX))
    if label.dtype.kind == "f" and not (np.isfinite(label).all() and (label == np.round(label)).all()):
        raise DataError(f"{label_path}: label has non-integer values -> save integer class values")
    label = label.astype(np.int64)
    if label_values is not None:
        extra = sorted(set(np.unique(label).tolist()) - set(label_values))
        if extra:
            raise DataError(
                f"{label_path}: label values {extra[:10]} are not declared in [data.labels] -> declare them or re-save the label"
            )
    return image, label, affine


def read_channels(
    image: str | Path | Sequence[str | Path], label_path: str | Path, in_channels: int, label_values=None
):
    """:func:`read_case` of an image in one file, or in one file per channel
    (in channel order): each file one 3D channel on the label's grid (same shape, affine within 1e-3 mm),
    else one :class:`DataError` naming the file and the fix."""
    if isinstance(image, (str, Path)):
        return read_case(image, label_path, in_channels, label_values)
    if len(image) != in_channels:
        raise DataError(
            f"{image[0]}: the case lists {len(image)} channel file(s) but in_channels = {in_channels} -> list one "
            "file per channel (in data.channels order) or set data.in_channels"
        )
    first, label, affine = read_case(image[0], label_path, 1, label_values)
    channels = [first[0]]
    for path in image[1:]:
        arr, aff = read_volume(path)
        if arr.ndim == 4 and arr.shape[-1] == 1:
            arr = arr[..., 0]
        if arr.ndim != 3:
            raise DataError(f"{path}: a channel file holds one 3D channel, not shape {arr.shape} -> split it")
        if arr.shape != label.shape or not np.allclose(aff, affine, atol=1e-3):
            raise DataError(
                f"{path}: channel file of shape {arr.shape} is not on the grid of {image[0]} (shape "
                f"{label.shape}, same affine to 1e-3 mm) -> resample every channel of a case onto one grid"
            )
        bad = non_finite(arr)
        if bad:
            raise DataError(non_finite_message(path, bad, arr.size, NON_FINITE_FIX))
        channels.append(arr)
    dtype = np.result_type(*[c.dtype for c in channels])
    return np.stack([c.astype(dtype, copy=False) for c in channels]), label, affine
