"""``fedseg prepare`` on miniature replicas of each dataset's real layout (tests/support/replicas.py).

Each replica keeps its release's folder and file names, formats, label encodings and quirks; the
tests check that preparing it gives a federation ``fedseg validate`` accepts, with the expected
cases, label values and orientation, splits by patient, a second run that converts nothing, an
untouched ``--raw``, and one clear message for what is missing or bad.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from fedseg.apps.prepare import base as prepare_base
from fedseg.apps.prepare import prepare, split_patients
from fedseg.apps.prepare.fundus import riga_annotation
from fedseg.cli import main
from fedseg.data import load_datalist, validate_federation
from fedseg.foundation.errors import ConfigError, DataError
from tests.support import replicas

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
QUIET = {"log": lambda _: None}


def _tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(p.relative_to(root).as_posix().encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def _grey(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im)


@pytest.fixture(scope="module")
def fundus(tmp_path_factory):
    raw = tmp_path_factory.mktemp("fundus_raw")
    expected = replicas.fundus_all(raw)
    before = _tree_hash(raw)
    out = tmp_path_factory.mktemp("fundus_out")
    summary = prepare("fedsm-fundus", raw, out, **QUIET)
    return raw, out, summary, expected, before


@pytest.fixture(scope="module")
def prostate(tmp_path_factory):
    raw = tmp_path_factory.mktemp("prostate_raw")
    expected = replicas.prostate_all(raw)
    before = _tree_hash(raw)
    out = tmp_path_factory.mktemp("prostate_out")
    summary = prepare("fedsm-prostate", raw, out, **QUIET)
    return raw, out, summary, expected, before


def _manifest(out: Path, site: str) -> dict:
    return json.loads((out / site / "manifest.json").read_text())


def _check_patient_splits(out: Path, site: str, expected: dict) -> None:
    """Every case converted, each patient in exactly one split, the datalist listing exactly the cases' files."""
    cases = _manifest(out, site)["cases"]
    assert sorted(cases) == sorted(replicas_ids(expected)), site
    split_of: dict[str, set[str]] = {}
    for entry in cases.values():
        split_of.setdefault(entry["patient"], set()).add(entry["split"])
    assert all(len(s) == 1 for s in split_of.values()), f"{site}: a patient in two splits: {split_of}"
    assert sorted(split_of) == sorted(set(expected["patients"]))
    listed = load_datalist(out / site / "datalist.json")
    for split, entries in listed.items():
        files = {e["image"].relative_to(out / site).as_posix() for e in entries}
        want = {img for e in cases.values() if e["split"] == split for img, _ in e["outputs"]}
        assert files == want, (site, split)


def replicas_ids(expected: dict) -> list[str]:
    return [c.replace(" ", "_") for c in expected["cases"]]


def test_fundus_replica_becomes_a_valid_federation(fundus):
    """Six sites, validate clean, every case converted, labels 0/1/2 with both disc rim and cup present."""
    _raw, out, summary, expected, _ = fundus
    assert validate_federation(summary.spec) == []
    assert [r.site for r in summary.sites] == list(expected)
    for r in summary.sites:
        assert not r.bad and r.converted == len(expected[r.site]["cases"]), r
        _check_patient_splits(out, r.site, expected[r.site])
        for label in (out / r.site / "labels").glob("*.png"):
            assert set(np.unique(_grey(label))) == {0, 1, 2}, label
    spec = summary.spec.read_text()
    assert "disc = [1, 2]" in spec and "cup = [2]" in spec and "in_channels = 3" in spec


def test_rim_one_two_eyes_of_a_patient_share_a_split_and_are_cut_to_the_annotated_half(fundus):
    _raw, out, _summary, _expected, _ = fundus
    cases = _manifest(out, "rim-one-r3")["cases"]
    assert cases["N-1-L"]["patient"] == cases["N-1-R"]["patient"] == "N-1"
    assert cases["N-1-L"]["split"] == cases["N-1-R"]["split"]
    label = _grey(out / "rim-one-r3" / "labels" / "N-1-L.png")
    assert label.shape == (replicas.SIZE, replicas.SIZE)  # one view of the 2 x SIZE stereo pair
    assert (label > 0).sum() == pytest.approx(np.pi * 12**2, rel=0.1)


