"""Reading one case (image + label) with MONAI readers, and checking it.

Shared by :mod:`fedseg.data.loading` (which raises on the first bad case) and
:mod:`fedseg.data.validate` (which reports every problem).

Array conventions
-----------------
* 2D files (PNG/JPG/BMP/TIFF) are read with ``PILReader(reverse_indexing=False)``
  so arrays are (H, W) or (H, W, C) exactly as PIL/numpy see them (MONAI's
  default would transpose to (W, H)).
* NIfTI files are read with ``NibabelReader`` as stored: (X, Y, Z) or
  (X, Y, Z, C).
* Images are returned channel-first (C, *spatial) in their file dtype; labels
  as (*spatial) int64.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fedseg.data.spec import FederationSpec

if TYPE_CHECKING:  # pragma: no cover
    from monai.data import ImageReader

PIL_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff")
NIFTI_SUFFIXES = (".nii", ".nii.gz")


@dataclass(frozen=True)
class Issue:
    """One thing wrong with one file. ``fatal`` issues make the case unloadable."""

    file: str
    message: str
    fix: str
    fatal: bool = True


@dataclass
class Case:
    """A case as read from disk.

    Attributes
    ----------
    image : np.ndarray
        (C, *spatial), file dtype.
    label : np.ndarray
        (*spatial), int64 label-file values.
    """

    image: np.ndarray
    label: np.ndarray


@cache
def _reader(kind: str) -> ImageReader:
    # MONAI is imported when a file is first read (importing it costs seconds and pulls in matplotlib).  The
    # reader is called directly, not through ``LoadImage``: LoadImage builds every reader MONAI has (its DICOM
    # readers among them, which warn on every construction where nvImageCodec is absent) and, when the one
    # asked for fails, tries all the others and reports each one's traceback.
    from monai.data import NibabelReader, PILReader

    return PILReader(reverse_indexing=False) if kind == "pil" else NibabelReader()


def read_array(path: str | Path) -> np.ndarray:
    """Read an image file into a numpy array in its stored dtype.

    Returns (H, W) / (H, W, C) for 2D formats, (X, Y, Z) / (X, Y, Z, C) for NIfTI.
    Raises ValueError for an unsupported suffix; the reader's own error (one exception) for a file it
    cannot read.
    """
    name = str(path).lower()
    if name.endswith(NIFTI_SUFFIXES):
        kind = "nifti"
    elif name.endswith(PIL_SUFFIXES):
        kind = "pil"
    else:
        raise ValueError(f"unsupported file type (use one of {PIL_SUFFIXES + NIFTI_SUFFIXES})")
    reader = _reader(kind)
    with warnings.catch_warnings():  # MONAI wraps PIL's read-only buffer; we copy below
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        array, _ = reader.get_data(reader.read(str(path)))
    return np.array(array, copy=True)


def non_finite(array: np.ndarray) -> int:
    """How many values of ``array`` are NaN or infinite (0 for an integer array)."""
    if array.dtype.kind not in "fc":
        return 0
    return int(array.size - np.count_nonzero(np.isfinite(array)))


def non_finite_message(path: str | Path, count: int, total: int, fix: str) -> str:
    """One error line for an image with ``count`` NaN or infinite values of ``total``: the file, the count
    and ``fix``."""
    every = " (every one)" if count == total else ""
    return f"{path}: {count:,} of {total:,} voxels are NaN or infinite{every} -> {fix}"


NON_FINITE_FIX = "replace them (e.g. with the background value) and save the image again, or remove the case"
"""What to do about a training or validation image with NaN or infinite values."""


def _file_dims(mode: str) -> int:
    return 2 if mode == "2d" else 3


def _image_channels_first(arr: np.ndarray, mode: str) -> np.ndarray | None:
    nd = _file_dims(mode)
    if arr.ndim == nd:
        return arr[None]
    if arr.ndim == nd + 1:
        return np.moveaxis(arr, -1, 0)
    return None


def _label_array(arr: np.ndarray, mode: str) -> np.ndarray | None:
    nd = _file_dims(mode)
    if arr.ndim == nd + 1 and arr.shape[-1] == 1:
        arr = arr[..., 0]
    return arr if arr.ndim == nd else None


def check_case(fed: FederationSpec, image_path: Path, label_path: Path) -> tuple[Case | None, list[Issue]]:
    """Read one image/label pair and list everything wrong with it.

    Parameters
    ----------
    fed : FederationSpec
        Gives mode, in_channels and the declared label values.
    image_path, label_path : Path
        Absolute paths of the two files.

    Returns
    -------
    case : Case or None
        The arrays, or None when a fatal issue prevents using the case.
    issues : list of Issue
        Empty when the case is clean. A constant image is a non-fatal issue.
    """
    issues: list[Issue] = []
    img_f, lab_f = str(image_path), str(label_path)
    for f in (img_f, lab_f):
        if not Path(f).is_file():
            issues.append(
                Issue(
                    f,
                    "file listed in the datalist does not exist",
                    "fix the path in the datalist (relative to the datalist's folder) or add the file",
                )
            )
    if issues:
        return None, issues
    arrays = {}
    for f in (img_f, lab_f):
        try:
            arrays[f] = read_array(f)
        except Exception as e:  # reader errors are varied; report them all the same way
            issues.append(
                Issue(f, f"cannot be read ({type(e).__name__}: {e})", "re-save it as PNG (2D) or NIfTI (.nii.gz)")
            )
    if issues:
        return None, issues
    dims = "2D" if fed.mode == "2d" else "3D"
    image = _image_channels_first(arrays[img_f], fed.mode)
    label = _label_array(arrays[lab_f], fed.mode)
    if image is None:
        issues.append(
            Issue(
                img_f,
                f"image has shape {arrays[img_f].shape}, not a {dims} image as mode {fed.mode!r} needs",
                f"store {dims} images or change data.mode",
            )
        )
    elif image.shape[0] != fed.in_channels:
        kind = {1: "grey", 3: "RGB", 4: "RGBA"}.get(image.shape[0], f"{image.shape[0]}-channel")
        issues.append(
            Issue(
                img_f,
                f"image is {kind} ({image.shape[0]} channels) but in_channels = {fed.in_channels}",
                f"convert the image to {fed.in_channels} channel(s) or set data.in_channels to match",
            )
        )
    if label is None:
        issues.append(
            Issue(
                lab_f,
                f"label has shape {arrays[lab_f].shape}, not a single-channel {dims} integer label map",
                "save the label as one channel of integer class values",
            )
        )
    if issues or image is None or label is None:  # either None has its issue
        return None, issues

    bad = non_finite(image)
    if bad:
        message, _, fix = non_finite_message(img_f, bad, image.size, NON_FINITE_FIX).partition(" -> ")
        issues.append(Issue(img_f, message[len(img_f) + 2 :], fix))
    elif image.size and image.min() == image.max():
        issues.append(
            Issue(
                img_f,
                f"image is constant (every value {image.flat[0]})",
                "check the file is not blank; remove it from the datalist if so",
                fatal=False,
            )
        )
    if label.dtype.kind == "f" and not (np.isfinite(label).all() and (label == np.round(label)).all()):
        issues.append(Issue(lab_f, "label has non-integer values", "save the label with integer class values"))
    else:
        label = label.astype(np.int64)
        extra = sorted(set(np.unique(label).tolist()) - fed.label_values)
        if extra:
            issues.append(
                Issue(
                    lab_f,
                    f"label values {extra[:10]} are not 0 or a value declared in [data.labels] {dict(fed.labels)}",
                    "declare the value in [data.labels] or re-save the mask as 0/1",
                )
            )
    if image.shape[1:] != label.shape:
        issues.append(
            Issue(
                lab_f,
                f"label shape {label.shape} differs from image shape {image.shape[1:]} ({img_f})",
                "save image and label at the same size",
            )
        )
    if any(i.fatal for i in issues):
        return None, issues
    return Case(image=image, label=label), issues
