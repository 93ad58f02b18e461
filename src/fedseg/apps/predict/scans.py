"""The scans ``fedseg predict`` reads and the masks it writes, each in its input's format and geometry.

* 2D files (PNG/JPG/BMP/TIFF, NIfTI slices) as :func:`fedseg.data.readers.read_array` reads a federation's
  images; masks as PNG at the input's size (NIfTI inputs: NIfTI with the input's affine and header).
* Volumes: NIfTI with its affine (:func:`fedseg.data.volumes.geometry.read_volume`); any other file
  SimpleITK reads (``.mha``, ``.nrrd``…) and a folder of one DICOM series, with SimpleITK's geometry turned
  into a RAS affine.  Masks: NIfTI for NIfTI and DICOM inputs, SimpleITK's writer in the input's own format
  and geometry otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import hashlib
import json
import locale
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from fedseg.data.readers import NIFTI_SUFFIXES, PIL_SUFFIXES, non_finite, non_finite_message, read_array
from fedseg.data.volumes.geometry import read_volume
from fedseg.foundation.errors import DataError

__all__ = [
    "Scan",
    "find_inputs",
    "input_sha256",
    "kind_of",
    "mask_path",
    "read_scan",
    "write_mask",
    "write_probabilities",
]

SITK_SUFFIXES = (".mha", ".mhd", ".nrrd", ".nhdr")
_LPS_TO_RAS = np.diag([-1.0, -1.0, 1.0, 1.0])


@dataclasses.dataclass
class Scan:
    """One input: its array channels-first ``(C, *spatial)`` in file units and what its mask keeps of it."""

    path: Path
    image: np.ndarray
    kind: str
    """``"pil"``, ``"nifti"``, ``"sitk"`` or ``"dicom"``."""
    affine: np.ndarray | None = None
    header: Any = None
    sitk_image: Any = None
    replaced: int = 0
    """NaN or infinite values replaced under ``nan_to_num`` (0: none were there)."""


def _is_dicom_folder(p: Path) -> bool:
    return p.is_dir() and any(f.suffix.lower() == ".dcm" for f in p.iterdir() if f.is_file())


def _datalist(p: Path) -> dict[str, Any]:
    try:
        lists = json.loads(p.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{p}: not a JSON datalist ({e}) -> give image files, folders or a datalist") from None
    if not isinstance(lists, dict):
        raise DataError(f"{p}: not a datalist (a JSON object of splits) -> give image files, folders or a datalist")
    return lists


def _check_split(p: Path, lists: dict[str, Any], split: str) -> None:
    """One error naming the datalist's splits (and the closest) when ``split`` is not one of them."""
    names = [k for k, v in lists.items() if isinstance(v, list)]
    if split in names:
        return
    close = difflib.get_close_matches(split, names, n=1, cutoff=0.3)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise DataError(
        f"--split {split!r} is not a split of {p}, whose splits are {', '.join(names) or 'none'}{hint} -> "
        f"give one of them{' (--split ' + close[0] + ')' if close else ''}"
    )


def find_inputs(paths: list[str | Path], split: str | None = None) -> Iterator[tuple[Path, str]]:
    """``(input, name)`` for every scan the given paths name: files; folders (their image files, sorted, and
    each sub-folder holding one DICOM series); datalists (``.json``: the images of every split, or of
    ``split``; labels ignored).  ``name`` is the mask's path relative to ``--out``.

    A ``split`` no datalist has (or given without a datalist) is one error naming the splits there are."""
    lists_of = {Path(p): _datalist(Path(p)) for p in paths if Path(p).suffix.lower() == ".json" and Path(p).is_file()}
    if split is not None:
        if not lists_of:
            raise DataError(f"--split {split!r} selects a split of a datalist, and --input names none -> drop --split")
        for p, lists in lists_of.items():
            _check_split(p, lists, split)
    for raw in paths:
        p = Path(raw)
        if p in lists_of:
            for key, entries in lists_of[p].items():
                if split is not None and key != split:
                    continue
                for entry in entries if isinstance(entries, list) else []:
                    img = entry.get("image") if isinstance(entry, dict) else entry
                    if not isinstance(img, str):
                        continue
                    f = Path(img) if Path(img).is_absolute() else p.parent / img
                    yield f, Path(img).as_posix() if not Path(img).is_absolute() else f.name
        elif _is_dicom_folder(p):
            yield p, p.name
        elif p.is_dir():
            for f in sorted(p.rglob("*")):
                if f.is_file() and not _is_dicom_folder(f.parent) and f.suffix.lower() != ".json":
                    yield f, f.relative_to(p).as_posix()
                elif f.is_dir() and _is_dicom_folder(f):
                    yield f, f.relative_to(p).as_posix()
        else:
            yield p, p.name


