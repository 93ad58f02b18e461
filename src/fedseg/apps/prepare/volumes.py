"""Reading the releases' volumes: DICOM series checked slice by slice, labels placed by their headers.

* :func:`read_series` reads a DICOM series with SimpleITK (slices sorted by position) and names the
  file at fault when a slice file cannot be read or a slice is missing (a gap in the positions).
* :func:`align_label` puts a label on its image's voxel grid using the label's own header: it may
  be stored in another axis order (permutations and flips, ``SimpleITK.DICOMOrient``), but its
  origin, spacing and direction must then equal the image's within :data:`POSITION_TOLERANCE` /
  :data:`DIRECTION_TOLERANCE` (nnU-Net's dataset check compares origin, spacing and direction the
  same way); otherwise it raises naming the label and what differs. A label is never re-stamped
  with its image's geometry.
* :func:`compact` stores integer volumes in the smallest of uint16 / int16 / int32 that holds
  their values (GDCM widens unsigned series with a rescale to int32).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedseg.apps.prepare.base import require
from fedseg.foundation.errors import DataError

#: Origins agree when they differ by at most this share of the smallest voxel spacing (per axis).
POSITION_TOLERANCE = 0.01
#: Direction cosines and relative spacings agree within this.
DIRECTION_TOLERANCE = 1e-3
#: A gap between consecutive slice positions larger than this many times the median gap is a missing slice.
GAP_FACTOR = 1.5


def _sitk(title: str) -> Any:
    return require("SimpleITK", title)


@dataclass
class Series:
    """A DICOM series read by :func:`read_series`.

    Attributes
    ----------
    image : SimpleITK.Image
        The volume, slices sorted by position along the slice normal.
    files : list of str
        The slice files in that order.
    instance_numbers : list of int or None
        Each slice's InstanceNumber (0020,0013) in that order; None for a slice without one.
    """

    image: Any
    files: list[str]
    instance_numbers: list[int | None]


def _series_dirs(folder: Path) -> list[Path]:
    return sorted(Path(d) for d, _, names in os.walk(folder) if any(not n.startswith(".") for n in names))


def _check_slices(reader: Any, names: list[str], folder: Path) -> list[int | None]:
    """Each slice's InstanceNumber; DataError naming the files around a gap in the slice positions."""
    numbers: list[int | None] = []
    positions = []
    for i in range(len(names)):
        number = reader.GetMetaData(i, "0020|0013").strip() if reader.HasMetaDataKey(i, "0020|0013") else ""
        try:
            numbers.append(int(float(number)))
        except ValueError:
            numbers.append(None)
        if reader.HasMetaDataKey(i, "0020|0032"):
            positions.append([float(v) for v in reader.GetMetaData(i, "0020|0032").split("\\")])
    if len(positions) == len(names) >= 3:
        pos = np.asarray(positions)
        steps = np.linalg.norm(np.diff(pos, axis=0), axis=1)
        median = float(np.median(steps))
        for i, step in enumerate(steps):
            if median > 0 and step > GAP_FACTOR * median:
                raise DataError(
                    f"{folder}: a slice is missing between {Path(names[i]).name} and {Path(names[i + 1]).name} "
                    f"(positions {step:.3g} mm apart, the series' slices {median:.3g} mm) "
                    "-> download the series again (its slice count should match the archive's)"
                )
            if step < 1e-3 * max(median, 1e-6):
                raise DataError(
                    f"{folder}: {Path(names[i]).name} and {Path(names[i + 1]).name} lie at the same position "
                    "-> remove the duplicate slice file"
                )
    return numbers


def read_series(
    folder: Path, title: str, want: tuple[int, ...] | None = None, series: set[str] | None = None
) -> Series:
    """The DICOM series under ``folder`` (any depth); with several series, the one whose size (x, y, z) is
    ``want`` in some axis order (e.g. its mask's), else the one with the most slices. A slice file that
    belongs to no readable series (truncated, corrupt) or a gap in the slice positions raises DataError
    naming the file.
    ``series``: only the series with these SeriesInstanceUIDs (e.g. those a DICOM-SEG references)."""
    sitk = _sitk(title)
    found = []
    unread = []
    for d in _series_dirs(folder):
        listed: set[str] = set()
        for sid in sitk.ImageSeriesReader.GetGDCMSeriesIDs(str(d)) or ():
            names = sitk.ImageSeriesReader.GetGDCMSeriesFileNames(str(d), sid)
            if not series or sid in series:
                found.append(names)
            listed |= {str(Path(n).resolve()) for n in names}
        unread += [p for p in sorted(d.iterdir()) if _slice_file(p) and str(p.resolve()) not in listed]
    if unread:
        raise DataError(
            f"{unread[0]}: not a readable DICOM slice (truncated or corrupt)"
            + (f", and {len(unread) - 1} more in {folder}" if len(unread) > 1 else "")
            + " -> download the series again"
        )
    if not found and series:
        raise DataError(
            f"{folder}: none of the DICOM series {sorted(series)[:3]} found -> download the referenced series there"
        )
    if not found:
        raise DataError(f"{folder}: no DICOM series found -> check that the DICOM files were unpacked there")
    sizes = []
    for names in sorted(found, key=len, reverse=True):
        reader = sitk.ImageSeriesReader()
        reader.SetFileNames(names)
        reader.MetaDataDictionaryArrayUpdateOn()
        try:
            image = reader.Execute()
        except RuntimeError as e:
            raise DataError(
                f"{folder}: the series cannot be read ({str(e).strip()[-200:]}) -> download it again"
            ) from e
        if want is None or sorted(image.GetSize()) == sorted(want):
            numbers = _check_slices(reader, list(names), folder)
            return Series(compact(image, title), list(names), numbers)
        sizes.append(f"{tuple(image.GetSize())}{_number_gaps(reader, len(names))}")
    found_text = "; ".join(sizes)
    raise DataError(
        f"{folder}: no DICOM series of size {tuple(want or ())} (the mask's); found {found_text} -> check the case's "
        "files (a slice file missing from the download makes a series one slice short)"
    )


