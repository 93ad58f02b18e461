"""The six prostate MR datasets of FedSM's prostate federation (Table 2): readers and slicing.

Every reader gives a T2-weighted volume and a prostate mask on the same voxel grid (SimpleITK
reads DICOM series, NIfTI, NRRD and MHD; highdicom reads ProstateX's DICOM-SEG). Then, as NVIDIA
FLARE's 2D prostate preparation does, :func:`slices` keeps the axial slices whose mask has
foreground and writes each once: the intensity is ``clip(v / 2048, 0, 1) × 255`` as 8-bit grey
(:data:`INTENSITY_MAX`), the label 1 for prostate. Volumes are first put into the LPS
orientation by axis permutations and flips only (``SimpleITK.DICOMOrient``, no resampling), so
every slice is seen as a radiologist sees it (anterior up, the patient's right on the left) —
the orientation NVIDIA FLARE's 2D slices have.

Per dataset (docs/datasets.md): I2CVB masks are DICOM series, any non-zero voxel is prostate;
MSD Task05 images are 4D with T2 first (channel 0 is taken) and labels 1 (peripheral zone) and
2 (transition zone) are merged; NCI-ISBI masks are NRRD with the same two zones, placed on the
DICOM series by their header's geometry, or by InstanceNumber where the header has none (see
:func:`_nci_convert`); PROMISE12 is MetaImage (0/1); ProstateX masks are DICOM-SEG with four
zone segments merged into one, the urethra segment only where a zone is on the slice. MSD labels
are placed by their own headers (:func:`~fedseg.apps.prepare.volumes.align_label`): one that does
not lie on its image's grid is refused, not re-stamped; a PROMISE12 segmentation whose header
differs from its image's is placed voxel for voxel, with a note.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from fedseg.apps.prepare.base import (
    Case,
    Dataset,
    Unit,
    all_files,
    check_values,
    files,
    image_beside,
    note,
    require,
    safe_id,
)
from fedseg.apps.prepare.volumes import align_label, read_series
from fedseg.foundation.errors import DataError

__all__ = ["DATASETS", "INTENSITY_MAX", "read_series", "slices"]

#: Intensities are divided by this and clipped to [0, 1] before 8-bit quantization (NVIDIA FLARE's
#: prostate 2D conversion).
INTENSITY_MAX = 2048.0
#: ProstateX zone segment that counts only on slices where another segment is present (NVIDIA
#: FLARE's label combination: the distal prostatic urethra).
URETHRA_SEGMENT = 3
SITK = ("SimpleITK",)


def _sitk(title: str) -> Any:
    return require("SimpleITK", title)


def slices(image: Any, mask: Any, title: str) -> list[Unit]:
    """Axial slices with foreground of (image, mask), both SimpleITK images on one grid: LPS-oriented,
    image ``clip(v / INTENSITY_MAX, 0, 1) × 255`` as uint8, label ``mask > 0`` as uint8."""
    sitk = _sitk(title)
    if tuple(image.GetSize()) != tuple(mask.GetSize()):
        raise DataError(f"image size {image.GetSize()} differs from mask size {mask.GetSize()} -> check the case")
    mask.CopyInformation(image)
    img = sitk.GetArrayFromImage(sitk.DICOMOrient(image, "LPS")).astype(np.float64)
    lab = sitk.GetArrayFromImage(sitk.DICOMOrient(mask, "LPS")) > 0
    if not np.isfinite(img).all():
        raise DataError("image has NaN or infinite values -> re-export the volume")
    grey = np.rint(np.clip(img / INTENSITY_MAX, 0.0, 1.0) * 255).astype(np.uint8)
    return [(f"{z:03d}", grey[z], lab[z].astype(np.uint8)) for z in range(lab.shape[0]) if lab[z].any()]


def _from_array(arr: np.ndarray, like: Any, title: str) -> Any:
    sitk = _sitk(title)
    out = sitk.GetImageFromArray(np.ascontiguousarray(arr.astype(np.uint8)))
    out.CopyInformation(like)
    return out


# --- I2CVB -------------------------------------------------------------------------------------


def _i2cvb_discover(root: Path, ds: Dataset) -> list[Case]:
    cases = []
    for vendor in ("GE", "Siemens"):
        base = root / vendor
        if not base.is_dir():
            raise ds.missing(root, base)
        for patient in sorted(p for p in base.iterdir() if p.is_dir()):
            t2, gt = patient / "T2W", patient / "GT" / "prostate"
            cid = safe_id(patient.name)
            cases.append(Case(cid, cid, tuple(p for d in (t2, gt) for p in all_files(d)), {"t2": t2, "gt": gt}))
    return cases


def _i2cvb_convert(case: Case) -> list[Unit]:
    for key in ("t2", "gt"):
        if not all_files(case.info[key]):
            raise DataError(f"{case.info[key]}: folder missing or empty -> unpack the patient's T2W and GT/prostate")
    image = read_series(case.info["t2"], "I2CVB").image
    mask = read_series(case.info["gt"], "I2CVB").image
    sitk = _sitk("I2CVB")
    arr = sitk.GetArrayFromImage(mask)
    return slices(image, _from_array(arr > 0, mask, "I2CVB"), "I2CVB")


# --- MSD Task05 --------------------------------------------------------------------------------


def _msd_discover(root: Path, ds: Dataset) -> list[Case]:
    images, labels = root / "Task05_Prostate" / "imagesTr", root / "Task05_Prostate" / "labelsTr"
    for folder in (images, labels):
        if not folder.is_dir():
            raise ds.missing(root, folder)
    cases = []
    found = files(images, (".gz", ".nii"))
    for path in found:
        cid = safe_id(path.name.split(".")[0])
        cases.append(Case(cid, cid, (path, labels / path.name)))
    names = {p.name for p in found}
    for lab in files(labels, (".gz", ".nii")):
        if lab.name not in names:  # a label whose image is missing: reported
            cid = safe_id(lab.name.split(".")[0])
            cases.append(Case(cid, cid, (images / lab.name, lab)))
    return cases


def _msd_convert(case: Case) -> list[Unit]:
    sitk = _sitk("MSD Task05")
    image_path, label_path = case.sources
    if not label_path.is_file():
        raise DataError(f"{label_path}: label missing -> unpack labelsTr next to imagesTr")
    image_beside(image_path, label_path)
    image = sitk.ReadImage(str(image_path))
    if image.GetDimension() == 4:  # (x, y, z, modality): T2 first, ADC second
        size = list(image.GetSize())
        image = sitk.Extract(image, [*size[:3], 0], [0, 0, 0, 0])
    label = sitk.ReadImage(str(label_path))
    check_values(
        sitk.GetArrayViewFromImage(label), (0, 1, 2), label_path, "0 background, 1 peripheral zone, 2 transition zone"
    )
    label, remark = align_label(label, image, label_path, "MSD Task05")
    note(case, remark)
    arr = sitk.GetArrayFromImage(label)
    return slices(image, _from_array(arr > 0, label, "MSD Task05"), "MSD Task05")


# --- NCI-ISBI 2013 -----------------------------------------------------------------------------

_NCI_SUFFIXES = ("_truth", "_correctedLabels")
_NCI_COLLECTIONS = {"3T": "Prostate-3T", "Dx": "PROSTATE-DIAGNOSIS"}


def _nci_discover(root: Path, ds: Dataset, subset: str) -> list[Case]:
    masks = root / "Mask"
    if not masks.is_dir():
        raise ds.missing(root, masks)
    roots = [root / "Image", *sorted(root.glob(f"manifest-*/{_NCI_COLLECTIONS[subset]}"))]
    if not any(r.is_dir() for r in roots):
        raise ds.missing(root, root / "Image")
    cases = []
    for split in ("Training", "Test", "Leaderboard"):
        for path in files(masks / split, (".nrrd",)):
            cid = path.stem
            for suffix in _NCI_SUFFIXES:
                cid = cid.removesuffix(suffix)
            if f"Prostate{subset}" not in cid:
                continue
            folder = next((r / cid for r in roots if (r / cid).is_dir()), roots[0] / cid)
            cases.append(Case(safe_id(cid), safe_id(cid), (path, *all_files(folder)), {"images": folder}))
    return cases


def nrrd_header(path: Path) -> dict[str, str]:
    """The fields of a NRRD file's text header (``key: value`` lines up to the first blank line)."""
    fields: dict[str, str] = {}
    with path.open("rb") as f:
        magic = f.readline()
        if not magic.startswith(b"NRRD"):
            raise DataError(f"{path}: not a NRRD file (no NRRD magic line) -> download the label archive again")
        for raw in iter(f.readline, b""):
            line = raw.decode("latin-1").rstrip("\r\n")
            if not line:
                break
            if line.startswith("#") or ":" not in line:
                continue
            key, _, value = line.partition(":")
            fields[key.strip().lower()] = value.lstrip("=").strip()
    return fields