def input_sha256(path: Path) -> str:
    """SHA-256 of an input's bytes; of a DICOM series folder, of each file's name and bytes in name order."""
    h = hashlib.sha256()
    files = sorted(f for f in path.iterdir() if f.is_file()) if path.is_dir() else [path]
    for f in files:
        if path.is_dir():
            h.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(2**20), b""):
                h.update(block)
    return h.hexdigest()


def _channels_first(arr: np.ndarray, dims: int, path: Path, in_channels: int, what: str) -> np.ndarray:
    if arr.ndim == dims:
        arr = arr[None]
    elif arr.ndim == dims + 1:
        arr = np.moveaxis(arr, -1, 0)
    else:
        raise DataError(
            f"{path}: has shape {arr.shape}, not {what} as this run's model takes -> give {what} "
            "(one scan per file; split a 4D series)"
        )
    if arr.shape[0] != in_channels:
        if in_channels == 1 and arr.shape[0] in (3, 4) and dims == 2:
            raise DataError(f"{path}: is a colour image but the run's model takes grey images -> save it as grey")
        raise DataError(
            f"{path}: has {arr.shape[0]} channel(s) but the run's model takes {in_channels} -> give images with the "
            f"channels of the run's federation (data.in_channels = {in_channels})"
        )
    return arr


@contextlib.contextmanager
def _keep_locale() -> Iterator[None]:
    """SimpleITK's DICOM reader (GDCM) sets the C locale of the process; restored after it, so that Python's
    text files keep their encoding."""
    saved = locale.setlocale(locale.LC_ALL)
    try:
        yield
    finally:
        locale.setlocale(locale.LC_ALL, saved)


def _sitk_read(path: Path) -> tuple[np.ndarray, np.ndarray, Any]:
    with _keep_locale():
        return _sitk_read_here(path)


def _sitk_read_here(path: Path) -> tuple[np.ndarray, np.ndarray, Any]:
    import SimpleITK as sitk  # the prepare extra's reader, deferred

    if path.is_dir():
        reader = sitk.ImageSeriesReader()
        ids = reader.GetGDCMSeriesIDs(str(path))
        if len(ids) != 1:
            raise DataError(f"{path}: holds {len(ids)} DICOM series -> give a folder of exactly one series")
        reader.SetFileNames(reader.GetGDCMSeriesFileNames(str(path), ids[0]))
        img = reader.Execute()
    else:
        img = sitk.ReadImage(str(path))
    arr = sitk.GetArrayFromImage(img)  # (Z, Y, X) or (Z, Y, X, C)
    arr = arr.transpose(2, 1, 0, 3) if arr.ndim == 4 else arr.transpose(2, 1, 0)  # (X, Y, Z[, C])
    d = np.asarray(img.GetDirection(), dtype=np.float64).reshape(3, 3)
    lps = np.eye(4)
    lps[:3, :3] = d * np.asarray(img.GetSpacing(), dtype=np.float64)
    lps[:3, 3] = img.GetOrigin()
    return arr, _LPS_TO_RAS @ lps, img


NON_FINITE_FIX = (
    "replace them (e.g. with the background value) and save the scan again, or predict with --nan-to-num VALUE"
)


def read_scan(path: Path, mode: str, in_channels: int, nan_to_num: float | None = None) -> Scan:
    """Read one input for a run of data ``mode`` with ``in_channels`` channels.

    An unreadable file raises ``OSError``/``ValueError`` (listed and skipped in a folder); a readable file that
    cannot match the run (dimensions, channels) raises one :class:`DataError` naming the file and the fix, and
    so does one with NaN or infinite values, unless ``nan_to_num`` gives the value that replaces them
    (:attr:`Scan.replaced` counts them)."""
    scan = _read_scan(path, mode, in_channels)
    bad = non_finite(scan.image)
    if bad:
        if nan_to_num is None:
            raise DataError(non_finite_message(path, bad, scan.image.size, NON_FINITE_FIX))
        v = float(nan_to_num)
        scan.image = np.nan_to_num(scan.image, nan=v, posinf=v, neginf=v)
        scan.replaced = bad
    return scan


