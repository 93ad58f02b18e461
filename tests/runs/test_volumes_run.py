"""A volume federation end to end: sites in different orientations and spacings, planned, trained on
patches, tested in each scan's own grid."""

from __future__ import annotations

import json

import nibabel as nib
import numpy as np
import pytest

from fedseg.cli import main
from fedseg.data.spec import load_federation
from fedseg.data.volumes.load import load_volume_split, plan_federation
from fedseg.foundation.errors import DataError
from fedseg.simulation.runner import run

# (affine of the array axes, shape): one site stored RAS at 1.5 mm slices, one LPS at 3 mm slices
SITES = {
    "ras": (np.diag([1.0, 1.0, 1.5, 1.0]), (24, 24, 16)),
    "lps": (np.array([[-1.2, 0, 0, 14.0], [0, -1.2, 0, 14.0], [0, 0, 3.0, 0.0], [0, 0, 0, 1]]), (20, 20, 8)),
}


def _case(rng, affine, shape, nested=False):
    idx = np.stack(np.meshgrid(*[np.arange(s) for s in shape], indexing="ij"), -1).reshape(-1, 3)
    world = idx @ affine[:3, :3].T + affine[:3, 3]
    centre = np.array([12.0, 12.0, 12.0]) + rng.uniform(-2, 2, 3)
    r = np.linalg.norm((world - centre) / [7.0, 6.0, 6.0], axis=1).reshape(shape)
    label = (r < 1).astype(np.int16)
    if nested:  # a core (value 2) inside the mass (values 1 and 2)
        label[r < 0.55] = 2
    image = np.where(r < 1, 60, np.where(r < 1.6, 20, -1000)) + rng.normal(0, 5, shape)
    return np.round(image).astype(np.int16), label


def write_federation(root, rng_seed=0, n=(3, 1, 1), broken=None, nested=False):
    """Two (or, with ``SITES`` patched, more) volume sites; ``nested``: labels ``mass = [1, 2]``, ``core = [2]``."""
    rng = np.random.default_rng(rng_seed)
    sites = []
    for name, (affine, shape) in SITES.items():
        lists = {}
        for split, count in zip(("training", "validation", "testing"), n):
            lists[split] = []
            for k in range(count):
                image, label = _case(rng, affine, shape, nested)
                img_f, lab_f = root / name / f"{split}{k}_img.nii.gz", root / name / f"{split}{k}_lab.nii.gz"
                img_f.parent.mkdir(parents=True, exist_ok=True)
                lab_affine = affine.copy()
                if broken == "affine" and name == "lps" and k == 0 and split == "training":
                    lab_affine[0, 3] += 5.0
                nib.save(nib.Nifti1Image(image, affine), img_f)
                nib.save(nib.Nifti1Image(label, lab_affine), lab_f)
                lists[split].append({"image": img_f.name, "label": lab_f.name})
        (root / name / "datalist.json").write_text(json.dumps(lists))
        sites.append(f'[[sites]]\nname = "{name}"\ndatalist = "{name}/datalist.json"\n')
    spec = root / "fed.toml"
    labels = "mass = [1, 2]\ncore = [2]\n" if nested else "mass = [1]\n"
    spec.write_text(
        'name = "vol"\n[data]\nmode = "3d"\nspatial_dims = 3\nin_channels = 1\n[data.labels]\n'
        + labels
        + "\n"
        + "\n".join(sites)
    )
    return spec


def test_plan_and_grid_of_a_two_site_volume_federation(tmp_path, capsys):
    spec = write_federation(tmp_path)
    assert main(["plan", str(spec)]) == 0
    plan = json.loads((tmp_path / "fed.plan.json").read_text())
    assert "wrote" in capsys.readouterr().out
    # median spacing over 6 cases (3 at 1.0/1.0/1.5, 3 at 1.2/1.2/3.0), per RAS axis
    assert plan["target_spacing"] == pytest.approx([1.1, 1.1, 2.25])
    assert plan["intensity"]["channels"][0]["mode"] == "ct"  # voxels with air at -1000
    fed = load_federation(spec)
    test = load_volume_split(fed, fed.site("lps"), "testing", plan_federation(fed, log=lambda m: None))
    assert test.originals[0].shape == SITES["lps"][1]
    assert tuple(test.original_labels[0].shape) == (1, *SITES["lps"][1])


def test_label_off_the_image_grid_names_both_files(tmp_path):
    spec = write_federation(tmp_path, broken="affine")
    fed = load_federation(spec)
    with pytest.raises(DataError, match=r"training0_lab.nii.gz: label affine differs .*training0_img.nii.gz"):
        plan_federation(fed, log=lambda m: None)


def test_fedavg_on_volumes_scores_every_test_case_in_its_own_grid(tmp_path):
    spec = write_federation(tmp_path)
    logs = []
    results = run(
        spec,
        out=tmp_path / "run",
        overrides=["rounds=2", "train.local_steps=2", "train.batch_size=2", "model.num_res_units=0"],
        progress=False,
        log=logs.append,
    )
    assert results["plan"]["patch_size"] == json.loads((tmp_path / "fed.plan.json").read_text())["patch_size"]
    assert any("plan: model.roi_size" in m for m in logs)
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["plan"]["target_spacing"] == results["plan"]["target_spacing"]
    assert saved["num_cases"] == {"ras": 1, "lps": 1}  # one test case per site, each scored once
    assert 0.0 <= saved["client_avg_dice"] <= 1.0
    # HD95 per test case in mm (3D default), bounded by the largest field-of-view diagonal of the two sites
    diagonal = max(float(np.linalg.norm(np.asarray(s) * np.abs(np.diag(a)[:3]))) for a, s in SITES.values())
    hd = saved["per_case_hd95"]["global"]
    assert {s: len(v) for s, v in hd.items()} == {"ras": 1, "lps": 1}
    assert all(0.0 <= v[0] <= diagonal + 1e-6 for v in hd.values())
    assert saved["client_avg_hd95"] == pytest.approx((hd["ras"][0] + hd["lps"][0]) / 2)
    assert "HD95 (mm)" in (tmp_path / "run" / "results.md").read_text()
    # the derived validation interval keeps at least 4 validations: a 2-round run validates every round
    assert saved["config"]["eval"]["every"] == 1 and not any(m.startswith("plan: eval.every") for m in logs)


@pytest.mark.parametrize("method", ["fedsm", "fedsm-extra"])
def test_fedsm_on_volumes_routes_whole_scans_through_sliding_windows(tmp_path, method):
    """FedSM's selector and its oracle labels (Eq. 1) see each validation scan whole, predicted by every
    model as the workload evaluates (sliding windows), so scans whose extent is not a multiple of the
    U-Net's strides are routed and scored like any other."""
    spec = write_federation(tmp_path)
    saved = run(
        spec,
        out=tmp_path / "run",
        overrides=[
            f"method={method}",
            "rounds=2",
            "train.local_steps=2",
            "train.batch_size=2",
            "model.num_res_units=0",
        ],
        progress=False,
        log=lambda m: None,
    )
    assert saved["num_cases"] == {"ras": 1, "lps": 1}
    assert 0.0 <= saved["client_avg_dice"] <= 1.0
