"""``fedseg predict``: masks written in each scan's own format and geometry, re-read from disk and scored with
an independent numpy Dice, equal evaluation's per-case Dice; FedSM's routing equals evaluation's."""

from __future__ import annotations

import contextlib
import csv
import json
import locale
import shutil
import subprocess
import sys
from types import SimpleNamespace

import nibabel as nib
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedseg.algorithms import known_sections
from fedseg.apps.deploy.site import data_header
from fedseg.apps.predict import keep_largest, load_predictor, predict_files
from fedseg.apps.predict.export import export_run
from fedseg.cli import main
from fedseg.data.readers import read_array
from fedseg.foundation.arrays import strip_prefix
from fedseg.foundation.config import load_run_config
from fedseg.foundation.errors import ConfigError, DataError
from fedseg.seams.algorithm import Candidate
from fedseg.seams.checkpoint import load_best
from fedseg.simulation.runner import build_engine, load_federation_data, run
from fedseg.site import predict as prediction
from fedseg.site.workload import workload_for

SMALL = ["model.channels=[4,8,16]", "model.strides=[2,2]", "model.num_res_units=1", "train.batch_size=8"]


def numpy_dice(mask: np.ndarray, label: np.ndarray, labels: dict, empty: float = 1.0) -> list[float]:
    """Per-channel Dice of two label maps through the spec's channels (``isin``), numpy only."""
    out = []
    for values in labels.values():
        p, t = np.isin(mask, values), np.isin(label, values)
        s = p.sum() + t.sum()
        out.append(empty if s == 0 else 2.0 * (p & t).sum() / s)
    return out


def evaluated(run_dir, split: str = "testing"):
    """Evaluation's per-case Dice of every best model (``fedseg evaluate``'s path), and its engine."""
    cfg = load_run_config(run_dir / "config.toml", known_sections=known_sections())
    fed, data = load_federation_data(cfg.federation)
    engine = build_engine(cfg, workload_for(fed, cfg), data, progress=False, log=lambda m: None)
    best = load_best(run_dir / "checkpoints")
    return (
        fed,
        engine,
        {n: engine.evaluate([b.candidate], split, lambda c: engine.transport.sites)[n] for n, b in best.items()},
    )


def test_label_map_gives_back_the_spec_values_of_nested_and_disjoint_channels():
    nested = {"disc": [1, 2], "cup": [2]}
    lit = torch.tensor([[1.0, 1.0, -1.0, -1.0], [-1.0, 1.0, -1.0, 1.0]]) * 5  # (L, 4): disc, cup
    # disc only -> 1, both -> 2, neither -> 0, cup without disc -> 2 (the later, more specific value on a tie)
    assert prediction.label_map(lit, nested).tolist() == [1, 2, 0, 2]
    disjoint = {"a": [1], "b": [3]}
    assert prediction.label_map(lit, disjoint).tolist() == [1, 3, 0, 3]
    # re-reading a consistent map through isin gives back the thresholded channels exactly
    logits = torch.randn(2, 9, 9) * 3
    logits[1] = torch.minimum(logits[1], logits[0])  # cup inside disc
    m = prediction.label_map(logits, nested).numpy()
    assert np.array_equal(np.stack([np.isin(m, v) for v in nested.values()]), (logits > 0).numpy())
    # keep-largest per channel drops the smaller disc island, and with it the cup inside it
    lab = np.zeros((8, 8), dtype=np.int64)
    lab[1:4, 1:4], lab[2, 2], lab[6, 6] = 1, 2, 2
    kept = keep_largest(lab, nested)
    assert kept[6, 6] == 0 and kept[2, 2] == 2 and (kept[1:4, 1:4] > 0).all()


def test_mirroring_is_equivariant_and_the_plain_prediction_is_the_identity_flip():
    """Test-time mirroring averages the probabilities of every flip of the spatial axes, each flipped back:
    the mean over the group of flips is invariant to mirroring the input first, so TTA(flip(x)) =
    flip(TTA(x)) for any network; without TTA the predictor runs once, unchanged."""
    torch.manual_seed(0)
    net = torch.nn.Conv2d(1, 2, 3, padding=1)
    site = SimpleNamespace(autocast=contextlib.nullcontext)
    x = torch.rand(1, 1, 9, 7)
    assert prediction.mirror_axes(2) == [(), (2,), (3,), (2, 3)] and len(prediction.mirror_axes(3)) == 8
    with torch.no_grad():
        assert torch.equal(prediction.logits(site, net, x), net(x))
        tta = prediction.logits(site, net, x, tta=True)
        torch.testing.assert_close(prediction.logits(site, net, x.flip(3), tta=True), tta.flip(3), atol=1e-5, rtol=0)
        assert not torch.allclose(tta, net(x), atol=1e-3)


