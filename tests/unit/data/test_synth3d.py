"""The 3D CT federation ``ct-lesion``: NIfTI files with per-site geometry and one anatomy in physical space."""

from __future__ import annotations

import itertools
import json

import nibabel as nib
import numpy as np
import pytest

from fedseg.cli import build_parser, main
from fedseg.data.spec import load_federation
from fedseg.data.synth import split_sizes, synthesize
from fedseg.data.synth3d import (
    CT_COUNTS,
    CT_SITES,
    ct_grid,
    ct_split_sizes,
    draw_anatomy,
    labels_at,
    render_ct,
)
from fedseg.foundation.errors import ConfigError

SIZE = 32  # u = 0.5: 32 x 32 in-plane, 24 / 10 / 8 slices
SCALE = 0.2  # 2 / 2 / 2 cases per site
CODES = [("R", "A", "S"), ("L", "P", "S"), ("I", "A", "L")]
#: nominal organ centre, a soft-tissue point and an air point in RAS mm at size 64 (x u = size / 64)
ORGAN, SOFT, AIR = (5.7, 2.0, 0.0), (-9.0, 0.0, 0.0), (0.0, 17.0, 0.0)


@pytest.fixture(scope="module")
def fed(tmp_path_factory):
    return synthesize("ct-lesion", tmp_path_factory.mktemp("ct"), seed=0, scale=SCALE, size=SIZE).parent


def _cases(root):
    """(site index, split index, case index, image, label) of every case, in datalist order."""
    for s in range(len(CT_SITES)):
        d = json.loads((root / f"site{s + 1}" / "datalist.json").read_text())
        for j, split in enumerate(("training", "validation", "testing")):
            for i, e in enumerate(d[split]):
                base = root / f"site{s + 1}"
                yield s, j, i, nib.load(base / e["image"]), nib.load(base / e["label"])


def _voxel(affine, point_mm):
    """Nearest voxel of a world point (world -> voxel through the inverse affine)."""
    return tuple(np.rint(np.linalg.inv(affine) @ [*point_mm, 1.0])[:3].astype(int))


def test_geometry_differs_per_site_as_declared(fed):
    """Orientation codes (nibabel.aff2axcodes), spacings (header zooms) in the declared ranges, shapes,
    scanner qform/sform, int16 images and uint8 labels on the image's grid; no two sites share an affine."""
    affines = {}
    for s, _, _, img, lab in _cases(fed):
        site = CT_SITES[s]
        assert nib.aff2axcodes(img.affine) == CODES[s]
        zooms = np.array(img.header.get_zooms())
        ax = site.slice_axis
        assert zooms[ax] == pytest.approx(site.slice) and 1.0 <= zooms[ax] <= 5.0
        inplane = np.delete(zooms, ax)
        assert inplane == pytest.approx([site.inplane] * 2) and np.all((0.6 <= inplane) & (inplane <= 1.0))
        assert img.shape == ct_grid(site, SIZE)[0] and img.shape[ax] == round(site.slices * SIZE / 64)
        assert np.allclose(img.affine, lab.affine) and img.shape == lab.shape
        assert int(img.header["qform_code"]) == int(img.header["sform_code"]) == 1
        assert img.get_data_dtype() == np.int16 and lab.get_data_dtype() == np.uint8
        affines.setdefault(s, img.affine)
    for a, b in itertools.combinations(affines.values(), 2):
        assert not np.allclose(a, b)
    assert {CT_SITES[s].slice for s in affines} == {1.0, 3.0, 5.0}


def test_labels_nested_and_exactly_the_anatomy(fed):
    """Every case has an organ and a lesion; every voxel labelled 1 or 2 lies in the organ ellipsoid of the
    patient drawn from the case's seed, and every voxel labelled 2 in the lesion too (lesion within organ);
    the voxel's world position comes from the file's affine, so this also checks the written geometry."""
    for s, j, i, _img, lab in _cases(fed):
        anat = draw_anatomy(CT_SITES[s], np.random.default_rng([0, s, j, i]), SIZE)
        values = np.asarray(lab.dataobj)
        assert set(np.unique(values)) == {0, 1, 2}
        vox = np.argwhere(np.ones(values.shape, bool))
        world = vox @ lab.affine[:3, :3].T + lab.affine[:3, 3]
        assert np.array_equal(labels_at(anat, world), values.ravel())
        assert (values == 1).sum() > 0 and (values == 2).sum() > 0


