"""Miniature replicas of the public datasets ``fedseg prepare`` reads, in their real layouts.

Each writer puts a handful of tiny cases under ``raw`` with the release's folder and file names,
formats, label encodings and quirks (docs/datasets.md): Drishti-GS1 soft maps (one smaller than
its image), RIGA's six annotators' outlines drawn on copies of the image (JPEG for BinRushed, one
annotator in TIFF as in BinRushed1-Corrected), RIM-ONE r3 stereo pairs with full-width masks and
two eyes of one patient, REFUGE's 0/128/255 BMP masks; DICOM series written with pydicom, MSD's 4D
NIfTI with T2 first and a macOS ``._`` file, NCI-ISBI NRRD masks in InstanceNumber order (which runs
head to feet in some series, feet to head in others) with or without a header geometry, PROMISE12
MetaImage pairs, ProstateX DICOM-SEG via highdicom.
Every writer returns what a correct preparation must give (cases, label values...).
"""

from __future__ import annotations

import datetime
from pathlib import Path

import numpy as np

SIZE = 48  # fundus images (RIM-ONE stereo pairs are 2 x SIZE wide)
MR = (5, 16, 16)  # prostate volumes (z, y, x)


# --- fundus ------------------------------------------------------------------------------------


def _save(arr: np.ndarray, path: Path, **kw) -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path, **kw)
    return path


def _dist(cy: float, cx: float, shape=(SIZE, SIZE)) -> np.ndarray:
    y, x = np.mgrid[: shape[0], : shape[1]]
    return np.hypot(y - cy, x - cx)


def fundus_image(rng: np.random.Generator, cy: float, cx: float, r_disc: float, r_cup: float, shape=(SIZE, SIZE)):
    """A reddish retina with a pale disc and a whiter cup at (cy, cx)."""
    d = _dist(cy, cx, shape)
    img = np.empty((*shape, 3))
    img[...] = (150, 60, 30)
    img += rng.normal(0, 6, img.shape)
    img[d < r_disc] = (220, 190, 120)
    img[d < r_cup] = (245, 235, 200)
    return np.clip(img, 0, 255).astype(np.uint8)


def _centre(rng) -> tuple[float, float]:
    return float(rng.uniform(18, 30)), float(rng.uniform(18, 30))


def drishti(raw: Path, seed: int = 0) -> dict:
    """Drishti-GS1_files: 2 training + 2 test images; soft maps at the 0/64/128/191/255 levels of 4 experts."""
    rng = np.random.default_rng(seed)
    root = raw / "Drishti-GS1_files"
    ids = []
    for i, (part, gt) in enumerate((("Training", "GT"), ("Training", "GT"), ("Test", "Test_GT"), ("Test", "Test_GT"))):
        stem = f"drishtiGS_{i + 1:03d}"
        cy, cx = _centre(rng)
        _save(fundus_image(rng, cy, cx, 9, 4), root / part / "Images" / f"{stem}.png")
        d = _dist(cy, cx)
        for name, r in (("OD", 9), ("cup", 4)):
            soft = np.zeros((SIZE, SIZE), np.uint8)
            for k, level in enumerate((64, 128, 191, 255)):  # more experts agree nearer the centre
                soft[d < r + 1.5 - k] = level
            if i == 1:  # a soft map smaller than its image (resized back by nearest neighbour)
                soft = soft[::2, ::2]
            _save(soft, root / part / gt / stem / "SoftMap" / f"{stem}_{name}segSoftmap.png")
        ids.append(stem)
    return {"cases": ids, "patients": ids}


def _outline(d: np.ndarray, r: float) -> np.ndarray:
    return np.abs(d - r) <= 1.0