@pytest.mark.slow
def test_predict_2d_fedsm_masks_and_routing_equal_evaluation(tmp_path, capsys):
    """One label channel (prostate): every mask re-read through ``isin`` is exactly the thresholded channel.
    Nested channels give the same wherever the prediction is consistent (cup inside disc; the first test)."""
    fed_dir = tmp_path / "prostate"
    assert main(["synth", "--preset", "prostate", "--out", str(fed_dir), "--scale", "0.05", "--size", "32"]) == 0
    out = tmp_path / "run"
    run(
        fed_dir / "federation.toml",
        out=out,
        overrides=["method=fedsm", "rounds=2", *SMALL, "checkpoint_keep=all"],  # site2's state is copied below
        progress=False,
        log=lambda m: None,
    )
    fed, engine, per_case = evaluated(out)
    loaded = load_predictor(out)
    assert loaded.candidate.name == "fedsm"
    for site in fed.sites:
        masks = tmp_path / "masks" / site.name
        res = predict_files(loaded, [site.datalist], masks, split="testing", progress=False, log=lambda m: None)
        entries = json.loads(site.datalist.read_text())["testing"]
        assert len(res["written"]) == len(entries) and not res["skipped"]
        for k, e in enumerate(entries):
            mask = read_array(masks / e["image"])
            label = read_array(site.datalist.parent / e["label"])
            assert mask.shape == label.shape[:2]
            got = numpy_dice(mask, label, fed.labels)
            assert got == pytest.approx(per_case["fedsm"][site.name][k], abs=1e-6)
        # the routing written per case is evaluation's: the composite's selector and thresholds on its images
        from fedseg.algorithms.fedsm.selection import load_composite, route, selector_probs, thresholds

        s = engine.transport.site(site.name)
        cand = load_best(out / "checkpoints")["fedsm"].candidate
        sel, _ = load_composite(s, cand.arrays, cand.config, engine.algorithm.selector_factory, "fedsm-eval/")
        idx = route(selector_probs(s, sel, "testing").float(), thresholds(cand.config)).tolist()
        rows = list(csv.DictReader((masks / "routing.csv").open()))
        assert [r["model"] for r in rows] == [loaded.route_names[i] for i in idx]
    # nothing is overwritten without --force; a run without best models names the fix
    with pytest.raises(ConfigError, match="--force"):
        predict_files(
            loaded, [fed.sites[0].datalist], tmp_path / "masks" / fed.sites[0].name, split="testing", progress=False
        )
    with pytest.raises(ConfigError, match="finished fedseg run"):
        load_predictor(tmp_path / "prostate")
    # personalized models: --site chooses; the choices are named
    with pytest.raises(ConfigError, match="site1"):
        load_predictor(out, site="nowhere")
    assert load_predictor(out, site="site2", model="personal").candidate.name == "personal/site2"
    # a deployed site's work folder, as the site writes it (config.toml, data.json, round-<r>/<site>.*): predict
    # there uses the site's own personalized model, no server involved, and equals evaluation of that model
    work = tmp_path / "work" / "run1"
    (work / "round-000002").mkdir(parents=True)
    shutil.copy(out / "config.toml", work / "config.toml")
    (work / "data.json").write_text(json.dumps(data_header(fed)))
    for suffix in (".safetensors", ".json"):
        shutil.copy(out / "checkpoints" / "sites" / f"site2{suffix}", work / "round-000002" / f"site2{suffix}")
    (work / "round-000002" / "DONE").write_text("2")
    at_site = load_predictor(work)
    assert at_site.site.name == "site2" and at_site.candidate.name == "personal"
    site2 = fed.site("site2")
    predict_files(at_site, [site2.datalist], tmp_path / "site2", split="testing", progress=False, log=lambda m: None)
    personal = strip_prefix("model/personal", load_file(str(out / "checkpoints" / "sites" / "site2.safetensors")))
    own = Candidate("own", personal, home_site="site2", config={"bn_role": "personal"})
    scored = engine.evaluate([own], "testing", lambda c: ("site2",))["own"]["site2"]
    for k, e in enumerate(json.loads(site2.datalist.read_text())["testing"]):
        mask = read_array(tmp_path / "site2" / e["image"])
        label = read_array(site2.datalist.parent / e["label"])
        assert numpy_dice(mask, label, fed.labels) == pytest.approx(scored[k], abs=1e-6)
    with pytest.raises(ConfigError, match="composite needs every site"):
        load_predictor(work, model="ensemble")
    # TorchScript and ONNX files of the composite's parts give torch's outputs (1e-4), loaded without fedseg
    onnxruntime = pytest.importorskip("onnxruntime")  # the export extra
    files = export_run(out, "torchscript", tmp_path / "ts") + export_run(out, "onnx", tmp_path / "onnx")
    pre = json.loads((tmp_path / "onnx" / "preprocessing.json").read_text())
    assert pre["composite"]["parts"][0] == "selector" and pre["composite"]["sites"] == list(fed.site_names)
    cpu = load_predictor(out, device="cpu", precision="fp32")
    x = torch.rand(2, 1, 32, 32)
    roles = {"selector": next(r for r in cpu.site.models if "selector" in r), "global": "fedsm-eval/global"}
    roles.update({f"personal_{s}": f"fedsm-eval/p{j}" for j, s in enumerate(fed.site_names)})
    for part, role in roles.items():
        with torch.no_grad():
            want = cpu.site.models[role](x).numpy()
        scripted = torch.jit.load(str(tmp_path / "ts" / f"{part}.ts"))
        np.testing.assert_allclose(scripted(x).detach().numpy(), want, atol=1e-4)
        sess = onnxruntime.InferenceSession(str(tmp_path / "onnx" / f"{part}.onnx"))
        np.testing.assert_allclose(sess.run(None, {"image": x.numpy()})[0], want, atol=1e-4)
    assert all(f.is_file() for f in files)