def _nci_convert(case: Case) -> list[Unit]:
    """The NRRD mask is placed on the DICOM series by its header when the header has a geometry
    (``space directions`` and ``space origin``): it must then describe the series' own grid
    (ImagePositionPatient, ImageOrientationPatient, spacing), in any axis order; a mask whose header
    disagrees stops with a message naming the case. A header without geometry (or with the default
    one a writer leaves: origin 0, unit spacing, identity directions) falls back to the public
    loaders' convention: the mask's slice k is the slice with the k-th smallest InstanceNumber,
    rows and columns as the DICOM stores them."""
    sitk = _sitk("NCI-ISBI")
    mask_path = case.sources[0]
    if not case.info["images"].is_dir():
        raise DataError(f"{case.info['images']}: the case's DICOM folder is missing -> unpack the TCIA download there")
    header = nrrd_header(mask_path)
    mask = sitk.ReadImage(str(mask_path))
    arr = sitk.GetArrayFromImage(mask)
    check_values(arr, (0, 1, 2), mask_path, "0 background, 1 peripheral zone, 2 central gland")
    series = read_series(case.info["images"], "NCI-ISBI", want=tuple(mask.GetSize()))
    image = series.image
    default = (
        np.allclose(mask.GetOrigin(), 0)
        and np.allclose(mask.GetSpacing(), 1)
        and np.allclose(mask.GetDirection(), np.eye(3).ravel())
    )
    if "space origin" in header and "space directions" in header and not default:
        try:
            placed, remark = align_label(mask, image, mask_path, "NCI-ISBI")
        except DataError as e:
            raise DataError(
                f"{case.case_id}: the NRRD header's geometry disagrees with the DICOM series "
                f"{case.info['images']}: {str(e).split(': ', 1)[1]}"
            ) from None
        note(case, remark)
        return slices(image, _from_array(sitk.GetArrayFromImage(placed) > 0, image, "NCI-ISBI"), "NCI-ISBI")
    if tuple(mask.GetSize()) != tuple(image.GetSize()):
        raise DataError(
            f"{case.case_id}: {mask_path.name} is {tuple(mask.GetSize())} with no geometry in its header, its series "
            f"{tuple(image.GetSize())} -> check that the mask belongs to the series"
        )
    numbers = series.instance_numbers
    known = [n for n in numbers if n is not None]
    if len(known) != len(numbers) or len(set(numbers)) != len(numbers):
        raise DataError(
            f"{case.case_id}: {mask_path.name} has no geometry in its header and the series' InstanceNumbers "
            f"are missing or repeated ({numbers}) -> the slice order cannot be known; leave the case out"
        )
    order = np.argsort(known, kind="stable")  # position index of the mask's k-th slice
    placed = np.zeros_like(arr)
    placed[order] = arr
    if order[0] != 0:
        note(
            case,
            f"{mask_path.name}: no geometry in its header{' (the default one)' if default else ''}; slices laid by "
            "InstanceNumber, which runs against the slice positions",
        )
    return slices(image, _from_array(placed > 0, image, "NCI-ISBI"), "NCI-ISBI")


