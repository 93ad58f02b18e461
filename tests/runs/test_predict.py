"""``fedseg predict``: masks written in each scan's own format and geometry, re-read from disk and scored with
an independent numpy Dice, equal evaluation's per-case Dice; FedSM's routing equals evaluation's."""

from __future__ import annotations

import contextlib
import csv
import json
import locale
import re
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
from fedseg.apps.predict import keep_largest, load_predictor, predict_files
from fedseg.apps.predict.export import export_run, label_map_expression
from fedseg.cli import main
from fedseg.data.readers import read_array
from fedseg.deployment.site import data_header
from fedseg.execution.federation import load_federation_data
from fedseg.foundation.arrays import strip_prefix
from fedseg.foundation.config import load_run_config
from fedseg.foundation.errors import ConfigError, DataError
from fedseg.seams.algorithm import Candidate
from fedseg.seams.checkpoint import load_best
from fedseg.simulation.runner import build_engine, run
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


def channel_dice(p: np.ndarray, t: np.ndarray, empty: float = 1.0) -> float:
    """Dice of two boolean masks (``empty`` when both are empty)."""
    s = p.sum() + t.sum()
    return empty if s == 0 else float(2.0 * (p & t).sum() / s)


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


def test_dice_is_the_dice_of_the_delivered_label_map():
    """Six pixels, disc = [1, 2], cup = [2].  Truth map [2, 1, 1, 0, 0, 0]: disc {0, 1, 2}, cup {0}.  The network
    lights disc at {0, 1} and cup at {0, 3, 4} — the cup outside the disc at 3 and 4.

    Delivered map (disc painted 1, then cup 2 over it): [2, 1, 0, 2, 2, 0], whose channels are disc
    {0, 1, 3, 4} and cup {0, 3, 4}.  By hand: disc Dice = 2·|{0, 1}| / (4 + 3) = 4/7, cup Dice = 2·1 / (3 + 1)
    = 1/2, the case 15/28.  Each thresholded channel on its own (the rule before) gives disc 2·2 / (2 + 3) =
    4/5, cup 1/2, the case 13/20: the mask written would score 15/28 while 13/20 was reported."""
    from fedseg.data import labelmap
    from fedseg.site.workload import dice_metric

    labels = {"disc": [1, 2], "cup": [2]}
    logits = torch.tensor([[1.0, 1, -1, -1, -1, -1], [1, -1, -1, 1, 1, -1]]) * 4  # (L, 6)
    truth_map = torch.tensor([2, 1, 1, 0, 0, 0])
    truth = labelmap.channels(truth_map, labels).float()[None]  # (1, L, 6)
    assert prediction.label_map(logits, labels).tolist() == [2, 1, 0, 2, 2, 0]
    got = dice_metric(0.5, 1.0, labels)(logits[None], truth)[0].tolist()  # the workload's metric (workload_for)
    assert got == pytest.approx([4 / 7, 1 / 2]) and sum(got) / 2 == pytest.approx(15 / 28)
    assert dice_metric()(logits[None], truth)[0].tolist() == pytest.approx([4 / 5, 1 / 2])  # channels on their own
    mask = prediction.label_map(logits, labels).numpy()
    assert numpy_dice(mask, truth_map.numpy(), labels) == pytest.approx(got)  # the written mask's Dice
    # three nested regions (BraTS-like): painted whole 1, core 2, enhancing 3, inner over outer as nnU-Net does,
    # so an enhancing pixel lit alone is 3 (enhancing, core and whole at once)
    brats = {"whole": [1, 2, 3], "core": [2, 3], "enhancing": [3]}
    assert labelmap.paint_order(brats) == [(0, 1), (1, 2), (2, 3)]
    three = torch.tensor([[1.0, 1, 1, -1, -1], [-1, 1, 1, -1, 1], [-1, -1, 1, 1, -1]]) * 4
    assert prediction.label_map(three, brats).tolist() == [1, 2, 3, 3, 2]
    # the exported bundle's post-processing (a MONAI-config expression on the probabilities) is the same map
    for spec in (labels, {"cup": [2], "disc": [1, 2]}, brats, {"a": [1], "b": [3]}, {"fg": [1, 2]}):
        x = torch.randn(len(spec), 7, 5) * 3
        expr = label_map_expression(spec, 0.5)
        bundle = eval(expr[1:], {"torch": torch})(torch.sigmoid(x))[0]  # "$lambda x: ..." as MONAI evaluates it
        assert torch.equal(bundle.to(torch.int64), prediction.label_map(x, spec).to(torch.int64))


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