def riga(raw: Path, part: str, seed: int = 0, nest: str = "", quirks: bool = False) -> dict:
    """RIGA/<part>: 4 images, each with ``imageNprime`` and six annotated copies ``imageN-k``. ``nest`` puts
    the part one folder deeper (``RIGA/BinRushedcorrected/BinRushed/...``, as one archive unpacks). With
    ``quirks`` (MESSIDOR's): the fourth image is ``image48`` with its original named without ``prime`` and the
    third has five annotators (``-4`` missing); ``notes`` says which case shows which."""
    rng = np.random.default_rng(seed)
    folders = {
        "BinRushed": ["BinRushed/BinRushed1-Corrected", "BinRushed/BinRushed2"],
        "Magrabia": ["Magrabia/Magrabia/MagrabiaMale", "Magrabia/Magrabia/MagrabiFemale"],
        "MESSIDOR": ["MESSIDOR", "MESSIDOR"],
    }[part]
    ids, truth = [], {}
    notes = {}
    for i in range(4):
        folder = raw / "RIGA" / nest / folders[i % 2]
        n = 48 if quirks and i == 3 else i + 1
        cy, cx = _centre(rng)
        image = fundus_image(rng, cy, cx, 10, 5)
        ext = ".jpg" if part == "BinRushed" else ".tif"
        kw = {"quality": 98, "subsampling": 0} if ext == ".jpg" else {}
        no_prime = quirks and n == 48
        _save(image, folder / f"image{n}{'' if no_prime else 'prime'}{ext}", **kw)
        d = _dist(cy, cx)
        for k in range(1, 7):
            if quirks and i == 2 and k == 4:
                continue  # five of six annotators
            rd, rc = 10 + (k % 3) - 1, 5 + (k % 2)  # annotators disagree by a pixel
            drawn = image.copy()
            if k == 6:  # an annotator who drew no cup: ignored, the other five vote
                drawn[_outline(d, rd)] = (0, 255, 0)
            else:
                drawn[_outline(d, rd) | _outline(d, rc)] = (0, 255, 0)
            kext = ".tif" if (part == "BinRushed" and k == 3) else ext  # BinRushed1-Corrected mixes formats
            _save(drawn, folder / f"image{n}-{k}{kext}", **(kw if kext == ".jpg" else {}))
        cid = f"{folders[i % 2].split('/', 1)[1] if '/' in folders[i % 2] else '.'}_image{n}"
        cid = cid.replace("/", "_").removeprefix("._")
        ids.append(cid)
        truth[cid] = (d <= 10.0, d <= 5.5)  # majority: disc radius 10, cup 5 (+ one pixel of outline)
        if quirks and i == 2:
            notes[cid] = f"5 of 6 annotators (image{n}-4 missing)"
        if no_prime:
            notes[cid] = f"image{n}{ext}: original named without 'prime'"
    return {"cases": ids, "patients": ids, "truth": truth, "notes": notes}


def rimone(raw: Path, seed: int = 0, half: bool = False) -> dict:
    """RIM-ONE r3: 5 stereo pairs of 4 patients (N-1-L and N-1-R are two eyes of one), full-width masks; with
    ``half``, masks of one view's width, as public loaders read them: the annotated view is the left half of
    every stereo pair, for ``-L`` and ``-R`` eyes alike (L/R names the eye). The right view's disc is shifted by
    8 px, so the wrong half would show."""
    rng = np.random.default_rng(seed)
    root = raw / "RIM-ONE r3"
    stems = [("Healthy", "N-1-L"), ("Healthy", "N-1-R"), ("Healthy", "N-2-L"), ("Glaucoma and suspects", "G-1-L")]
    stems.append(("Glaucoma and suspects", "G-2-R"))
    for group, stem in stems:
        cy, cx = _centre(rng)
        left = fundus_image(rng, cy, cx, 12, 6)
        shift = 8 if half else 1
        right = fundus_image(rng, cy + shift, cx - shift, 12, 6)  # the other view of the stereo pair
        _save(np.concatenate([left, right], axis=1), root / group / "Stereo Images" / f"{stem}.jpg", quality=95)
        d = _dist(cy, cx, (SIZE, SIZE) if half else (SIZE, 2 * SIZE))
        for name, r in (("Disc", 12), ("Cup", 6)):
            mask = np.where(d < r, 255, 0).astype(np.uint8)  # annotated on the left half
            _save(mask, root / group / "Average_masks" / f"{stem}-{name}-Avg.png")
    return {"cases": [s for _, s in stems], "patients": ["N-1", "N-1", "N-2", "G-1", "G-2"]}