# --- PROMISE12 ---------------------------------------------------------------------------------


def _promise_discover(root: Path, ds: Dataset) -> list[Case]:
    raw = root / "Raw_Data"
    if not raw.is_dir():
        raise ds.missing(root, raw)
    cases = []
    stems = {p.stem for p in files(raw, (".mhd",))}
    for stem in sorted(stems):
        m = re.fullmatch(r"(Case\d+)(_segmentation)?", stem)
        if m is None or (m.group(2) and m.group(1) in stems):
            continue  # not a case, or a segmentation listed with its image
        path, seg = raw / f"{m.group(1)}.mhd", raw / f"{m.group(1)}_segmentation.mhd"
        srcs = (path, path.with_suffix(".raw"), seg, seg.with_suffix(".raw"))
        cases.append(Case(m.group(1), m.group(1), srcs))
    return cases


def _data_file(mhd: Path) -> Path | None:
    """The file a MetaImage header's ElementDataFile names (None for LOCAL or a LIST)."""
    for line in mhd.read_text(encoding="latin-1", errors="replace").splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "ElementDataFile":
            value = value.strip()
            return None if value.upper() in ("LOCAL", "LIST") or " " in value else mhd.parent / value
    return None


def _promise_convert(case: Case) -> list[Unit]:
    sitk = _sitk("PROMISE12")
    image_path, _, seg_path, _ = case.sources
    if not seg_path.is_file():
        raise DataError(f"{seg_path}: segmentation missing -> unpack all three training archives into Raw_Data")
    image_beside(image_path, seg_path)
    for mhd in (image_path, seg_path):
        data = _data_file(mhd)
        if data is not None and not data.is_file():
            raise DataError(
                f"{data}: missing (the voxel data {mhd.name} points to) -> extract the .raw files of all three "
                "training archives into Raw_Data with 7z"
            )
    image = sitk.ReadImage(str(image_path))
    label = sitk.ReadImage(str(seg_path))
    check_values(sitk.GetArrayViewFromImage(label), (0, 1), seg_path, "0 background, 1 prostate")
    label, remark = align_label(label, image, seg_path, "PROMISE12", lenient=True)
    note(case, remark)
    return slices(image, _from_array(sitk.GetArrayFromImage(label), label, "PROMISE12"), "PROMISE12")