def test_same_physical_point_same_tissue_at_every_site(fed):
    """One world point lands in the organ of every case of every site (despite orientation, spacing and field
    of view), a second in soft tissue, a third in air: the anatomy is one, the grids differ."""
    u = SIZE / 64
    for _, _, _, img, lab in _cases(fed):
        hu, values = img.get_fdata(), np.asarray(lab.dataobj)
        organ, soft, air = (_voxel(img.affine, np.array(p) * u) for p in (ORGAN, SOFT, AIR))
        assert values[organ] in (1, 2)
        assert values[soft] == 0 and -80 < hu[soft] < 160
        assert values[air] == 0 and hu[air] < -900


def test_one_anatomy_on_three_grids_gives_one_organ():
    """The same patient rendered on each site's grid (size 64): the organ's centroid in world millimetres
    agrees within half a millimetre and its volume is the ellipsoid's, 4/3 pi abc, within 5 %."""
    anat = draw_anatomy(CT_SITES[0], np.random.default_rng(7), 64)
    centre, semi, _ = anat.organ
    expected = 4 / 3 * np.pi * np.prod(semi)
    for site in CT_SITES:
        _, label, affine = render_ct(anat, site, 64, np.random.default_rng(0))
        vox = np.argwhere(label > 0)
        world = vox @ affine[:3, :3].T + affine[:3, 3]
        volume = len(vox) * abs(np.linalg.det(affine[:3, :3]))
        assert np.linalg.norm(world.mean(0) - centre) < 0.5
        assert volume == pytest.approx(expected, rel=0.05)


def test_intensities_are_ct_like_per_site(fed):
    """HU as stored by CT: air at -1000 + the site's calibration offset, soft tissue and bone in range,
    the implant site's metal above 2000 HU (what breaks min-max scaling), the reconstruction circle's
    -2048 at the third site, whose file stores HU + 1024 with scl_inter = -1024."""
    for s, _, _, img, lab in _cases(fed):
        site, hu, values = CT_SITES[s], img.get_fdata(), np.asarray(lab.dataobj)
        inside = hu > -1500
        assert hu[inside].min() >= -1024 and hu.max() <= 3071
        air = hu[(hu < -500) & inside]
        assert abs(np.median(air) - (-1000 + site.hu_offset)) < 5
        organ = np.median(hu[values == 1])
        assert abs(organ - (site.organ_hu + site.hu_offset)) < site.noise
        if site.implant:
            assert hu.max() > 2000
        else:
            assert hu.max() < 1000
        if site.outside is not None:
            assert hu.min() == site.outside and img.dataobj.inter == -1024
            assert img.dataobj.get_unscaled().min() == site.outside + 1024
        else:
            assert hu.min() >= -1024


def test_same_seed_same_bytes_other_seed_differs(fed, tmp_path):
    again = synthesize("ct-lesion", tmp_path / "a", seed=0, scale=SCALE, size=SIZE).parent
    other = synthesize("ct-lesion", tmp_path / "b", seed=1, scale=SCALE, size=SIZE).parent

    def tree(root):
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    ref = tree(fed)
    assert tree(again) == ref
    changed = tree(other)
    assert changed.keys() == ref.keys()
    assert changed["site2/images/train_0.nii.gz"] != ref["site2/images/train_0.nii.gz"]


def test_spec_and_split_sizes(fed):
    spec = load_federation(fed / "federation.toml")
    assert (spec.mode, spec.spatial_dims, spec.in_channels, spec.image_size) == ("3d", 3, 1, None)
    assert spec.labels == {"organ": (1, 2), "lesion": (2,)} and spec.site_names == ("site1", "site2", "site3")
    assert split_sizes("ct-lesion", 1.0) == ct_split_sizes(1.0) == [tuple(c) for c in CT_COUNTS]
    for s, counts in enumerate(ct_split_sizes(SCALE)):
        d = json.loads((fed / f"site{s + 1}" / "datalist.json").read_text())
        assert [len(d[k]) for k in ("training", "validation", "testing")] == list(counts) == [2, 2, 2]


def test_cli_writes_the_preset_and_refuses_a_tiny_size(tmp_path, capsys):
    parser = build_parser()
    synth = parser._subparsers._group_actions[0].choices["synth"]
    assert "ct-lesion" in synth.format_help()
    assert (
        main(["synth", "--preset", "ct-lesion", "--out", str(tmp_path / "ct"), "--scale", "0.1", "--size", "16"]) == 0
    )
    assert "federation.toml" in capsys.readouterr().out
    assert len(list((tmp_path / "ct" / "site3" / "images").glob("*.nii.gz"))) == 6
    with pytest.raises(ConfigError, match="size >= 16"):
        synthesize("ct-lesion", tmp_path / "x", size=8)
