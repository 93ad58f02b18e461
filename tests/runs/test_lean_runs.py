"""Finished runs are small: what only --resume reads is pruned (``checkpoint_keep``), ``fedseg clean`` prunes old
folders, MLflow holds the best checkpoint without a second copy; a grid axis no listed method reads is refused;
FedSM's routing on test is stored by the run and shown by the report."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from fedseg.apps.clean import clean
from fedseg.apps.studies import grid
from fedseg.apps.studies.compare import compare
from fedseg.apps.studies.jobs import StudyOptions
from fedseg.cli import main
from fedseg.foundation.errors import ConfigError
from fedseg.simulation.runner import simulate
from fedseg.site.workload import segmentation_workload
from tests.support.helpers import SMALL, TINY_MODEL, fake_results, synth_fundus, tiny_config, tiny_sites

QUIET = {"progress": False, "log": lambda m: None}
SEL = {"fedsm": {"selector_width": 0.0625, "selector_hidden": 8}}


def _run(out: Path, keep: str, method: str = "fedavg", **kw) -> dict | None:
    """A tiny 2-round run into ``out`` keeping ``keep`` (``stop_after``, ``resume`` passed on)."""
    cfg = dataclasses.replace(tiny_config(method, rounds=2), checkpoint_keep=keep)
    return simulate(cfg, segmentation_workload(2, 1, ["fg"], TINY_MODEL), tiny_sites(), out=out, **QUIET, **kw)


def _names(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


def test_a_finished_run_keeps_its_models_and_drops_what_only_resume_reads(tmp_path):
    """Default 'final': every site's state goes (the old code kept it: this failed), the best models, the last
    round's server state, progress and results stay, and pruned.json says what went with its bytes; 'best' drops
    the server state too; 'all' keeps everything and a finished run resumes."""
    sizes = {}
    for keep in ("all", "final", "best"):
        out = tmp_path / keep
        assert _run(out, keep) is not None
        ck = out / "checkpoints"
        if keep == "all":
            sizes = {f.name: f.stat().st_size for f in (ck / "sites").iterdir()}
            assert "pruned.json" not in _names(ck) and len(sizes) == 6  # 3 sites × (.safetensors, .json)
            continue
        kept = {"best.safetensors", "best.json", "progress.json", "pruned.json"}
        kept |= {"server.safetensors"} if keep == "final" else set()
        assert _names(ck) == kept
        record = json.loads((ck / "pruned.json").read_text())
        assert record["keep"] == keep and record["removed"]["sites"] == sum(sizes.values())  # the same-sized states
        assert (out / "results.json").is_file() and (out / "config.toml").is_file()
        with pytest.raises(ConfigError, match=r"finished run whose resumable state .* was pruned.*checkpoint_keep"):
            _run(out, keep, resume=True)
    assert _run(tmp_path / "all", "all", resume=True) is not None  # 'all': there is a state to resume from


def test_clean_prunes_an_old_style_study_folder_and_links_mlflow_copies(tmp_path, capsys):
    """An output folder written before runs were pruned (every site's state kept, MLflow's copy of the best
    checkpoint): --dry-run lists the bytes and removes nothing; an unfinished run is refused (nothing removed)
    unless --force; clean removes the sites' states and makes MLflow's copy a link to the run's file."""
    study = tmp_path / "cmp"
    done, cut = study / "fedavg" / "seed0", study / "fedprox" / "seed0"
    _run(done, "all")
    assert _run(cut, "all", method="fedprox", stop_after=1) is None
    copy = study / "mlartifacts" / "1" / "abc" / "artifacts" / "checkpoints" / "best.safetensors"
    copy.parent.mkdir(parents=True)
    for name in ("best.safetensors", "best.json"):
        shutil.copy(done / "checkpoints" / name, copy.with_name(name))
    site_bytes = sum(f.stat().st_size for f in (done / "checkpoints" / "sites").iterdir())
    # an unfinished run: refused, naming it and the fix, before anything is removed
    assert main(["clean", str(study)]) == 2
    err = capsys.readouterr().err
    assert "unfinished" in err and str(cut) in err and "--force" in err
    assert (done / "checkpoints" / "sites").is_dir() and (cut / "checkpoints" / "sites").is_dir()
    # dry run of the finished run's folder: what would go, nothing gone
    assert main(["clean", str(done), "--dry-run"]) == 0
    said = capsys.readouterr().out
    assert f"would remove {done / 'checkpoints' / 'sites'} ({site_bytes / 1e6:.1f} MB)" in said
    assert (done / "checkpoints" / "sites").is_dir()
    # forced over the whole study: both runs pruned, the MLflow copy now the run's own file
    rep = clean(study, force=True, log=lambda m: None)
    assert not (done / "checkpoints" / "sites").exists() and not (cut / "checkpoints" / "sites").exists()
    assert os.path.samefile(copy, done / "checkpoints" / "best.safetensors")
    assert os.path.samefile(copy.with_name("best.json"), done / "checkpoints" / "best.json")
    assert rep.freed >= site_bytes + copy.stat().st_size
    assert clean(study, force=True, log=lambda m: None).freed == 0  # nothing left to prune