def _slice_file(p: Path) -> bool:
    """A file that should be a slice of a series: ``.dcm``/``.ima`` or no suffix, not hidden, not a DICOMDIR."""
    return (
        p.is_file()
        and p.suffix.lower() in (".dcm", ".ima", "")
        and not p.name.startswith(".")
        and p.name.upper() != "DICOMDIR"
    )


def _number_gaps(reader: Any, n: int) -> str:
    """ " (InstanceNumber k missing)" when the slices' InstanceNumbers skip some between their first and last."""
    numbers = []
    for i in range(n):
        if not reader.HasMetaDataKey(i, "0020|0013"):
            return ""
        try:
            numbers.append(int(float(reader.GetMetaData(i, "0020|0013"))))
        except ValueError:
            return ""
    missing = sorted(set(range(min(numbers), max(numbers) + 1)) - set(numbers)) if numbers else []
    return f" (InstanceNumber {', '.join(map(str, missing[:5]))} missing)" if missing else ""


def compact(image: Any, title: str) -> Any:
    """``image`` cast to the smallest of uint16, int16, int32 holding its values, if they are integers
    (unchanged otherwise): an unsigned series stays unsigned; a rescaled CT becomes int16."""
    sitk = _sitk(title)
    arr = sitk.GetArrayViewFromImage(image)
    if arr.dtype.kind not in "iu" or arr.size == 0:
        return image
    lo, hi = int(arr.min()), int(arr.max())
    for pixel, info in ((sitk.sitkUInt16, np.iinfo(np.uint16)), (sitk.sitkInt16, np.iinfo(np.int16))):
        if info.min <= lo and hi <= info.max:
            return image if image.GetPixelID() == pixel else sitk.Cast(image, pixel)
    return image


def _orientation(image: Any, title: str) -> str:
    sitk = _sitk(title)
    return sitk.DICOMOrientImageFilter.GetOrientationFromDirectionCosines(image.GetDirection())


def geometry_text(image: Any) -> str:
    fmt = lambda v: "(" + ", ".join(f"{x:.4g}" for x in v) + ")"  # noqa: E731
    return (
        f"size {tuple(image.GetSize())}, origin {fmt(image.GetOrigin())}, spacing {fmt(image.GetSpacing())}, "
        f"direction {fmt(image.GetDirection())}"
    )


def align_label(label: Any, image: Any, path: Path, title: str, lenient: bool = False) -> tuple[Any, str]:
    """``label`` on ``image``'s voxel grid, by the label's own header, and a note ("" or how it was stored).

    The label may be stored in another axis order than the image (permutations and flips): it is
    reoriented to the image's (``SimpleITK.DICOMOrient``, no resampling). Then its size must equal
    the image's, its spacing and direction cosines agree within :data:`DIRECTION_TOLERANCE` and its
    origin within :data:`POSITION_TOLERANCE` of a voxel; otherwise DataError names ``path`` and both
    geometries. The result carries the image's geometry exactly (they agreed within tolerance).
    ``lenient`` (releases whose label headers are not documented to match their images: TCIA
    Pancreas-CT, PROMISE12) places a label of the right size that disagrees voxel for voxel after the
    reorientation, and says so in the note instead of raising."""
    sitk = _sitk(title)
    if label.GetDimension() != image.GetDimension():
        raise DataError(
            f"{path}: label is {label.GetDimension()}D, its image {image.GetDimension()}D -> check the pair"
        )
    code, own = _orientation(image, title), _orientation(label, title)
    note = ""
    if own != code:
        label = sitk.DICOMOrient(label, code)
        note = f"{path.name}: label stored in {own} axis order, reoriented to its image's {code} (no resampling)"
    if tuple(label.GetSize()) != tuple(image.GetSize()):
        raise DataError(
            f"{path}: label size {tuple(label.GetSize())} (in the image's axis order) differs from its image's "
            f"{tuple(image.GetSize())} -> check that the label belongs to the image; an image with fewer slices "
            "than its label has slice files missing from the download"
        )
    spacing = np.asarray(image.GetSpacing())
    ok = (
        np.allclose(label.GetSpacing(), spacing, rtol=DIRECTION_TOLERANCE, atol=0)
        and np.allclose(label.GetDirection(), image.GetDirection(), rtol=0, atol=DIRECTION_TOLERANCE)
        and np.allclose(label.GetOrigin(), image.GetOrigin(), rtol=0, atol=POSITION_TOLERANCE * spacing.min())
    )
    if not ok and lenient:
        note = "; ".join(
            filter(
                None,
                (
                    note,
                    f"{path.name}: label header ({geometry_text(label)}) is not its image's; placed voxel for voxel",
                ),
            )
        )
    elif not ok:
        raise DataError(
            f"{path}: the label's header does not place it on its image: label {geometry_text(label)}; "
            f"image {geometry_text(image)} -> check that the label belongs to the image and that neither header was "
            "edited (fedseg does not re-stamp a label with its image's geometry)"
        )
    label = sitk.Image(label)
    label.CopyInformation(image)
    return label, note