def _read_scan(path: Path, mode: str, in_channels: int) -> Scan:
    name = path.name.lower()
    volumes = mode in ("3d", "patches2d")
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if volumes:
        if name.endswith(NIFTI_SUFFIXES):
            try:
                arr, affine = read_volume(path)
            except DataError as e:
                if "dimensions" in str(e):
                    raise
                raise OSError(str(e)) from None
            import nibabel as nib

            header = nib.load(str(path)).header
            return Scan(path, _channels_first(arr, 3, path, in_channels, "a 3D volume"), "nifti", affine, header)
        arr, affine, img = _sitk_read(path)
        return Scan(
            path,
            _channels_first(arr, 3, path, in_channels, "a 3D volume"),
            "dicom" if path.is_dir() else "sitk",
            affine,
            sitk_image=img,
        )
    if not name.endswith(NIFTI_SUFFIXES + PIL_SUFFIXES):
        raise ValueError(
            f"{path}: not an image file fedseg reads in mode {mode!r} (use {PIL_SUFFIXES + NIFTI_SUFFIXES})"
        )
    arr = read_array(path)
    dims, what = (3, "a 3D NIfTI of 2D slices") if mode == "slices" else (2, "a 2D image")
    if name.endswith(NIFTI_SUFFIXES):
        import nibabel as nib

        nimg: Any = nib.load(str(path))
        if mode == "2d" and arr.ndim >= 3 and arr.shape[-1] != in_channels and arr.shape[-1] != 1:
            raise DataError(
                f"{path}: is a volume of shape {arr.shape}, but this run's model segments 2D images of {in_channels} "
                "channel(s) -> give 2D images, or predict with a run on a volume federation"
            )
        if mode == "2d" and arr.ndim == 3 and arr.shape[-1] == 1 and in_channels != 1:
            arr = arr[..., 0]
        if mode == "2d" and arr.ndim == 3 and in_channels == 1 and arr.shape[-1] == 1:
            arr = arr[..., 0]
        return Scan(path, _channels_first(arr, dims, path, in_channels, what), "nifti", nimg.affine, nimg.header)
    if mode == "slices":
        raise DataError(f"{path}: a 2D picture, but this run segments slices of NIfTI volumes -> give .nii.gz files")
    if arr.ndim == 3 and in_channels == 1 and arr.shape[-1] == 1:
        arr = arr[..., 0]
    if arr.ndim == 3 and in_channels == 3 and arr.shape[-1] == 4:  # RGBA: the alpha channel carries no image
        arr = arr[..., :3]
    return Scan(path, _channels_first(arr, 2, path, in_channels, what), "pil")


def _stem(name: str) -> str:
    low = name.lower()
    for suf in sorted(NIFTI_SUFFIXES + PIL_SUFFIXES + SITK_SUFFIXES, key=len, reverse=True):
        if low.endswith(suf):
            return name[: -len(suf)]
    return name


def kind_of(path: Path) -> str:
    """The reader of an input: ``"pil"``, ``"nifti"``, ``"dicom"`` (a folder) or ``"sitk"``."""
    low = path.name.lower()
    if path.is_dir():
        return "dicom"
    if low.endswith(PIL_SUFFIXES):
        return "pil"
    return "nifti" if low.endswith(NIFTI_SUFFIXES) else "sitk"


def mask_path(out: Path, name: str, kind: str, source: Path) -> Path:
    """Where the mask of input ``name`` goes: PNG for pictures, NIfTI for NIfTI and DICOM, the input's own
    format for other SimpleITK files."""
    stem = _stem(name)
    if kind == "pil":
        return out / f"{stem}.png"
    if kind == "sitk":
        low = source.name.lower()
        suffix = next((s for s in SITK_SUFFIXES if low.endswith(s)), ".mha")
        return out / f"{stem}{suffix if suffix not in ('.mhd', '.nhdr') else '.mha'}"
    return out / (stem + (".nii" if name.lower().endswith(".nii") else ".nii.gz"))


def write_mask(path: Path, labels: np.ndarray, scan: Scan) -> None:
    """Write the label map ``labels`` (the input's spatial shape) in the input's format and geometry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    dtype = np.uint8 if labels.max(initial=0) < 256 else np.int16
    data = labels.astype(dtype)
    if scan.kind == "pil":
        from PIL import Image

        Image.fromarray(data).save(path)
        return
    if scan.kind == "sitk":
        import SimpleITK as sitk

        img = sitk.GetImageFromArray(data.transpose(tuple(range(data.ndim))[::-1]))
        img.SetOrigin(scan.sitk_image.GetOrigin())
        img.SetSpacing(scan.sitk_image.GetSpacing())
        img.SetDirection(scan.sitk_image.GetDirection())
        with _keep_locale():
            sitk.WriteImage(img, str(path), useCompression=True)
        return
    import nibabel as nib

    header = scan.header.copy() if scan.header is not None else None
    nifti = nib.Nifti1Image(data, scan.affine, header=header)
    nifti.header.set_data_dtype(dtype)
    nifti.header.set_slope_inter(1.0, 0.0)
    if header is not None:
        nifti.set_qform(scan.affine, code=int(header["qform_code"]) or 1)
        nifti.set_sform(scan.affine, code=int(header["sform_code"]) or 1)
    nib.save(nifti, str(path))


def write_probabilities(path: Path, probs: np.ndarray) -> None:
    """Per-channel probabilities ``(L, *input spatial)`` as float16 ``.npy`` (no pickle)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, probs.astype(np.float16), allow_pickle=False)