def refuge(raw: Path, seed: int = 0) -> dict:
    """REFUGE: 2 training images (Glaucoma, Non-Glaucoma) and 2 validation images, 0/128/255 BMP masks."""
    rng = np.random.default_rng(seed)
    root = raw / "REFUGE"
    cases = [
        ("Training400/Glaucoma/g0001.jpg", "Annotation-Training400/Disc_Cup_Masks/Glaucoma/g0001.bmp"),
        ("Training400/Non-Glaucoma/n0001.jpg", "Annotation-Training400/Disc_Cup_Masks/Non-Glaucoma/n0001.bmp"),
        ("REFUGE-Validation400/V0001.jpg", "REFUGE-Validation400-GT/Disc_Cup_Masks/V0001.bmp"),
        ("REFUGE-Validation400/V0002.jpg", "REFUGE-Validation400-GT/Disc_Cup_Masks/V0002.bmp"),
    ]
    for image, mask in cases:
        cy, cx = _centre(rng)
        _save(fundus_image(rng, cy, cx, 9, 4), root / image, quality=95)
        d = _dist(cy, cx)
        m = np.full((SIZE, SIZE), 255, np.uint8)
        m[d < 9] = 128
        m[d < 4] = 0
        _save(m, root / mask)
    ids = [Path(i).stem for i, _ in cases]
    return {"cases": ids, "patients": ids}


def fundus_all(raw: Path) -> dict[str, dict]:
    """Every fundus dataset, keyed by site."""
    return {
        "drishti-gs1": drishti(raw),
        "riga-binrushed": riga(raw, "BinRushed", 1),
        "riga-magrabia": riga(raw, "Magrabia", 2),
        "riga-messidor": riga(raw, "MESSIDOR", 3),
        "rim-one-r3": rimone(raw),
        "refuge": refuge(raw),
    }


# --- prostate ----------------------------------------------------------------------------------


def volume(rng: np.random.Generator, slices_with_prostate=(1, 2, 3)) -> tuple[np.ndarray, np.ndarray]:
    """(image uint16 z,y,x up to ~3000, mask uint8) with a prostate blob on some slices, off-centre in y
    (rows 4..8 of 16), so a flipped row axis would show."""
    img = rng.integers(100, 400, size=MR).astype(np.uint16)
    mask = np.zeros(MR, np.uint8)
    for k in slices_with_prostate:
        mask[k, 4:8, 6:11] = 1
    img[mask > 0] += 2500  # bright prostate: above the 2048 clip
    return img, mask


def _uid() -> str:
    from pydicom.uid import generate_uid

    return generate_uid()