def test_riga_outlines_are_filled_and_fused_by_majority(fundus):
    """Annotators' disc outlines (2 px wide) of radius 10, 11, 9, 10, 11 and cup outlines of 6, 5, 6, 5, 6;
    the sixth drew no cup and is ignored. Boundaries run along the middle of the lines, so a strict
    majority (3 of 5) gives a disc of radius 10 and a cup of radius 6, for TIFF and for JPEG copies."""
    _raw, out, _summary, expected, _ = fundus
    for site in ("riga-binrushed", "riga-magrabia", "riga-messidor"):
        for cid in expected[site]["cases"]:
            label = _grey(out / site / "labels" / f"{cid}.png")
            assert (label > 0).sum() == pytest.approx(np.pi * 10**2, rel=0.1), (site, cid)
            assert (label == 2).sum() == pytest.approx(np.pi * 6**2, rel=0.2), (site, cid)


def test_riga_annotation_needs_two_closed_outlines():
    image = np.full((20, 20, 3), 100, np.uint8)
    assert riga_annotation(image, image.copy()) is None  # nothing drawn
    drawn = image.copy()
    drawn[3:17, 3] = drawn[3:17, 16] = drawn[3, 3:17] = drawn[16, 3:17] = 255  # a disc outline, no cup
    assert riga_annotation(image, drawn) is None
    drawn[8:12, 8] = drawn[8:12, 11] = drawn[8, 8:12] = drawn[11, 8:12] = 255  # a cup outline inside it
    disc, cup = riga_annotation(image, drawn)
    assert disc[4:16, 4:16].all() and cup[9:11, 9:11].all() and not cup[5, 5] and (cup <= disc).all()


def test_drishti_soft_maps_are_thresholded_at_half_the_experts(fundus):
    """Soft levels 64/128/191/255 at radius r+1.5, r+0.5, r-0.5, r-1.5: >= 128 keeps d < r + 0.5 (also for the
    soft map stored at half size, resized back by nearest neighbour)."""
    _raw, out, _summary, expected, _ = fundus
    for cid in expected["drishti-gs1"]["cases"]:
        label = _grey(out / "drishti-gs1" / "labels" / f"{cid}.png")
        area = np.pi * 9.5**2
        assert (label > 0).sum() == pytest.approx(area, rel=0.25 if cid == "drishtiGS_002" else 0.08), cid


def test_prostate_replica_becomes_a_valid_federation(prostate):
    """Slices with prostate only (3 per case), labels 0/1, rows as in the DICOM (not flipped), the release's
    known-bad cases left out with their reason, MSD's T2 channel taken (the ADC replica is constant)."""
    _raw, out, summary, expected, _ = prostate
    assert validate_federation(summary.spec) == []
    for r in summary.sites:
        assert not r.bad, r
        assert sum(r.counts.values()) == expected[r.site]["slices"], r.site
        _check_patient_splits(out, r.site, expected[r.site])
        for label in (out / r.site / "labels").rglob("*.png"):
            values = _grey(label)
            assert set(np.unique(values)) == {0, 1}, label
            if r.site != "msd":  # DICOM / MetaImage grids are LPS already: rows 4..7 stay rows 4..7
                assert np.nonzero(values.any(axis=1))[0].tolist() == [4, 5, 6, 7], label
    assert "Patient_428260" in summary.sites[0].excluded and "ProstateDx-01-0055" in summary.sites[3].excluded
    image = _grey(next((out / "msd" / "images").rglob("*.png")))
    assert image.max() == 255 and image.min() < 60  # prostate clipped at 2048, background ~100..400 / 2048
    assert "prostate = [1]" in summary.spec.read_text()


def test_prostatex_urethra_counts_only_on_slices_with_a_zone(prostate):
    _raw, out, _summary, _expected, _ = prostate
    slices = sorted(p.stem for p in (out / "prostatex" / "labels" / "ProstateX-0000").glob("*.png"))
    assert slices == ["001", "002", "003"]  # the urethra segment alone on slices 0 and 4 adds none
    label = _grey(out / "prostatex" / "labels" / "ProstateX-0000" / "001.png")
    assert label[6, 8] == 1  # ...but counts inside a slice that has a zone