def _oblique(angle: float) -> np.ndarray:
    c, s = np.cos(angle), np.sin(angle)
    a = np.eye(4)
    a[:3, :3] = np.array([[c, -s, 0], [s, c, 0], [0, 0, 1.0]]) @ np.diag([1.1, 1.1, 2.5])
    a[:3, 3] = [2.0, -3.0, 0.0]
    return a


@pytest.mark.slow
def test_predict_3d_masks_in_each_scans_own_grid_equal_evaluation(tmp_path, monkeypatch):
    """Anisotropic, flipped (LPS) and oblique scans: each mask in the scan's own grid, with its affine."""
    import test_volumes_run as tv

    monkeypatch.setitem(tv.SITES, "oblique", (_oblique(0.3), (20, 20, 10)))
    spec = tv.write_federation(tmp_path, n=(2, 1, 2))
    out = tmp_path / "run"
    overrides = ["rounds=2", "train.local_steps=2", "train.batch_size=2", "model.num_res_units=0"]
    run(spec, out=out, overrides=overrides, progress=False, log=lambda m: None)
    fed, _, per_case = evaluated(out)
    loaded = load_predictor(out)
    # a small slab size: the scan's grid is filled slab by slab, as a large volume is
    monkeypatch.setattr("fedseg.apps.predict.run.SLAB_BYTES", 20 * 20 * 3 * 8)
    for site in fed.sites:
        masks = tmp_path / "masks" / site.name
        predict_files(loaded, [site.datalist], masks, split="testing", progress=False, log=lambda m: None)
        for k, e in enumerate(json.loads(site.datalist.read_text())["testing"]):
            written = nib.load(str(masks / e["image"]))
            label = nib.load(str(site.datalist.parent / e["label"]))
            assert np.allclose(written.affine, label.affine) and written.shape == label.shape
            got = numpy_dice(np.asarray(written.dataobj), np.asarray(label.dataobj), fed.labels)
            assert got == pytest.approx(per_case["global"][site.name][k], abs=1e-6)
    # the MONAI bundle, run by MONAI's own bundle runner, writes the masks fedseg predict writes
    bundle = tmp_path / "bundle"
    export_run(out, "bundle", bundle)
    meta = json.loads((bundle / "configs" / "metadata.json").read_text())
    assert meta["fedseg"]["orientation"] == "RAS" and meta["fedseg"]["spacing"] == loaded.plan.target_spacing
    (bundle / "data").mkdir()
    scans = {}
    for site in fed.sites:
        for e in json.loads(site.datalist.read_text())["testing"]:
            name = f"{site.name}_{e['image']}"
            shutil.copy(site.datalist.parent / e["image"], bundle / "data" / name)
            scans[name] = tmp_path / "masks" / site.name / e["image"]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "monai.bundle",
            "run",
            "--config_file",
            "configs/inference.json",
            "--bundle_root",
            str(bundle),
        ],
        cwd=bundle,
        check=True,
        capture_output=True,
    )
    for name, ours in scans.items():
        theirs = nib.load(str(bundle / "eval" / name.replace(".nii.gz", "_seg.nii.gz")))
        assert np.allclose(theirs.affine, nib.load(str(ours)).affine)
        assert np.array_equal(np.asarray(theirs.dataobj), np.asarray(nib.load(str(ours)).dataobj))  # identical labels
    # a 2D picture or a two-channel volume cannot match the run: one error naming the file and the fix
    bad = tmp_path / "bad.nii.gz"
    nib.save(nib.Nifti1Image(np.zeros((8, 8, 8, 2), np.float32), np.eye(4)), bad)
    with pytest.raises(DataError, match=r"bad.nii.gz: has 2 channel\(s\).*in_channels = 1"):
        predict_files(loaded, [bad], tmp_path / "m2", progress=False)
    # two inputs whose masks would share a name: refused before anything is written
    scan = fed.sites[0].datalist.parent / json.loads(fed.sites[0].datalist.read_text())["testing"][0]["image"]
    with pytest.raises(DataError, match="separate --out"):
        predict_files(loaded, [scan, scan], tmp_path / "m5", progress=False)
    assert not (tmp_path / "m5").exists()
    # an unreadable file in a folder is listed and skipped; --strict stops
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "broken.nii.gz").write_bytes(b"not a volume")
    res = predict_files(loaded, [folder], tmp_path / "m3", progress=False, log=lambda m: None)
    assert [s["file"] for s in res["skipped"]] == [str(folder / "broken.nii.gz")]
    with pytest.raises(DataError, match="broken.nii.gz"):
        predict_files(loaded, [folder], tmp_path / "m4", strict=True, progress=False)