def dicom_series(
    arr: np.ndarray,
    folder: Path,
    patient: str,
    study: str | None = None,
    head_first: bool = False,
    ct: bool = False,
    origin: tuple[float, float, float] = (0.0, 0.0, 0.0),
    **tags,
) -> list:
    """Write a (z, y, x) array as an axial MR series with pydicom, one file per slice; returns the datasets.
    Slice k lies at ``origin`` + (0, 0, 3k) mm (LPS: k = 0 the most inferior); InstanceNumber runs feet to head (k + 1) or,
    with ``head_first``, head to feet (n - k), and the files are named by InstanceNumber. ``tags`` are set on
    every slice (e.g. RescaleIntercept); ``ct`` writes CT Image Storage instead of MR."""
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, MRImageStorage

    sop_class = CTImageStorage if ct else MRImageStorage

    folder.mkdir(parents=True, exist_ok=True)
    study, series, frame = study or _uid(), _uid(), _uid()
    out = []
    for k in range(arr.shape[0]):
        meta = FileMetaDataset()
        meta.MediaStorageSOPClassUID = sop_class
        meta.MediaStorageSOPInstanceUID = _uid()
        meta.TransferSyntaxUID = ExplicitVRLittleEndian
        ds = Dataset()
        ds.file_meta = meta
        ds.SOPClassUID, ds.SOPInstanceUID = sop_class, meta.MediaStorageSOPInstanceUID
        ds.PatientName, ds.PatientID, ds.PatientBirthDate, ds.PatientSex = f"{patient}^", patient, "19700101", "M"
        ds.StudyInstanceUID, ds.SeriesInstanceUID, ds.FrameOfReferenceUID = study, series, frame
        ds.StudyDate, ds.StudyTime, ds.AccessionNumber, ds.StudyID = "20200101", "120000", "1", "1"
        ds.ReferringPhysicianName, ds.Manufacturer = "", "replica"
        number = arr.shape[0] - k if head_first else k + 1
        ds.Modality, ds.SeriesNumber, ds.InstanceNumber = "CT" if ct else "MR", 1, number
        ds.ImageOrientationPatient = [1, 0, 0, 0, 1, 0]
        ds.ImagePositionPatient = [origin[0], origin[1], origin[2] + 3.0 * k]
        ds.PixelSpacing, ds.SliceThickness = [0.5, 0.5], 3.0
        ds.Rows, ds.Columns = arr.shape[1], arr.shape[2]
        ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
        ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 0
        ds.PixelData = np.ascontiguousarray(arr[k].astype(np.uint16)).tobytes()
        for key, value in tags.items():
            setattr(ds, key, value)
        ds.save_as(folder / f"1-{number:02d}.dcm", enforce_file_format=True)
        out.append(ds)
    return out


def i2cvb(raw: Path, seed: int = 0) -> dict:
    """I2CVB/{GE,Siemens}/<Patient>/T2W + GT/prostate as DICOM series (mask 0/255); Patient_428260 is
    the release's case with a missing ground-truth slice (left out)."""
    rng = np.random.default_rng(seed)
    names = [("GE", "Patient_001"), ("GE", "Patient_002"), ("Siemens", "Patient_428260")]
    names += [("Siemens", "Patient_003"), ("Siemens", "Patient_004")]
    for vendor, name in names:
        img, mask = volume(rng)
        base = raw / "I2CVB" / vendor / name
        dicom_series(img, base / "T2W", name)
        gt = (mask * 255).astype(np.uint16)
        dicom_series(gt[:-1] if name == "Patient_428260" else gt, base / "GT" / "prostate", name)
    kept = [n for _, n in names if n != "Patient_428260"]
    return {"cases": kept, "patients": kept, "slices": 3 * len(kept)}


def msd(raw: Path, seed: int = 0) -> dict:
    """MSD/Task05_Prostate: 4D NIfTI (x, y, z, [T2, ADC]) and labels 0/1/2 (peripheral, transition zone)."""
    import nibabel as nib

    rng = np.random.default_rng(seed)
    base = raw / "MSD" / "Task05_Prostate"
    (base / "imagesTr").mkdir(parents=True)
    (base / "labelsTr").mkdir(parents=True)
    ids = []
    for i in (0, 1, 2, 4):
        img, mask = volume(rng)
        adc = np.full(MR, 3000, np.float32)  # a constant second channel: taking it would give no contrast
        four = np.stack([img.astype(np.float32).transpose(2, 1, 0), adc.transpose(2, 1, 0)], axis=-1)
        lab = (mask * np.where(rng.random(MR) < 0.5, 1, 2)).astype(np.uint8).transpose(2, 1, 0)
        affine = np.diag([0.6, 0.6, 3.6, 1.0])
        name = f"prostate_{i:02d}.nii.gz"
        nib.save(nib.Nifti1Image(four, affine), base / "imagesTr" / name)
        nib.save(nib.Nifti1Image(lab, affine), base / "labelsTr" / name)
        ids.append(f"prostate_{i:02d}")
    (base / "imagesTr" / "._prostate_00.nii.gz").write_bytes(b"\x00\x05\x16\x07 macOS resource fork")
    return {"cases": ids, "patients": ids, "slices": 3 * len(ids)}