def reported(run_dir) -> dict:
    """The run's own ``results.json``: the Dice it reports per case and per site."""
    return json.loads((run_dir / "results.json").read_text())


def assert_masks_score_as_reported(masks, labels, results, candidate, per_case, labels_spec):
    """Masks re-read with numpy, scored through the spec's channels: each case's Dice is the run's per-case
    Dice and evaluation's, each site's mean its per-site Dice (1e-6).  ``masks``: ``{site: [(mask, label)]}``."""
    for site, pairs in masks.items():
        got = [numpy_dice(m, lab, labels_spec) for m, lab in pairs]
        assert [float(np.mean(g)) for g in got] == pytest.approx(results["per_case_dice"][candidate][site], abs=1e-6)
        np.testing.assert_allclose(got, per_case[candidate][site], atol=1e-6, rtol=0)
        if results.get("primary") == candidate:
            assert float(np.mean([np.mean(g) for g in got])) == pytest.approx(results["per_site_dice"][site], abs=1e-6)
            by_channel = dict(zip(labels, np.mean(got, axis=0).tolist()))
            assert by_channel == pytest.approx(results["per_site_channel_dice"][site], abs=1e-6)


def unnested(probabilities: np.ndarray, threshold: float = 0.5) -> int:
    """Pixels where the inner channel (1) is lit and the outer one (0) is not."""
    return int(((probabilities[1] > threshold) & ~(probabilities[0] > threshold)).sum())


def test_predict_2d_fedsm_masks_and_routing_equal_evaluation(tmp_path, capsys):
    """Nested labels (fundus: disc = [1, 2], cup = [2]) and personalized models (γ = 0: every image routed to
    its top site's personalized model) that, 2 rounds in, light the cup outside the disc: the masks
    ``predict`` writes, re-read with numpy through ``isin``, score exactly the per-case and per-site Dice the
    run reports (``results.json``) and evaluation gives.  Scoring each thresholded channel on its own (the
    rule before the delivered label map) gives other numbers on these cases: checked below, from the
    probabilities ``predict`` writes."""
    fed_dir = tmp_path / "fundus"
    assert main(["synth", "--preset", "fundus", "--out", str(fed_dir), "--scale", "0.05", "--size", "32"]) == 0
    out = tmp_path / "run"
    run(
        fed_dir / "federation.toml",
        out=out,
        overrides=[
            "method=fedsm",
            "rounds=2",
            "train.local_steps=2",
            "fedsm.gamma=0.0",
            *SMALL,
            "checkpoint_keep=all",
        ],  # site2's state is copied below
        progress=False,
        log=lambda m: None,
    )
    fed, engine, per_case = evaluated(out)
    results = reported(out)
    loaded = load_predictor(out)
    assert loaded.candidate.name == "fedsm"
    written, lit_apart, independent = {}, 0, []
    for site in fed.sites:
        masks = tmp_path / "masks" / site.name
        res = predict_files(
            loaded, [site.datalist], masks, split="testing", probabilities=True, progress=False, log=lambda m: None
        )
        entries = json.loads(site.datalist.read_text())["testing"]
        assert len(res["written"]) == len(entries) and not res["skipped"]
        written[site.name] = []
        for e in entries:
            mask = read_array(masks / e["image"])
            label = read_array(site.datalist.parent / e["label"])
            assert mask.shape == label.shape[:2]
            written[site.name].append((mask, label))
            probs = np.load(masks / (e["image"].split(".")[0] + "_probabilities.npy")).astype(np.float32)
            lit_apart += unnested(probs)
            # each thresholded channel scored on its own, as scoring did before the delivered label map
            truth = np.stack([np.isin(label, v) for v in fed.labels.values()])
            independent.append([channel_dice(p, t) for p, t in zip(probs > 0.5, truth)])
        # the routing written per case is evaluation's: the composite's selector and thresholds on its images
        from fedseg.algorithms.fedsm.selection import load_composite, route, selector_probs, thresholds

        s = engine.transport.site(site.name)
        cand = load_best(out / "checkpoints")["fedsm"].candidate
        sel, _ = load_composite(s, cand.arrays, cand.config, engine.algorithm.selector_factory, "fedsm-eval/")
        idx = route(selector_probs(s, sel, "testing").float(), thresholds(cand.config)).tolist()
        rows = list(csv.DictReader((masks / "routing.csv").open()))
        assert [r["model"] for r in rows] == [loaded.route_names[i] for i in idx]
        assert list(rows[0]) == ["case", "model", *[f"p_{s}" for s in fed.site_names]]  # by site
        assert all(r["model"].startswith("personal/") for r in rows)  # γ = 0: the personalized models
    assert lit_apart > 0, "the personalized models light the cup outside the disc somewhere"
    assert_masks_score_as_reported(written, list(fed.labels), results, "fedsm", per_case, fed.labels)
    reported_cases = [c for site in fed.site_names for c in per_case["fedsm"][site]]
    assert not np.allclose(independent, reported_cases, atol=1e-6)  # the old rule scores other numbers
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
    x = torch.rand(2, fed.in_channels, 32, 32)
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