def test_a_tune_key_no_listed_method_reads_is_refused_before_training(tmp_path, monkeypatch):
    """`compare --methods fedavg --tune fedsm.lam=0.3,0.5` trained FedAvg twice (the old code); now one error
    naming the key, the methods listed and those that read [fedsm], before any folder is made.  With FedSM
    listed too, the axis applies to FedSM's runs only: FedAvg runs once."""
    out = tmp_path / "cmp"
    with pytest.raises(ConfigError, match=r"fedsm\.lam: no method listed \(fedavg\) reads \[fedsm\].*fedsm-extra"):
        compare("nowhere.toml", ["fedavg"], out, StudyOptions(seeds=(0,)), tune=["fedsm.lam=0.3,0.5"])
    assert not out.exists()
    seen = []

    def fake_jobs(jobs, *a, **k):
        seen.extend(jobs)
        return [fake_results(0.5, 0.5) for _ in jobs]

    monkeypatch.setattr(grid, "run_jobs", fake_jobs)
    grid.tune(
        "nowhere.toml",
        [("fedavg", "fedavg", [], "fedavg"), ("fedsm", "fedsm", [], "fedsm")],
        [grid.parse_grid("fedsm.lam=0.3,0.5")],
        out,
        StudyOptions(seeds=(0,)),
    )
    assert [(j.method, j.point) for j in seen] == [
        ("fedavg", ()),
        ("fedsm", (("fedsm.lam", "0.3"),)),
        ("fedsm", (("fedsm.lam", "0.5"),)),
    ]


def test_fedsm_stores_where_its_test_cases_went_and_the_report_shows_it(tmp_path):
    """results["fedsm"] after a plain FedSM run: per site the counts of test cases routed to each model, equal to
    routing the site's test images by hand with the composite's saved selector and thresholds; the report's
    FedSM section shows the routing table from results.json alone (no model loaded)."""
    from fedseg.algorithms.fedsm.selection import load_composite, route, selector_probs, thresholds
    from fedseg.apps.report.fedsm_section import fedsm_section
    from fedseg.apps.report.model_sections import cases_summary
    from fedseg.apps.report.runs import load_runs
    from fedseg.seams.checkpoint import load_best
    from fedseg.simulation.runner import build_engine

    out = tmp_path / "fedsm"
    cfg = dataclasses.replace(tiny_config("fedsm", rounds=1), checkpoint_keep="final", params=SEL)
    wl = segmentation_workload(2, 1, ["fg"], TINY_MODEL)
    res = simulate(cfg, wl, tiny_sites(), out=out, **QUIET)
    rep = res["fedsm"]
    cand = load_best(out / "checkpoints")["fedsm"].candidate
    engine = build_engine(cfg, wl, tiny_sites(), progress=False, log=lambda m: None)
    for s in res["sites"]:
        site = engine.transport.site(s)
        sel, _ = load_composite(site, cand.arrays, cand.config, engine.algorithm.selector_factory, "fedsm-eval/")
        idx = route(selector_probs(site, sel, "testing").float(), thresholds(cand.config))
        by_hand = torch.bincount(idx, minlength=len(rep["models"])).tolist()
        assert list(rep["per_site"][s]["counts"].values()) == by_hand
        assert sum(by_hand) == res["num_cases"][s] == rep["per_site"][s]["n"]
    assert json.loads((out / "results.json").read_text())["fedsm"] == rep
    (run,) = load_runs([out])
    html = fedsm_section([run], {run.label: rep})
    assert "Routing on test" in html and "PM site3" in html
    summary = cases_summary([run])
    worst = min(range(3), key=lambda i: res["per_case_dice"]["fedsm"]["site1"][i])
    assert f"worst #{worst}" in summary and "→ " in summary