def write_nrrd(arr: np.ndarray, path: Path, geometry: tuple | None) -> None:
    """A raw-encoded NRRD of a (z, y, x) uint8 array as 3D Slicer writes one: ``space: left-posterior-superior``
    with ``space directions`` (one column per axis, mm) and ``space origin`` when ``geometry = (origin,
    directions)`` is given; without them (a header with no geometry) when it is None."""
    lines = ["NRRD0004", "type: unsigned char", "dimension: 3", f"sizes: {arr.shape[2]} {arr.shape[1]} {arr.shape[0]}"]
    if geometry is not None:
        origin, directions = geometry
        lines += [
            "space: left-posterior-superior",
            "space directions: " + " ".join("(" + ",".join(f"{v:g}" for v in d) + ")" for d in directions),
            "kinds: domain domain domain",
            "space origin: (" + ",".join(f"{v:g}" for v in origin) + ")",
        ]
    lines += ["endian: little", "encoding: raw"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(("\n".join(lines) + "\n\n").encode() + np.ascontiguousarray(arr, np.uint8).tobytes())


#: NCI-ISBI replica, per case of each collection: (InstanceNumber runs head to feet, the NRRD header's geometry:
#: "series" as 3D Slicer writes it, "none" without space fields, "default" the identity a writer leaves).
NCI_KINDS = {
    "3T": ((False, "series"), (True, "series"), (True, "none"), (False, "none"), (False, "series")),
    "Dx": ((True, "series"), (False, "series"), (True, "default"), (False, "default"), (False, "series")),
}
#: Where the NCI-ISBI replica's series lie (ImagePositionPatient of the most inferior slice, mm).
NCI_ORIGIN = (-4.0, -3.5, -12.0)


def nci_volume(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(image, mask) of 5 slices with prostate on slices 1 (20 px) and 2 (12 px) from the feet: a reversed
    slice order puts them on slices 2 and 3 with the areas swapped."""
    img = rng.integers(100, 400, size=MR).astype(np.uint16)
    mask = np.zeros(MR, np.uint8)
    mask[1, 4:8, 6:11] = 1
    mask[2, 4:8, 6:9] = 1
    img[mask > 0] += 2500
    return img, mask


NCI_AREAS = {"001": 20, "002": 12}


def nci_isbi(raw: Path, seed: int = 0) -> dict:
    """NCI_ISBI: Image/<id>/<study>/<series>/*.dcm and Mask/{Training,Test,Leaderboard}/<id>[_truth].nrrd with
    labels 1/2. As the challenge's loaders read them, the NRRD's slice k is the DICOM slice with InstanceNumber
    k + 1, rows and columns as the DICOM stores them; InstanceNumber runs feet to head in some series and head
    to feet in others, and the NRRD header either carries the series' geometry (origin at the first instance's
    ImagePositionPatient, the slice axis towards the next instance: as 3D Slicer writes it) or none
    or the default one a writer leaves (:data:`NCI_KINDS`). ProstateDx-01-0055 is the release's mismatched case
    (left out)."""
    rng = np.random.default_rng(seed)
    ids = {"3T": [f"Prostate3T-01-{i:04d}" for i in (1, 2, 3, 4)]}
    ids["Dx"] = [f"ProstateDx-01-{i:04d}" for i in (6, 7, 8, 9, 55)]
    where = ["Training", "Training", "Test", "Leaderboard", "Training"]
    for key, group in ids.items():
        for (cid, split), (head_first, header) in zip(zip(group, where), NCI_KINDS[key]):
            img, mask = nci_volume(rng)
            folder = raw / "NCI_ISBI" / "Image" / cid / "1.2.3-study" / "1.2.3-series"
            dicom_series(img, folder, cid, head_first=head_first, origin=NCI_ORIGIN)
            lab = (mask * 2)[::-1] if head_first else mask * 2  # central gland = 2, in InstanceNumber order
            top = NCI_ORIGIN[2] + 3.0 * (MR[0] - 1)
            geometry = {
                "series": (
                    (*NCI_ORIGIN[:2], top if head_first else NCI_ORIGIN[2]),
                    ((0.5, 0, 0), (0, 0.5, 0), (0, 0, -3.0 if head_first else 3.0)),
                ),
                "default": ((0, 0, 0), ((1, 0, 0), (0, 1, 0), (0, 0, 1))),
                "none": None,
            }[header]
            suffix = "_truth" if split == "Test" else "_correctedLabels" if cid == "ProstateDx-01-0006" else ""
            write_nrrd(lab, raw / "NCI_ISBI" / "Mask" / split / f"{cid}{suffix}.nrrd", geometry)
    dx = [c for c in ids["Dx"] if not c.endswith("0055")]
    return {
        "3t": {"cases": ids["3T"], "patients": ids["3T"], "slices": 8, "areas": NCI_AREAS},
        "dx": {"cases": dx, "patients": dx, "slices": 8, "areas": NCI_AREAS},
    }


def promise12(raw: Path, seed: int = 0, n: int = 4) -> dict:
    """Promise12/Raw_Data/CaseNN.mhd/.raw and CaseNN_segmentation.mhd/.raw (0/1), ``n`` cases."""
    import SimpleITK as sitk

    rng = np.random.default_rng(seed)
    base = raw / "Promise12" / "Raw_Data"
    base.mkdir(parents=True)
    ids = [f"Case{i:02d}" for i in range(n)]
    for cid in ids:
        img, mask = volume(rng)
        im = sitk.GetImageFromArray(img.astype(np.int16))
        im.SetSpacing((0.6, 0.6, 3.6))
        lab = sitk.GetImageFromArray(mask)
        lab.CopyInformation(im)
        sitk.WriteImage(im, str(base / f"{cid}.mhd"))
        sitk.WriteImage(lab, str(base / f"{cid}_segmentation.mhd"))
    return {"cases": ids, "patients": ids, "slices": 3 * n}


def prostatex(raw: Path, seed: int = 0) -> dict:
    """PROSTATEx/Image/<manifest>/PROSTATEx/<id>/<study>/<series> and a DICOM-SEG with 4 zone segments in
    PROSTATEx/Mask/<manifest>/...; segment 3 (urethra) also marks a slice without zones (not prostate)."""
    import highdicom as hd
    from pydicom.sr.codedict import codes

    rng = np.random.default_rng(seed)
    ids = [f"ProstateX-{i:04d}" for i in range(4)]
    for cid in ids:
        img, mask = volume(rng)
        study = _uid()
        sources = dicom_series(
            img, raw / "PROSTATEx" / "Image" / "manifest-A" / "PROSTATEx" / cid / "s" / "t2", cid, study
        )
        zones = np.zeros((*MR, 4), bool)
        zones[..., 0] = mask > 0  # peripheral zone
        zones[1, 4:6, 6:8, 1] = True  # transition zone
        zones[:, 6, 8, 2] = True  # urethra: on every slice, counted only where a zone is
        zones[2, 5, 9, 3] = True  # anterior fibromuscular stroma
        names = ("peripheral zone", "transition zone", "urethra", "anterior fibromuscular stroma")
        descriptions = [
            hd.seg.SegmentDescription(
                segment_number=i + 1,
                segment_label=name,
                segmented_property_category=codes.SCT.Tissue,
                segmented_property_type=codes.SCT.Tissue,
                algorithm_type=hd.seg.SegmentAlgorithmTypeValues.MANUAL,
            )
            for i, name in enumerate(names)
        ]
        seg = hd.seg.Segmentation(
            source_images=sources,
            pixel_array=zones,
            segmentation_type=hd.seg.SegmentationTypeValues.BINARY,
            segment_descriptions=descriptions,
            series_instance_uid=_uid(),
            series_number=2,
            sop_instance_uid=_uid(),
            instance_number=1,
            manufacturer="replica",
            manufacturer_model_name="replica",
            software_versions="1",
            device_serial_number="1",
            content_date=datetime.date(2020, 1, 1),
            content_time=datetime.time(12, 0),
        )
        out = raw / "PROSTATEx" / "Mask" / "manifest-B" / "PROSTATEx" / cid / "s" / "seg" / "1-1.dcm"
        out.parent.mkdir(parents=True, exist_ok=True)
        seg.save_as(out)
    return {"cases": ids, "patients": ids, "slices": 12}


def prostate_all(raw: Path) -> dict[str, dict]:
    """Every prostate dataset, keyed by site."""
    nci = nci_isbi(raw, 3)
    return {
        "i2cvb": i2cvb(raw, 1),
        "msd": msd(raw, 2),
        "nci-isbi-3t": nci["3t"],
        "nci-isbi-dx": nci["dx"],
        "promise12": promise12(raw, 4),
        "prostatex": prostatex(raw, 5),
    }


# --- pancreas (3D) -----------------------------------------------------------------------------

CT = (6, 12, 10)  # (z, y, x): not cubic, so a transposed axis would show


def ct_volume(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(CT-like int16 volume, mask with 1 pancreas on slices 1..2 of 6 and 2 tumour inside it): not symmetric in
    any axis, so a reversed or transposed axis would show."""
    img = rng.integers(-200, 200, size=CT).astype(np.int16)
    mask = np.zeros(CT, np.uint8)
    mask[1:3, 3:7, 2:5] = 1
    mask[1, 4:5, 3:4] = 2
    return img, mask


def msd_pancreas(raw: Path, seed: int = 0) -> dict:
    """MSD/Task07_Pancreas: NIfTI images with an oblique-free but non-trivial affine, labels 0/1/2."""
    import nibabel as nib

    rng = np.random.default_rng(seed)
    base = raw / "MSD" / "Task07_Pancreas"
    affine = np.array([[-0.8, 0, 0, 120.0], [0, -0.8, 0, 90.0], [0, 0, 2.5, -300.0], [0, 0, 0, 1]])
    ids, masks = [], {}
    for i in (1, 4, 5):
        img, mask = ct_volume(rng)
        name = f"pancreas_{i:03d}.nii.gz"
        for folder, arr in (("imagesTr", img), ("labelsTr", mask)):
            (base / folder).mkdir(parents=True, exist_ok=True)
            nib.save(nib.Nifti1Image(arr.transpose(2, 1, 0), affine), base / folder / name)
        ids.append(name.split(".")[0])
        masks[ids[-1]] = mask
    return {"cases": ids, "patients": ids, "masks": masks}


def tcia_pancreas(raw: Path, seed: int = 0, quirks: bool = False) -> dict:
    """Pancreas-CT: DICOM series per patient (NBIA nesting) and TCIA_pancreas_labels-02-05-2017/labelNNNN.nii.gz
    stored head-first (z reversed, its header saying so). The series are unsigned (PixelRepresentation 0,
    values 824..1224). With ``quirks``: PANCREAS_0002 is a CT series with RescaleIntercept -1024 (stored values
    824..1224 are -200..200 HU), and label0025 / label0070 ship without images (TCIA removed those two
    patients from the collection; the label archive still has them). ``values`` holds each image's voxels."""
    import SimpleITK as sitk

    rng = np.random.default_rng(seed)
    root = raw / "Pancreas-CT"
    ids, masks, values = [], {}, {}
    for n in (1, 2, 3, 25, 70) if quirks else (1, 2, 3):
        cid = f"PANCREAS_{n:04d}"
        img, mask = ct_volume(rng)
        stored = (img.astype(np.int32) + 1024).astype(np.uint16)
        if quirks and n == 2:
            dicom_series(
                stored, root / cid / "s" / "c", cid, ct=True, RescaleIntercept=-1024, RescaleSlope=1, RescaleType="HU"
            )
            values[cid] = img
        elif n in (1, 2, 3):
            dicom_series(stored, root / cid / "1.2-study" / "1.2-series", cid)
            values[cid] = stored
        lab = sitk.GetImageFromArray(np.ascontiguousarray(mask[::-1] > 0).astype(np.uint8))
        lab.SetSpacing((0.5, 0.5, 3.0))
        lab.SetDirection((1, 0, 0, 0, 1, 0, 0, 0, -1))
        lab.SetOrigin((0.0, 0.0, 3.0 * (CT[0] - 1)))
        out = root / "TCIA_pancreas_labels-02-05-2017" / f"label{n:04d}.nii.gz"
        out.parent.mkdir(parents=True, exist_ok=True)
        sitk.WriteImage(lab, str(out))
        if n in (25, 70):
            continue
        ids.append(cid)
        masks[cid] = (mask > 0).astype(np.uint8)
    return {"cases": ids, "patients": ids, "masks": masks, "values": values}


def btcv(raw: Path, seed: int = 0) -> dict:
    """BTCV/RawData/Training/{img,label}/{img,label}NNNN.nii.gz with 13 organ labels (11 pancreas)."""
    import nibabel as nib

    rng = np.random.default_rng(seed)
    base = raw / "BTCV" / "RawData" / "Training"
    ids, masks = [], {}
    for n in (1, 2, 3):
        img, mask = ct_volume(rng)
        organs = np.where(mask > 0, 11, 0).astype(np.uint8)
        organs[0, :2, :2] = 1  # spleen
        organs[5, -2:, -2:] = 13  # left adrenal gland
        for folder, prefix, arr in (("img", "img", img), ("label", "label", organs)):
            (base / folder).mkdir(parents=True, exist_ok=True)
            nib.save(
                nib.Nifti1Image(arr.transpose(2, 1, 0), np.diag([0.7, 0.7, 3.0, 1])),
                base / folder / f"{prefix}{n:04d}.nii.gz",
            )
        ids.append(f"img{n:04d}")
        masks[ids[-1]] = (mask > 0).astype(np.uint8)
    return {"cases": ids, "patients": ids, "masks": masks}


def btcv_quirks(raw: Path, seed: int = 0) -> dict:
    """BTCV with labels whose header is not their image's: img0001 as it should be; img0002's label origin
    shifted by two voxels in x; img0003's label header with a flipped x axis over the same voxels (the
    affine's first column negated, origin kept); img0004's label stored with x reversed and a header that
    says so (the same physical grid); img0005's label without the pancreas value 11 (other organs only).
    ``bad`` maps each case to be refused to a word its message holds; ``masks`` the pancreas of the others."""
    import nibabel as nib

    rng = np.random.default_rng(seed)
    base = raw / "BTCV" / "RawData" / "Training"
    affine = np.diag([0.7, 0.7, 3.0, 1])
    masks, bad = {}, {}
    for n in range(1, 6):
        img, mask = ct_volume(rng)
        organs = np.where(mask > 0, 11, 0).astype(np.uint8)
        organs[0, :2, :2] = 1
        lab_affine, lab = affine.copy(), organs.transpose(2, 1, 0)
        if n == 2:
            lab_affine[0, 3] += 2 * 0.7
            bad["img0002"] = "origin"
        elif n == 3:
            lab_affine[:, 0] *= -1
            bad["img0003"] = "direction"
        elif n == 4:
            lab = lab[::-1]  # x reversed: voxel i holds what voxel (nx - 1 - i) held
            lab_affine[:, 0] *= -1
            lab_affine[0, 3] = (CT[2] - 1) * 0.7
        elif n == 5:
            lab = np.where(lab == 11, 0, lab).astype(np.uint8)
            bad["img0005"] = "value 11"
        for folder, name, arr, aff in (
            ("img", "img", img.transpose(2, 1, 0), affine),
            ("label", "label", lab, lab_affine),
        ):
            (base / folder).mkdir(parents=True, exist_ok=True)
            nib.save(nib.Nifti1Image(np.ascontiguousarray(arr), aff), base / folder / f"{name}{n:04d}.nii.gz")
        if f"img{n:04d}" not in bad:
            masks[f"img{n:04d}"] = (mask > 0).astype(np.uint8)
    return {"masks": masks, "bad": bad}


def pancreas_all(raw: Path) -> dict[str, dict]:
    """Every pancreas dataset, keyed by site."""
    return {"msd-pancreas": msd_pancreas(raw, 1), "tcia-pancreas-ct": tcia_pancreas(raw, 2), "btcv": btcv(raw, 3)}
