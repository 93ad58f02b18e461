"""The three CT datasets of Auto-FedAvg's pancreas federation (§4.3): readers that keep volumes 3D.

Each case is written as a NIfTI image and label with the image's own geometry (origin, spacing,
direction: its affine), nothing resampled; the label is 1 for pancreas, tumour included, 0
elsewhere. Every label is placed by its own header (:func:`~fedseg.apps.prepare.volumes.align_label`):
stored in another axis order it is reoriented by permutations and flips; an origin, spacing or
direction that differs from its image's stops an MSD or BTCV case with a message (TCIA's labels are
then placed voxel for voxel, with a note). Per dataset (docs/datasets.md):

* **MSD Task07 Pancreas** (281 labelled cases): labels 1 (pancreas) and 2 (tumour) merged.
* **TCIA Pancreas-CT** (80 cases; the label archive has 82: TCIA removed #25 and #70 from the
  images on purpose, and they are left out): the DICOM series, stored in the smallest integer type
  that holds it, and the NIH label NIfTI (0/1).
* **BTCV Abdomen** (30 training cases): of its 13 organ labels, 11 (pancreas) is kept.

Patients split 95/93/93, 28/27/27 (28/26/26 of today's 80) and 10/10/10 as the paper:
``round(0.33 n)`` to validation and to testing, the rest to training
(``Federation(fractions=(0.34, 0.33, 0.33), rest=0)``).
:data:`AUTOFEDAVG_PANCREAS` is the federation; ``prepare(AUTOFEDAVG_PANCREAS, raw, out)`` builds
it (a ``mode = "3d"`` spec without ``image_size``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fedseg.apps.prepare.base import (
    Case,
    Dataset,
    Federation,
    Unit,
    all_files,
    check_values,
    files,
    image_beside,
    note,
    require,
    safe_id,
)
from fedseg.apps.prepare.volumes import align_label, compact, read_series
from fedseg.foundation.errors import DataError

#: BTCV's label value for the pancreas (1 spleen, 2 right kidney, ... 11 pancreas, ... 13 left adrenal).
BTCV_PANCREAS = 11


def _sitk(title: str) -> Any:
    return require("SimpleITK", title)


def _on_grid(
    case: Case, label: Any, image: Any, keep: Any, path: Path, title: str, what: str, lenient: bool = False
) -> Unit:
    """(image, label on the image's grid) as one volume unit: the label placed by its own header
    (:func:`~fedseg.apps.prepare.volumes.align_label`), its voxels ``keep(array)`` as 0/1; DataError
    naming ``path`` when no voxel is kept (``what`` says which value was looked for)."""
    sitk = _sitk(title)
    placed, text = align_label(label, image, path, title, lenient=lenient)
    if not lenient or "voxel for voxel" in text:
        note(case, text)
    values = keep(sitk.GetArrayFromImage(placed))
    if not values.any():
        present = sorted(np.unique(sitk.GetArrayViewFromImage(label)).tolist())
        raise DataError(
            f"{path}: no pancreas in the label ({what}; values present {present[:14]}) "
            "-> check that the label file is the case's full annotation"
        )
    out = sitk.GetImageFromArray(np.ascontiguousarray(values.astype(np.uint8)))
    out.CopyInformation(image)
    return ("", compact(image, title), out)


def _pair_discover(
    root: Path, ds: Dataset, images: str, labels: str, label_name=lambda n: n, image_name=lambda n: n
) -> list[Case]:
    img_dir, lab_dir = root / images, root / labels
    for folder in (img_dir, lab_dir):
        if not folder.is_dir():
            raise ds.missing(root, folder)
    cases = []
    found = files(img_dir, (".gz", ".nii"))
    for path in found:
        cid = safe_id(path.name.split(".")[0])
        cases.append(Case(cid, cid, (path, lab_dir / label_name(path.name))))
    names = {p.name for p in found}
    for lab in files(lab_dir, (".gz", ".nii")):
        if image_name(lab.name) not in names:  # a label whose image is missing: reported
            image = img_dir / image_name(lab.name)
            cid = safe_id(image.name.split(".")[0])
            cases.append(Case(cid, cid, (image, lab)))
    return cases


def _msd_convert(case: Case) -> list[Unit]:
    sitk = _sitk("MSD Task07")
    image_path, label_path = case.sources
    if not label_path.is_file():
        raise DataError(f"{label_path}: label missing -> unpack labelsTr next to imagesTr")
    image_beside(image_path, label_path)
    label = sitk.ReadImage(str(label_path))
    check_values(sitk.GetArrayViewFromImage(label), (0, 1, 2), label_path, "0 background, 1 pancreas, 2 tumour")
    image = sitk.ReadImage(str(image_path))
    return [_on_grid(case, label, image, lambda a: a > 0, label_path, "MSD Task07", "values 1 or 2")]


def _btcv_convert(case: Case) -> list[Unit]:
    sitk = _sitk("BTCV")
    image_path, label_path = case.sources
    if not label_path.is_file():
        raise DataError(f"{label_path}: label missing -> unpack RawData/Training/label next to img")
    image_beside(image_path, label_path)
    label = sitk.ReadImage(str(label_path))
    check_values(sitk.GetArrayViewFromImage(label), range(14), label_path, "0 background, 1..13 organs (11 pancreas)")
    image = sitk.ReadImage(str(image_path))
    keep = lambda a: a == BTCV_PANCREAS  # noqa: E731
    return [_on_grid(case, label, image, keep, label_path, "BTCV", f"value {BTCV_PANCREAS}, BTCV's pancreas")]


def _tcia_discover(root: Path, ds: Dataset) -> list[Case]:
    labels = sorted(root.glob("TCIA_pancreas_labels*"))
    if not labels:
        raise ds.missing(root, root / "TCIA_pancreas_labels-02-05-2017")
    dirs = {p.name: p for pattern in ("PANCREAS_*", "manifest-*/Pancreas-CT/PANCREAS_*") for p in root.glob(pattern)}
    cases = []
    for path in files(labels[0], (".gz", ".nii")):
        number = path.name.split(".")[0].removeprefix("label")
        cid = f"PANCREAS_{number}"
        folder = dirs.get(cid, root / cid)
        cases.append(Case(cid, cid, (path, *all_files(folder)), {"images": folder}))
    return cases


def _tcia_convert(case: Case) -> list[Unit]:
    sitk = _sitk("Pancreas-CT")
    label_path = case.sources[0]
    if not case.info["images"].is_dir():
        raise DataError(f"{case.info['images']}: the case's DICOM folder is missing -> unpack the TCIA download there")
    image = read_series(case.info["images"], "Pancreas-CT").image
    label = sitk.ReadImage(str(label_path))
    check_values(sitk.GetArrayViewFromImage(label), (0, 1), label_path, "0 background, 1 pancreas")
    return [_on_grid(case, label, image, lambda a: a > 0, label_path, "Pancreas-CT", "value 1", lenient=True)]


def _make(site: str, discover, *args: Any, **kw: Any) -> Dataset:
    def bound(root: Path) -> list[Case]:
        return discover(root, ds, *args)

    ds = Dataset(site=site, discover=bound, needs=("SimpleITK",), **kw)
    return ds


_KEEP = "NIfTI with the image's geometry, no resampling"
MSD07 = _make(
    "msd-pancreas",
    _pair_discover,
    "Task07_Pancreas/imagesTr",
    "Task07_Pancreas/labelsTr",
    title="MSD Task07 Pancreas",
    folder="MSD",
    source="http://medicaldecathlon.com (Task07_Pancreas.tar)",
    licence="CC BY-SA 4.0",
    citation="Antonelli et al., The Medical Segmentation Decathlon, Nature Communications 2022",
    layout="MSD/Task07_Pancreas/imagesTr/pancreas_NNN.nii.gz\nMSD/Task07_Pancreas/labelsTr/pancreas_NNN.nii.gz",
    convert=_msd_convert,
    steps=f"labels 1 (pancreas) + 2 (tumour) merged; {_KEEP}",
)
TCIA = _make(
    "tcia-pancreas-ct",
    _tcia_discover,
    title="TCIA Pancreas-CT",
    folder="Pancreas-CT",
    source="https://www.cancerimagingarchive.net (Pancreas-CT: the DICOM images via NBIA and the label NIfTIs)",
    licence="TCIA data usage policy and the collection's licence",
    citation="Roth et al., DeepOrgan: multi-level deep convolutional networks for automated pancreas "
    "segmentation, MICCAI 2015; Roth et al., Data from Pancreas-CT, TCIA 2016",
    layout="Pancreas-CT/PANCREAS_NNNN/<study>/<series>/*.dcm  (or Pancreas-CT/manifest-*/Pancreas-CT/PANCREAS_NNNN/...)\n"
    "Pancreas-CT/TCIA_pancreas_labels-02-05-2017/labelNNNN.nii.gz",
    convert=_tcia_convert,
    steps=f"DICOM series (smallest integer type); label reoriented to the image's axes (no resampling), 0/1; {_KEEP}",
    excluded={
        f"PANCREAS_{n:04d}": "removed from the Pancreas-CT image collection by TCIA on purpose (its label file still "
        "ships in the label archive); nothing to download"
        for n in (25, 70)
    },
)
BTCV = _make(
    "btcv",
    _pair_discover,
    "RawData/Training/img",
    "RawData/Training/label",
    lambda n: n.replace("img", "label", 1),
    lambda n: n.replace("label", "img", 1),
    title="BTCV Abdomen",
    folder="BTCV",
    source="https://www.synapse.org/#!Synapse:syn3193805 (Multi-Atlas Labeling Beyond the Cranial Vault, RawData.zip)",
    licence="the Synapse project's terms (registration)",
    citation="Landman et al., MICCAI Multi-Atlas Labeling Beyond the Cranial Vault - Workshop and Challenge, 2015",
    layout="BTCV/RawData/Training/img/imgNNNN.nii.gz\nBTCV/RawData/Training/label/labelNNNN.nii.gz",
    convert=_btcv_convert,
    steps=f"label {BTCV_PANCREAS} (pancreas) kept, other organs background; {_KEEP}",
)
AUTOFEDAVG_PANCREAS = Federation(
    name="autofedavg-pancreas",
    paper="Auto-FedAvg (Xia et al., 2021), §4.3: pancreas in abdominal CT, 3 clients",
    datasets=(MSD07, TCIA, BTCV),
    labels={"pancreas": [1]},
    in_channels=1,
    image_size=None,
    paper_counts={"msd-pancreas": (95, 93, 93), "tcia-pancreas-ct": (28, 27, 27), "btcv": (10, 10, 10)},
    unit="volumes",
    fractions=(0.34, 0.33, 0.33),
    rest=0,
    mode="3d",
    note="The paper's counts are the full releases (281, 82 and 30 labelled cases) split by its rule; TCIA has "
    "since removed PANCREAS_0025 and PANCREAS_0070 from Pancreas-CT (80 cases today).",
)