def test_a_second_run_converts_nothing_and_raw_is_never_written(fundus, tmp_path):
    raw, out, _summary, expected, before = fundus
    assert _tree_hash(raw) == before
    work = tmp_path / "out"
    shutil.copytree(out, work)
    outputs = _tree_hash(work)
    again = prepare("fedsm-fundus", raw, work, **QUIET)
    assert sum(r.converted for r in again.sites) == 0
    assert sum(r.reused for r in again.sites) == sum(len(e["cases"]) for e in expected.values())
    assert _tree_hash(work) == outputs and _tree_hash(raw) == before
    forced = prepare("fedsm-fundus", raw, work, force=True, sites=["refuge"], **QUIET)
    assert forced.sites[0].converted == 4 and forced.sites[0].reused == 0
    assert _tree_hash(raw) == before


def test_a_changed_source_is_converted_again_and_a_deleted_one_dropped(tmp_path):
    raw = tmp_path / "raw"
    replicas.refuge(raw)
    out = tmp_path / "out"
    prepare("fedsm-fundus", raw, out, sites=["refuge"], **QUIET)
    mask = raw / "REFUGE" / "REFUGE-Validation400-GT" / "Disc_Cup_Masks" / "V0001.bmp"
    m = _grey(mask).copy()
    m[0, 0] = 128 if m[0, 0] == 255 else 255
    from PIL import Image

    Image.fromarray(m).save(mask)
    (raw / "REFUGE" / "Training400" / "Glaucoma" / "g0001.jpg").unlink()
    again = prepare("fedsm-fundus", raw, out, sites=["refuge"], **QUIET).sites[0]
    assert (again.converted, again.reused) == (1, 2)
    assert not (out / "refuge" / "images" / "g0001.png").exists()
    assert "g0001" not in _manifest(out, "refuge")["cases"]


def test_bad_files_are_listed_and_skipped_or_stop_with_strict(tmp_path):
    raw = tmp_path / "raw"
    replicas.refuge(raw)
    gt = raw / "REFUGE" / "REFUGE-Validation400-GT" / "Disc_Cup_Masks"
    m = _grey(gt / "V0001.bmp").copy()
    m[0, 0] = 50
    from PIL import Image

    Image.fromarray(m).save(gt / "V0001.bmp")
    (raw / "REFUGE" / "Training400" / "Glaucoma" / "g0001.jpg").write_bytes(b"not a jpeg")
    summary = prepare("fedsm-fundus", raw, tmp_path / "out", sites=["refuge"], **QUIET)
    bad = summary.sites[0].bad
    assert set(bad) == {"V0001", "g0001"}
    assert "V0001.bmp" in bad["V0001"] and "[50]" in bad["V0001"] and "0 cup, 128 disc rim" in bad["V0001"]
    table = summary.table()
    assert "2 bad case(s) skipped" in table and "g0001: skipped" in table
    with pytest.raises(DataError, match=r"V0001\.bmp: label values \[50\]|g0001"):
        prepare("fedsm-fundus", raw, tmp_path / "out2", sites=["refuge"], strict=True, **QUIET)


def test_a_missing_archive_names_the_dataset_the_path_and_where_to_get_it(tmp_path):
    raw = tmp_path / "raw"
    replicas.refuge(raw)
    with pytest.raises(DataError) as e:
        prepare("fedsm-fundus", raw, tmp_path / "out", **QUIET)
    text = str(e.value)
    for title, path in (("Drishti-GS1", "Drishti-GS1_files"), ("RIM-ONE r3", "RIM-ONE r3"), ("RIGA MESSIDOR", "RIGA")):
        assert title in text and str(raw / path) in text
    assert "cvit.iiit.ac.in" in text and "--sites" in text and "REFUGE (refuge)" not in text
    shutil.rmtree(raw / "REFUGE" / "REFUGE-Validation400-GT")
    with pytest.raises(DataError, match="REFUGE-Validation400-GT"):
        prepare("fedsm-fundus", raw, tmp_path / "out", sites=["refuge"], **QUIET)


def test_a_missing_reader_library_names_the_extra(monkeypatch, tmp_path):
    raw = tmp_path / "raw"
    replicas.promise12(raw)
    real = prepare_base.importlib.import_module

    def no_sitk(name, *a):
        if name == "SimpleITK":
            raise ImportError(name)
        return real(name, *a)

    monkeypatch.setattr(prepare_base.importlib, "import_module", no_sitk)
    with pytest.raises(ConfigError, match=r"SimpleITK.*pip install 'fedseg\[prepare\]'"):
        prepare("fedsm-prostate", raw, tmp_path / "out", sites=["promise12"], **QUIET)