def test_predict_3d_masks_in_each_scans_own_grid_equal_evaluation(tmp_path, monkeypatch):
    """Anisotropic, flipped (LPS) and oblique scans with nested labels (mass = [1, 2], core = [2]): each mask in
    the scan's own grid, with its affine; 2 rounds in, the model lights the core outside the mass, and the
    masks re-read with numpy score exactly the per-case and per-site Dice the run reports (each thresholded
    channel scored on its own gives other numbers)."""
    import tests.runs.test_volumes_run as tv

    monkeypatch.setitem(tv.SITES, "oblique", (_oblique(0.3), (20, 20, 10)))
    spec = tv.write_federation(tmp_path, n=(2, 1, 2), nested=True)
    out = tmp_path / "run"
    overrides = ["rounds=2", "train.local_steps=2", "train.batch_size=2", "model.num_res_units=0"]
    run(spec, out=out, overrides=overrides, progress=False, log=lambda m: None)
    fed, _, per_case = evaluated(out)
    results = reported(out)
    loaded = load_predictor(out)
    # a small slab size: the scan's grid is filled slab by slab, as a large volume is
    monkeypatch.setattr("fedseg.apps.predict.run.SLAB_BYTES", 20 * 20 * 3 * 8)
    written, lit_apart, independent = {}, 0, []
    for site in fed.sites:
        masks = tmp_path / "masks" / site.name
        predict_files(
            loaded, [site.datalist], masks, split="testing", probabilities=True, progress=False, log=lambda m: None
        )
        written[site.name] = []
        for e in json.loads(site.datalist.read_text())["testing"]:
            mask = nib.load(str(masks / e["image"]))
            label = nib.load(str(site.datalist.parent / e["label"]))
            assert np.allclose(mask.affine, label.affine) and mask.shape == label.shape
            lab = np.asarray(label.dataobj)
            written[site.name].append((np.asarray(mask.dataobj), lab))
            probs = np.load(masks / (e["image"].split(".")[0] + "_probabilities.npy")).astype(np.float32)
            lit_apart += unnested(probs)
            truth = np.stack([np.isin(lab, v) for v in fed.labels.values()])
            independent.append([channel_dice(p, t) for p, t in zip(probs > 0.5, truth)])
    assert lit_apart > 0, "the model lights the core outside the mass somewhere"
    assert_masks_score_as_reported(written, list(fed.labels), results, "global", per_case, fed.labels)
    reported_cases = [c for site in fed.site_names for c in per_case["global"][site]]
    assert not np.allclose(independent, reported_cases, atol=1e-6)  # the old rule scores other numbers
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