# --- ProstateX ---------------------------------------------------------------------------------


def _case_dirs(base: Path) -> dict[str, Path]:
    """Folders named ProstateX-NNNN at most three levels under ``base`` (the TCIA download's nesting)."""
    out: dict[str, Path] = {}
    for depth in ("*", "*/*", "*/*/*"):
        for p in sorted(base.glob(f"{depth}/ProstateX-*")):
            if p.is_dir():
                out.setdefault(p.name, p)
    return out


def _prostatex_discover(root: Path, ds: Dataset) -> list[Case]:
    for folder in (root / "Image", root / "Mask"):
        if not folder.is_dir():
            raise ds.missing(root, folder)
    images = _case_dirs(root / "Image")
    cases = []
    for cid, folder in _case_dirs(root / "Mask").items():
        image_dir = images.get(cid, root / "Image" / cid)
        segs = [p for p in all_files(folder) if p.suffix.lower() == ".dcm"]
        cases.append(
            Case(safe_id(cid), safe_id(cid), (*segs, *all_files(image_dir)), {"images": image_dir, "seg": segs})
        )
    return cases


def _prostatex_convert(case: Case) -> list[Unit]:
    _sitk("ProstateX")
    pydicom = require("pydicom", "ProstateX")
    hd = require("highdicom", "ProstateX")
    if len(case.info["seg"]) != 1:
        raise DataError(
            f"{case.case_id}: expected one DICOM-SEG file in its mask folder, found {len(case.info['seg'])}"
        )
    seg_path = case.info["seg"][0]
    seg = hd.seg.segread(str(seg_path))
    referenced = {sop for _, _, sop in seg.get_source_image_uids()}
    series = {r.SeriesInstanceUID for r in getattr(seg, "ReferencedSeriesSequence", [])}
    image_dir = case.info["images"]
    if not image_dir.is_dir():
        raise DataError(f"{image_dir}: the case's T2 series is missing -> unpack the TCIA image download there")
    try:
        read = read_series(image_dir, "ProstateX", series=series or None)
    except DataError as e:
        raise DataError(f"{e} (the series {seg_path.name} references)") from None
    image, names = read.image, read.files
    uids = [pydicom.dcmread(n, stop_before_pixels=True).SOPInstanceUID for n in names]
    numbers = [int(s.SegmentNumber) for s in seg.SegmentSequence]
    present = [u for u in uids if u in referenced]
    stack = np.zeros((len(uids), image.GetSize()[1], image.GetSize()[0], len(numbers)), bool)
    if present:
        px = seg.get_pixels_by_source_instance(present, segment_numbers=numbers, combine_segments=False)
        index = {u: i for i, u in enumerate(uids)}
        for j, u in enumerate(present):
            stack[index[u]] = px[j] > 0
    zones = np.asarray(stack[..., [i for i, n in enumerate(numbers) if n != URETHRA_SEGMENT]].any(axis=-1))
    if URETHRA_SEGMENT in numbers:
        urethra = stack[..., numbers.index(URETHRA_SEGMENT)]
        zones |= urethra & zones.any(axis=(1, 2), keepdims=True)
    return slices(image, _from_array(zones, image, "ProstateX"), "ProstateX")


