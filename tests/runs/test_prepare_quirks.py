"""``fedseg prepare`` on replicas of the releases' quirks (tests/support/replicas.py): each case lands on the right
anatomy, slice order and view, or is refused with a message naming its file and the fix; no split is
left empty when a site has enough patients, and ``fedseg validate`` accepts what ``prepare`` wrote."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from fedseg.apps.prepare import prepare, split_patients
from fedseg.apps.prepare.pancreas import AUTOFEDAVG_PANCREAS
from fedseg.data import validate_federation
from fedseg.foundation.errors import DataError
from tests.support import replicas

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
QUIET = {"log": lambda _: None}


def _png(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im)


def _tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(p.relative_to(root).as_posix().encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


# --- NCI-ISBI: the NRRD's slice order -----------------------------------------------------------


def test_nci_isbi_labels_land_on_their_slices_whichever_way_instance_numbers_run(tmp_path):
    """Replicas as the challenge's loaders read them: NRRD slice k is InstanceNumber k + 1. Prostate on the
    LPS slices 1 (20 px) and 2 (12 px) of 5; a mask laid the wrong way round would land on slices 2 and 3 with
    the areas swapped. Cases cover InstanceNumber head-to-feet and feet-to-head, with a header geometry
    (placed by it), without one or with the default one a writer leaves (placed by InstanceNumber). A second run converts nothing and leaves the
    output byte-identical."""
    raw = tmp_path / "raw"
    expected = replicas.nci_isbi(raw)
    out = tmp_path / "out"
    summary = prepare("fedsm-prostate", raw, out, sites=["nci-isbi-3t", "nci-isbi-dx"], **QUIET)
    assert validate_federation(summary.spec) == [] and not summary.problems
    for r, key in zip(summary.sites, ("3t", "dx")):
        assert not r.bad and r.converted == 4, r
        for cid in expected[key]["cases"]:
            labels = sorted((out / r.site / "labels" / cid).glob("*.png"))
            areas = {p.stem: int((_png(p) > 0).sum()) for p in labels}
            assert areas == expected[key]["areas"], (cid, areas)
            for p in labels:
                assert np.nonzero(_png(p).any(axis=1))[0].tolist() == [4, 5, 6, 7], p
    # the cases without a header geometry whose InstanceNumbers run head to feet are noted as laid by them
    assert "InstanceNumber" in summary.sites[0].notes["Prostate3T-01-0003"]
    assert "(the default one)" in summary.sites[1].notes["ProstateDx-01-0008"]
    before = _tree_hash(out)
    again = prepare("fedsm-prostate", raw, out, sites=["nci-isbi-3t", "nci-isbi-dx"], **QUIET)
    assert sum(r.converted for r in again.sites) == 0 and _tree_hash(out) == before


def test_nci_isbi_header_that_disagrees_with_the_series_stops_naming_the_case(tmp_path):
    """The NRRD header's origin 6 mm (two slices) off the series' first ImagePositionPatient: the case is
    reported with its id, nothing written for it; --strict stops at it."""
    raw = tmp_path / "raw"
    replicas.nci_isbi(raw)
    path = raw / "NCI_ISBI" / "Mask" / "Training" / "Prostate3T-01-0001.nrrd"
    header, _, data = path.read_bytes().partition(b"\n\n")
    x, y, z = replicas.NCI_ORIGIN
    shifted = header.replace(
        f"space origin: ({x:g},{y:g},{z:g})".encode(), f"space origin: ({x:g},{y:g},{z + 6:g})".encode()
    )
    assert shifted != header
    path.write_bytes(shifted + b"\n\n" + data)
    summary = prepare("fedsm-prostate", raw, tmp_path / "out", sites=["nci-isbi-3t"], **QUIET)
    why = summary.sites[0].bad["Prostate3T-01-0001"]
    assert "Prostate3T-01-0001" in why and "disagrees with the DICOM series" in why and "origin" in why
    assert not (tmp_path / "out" / "nci-isbi-3t" / "labels" / "Prostate3T-01-0001").exists()
    with pytest.raises(DataError, match=r"Prostate3T-01-0001.*disagrees"):
        prepare("fedsm-prostate", raw, tmp_path / "out2", sites=["nci-isbi-3t"], strict=True, **QUIET)


# --- RIM-ONE r3: the annotated view ------------------------------------------------------------


def test_rim_one_half_width_masks_are_on_the_left_view_for_both_eyes(tmp_path):
    """Half-width masks (one view wide): every case, -L and -R, is cut to the left half of its stereo pair,
    where the disc was drawn (the right view's disc is 8 px away, so the wrong half would not match)."""
    from PIL import Image

    raw = tmp_path / "raw"
    expected = replicas.rimone(raw, half=True)
    out = tmp_path / "out"
    summary = prepare("fedsm-fundus", raw, out, sites=["rim-one-r3"], **QUIET)
    assert not summary.sites[0].bad
    assert any(c.endswith("-R") for c in expected["cases"])
    for cid in expected["cases"]:
        group = "Healthy" if cid.startswith("N") else "Glaucoma and suspects"
        with Image.open(raw / "RIM-ONE r3" / group / "Stereo Images" / f"{cid}.jpg") as im:
            stereo = np.asarray(im.convert("RGB"))
        np.testing.assert_array_equal(_png(out / "rim-one-r3" / "images" / f"{cid}.png"), stereo[:, : replicas.SIZE])
        label = _png(out / "rim-one-r3" / "labels" / f"{cid}.png")
        pale = stereo[:, : replicas.SIZE, 0] > 190  # the drawn disc of the left view
        dice = 2 * (pale & (label > 0)).sum() / (pale.sum() + (label > 0).sum())
        assert dice > 0.9, (cid, dice)


# --- files missing, truncated, corrupt: each named ---------------------------------------------


def test_refuge_missing_image_and_truncated_mask_are_named_and_the_spec_warned(tmp_path):
    """A mask whose image is missing is a reported case, not a silent drop; a truncated BMP is reported with
    its file name. Two good patients cannot fill three splits: prepare warns that validate will refuse."""
    raw = tmp_path / "raw"
    replicas.refuge(raw)
    (raw / "REFUGE" / "Training400" / "Glaucoma" / "g0001.jpg").unlink()
    bmp = raw / "REFUGE" / "REFUGE-Validation400-GT" / "Disc_Cup_Masks" / "V0002.bmp"
    bmp.write_bytes(bmp.read_bytes()[:-200])
    logged = []
    summary = prepare("fedsm-fundus", raw, tmp_path / "out", sites=["refuge"], log=logged.append)
    bad = summary.sites[0].bad
    assert set(bad) == {"g0001", "V0002"}
    assert "g0001.jpg: image missing beside its mask g0001.bmp" in bad["g0001"]
    assert "V0002.bmp: cannot be read" in bad["V0002"]
    assert summary.problems and "refuge" in summary.problems[0] and "validation" in summary.problems[0]
    assert "WARNING: fedseg validate will refuse" in summary.table() and any("WARNING" in m for m in logged)
    assert validate_federation(summary.spec)  # the warning was right


def test_dicom_slice_missing_or_corrupt_is_named(tmp_path):
    """I2CVB T2W series: one with a slice file deleted (a gap in ImagePositionPatient), one with a truncated
    slice file (GDCM leaves it out of the series): each message names the files, not a size mismatch."""
    raw = tmp_path / "raw"
    replicas.i2cvb(raw)
    (raw / "I2CVB" / "GE" / "Patient_001" / "T2W" / "1-03.dcm").unlink()
    broken = raw / "I2CVB" / "GE" / "Patient_002" / "T2W" / "1-02.dcm"
    broken.write_bytes(broken.read_bytes()[:-100])
    bad = prepare("fedsm-prostate", raw, tmp_path / "out", sites=["i2cvb"], **QUIET).sites[0].bad
    assert "a slice is missing between 1-02.dcm and 1-04.dcm" in bad["Patient_001"]
    assert "1-02.dcm: not a readable DICOM slice" in bad["Patient_002"]
    assert "size" not in bad["Patient_001"] + bad["Patient_002"]


def test_promise12_missing_raw_is_named_and_splits_are_drawn_after_skips(tmp_path):
    """Six cases, two without their voxel data and one segmentation without its image: the message names the
    missing .raw (not the .mhd that points to it) and the missing image; the three good patients fill
    training, validation and testing (1/1/1), and ``fedseg validate`` accepts the spec."""
    raw = tmp_path / "raw"
    replicas.promise12(raw, n=6)
    base = raw / "Promise12" / "Raw_Data"
    (base / "Case01.raw").unlink()
    (base / "Case03_segmentation.raw").unlink()
    (base / "Case05.mhd").unlink()
    (base / "Case05.raw").unlink()
    summary = prepare("fedsm-prostate", raw, tmp_path / "out", sites=["promise12"], **QUIET)
    r = summary.sites[0]
    assert r.bad["Case01"].startswith(f"{base / 'Case01.raw'}: missing")
    assert r.bad["Case03"].startswith(f"{base / 'Case03_segmentation.raw'}: missing")
    assert r.bad["Case05"].startswith(f"{base / 'Case05.mhd'}: image missing beside its label Case05_segmentation.mhd")
    assert r.patients == {"training": 1, "validation": 1, "testing": 1}
    assert not summary.problems and validate_federation(summary.spec) == []


def test_three_patients_fill_three_splits_and_two_cannot():
    """0.5/0.25/0.25 of 3 rounds to 2/1/0: an empty split takes a patient from the largest, 1/1/1. The paper
    tables' counts have no empty split and stay as they were (tests/runs/test_prepare.py)."""
    for fractions, rest in (((0.5, 0.25, 0.25), 2), (AUTOFEDAVG_PANCREAS.fractions, AUTOFEDAVG_PANCREAS.rest)):
        split = split_patients(["a", "b", "c"], 0, "s", fractions, rest)
        assert sorted(split.values()) == ["testing", "training", "validation"]
    assert len(set(split_patients(["a", "b"], 0, "s").values())) == 2


# --- RIGA: names and nesting -------------------------------------------------------------------


def test_riga_original_without_prime_and_five_annotators_are_noted(tmp_path):
    """MESSIDOR's image48 (original without 'prime') is read as the original and noted; a case with 5 of 6
    annotators is fused by the majority of those and noted; both still give disc radius 10, cup 6."""
    raw = tmp_path / "raw"
    expected = replicas.riga(raw, "MESSIDOR", 3, quirks=True)
    out = tmp_path / "out"
    summary = prepare("fedsm-fundus", raw, out, sites=["riga-messidor"], **QUIET)
    r = summary.sites[0]
    assert not r.bad and r.converted == 4
    assert set(r.notes) == set(expected["notes"]) and len(r.notes) == 2
    for cid, text in expected["notes"].items():
        assert text in r.notes[cid], (cid, r.notes[cid])
        assert f"{cid}: note:" in summary.table()
        label = _png(out / "riga-messidor" / "labels" / f"{cid}.png")
        assert (label > 0).sum() == pytest.approx(np.pi * 10**2, rel=0.1)
        assert (label == 2).sum() == pytest.approx(np.pi * 6**2, rel=0.2)


def test_riga_binrushed_nested_as_the_archive_unpacks_is_found(tmp_path):
    raw = tmp_path / "raw"
    expected = replicas.riga(raw, "BinRushed", 1, nest="BinRushedcorrected")
    assert not (raw / "RIGA" / "BinRushed").exists()
    r = prepare("fedsm-fundus", raw, tmp_path / "out", sites=["riga-binrushed"], **QUIET).sites[0]
    assert not r.bad and r.converted == 4
    assert sorted(p.stem for p in (tmp_path / "out" / "riga-binrushed" / "labels").glob("*.png")) == sorted(
        expected["cases"]
    )


# --- pancreas: label headers, removed cases, pixel types ---------------------------------------


def test_btcv_labels_with_another_geometry_are_refused_and_a_missing_pancreas_flagged(tmp_path):
    """A label whose origin is shifted, or whose header flips an axis over the same voxels, is refused with
    the label named (not re-stamped with the image's geometry); a label stored with x reversed and a header
    saying so is the same grid: reoriented, right and noted; a label without value 11 is flagged."""
    import nibabel as nib

    raw = tmp_path / "raw"
    expected = replicas.btcv_quirks(raw)
    out = tmp_path / "out"
    summary = prepare(AUTOFEDAVG_PANCREAS, raw, out, sites=["btcv"], **QUIET)
    r = summary.sites[0]
    assert set(r.bad) == set(expected["bad"])
    for cid, word in expected["bad"].items():
        assert f"label{cid[3:]}.nii.gz" in r.bad[cid] and word in r.bad[cid], r.bad[cid]
    assert "does not place it on its image" in r.bad["img0002"] and "does not place" in r.bad["img0003"]
    assert "no pancreas" in r.bad["img0005"]
    for cid, mask in expected["masks"].items():
        got = np.asarray(nib.load(out / "btcv" / "labels" / f"{cid}.nii.gz").dataobj).transpose(2, 1, 0)
        np.testing.assert_array_equal(got, mask)
    assert "reoriented" in r.notes["img0004"]


def test_msd_pancreas_label_with_a_shifted_origin_or_without_its_image_is_refused(tmp_path):
    import nibabel as nib

    raw = tmp_path / "raw"
    replicas.msd_pancreas(raw)
    (raw / "MSD" / "Task07_Pancreas" / "imagesTr" / "pancreas_005.nii.gz").unlink()
    path = raw / "MSD" / "Task07_Pancreas" / "labelsTr" / "pancreas_004.nii.gz"
    lab = nib.load(path)
    affine = lab.affine.copy()
    affine[2, 3] += 2.5  # one slice up
    nib.save(nib.Nifti1Image(np.asarray(lab.dataobj), affine), path)
    bad = prepare(AUTOFEDAVG_PANCREAS, raw, tmp_path / "out", sites=["msd-pancreas"], **QUIET).sites[0].bad
    assert set(bad) == {"pancreas_004", "pancreas_005"}
    assert "pancreas_004.nii.gz: the label's header does not place" in bad["pancreas_004"]
    assert "pancreas_005.nii.gz: image missing beside its label" in bad["pancreas_005"]


def test_tcia_removed_cases_are_said_so_and_series_keep_a_small_integer_type(tmp_path):
    """label0025 / label0070 without images: left out with the reason (removed by TCIA), not "unpack the
    download". A label whose header origin is not its image's (the release does not document its label
    headers) is placed voxel for voxel after reorientation, with a note. An unsigned series is written uint16 with its stored values; a CT series with
    RescaleIntercept -1024 as int16 Hounsfield units."""
    import SimpleITK as sitk

    raw = tmp_path / "raw"
    expected = replicas.tcia_pancreas(raw, quirks=True)
    shifted = raw / "Pancreas-CT" / "TCIA_pancreas_labels-02-05-2017" / "label0003.nii.gz"
    label = sitk.ReadImage(str(shifted))
    label.SetOrigin((0.0, 0.0, 0.0))  # a header that does not place it (the release does not document them)
    sitk.WriteImage(label, str(shifted))
    out = tmp_path / "out"
    summary = prepare(AUTOFEDAVG_PANCREAS, raw, out, sites=["tcia-pancreas-ct"], **QUIET)
    r = summary.sites[0]
    assert not r.bad and set(r.excluded) == {"PANCREAS_0025", "PANCREAS_0070"}
    assert set(r.notes) == {"PANCREAS_0003"} and "placed voxel for voxel" in r.notes["PANCREAS_0003"]
    got = sitk.GetArrayFromImage(sitk.ReadImage(str(out / "tcia-pancreas-ct" / "labels" / "PANCREAS_0003.nii.gz")))
    np.testing.assert_array_equal(got, expected["masks"]["PANCREAS_0003"])
    assert all("removed" in why and "on purpose" in why for why in r.excluded.values())
    assert "unpack" not in summary.table()
    for cid, want in (("PANCREAS_0001", sitk.sitkUInt16), ("PANCREAS_0002", sitk.sitkInt16)):
        image = sitk.ReadImage(str(out / "tcia-pancreas-ct" / "images" / f"{cid}.nii.gz"))
        assert image.GetPixelID() == want, (cid, image.GetPixelIDTypeAsString())
        np.testing.assert_array_equal(sitk.GetArrayFromImage(image), expected["values"][cid])
    assert validate_federation(summary.spec) == []