def test_simpleitk_and_dicom_scans_read_with_the_nifti_affine_and_masks_keep_their_geometry(tmp_path):
    """A volume saved by SimpleITK (LPS world) reads as the same array and RAS affine nibabel gives for it as
    NIfTI; its mask is written in its own format with its origin, spacing and direction."""
    import SimpleITK as sitk

    from fedseg.apps.predict.scans import mask_path, read_scan, write_mask

    rng = np.random.default_rng(0)
    arr = rng.integers(-100, 100, size=(6, 5, 4)).astype(np.int16)  # (X, Y, Z)
    img = sitk.GetImageFromArray(arr.transpose(2, 1, 0))
    img.SetSpacing((0.7, 1.3, 2.5))
    img.SetOrigin((10.0, -4.0, 3.0))
    c, s = np.cos(0.4), np.sin(0.4)
    img.SetDirection((c, -s, 0.0, s, c, 0.0, 0.0, 0.0, 1.0))
    mha, nii = tmp_path / "scan.mha", tmp_path / "scan.nii.gz"
    sitk.WriteImage(img, str(mha))
    sitk.WriteImage(img, str(nii))
    a, b = read_scan(mha, "3d", 1), read_scan(nii, "3d", 1)
    assert a.kind == "sitk" and b.kind == "nifti"
    assert np.array_equal(a.image, b.image) and np.allclose(a.affine, b.affine, atol=1e-5)
    out = mask_path(tmp_path / "masks", "scan.mha", a.kind, mha)
    assert out.name == "scan.mha"
    write_mask(out, (a.image[0] > 0).astype(np.uint8), a)
    back = sitk.ReadImage(str(out))
    assert back.GetSpacing() == img.GetSpacing() and back.GetOrigin() == img.GetOrigin()
    assert np.allclose(back.GetDirection(), img.GetDirection())
    assert np.array_equal(sitk.GetArrayFromImage(back).transpose(2, 1, 0), (arr > 0).astype(np.uint8))
    # a folder of one DICOM series reads as one scan, with the same array and affine
    series = tmp_path / "series"
    series.mkdir()
    saved = locale.setlocale(locale.LC_ALL)  # SimpleITK's DICOM writer sets the C locale of the process
    writer = sitk.ImageFileWriter()
    writer.KeepOriginalImageUIDOn()
    for z in range(arr.shape[2]):
        sl = img[:, :, z]
        sl.SetMetaData("0020|000e", "1.2.826.0.1.3680043.2.1125.1")
        sl.SetMetaData("0020|0032", "\\".join(map(str, img.TransformIndexToPhysicalPoint((0, 0, z)))))
        sl.SetMetaData("0020|0037", "\\".join(map(str, (c, s, 0.0, -s, c, 0.0))))
        sl.SetMetaData("0020|0013", str(z))
        writer.SetFileName(str(series / f"{z}.dcm"))
        writer.Execute(sl)
    locale.setlocale(locale.LC_ALL, saved)
    d = read_scan(series, "3d", 1)
    assert locale.setlocale(locale.LC_ALL) == saved  # reading a series leaves the process's locale as it was
    assert d.kind == "dicom" and np.array_equal(d.image, b.image)
    assert np.allclose(d.affine, b.affine, atol=1e-3)