# --- the datasets ------------------------------------------------------------------------------


def _make(site: str, discover, *args: Any, **kw: Any) -> Dataset:
    def bound(root: Path) -> list[Case]:
        return discover(root, ds, *args)

    ds = Dataset(site=site, discover=bound, needs=SITK, **kw)
    return ds


_SLICES = f"LPS orientation; slices with prostate; clip(v/{INTENSITY_MAX:.0f})x255 uint8"
_NCI = dict(
    folder="NCI_ISBI",
    source="https://www.cancerimagingarchive.net (NCI-ISBI 2013 Challenge: the 3 image manifests + 3 NRRD label zips)",
    licence="TCIA data usage policy and the collection's licence",
    citation="Bloch et al., NCI-ISBI 2013 Challenge: Automated Segmentation of Prostate Structures, TCIA 2015",
    convert=_nci_convert,
)
_NCI_LAYOUT = (
    "NCI_ISBI/Image/{id}/<study>/<series>/*.dcm  (or NCI_ISBI/manifest-*/{collection}/{id}/..., as NBIA writes it)\n"
    "NCI_ISBI/Mask/{{Training,Test,Leaderboard}}/{id}[_truth].nrrd"
)
I2CVB = _make(
    "i2cvb",
    _i2cvb_discover,
    title="I2CVB",
    folder="I2CVB",
    source="https://zenodo.org/record/162231 (ge-1-5t and siemens-3t archives, parts joined and untarred)",
    licence="as stated on the Zenodo record",
    citation="Lemaître et al., Computer-aided detection and diagnosis for prostate cancer based on mono and "
    "multi-parametric MRI: a review, Computers in Biology and Medicine 2015",
    layout="I2CVB/{GE,Siemens}/<Patient>/T2W/*.dcm\nI2CVB/{GE,Siemens}/<Patient>/GT/prostate/*.dcm",
    convert=_i2cvb_convert,
    steps=f"T2W DICOM; GT/prostate non-zero = prostate; {_SLICES}",
    excluded={"Patient_428260": "its ground truth misses a slice (left out by NVIDIA FLARE's preparation)"},
)
MSD = _make(
    "msd",
    _msd_discover,
    title="MSD Task05 Prostate",
    folder="MSD",
    source="http://medicaldecathlon.com (Task05_Prostate.tar)",
    licence="CC BY-SA 4.0",
    citation="Antonelli et al., The Medical Segmentation Decathlon, Nature Communications 2022",
    layout="MSD/Task05_Prostate/imagesTr/prostate_NN.nii.gz  (4D: T2, ADC)\nMSD/Task05_Prostate/labelsTr/prostate_NN.nii.gz",
    convert=_msd_convert,
    steps=f"channel 0 (T2); labels 1+2 merged; {_SLICES}",
)
NCI_3T = _make(
    "nci-isbi-3t",
    _nci_discover,
    "3T",
    title="NCI-ISBI 2013 (Prostate-3T)",
    layout=_NCI_LAYOUT.format(id="Prostate3T-NN-NNNN", collection="Prostate-3T"),
    steps=f"DICOM series + NRRD mask placed by its header (or InstanceNumber); labels 1+2 merged; {_SLICES}",
    **_NCI,
)
NCI_DX = _make(
    "nci-isbi-dx",
    _nci_discover,
    "Dx",
    title="NCI-ISBI 2013 (PROSTATE-DIAGNOSIS)",
    layout=_NCI_LAYOUT.format(id="ProstateDx-NN-NNNN", collection="PROSTATE-DIAGNOSIS"),
    steps=f"DICOM series + NRRD mask placed by its header (or InstanceNumber); labels 1+2 merged; {_SLICES}",
    excluded={"ProstateDx-01-0055": "its image and label do not match (left out by NVIDIA FLARE's preparation)"},
    **_NCI,
)
PROMISE12 = _make(
    "promise12",
    _promise_discover,
    title="PROMISE12",
    folder="Promise12",
    source="https://promise12.grand-challenge.org (Training data parts 1-3, extracted with 7z)",
    licence="registration on grand-challenge.org; the challenge's terms",
    citation="Litjens et al., Evaluation of prostate segmentation algorithms for MRI: the PROMISE12 "
    "challenge, Medical Image Analysis 2014",
    layout="Promise12/Raw_Data/CaseNN.{mhd,raw}\nPromise12/Raw_Data/CaseNN_segmentation.{mhd,raw}",
    convert=_promise_convert,
    steps=f"MetaImage; label 0/1; {_SLICES}",
)
PROSTATEX: Dataset = Dataset(
    site="prostatex",
    discover=lambda root: _prostatex_discover(root, PROSTATEX),
    title="ProstateX (zone segmentations)",
    folder="PROSTATEx",
    source="https://www.cancerimagingarchive.net (PROSTATEx and its zone segmentations, PROSTATEx-Seg-Zones)",
    licence="TCIA data usage policy and the collections' licences",
    citation="Litjens et al., ProstateX Challenge data, TCIA 2017; Meyer et al., PROSTATEx Zone "
    "Segmentations, TCIA 2020",
    layout="PROSTATEx/Image/<manifest>/PROSTATEx/ProstateX-NNNN/<study>/<T2 series>/*.dcm\n"
    "PROSTATEx/Mask/<manifest>/PROSTATEx/ProstateX-NNNN/<study>/<series>/<seg>.dcm  (DICOM-SEG)",
    convert=_prostatex_convert,
    steps=f"DICOM-SEG zones merged (urethra only on slices with a zone); {_SLICES}",
    needs=("SimpleITK", "pydicom", "highdicom"),
)
DATASETS = (I2CVB, MSD, NCI_3T, NCI_DX, PROMISE12, PROSTATEX)