def test_patient_splits_are_seeded_disjoint_and_follow_the_paper_proportions():
    """FedSM Table 1 from 0.5/0.25/0.25 of the images with Python's rounding (halves to even):
    101 -> 50/25/26, 195 -> 98/49/48, 94 -> 47/24/23, 460 -> 230/115/115, 159 -> 80/40/39, 800 -> 400/200/200."""
    table1 = {101: (50, 25, 26), 195: (98, 49, 48), 94: (47, 24, 23), 460: (230, 115, 115), 159: (80, 40, 39)}
    table1[800] = (400, 200, 200)
    for n, want in table1.items():
        split = split_patients([f"p{i}" for i in range(n)], seed=0, key="site")
        got = tuple(list(split.values()).count(s) for s in ("training", "validation", "testing"))
        assert got == want, n
    a = split_patients([f"p{i}" for i in range(20)], seed=0, key="x")
    assert a == split_patients([f"p{i}" for i in reversed(range(20))], seed=0, key="x")
    assert a != split_patients([f"p{i}" for i in range(20)], seed=1, key="x")


def test_table_sets_the_counts_beside_the_paper(fundus):
    table = fundus[2].table()
    assert "50/25/26" in table and "400/200/200" in table and "differs: train -48" in table


def test_cli_list_and_prepare(fundus, tmp_path, capsys):
    assert main(["prepare", "--list"]) == 0
    listed = capsys.readouterr().out
    for name in ("fedsm-fundus", "fedsm-prostate", "riga-binrushed", "prostatex", "licence", "pip install"):
        assert name in listed
    out = tmp_path / "cli"
    assert main(["prepare", "fedsm-fundus", "--raw", str(fundus[0]), "--out", str(out), "--sites", "refuge"]) == 0
    printed = capsys.readouterr().out
    assert "refuge" in printed and "400/200/200" in printed and (out / "federation.toml").is_file()
    assert main(["prepare", "fedsm-fundus", "--raw", str(tmp_path / "nowhere"), "--out", str(out)]) == 2
    assert main(["prepare"]) == 2


def test_fedavg_trains_two_rounds_on_the_prepared_fundus_federation(fundus, tmp_path):
    from fedseg.simulation.runner import run

    overrides = [
        "model.channels=[4,8,16]",
        "model.strides=[2,2]",
        "model.num_res_units=1",
        "train.batch_size=4",
        "train.local_steps=1",
        "device=cpu",
    ]
    spec = tmp_path / "federation.toml"
    spec.write_text(fundus[2].spec.read_text().replace("[256, 256]", "[32, 32]"))
    for site in fundus[2].sites:
        shutil.copytree(fundus[1] / site.site, tmp_path / site.site)
    res = run(
        spec, out=tmp_path / "run", overrides=overrides, method="fedavg", rounds=2, progress=False, log=lambda _: None
    )
    assert res is not None and (tmp_path / "run" / "results.json").is_file()
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["sites"] == [r.site for r in fundus[2].sites] and len(results["history"]) == 2


def test_fedavg_trains_two_rounds_on_the_prepared_prostate_federation(prostate, tmp_path):
    import re

    from fedseg.simulation.runner import run

    overrides = ["model.channels=[4,8,16]", "model.strides=[2,2]", "model.num_res_units=1"]
    overrides += ["train.batch_size=4", "train.local_steps=1", "device=cpu"]
    spec = tmp_path / "federation.toml"
    text = prostate[2].spec.read_text()
    spec.write_text(re.sub(r"image_size = \[[0-9, ]+\]", "image_size = [32, 32]", text))
    for site in prostate[2].sites:
        shutil.copytree(prostate[1] / site.site, tmp_path / site.site)
    res = run(
        spec, out=tmp_path / "run", overrides=overrides, method="fedavg", rounds=2, progress=False, log=lambda _: None
    )
    assert res is not None and len(res["history"]) == 2
    assert res["sites"] == [r.site for r in prostate[2].sites]