# ---------------------------------------------------------------- bad input, a self-contained run, provenance
def tiny_federation(root, size: int = 16, seed: int = 0):
    """Two sites of 16² grey PNGs (2 training, 1 validation, 2 test cases each) with nested labels; its spec."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    blocks = []
    for s in (1, 2):
        d = root / f"site{s}"
        for sub in ("images", "labels"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        lists: dict = {}
        for split, n in (("training", 2), ("validation", 1), ("testing", 2)):
            lists[split] = []
            for k in range(n):
                img = (rng.random((size, size)) * 255).astype(np.uint8)
                lab = (img > 100 + 20 * s).astype(np.uint8) + (img > 200).astype(np.uint8)
                Image.fromarray(img).save(d / "images" / f"{split}{k}.png")
                Image.fromarray(lab).save(d / "labels" / f"{split}{k}.png")
                lists[split].append({"image": f"images/{split}{k}.png", "label": f"labels/{split}{k}.png"})
        (d / "datalist.json").write_text(json.dumps(lists))
        blocks.append(f'[[sites]]\nname = "site{s}"\ndatalist = "site{s}/datalist.json"\n')
    spec = root / "federation.toml"
    spec.write_text(
        'name = "tiny"\n[data]\nmode = "2d"\nspatial_dims = 2\nin_channels = 1\n'
        "[data.labels]\nouter = [1, 2]\ninner = [2]\n\n" + "\n".join(blocks)
    )
    return spec


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A one-round FedAvg run of a small U-Net on :func:`tiny_federation`: ``(run folder, spec)``."""
    root = tmp_path_factory.mktemp("tiny")
    spec = tiny_federation(root / "fed")
    overrides = ["method=fedavg", "rounds=1", "train.local_steps=1", *SMALL[:3], "train.batch_size=2"]
    run(spec, out=root / "runs" / "fedavg" / "seed0", overrides=overrides, progress=False, log=lambda m: None)
    return root / "runs" / "fedavg" / "seed0", spec


def _nifti(path, array):
    nib.save(nib.Nifti1Image(np.asarray(array, dtype=np.float32), np.eye(4)), str(path))
    return path


def _quiet(m: str) -> None:
    pass


def test_a_nan_volume_is_refused_by_predict_validate_and_training(tmp_path):
    """A 32 × 32 × 24 volume (24,576 voxels) with 48 NaN voxels, and one all NaN: one error naming the file,
    the count and the fix in predict's reader, in ``fedseg validate`` (a problem of that file) and in a site's
    loading of its volumes (naming the site).  Before, predict read it and wrote an all-background mask."""
    from fedseg.apps.predict.scans import read_scan
    from fedseg.data.spec import load_federation
    from fedseg.data.validate import validate_federation
    from fedseg.data.volumes.load import load_volume_split, plan_federation

    rng = np.random.default_rng(0)
    clean = rng.normal(0, 1, (32, 32, 24)).astype(np.float32)
    label = (clean > 1).astype(np.int16)
    holes = clean.copy()
    holes.reshape(-1)[rng.choice(clean.size, 48, replace=False)] = np.nan
    nan48, all_nan = (
        _nifti(tmp_path / "nan48.nii.gz", holes),
        _nifti(tmp_path / "allnan.nii.gz", np.full_like(clean, np.nan)),
    )
    with pytest.raises(DataError, match=r"nan48.nii.gz: 48 of 24,576 voxels are NaN or infinite -> .*--nan-to-num"):
        read_scan(nan48, "3d", 1)
    with pytest.raises(DataError, match=r"allnan.nii.gz: 24,576 of 24,576 voxels are NaN or infinite \(every one\)"):
        read_scan(all_nan, "3d", 1)
    replaced = read_scan(nan48, "3d", 1, nan_to_num=-1.0)
    assert replaced.replaced == 48 and np.isfinite(replaced.image).all() and (replaced.image == -1.0).sum() == 48
    # a federation whose test case has the NaN voxels: validate names the file, loading names site and file
    site = tmp_path / "site1"
    site.mkdir()
    nib.save(nib.Nifti1Image(clean, np.eye(4)), str(site / "img.nii.gz"))
    nib.save(nib.Nifti1Image(label, np.eye(4)), str(site / "lab.nii.gz"))
    shutil.copy(nan48, site / "nan48.nii.gz")
    case = {"image": "img.nii.gz", "label": "lab.nii.gz"}
    lists = {"training": [case], "validation": [case], "testing": [{"image": "nan48.nii.gz", "label": "lab.nii.gz"}]}
    (site / "datalist.json").write_text(json.dumps(lists))
    spec = tmp_path / "fed.toml"
    spec.write_text(
        'name = "v"\n[data]\nmode = "3d"\nin_channels = 1\n[data.labels]\nfg = [1]\n'
        '[[sites]]\nname = "site1"\ndatalist = "site1/datalist.json"\n'
    )
    problems = validate_federation(spec)
    assert [(p.file, p.message) for p in problems] == [
        (str(site / "nan48.nii.gz"), "48 of 24,576 voxels are NaN or infinite")
    ]
    assert "replace them" in problems[0].fix
    fed = load_federation(spec)
    plan = plan_federation(fed, log=_quiet)
    with pytest.raises(DataError, match=r"^site1: .*nan48.nii.gz: 48 of 24,576 voxels are NaN or infinite -> replace"):
        load_volume_split(fed, fed.sites[0], "testing", plan)


