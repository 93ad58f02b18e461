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
    from monai.transforms import LoadImage

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
def _loader(kind: str) -> LoadImage:
    # MONAI is imported when a file is first read (importing it costs seconds and pulls in matplotlib)
    from monai.data import NibabelReader, PILReader
    from monai.transforms import LoadImage

    reader = PILReader(reverse_indexing=False) if kind == "pil" else NibabelReader()
    return LoadImage(image_only=True, reader=reader, dtype=None)


def read_array(path: str | Path) -> np.ndarray:
    """Read an image file into a numpy array in its stored dtype.

    Returns (H, W) / (H, W, C) for 2D formats, (X, Y, Z) / (X, Y, Z, C) for NIfTI.
    Raises ValueError for an unsupported suffix; reader errors propagate.
    """
    name = str(path).lower()
    if name.endswith(NIFTI_SUFFIXES):
        kind = "nifti"
    elif name.endswith(PIL_SUFFIXES):
        kind = "pil"
    else:
        raise ValueError(f"unsupported file type (use one of {PIL_SUFFIXES + NIFTI_SUFFIXES})")
    with warnings.catch_warnings():  # MONAI wraps PIL's read-only buffer; we copy below
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return _loader(kind)(str(path)).as_tensor().numpy().copy()


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

    if image.dtype.kind == "f" and not np.isfinite(image).all():
        issues.append(
            Issue(img_f, "image contains NaN or infinite values", "replace them (e.g. with 0) and re-save the image")
        )
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