def test_a_pruned_run_still_evaluates_predicts_exports_and_reports(tmp_path):
    """The readers of a finished run work on what pruning keeps: evaluate (the same test Dice), predict (masks),
    export (TorchScript), the report with the FedSM routing and the predictions on test."""
    from fedseg.apps.predict import load_predictor, predict_files
    from fedseg.apps.predict.export import export_run
    from fedseg.apps.report import ReportOptions, build_report
    from fedseg.apps.studies.compare import evaluate_run
    from fedseg.data.spec import load_federation
    from fedseg.simulation.runner import run

    spec = synth_fundus(tmp_path)
    out = tmp_path / "run"
    res = run(spec, out=out, overrides=["method=fedsm", "rounds=2", *SMALL, "device=cpu"], **QUIET)
    assert not (out / "checkpoints" / "sites").exists() and (out / "checkpoints" / "pruned.json").is_file()
    ev = evaluate_run(out, progress=False)
    row = next(r for r in ev["rows"] if r["name"] == "fedsm")
    assert row["per_site_dice"] == pytest.approx(res["per_site_dice"], abs=1e-6)
    site = load_federation(spec).sites[0]
    written = predict_files(load_predictor(out), [site.datalist], tmp_path / "masks", split="testing", **QUIET)
    assert len(written["written"]) == res["num_cases"][site.name]
    files = export_run(out, "torchscript", tmp_path / "export")
    assert files and all(f.is_file() for f in files)
    html = build_report([out], tmp_path / "r.html", ReportOptions(loss_surface=False, tsne=False), progress=False)
    text = html.read_text(encoding="utf-8")
    assert 'id="predictions"' in text and "Routing on test" in text and "worst #" in text


def test_mlflow_holds_the_best_checkpoint_once(tmp_path, monkeypatch):
    """A local MLflow store gets the run's best checkpoint as an artifact that is the run's own file (one copy on
    disk: the old code copied it, 94 MB again for a 3D FedSM run)."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from fedseg.apps.tracking import MlflowTracker

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "out" / "run"
    _run(run_dir, "final")
    tracker = MlflowTracker(tmp_path / "out")
    rid = tracker.log_run(run_dir)
    arts = {a.path for a in MlflowClient(tracker.uri).list_artifacts(rid, "checkpoints")}
    assert arts == {"checkpoints/best.safetensors", "checkpoints/best.json"}
    logged = list((tmp_path / "out" / "mlartifacts").rglob("best.safetensors"))
    assert len(logged) == 1 and os.path.samefile(logged[0], run_dir / "checkpoints" / "best.safetensors")


def test_compacted_best_models_store_a_shared_tensor_once_and_load_unchanged(tmp_path):
    """FedSM's composite holds copies of its best global and personalized models; a finished run stores each
    tensor once.  By hand: candidates a = {w: x, z: +0.0}, b = {w: x (a copy), z: -0.0}: b's w becomes an alias
    of a/w (the file loses 4 × 1000 bytes), b's z stays (its bytes differ from a's), and load_best gives both
    candidates back bit for bit."""
    from fedseg.seams.algorithm import Candidate
    from fedseg.seams.checkpoint import Best, best_files, compact_best, load_best, save_arrays, save_json

    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    best = {
        "a": Best(0.5, 1, Candidate("a", {"w": x, "z": torch.zeros(1)})),
        "b": Best(0.6, 2, Candidate("b", {"w": x.clone(), "z": -torch.zeros(1)})),
    }
    arrays, meta = best_files(best)
    save_arrays(arrays, tmp_path / "best.safetensors")
    save_json(meta, tmp_path / "best.json")
    size = (tmp_path / "best.safetensors").stat().st_size
    assert compact_best(tmp_path, dry_run=True) == 4000  # b/w: 1000 float32 (what `fedseg clean --dry-run` lists)
    assert (tmp_path / "best.safetensors").stat().st_size == size
    assert compact_best(tmp_path) == size - (tmp_path / "best.safetensors").stat().st_size >= 4000
    assert json.loads((tmp_path / "best.json").read_text())["b"]["aliases"] == {"w": "a/w"}
    got = load_best(tmp_path)
    for name, b in best.items():
        arr = got[name].candidate.arrays
        assert arr.keys() == b.candidate.arrays.keys()
        assert all(
            torch.equal(arr[k].view(-1).view(torch.uint8), v.view(-1).view(torch.uint8))
            for k, v in b.candidate.arrays.items()
        )
    assert compact_best(tmp_path) == 0  # already once each