def test_reading_an_image_builds_no_dicom_reader(tmp_path, caplog, recwarn):
    """MONAI's ``LoadImage`` builds every reader it has, its nvImageCodec DICOM reader among them, which logs a
    warning and warns where nvImageCodec is absent — three lines on every command.  fedseg's reader calls the
    one reader it needs, so reading a picture or a NIfTI file logs and warns nothing."""
    import logging

    from PIL import Image

    from fedseg.data import readers

    Image.fromarray(np.zeros((4, 4), np.uint8)).save(tmp_path / "a.png")
    _nifti(tmp_path / "a.nii.gz", np.zeros((4, 4, 4)))
    readers._reader.cache_clear()
    with caplog.at_level(logging.DEBUG - 1):
        assert read_array(tmp_path / "a.png").shape == (4, 4)
        assert read_array(tmp_path / "a.nii.gz").shape == (4, 4, 4)
    text = caplog.text + " ".join(str(w.message) for w in recwarn)
    assert "nvImageCodec" not in text and "NvImgCodec" not in text
    # a file PIL cannot read is one exception, not one traceback per reader MONAI has
    (tmp_path / "b.png").write_bytes(b"not a picture")
    with pytest.raises(Exception) as err:
        read_array(tmp_path / "b.png")
    assert "Traceback" not in str(err.value) and len(str(err.value).splitlines()) == 1


