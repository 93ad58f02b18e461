"""Auto-FedAvg's pancreas federation prepared from replicas of MSD Task07, TCIA Pancreas-CT and BTCV:
volumes stay 3D NIfTI with their source geometry, labels are pancreas (tumour included), splits by patient."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedseg.apps.prepare import prepare, split_patients
from fedseg.apps.prepare.pancreas import AUTOFEDAVG_PANCREAS
from tests.support import replicas

AUTOFEDAVG_PANCREAS_SITES = ("msd-pancreas", "tcia-pancreas-ct", "btcv")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def pancreas(tmp_path_factory):
    raw = tmp_path_factory.mktemp("pancreas_raw")
    expected = replicas.pancreas_all(raw)
    out = tmp_path_factory.mktemp("pancreas_out")
    return raw, out, prepare(AUTOFEDAVG_PANCREAS, raw, out, log=lambda _: None), expected


def test_volumes_keep_their_geometry_and_labels_are_pancreas_with_tumour(pancreas):
    """Each output image has its source's affine (MSD, BTCV: the NIfTI's; TCIA: the DICOM series'), each label
    the image's; values 0/1: MSD's tumour (2) merged, BTCV's other organs dropped, TCIA's head-first label
    put back into the image's axis order."""
    import nibabel as nib
    import SimpleITK as sitk

    raw, out, summary, expected = pancreas
    spec = summary.spec.read_text()
    assert 'mode = "3d"' in spec and "spatial_dims = 3" in spec and "image_size" not in spec
    for r in summary.sites:
        assert not r.bad and r.converted == 3 and r.counts == {"training": 1, "validation": 1, "testing": 1}, r
        for cid, mask in expected[r.site]["masks"].items():
            image = nib.load(out / r.site / "images" / f"{cid}.nii.gz")
            label = nib.load(out / r.site / "labels" / f"{cid}.nii.gz")
            np.testing.assert_allclose(label.affine, image.affine)
            got = np.asarray(label.dataobj).transpose(2, 1, 0)  # (z, y, x) as the replica wrote it
            np.testing.assert_array_equal(got, (mask > 0).astype(np.uint8))
            if r.site == "msd-pancreas":
                source = nib.load(raw / "MSD" / "Task07_Pancreas" / "imagesTr" / f"{cid}.nii.gz")
                np.testing.assert_allclose(image.affine, source.affine, atol=1e-5)
            if r.site == "tcia-pancreas-ct":
                source = sitk.ReadImage(str(out / r.site / "images" / f"{cid}.nii.gz"))
                assert source.GetSpacing() == pytest.approx((0.5, 0.5, 3.0)) and source.GetOrigin() == (0, 0, 0)
        cases = json.loads((out / r.site / "manifest.json").read_text())["cases"]
        assert len({e["split"] for e in cases.values()}) == 3


def test_the_prepared_pancreas_federation_validates(pancreas):
    from fedseg.data import validate_federation

    assert validate_federation(pancreas[2].spec) == []


def test_the_prepared_pancreas_federation_is_planned(pancreas):
    """The volumes' plan is made from the three sites' training cases (one each here)."""
    from fedseg.data.spec import load_federation
    from fedseg.data.volumes.load import plan_federation

    plan = plan_federation(load_federation(pancreas[2].spec), log=lambda _: None)
    assert plan.sites == sorted(AUTOFEDAVG_PANCREAS_SITES) and plan.cases == 3 and not plan.rejected


def test_auto_fedavg_split_sizes_from_its_rule():
    """Auto-FedAvg §4.3: 281 -> 95/93/93, 82 -> 28/27/27, 30 -> 10/10/10 with round(0.33 n) to validation and
    to testing and the rest to training."""
    for n, want in {281: (95, 93, 93), 82: (28, 27, 27), 30: (10, 10, 10)}.items():
        split = split_patients(
            [str(i) for i in range(n)], 0, "s", AUTOFEDAVG_PANCREAS.fractions, AUTOFEDAVG_PANCREAS.rest
        )
        assert tuple(list(split.values()).count(s) for s in ("training", "validation", "testing")) == want