def test_predict_reads_every_input_before_writing_and_records_what_made_the_masks(tiny, tmp_path, capsys):
    """A NaN scan or (with ``--strict``) a non-image file in the middle of a batch stops it before any mask is
    written (before, the masks of the files ahead of it were written); a non-image ``.png`` is one line and
    skipped (exit 3); ``--nan-to-num`` predicts with a warning; ``predictions.json`` records the run, model,
    round, options, fedseg's version and each input's SHA-256."""
    import hashlib

    import fedseg

    run_dir, spec = tiny
    images = spec.parent / "site1" / "images"
    batch = tmp_path / "batch"
    batch.mkdir()
    for name in ("a_testing0.png", "c_testing1.png"):
        shutil.copy(images / name.split("_", 1)[1], batch / name)
    holes = read_array(images / "testing0.png").astype(np.float32)
    holes.reshape(-1)[:48] = np.nan
    _nifti(batch / "b_nan.nii.gz", holes)
    out = tmp_path / "masks"
    assert main(["predict", str(run_dir), "--input", str(batch), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "b_nan.nii.gz: 48 of 256 voxels are NaN or infinite" in err and "--nan-to-num" in err
    )
    assert not out.exists()  # a_testing0.png, ahead of it, has no mask
    # replaced under --nan-to-num, with a warning
    argv = ["predict", str(run_dir), "--input", str(batch), "--out", str(out), "--quiet", "--nan-to-num", "0"]
    assert main(argv) == 0
    assert "b_nan.nii.gz: 48 of 256 voxels were NaN or infinite; replaced with 0" in capsys.readouterr().out
    record = json.loads((out / "predictions.json").read_text())
    best = json.loads((run_dir / "checkpoints" / "best.json").read_text())
    assert record["run"] == str(run_dir.resolve()) and record["method"] == "fedavg" and record["model"] == "global"
    assert record["round"] == best["global"]["round"] and record["fedseg_version"] == fedseg.__version__
    assert record["options"]["nan_to_num"] == 0.0 and record["options"]["tta"] is False
    assert record["data_layout"] == str(run_dir / "data.json")
    assert [c["mask"] for c in record["cases"]] == ["a_testing0.png", "b_nan.nii.gz", "c_testing1.png"]
    assert [c["model"] for c in record["cases"]] == ["global"] * 3
    assert [c.get("non_finite_replaced") for c in record["cases"]] == [None, 48, None]
    for c in record["cases"]:
        assert c["sha256"] == hashlib.sha256((batch / c["mask"]).read_bytes()).hexdigest()
    # a text file named .png: one line naming it, skipped, the others written; exit 3.  --strict refuses all
    (batch / "b_nan.nii.gz").unlink()
    (batch / "b_notes.png").write_text("not a picture\n" * 20)
    assert main(["predict", str(run_dir), "--input", str(batch), "--out", str(tmp_path / "m2"), "--quiet"]) == 3
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("predict: 2 case(s) written") and len(printed) == 2
    assert printed[1].startswith(f"  skipped {batch / 'b_notes.png'}: cannot be read (UnidentifiedImageError")
    assert sorted(p.name for p in (tmp_path / "m2").iterdir()) == [
        "a_testing0.png",
        "c_testing1.png",
        "predictions.json",
    ]
    argv = ["predict", str(run_dir), "--input", str(batch), "--out", str(tmp_path / "m3"), "--quiet", "--strict"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "b_notes.png: cannot be read" in err and not (tmp_path / "m3").exists()
    # the record is an output: never overwritten without --force
    shutil.copy(batch / "a_testing0.png", tmp_path / "z.png")
    with pytest.raises(ConfigError, match=r"predictions.json exists \(1 output"):
        predict_files(load_predictor(run_dir, log=_quiet), [tmp_path / "z.png"], out, progress=False)


def test_predict_names_the_splits_the_out_file_and_the_runs_it_finds(tiny, tmp_path, capsys):
    """``--split test`` names the datalist's splits and the closest; ``--out`` naming a file says so; a
    folder holding one run is taken for it, one holding several lists them."""
    run_dir, spec = tiny
    datalist = spec.parent / "site1" / "datalist.json"
    argv = ["predict", str(run_dir), "--input", str(datalist), "--out", str(tmp_path / "m"), "--quiet"]
    assert main([*argv, "--split", "test"]) == 2
    err = capsys.readouterr().err
    assert "--split 'test' is not a split of" in err and "training, validation, testing" in err
    assert "did you mean 'testing'?" in err and not (tmp_path / "m").exists()
    (tmp_path / "file").write_text("")
    argv = ["predict", str(run_dir), "--input", str(datalist), "--out", str(tmp_path / "file"), "--quiet"]
    assert main(argv) == 2
    assert "--out" in (err := capsys.readouterr().err) and "is a file" in err and "give a folder path" in err
    # runs/fedavg holds runs/fedavg/seed0 alone: taken, and said; runs/ with a second run: both listed
    top = run_dir.parent
    argv = [
        "predict",
        str(top),
        "--input",
        str(datalist),
        "--split",
        "testing",
        "--out",
        str(tmp_path / "m"),
        "--quiet",
    ]
    assert main(argv) == 0
    assert f"using the run in {run_dir}" in capsys.readouterr().out
    other = top.parent / "other" / "seed1"
    shutil.copytree(run_dir, other)
    try:
        with pytest.raises(ConfigError, match=r"holds 2 runs \(.*fedavg/seed0, .*other/seed1\) -> name the one"):
            load_predictor(top.parent, log=_quiet)
    finally:
        shutil.rmtree(other.parent)


def test_a_moved_run_predicts_the_same_masks(tiny, tmp_path):
    """The run folder keeps its data layout (``data.json``): copied elsewhere with its federation renamed, it
    writes the same masks, byte for byte.  Before, predict read the layout from the spec at its original
    path and refused.  Without ``data.json`` the error names ``--spec``, which then serves."""
    run_dir, spec = tiny
    scans = spec.parent / "site2" / "images"
    predict_files(load_predictor(run_dir, log=_quiet), [scans], tmp_path / "here", progress=False, log=_quiet)
    moved = tmp_path / "elsewhere" / "run"
    shutil.copytree(run_dir, moved)
    inputs = tmp_path / "scans"
    shutil.copytree(scans, inputs)
    renamed = spec.parent.with_name("fed-renamed")  # the training federation is gone from its path
    spec.parent.rename(renamed)
    try:
        loaded = load_predictor(moved, log=_quiet)
        assert loaded.layout_source == str(moved / "data.json")
        predict_files(loaded, [inputs], tmp_path / "there", progress=False, log=_quiet)
        names = sorted(p.name for p in (tmp_path / "here").glob("*.png"))
        assert names == sorted(p.name for p in inputs.glob("*.png")) and len(names) == 5
        for n in names:
            assert (tmp_path / "here" / n).read_bytes() == (tmp_path / "there" / n).read_bytes()
        header = json.loads((moved / "data.json").read_text())
        (moved / "data.json").unlink()
        with pytest.raises(ConfigError, match=r"has no data.json .* which is not there -> .*--spec PATH"):
            load_predictor(moved, log=_quiet)
        (moved / "deploy.json").write_text(json.dumps({"data": header}))  # a deployed server's run folder
        assert load_predictor(moved, log=_quiet).layout_source == str(moved / "deploy.json")
        (moved / "deploy.json").unlink()
        assert load_predictor(moved, spec=renamed / "federation.toml", log=_quiet).layout["labels"] == {
            "outer": [1, 2],
            "inner": [2],
        }
    finally:
        renamed.rename(spec.parent)


@pytest.mark.filterwarnings("ignore:NvImgCodecPydicomReader")  # MONAI's LoadImaged builds its DICOM readers
def test_the_bundle_refuses_a_nan_scan_and_preprocessing_json_says_so(tiny, tmp_path):
    """The exported bundle's preprocessing, built by MONAI's own config parser from ``inference.json`` (the
    bundle runner's path), raises on a scan with NaN voxels naming the file and the count, and passes a clean
    scan; ``preprocessing.json`` states the rule.  Before, the bundle wrote an all-background mask."""
    from monai.bundle import ConfigParser

    run_dir, spec = tiny
    bundle = tmp_path / "bundle"
    export_run(run_dir, "bundle", bundle)
    export_run(run_dir, "torchscript", tmp_path / "ts")
    assert "NaN or infinite" in json.loads((tmp_path / "ts" / "preprocessing.json").read_text())["non_finite"]
    parser = ConfigParser()
    parser.read_config(str(bundle / "configs" / "inference.json"))
    parser["bundle_root"] = str(bundle)
    sys.path.insert(0, str(bundle))
    try:
        pre = parser.get_parsed_content("preprocessing")
        ok = pre({"image": str(spec.parent / "site1" / "images" / "testing0.png")})
        assert ok["image"].shape == (1, 16, 16)
        holes = np.zeros((16, 16), np.float32)
        holes[:3, :16] = np.nan
        with pytest.raises(Exception) as err:  # MONAI wraps the check's ValueError in its own RuntimeError
            pre({"image": str(_nifti(tmp_path / "nan.nii.gz", holes))})
        cause = err.value
        while cause.__cause__ is not None:
            cause = cause.__cause__
        assert isinstance(cause, ValueError)
        assert re.match(rf"{re.escape(str(tmp_path))}/nan.nii.gz: 48 of 256 voxels are NaN or infinite -> ", str(cause))
    finally:
        sys.path.remove(str(bundle))
        sys.modules.pop("scripts.checks", None)
        sys.modules.pop("scripts", None)
    with pytest.raises(ConfigError, match="is a file; export writes a folder"):
        export_run(run_dir, "onnx", tmp_path / "ts" / "model.ts")
