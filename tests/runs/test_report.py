"""`fedseg report`: one self-contained, valid HTML file with every table and figure the runs call for;
`fedseg run --tensorboard` writes per-round scalars.

The runs are made once per module on a tiny synthetic fundus federation (6 sites, 32 px,
scale 0.05, U-Net channels 4-8-16, 2 rounds): local, centralized, FedAvg, Auto-FedAvg,
and FedSM trained without site6 (the unseen-site study, FedSM Table 5).
"""

from __future__ import annotations

import base64
import json
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from fedseg.algorithms import REGISTRY
from fedseg.apps.report import ReportOptions, build_report
from fedseg.cli import main

SMALL = ["model.channels=[4,8,16]", "model.strides=[2,2]", "model.num_res_units=1", "train.batch_size=4"]
VOID = {"meta", "img", "br", "hr", "link", "input", "col", "source", "wbr"}


class _Checker(HTMLParser):
    """Tag balance, ids of sections and figures, image sources, external references."""

    def __init__(self):
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.sections: list[str] = []
        self.figures: list[str] = []
        self.images: list[str] = []
        self.external: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section":
            self.sections.append(a.get("id"))
        if tag == "figure":
            self.figures.append(a.get("id"))
        if tag == "img":
            self.images.append(a.get("src", ""))
        for key in ("src", "href"):
            v = a.get(key)
            if v and not (v.startswith("data:") or v.startswith("#")):
                if (
                    key == "href"
                    and tag == "a"
                    and v.endswith("config.toml")
                    and "://" not in v
                    and not v.startswith("/")
                ):
                    continue  # the bookkeeping links each run's config.toml, relative to the report
                self.external.append(v)
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in VOID:
            self.stack.pop()

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes <{self.stack[-1] if self.stack else None}>")
            return
        self.stack.pop()


def check_html(path: Path) -> _Checker:
    text = path.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>")
    c = _Checker()
    c.feed(text)
    c.close()
    assert c.errors == [], c.errors[:5]
    assert c.stack == [], f"unclosed tags: {c.stack}"
    assert c.external == [], "the report must be self-contained"
    for src in c.images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    return c


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Tiny runs of every method family the report knows (made once, ~20 s on a loaded 2-core CPU)."""
    from fedseg.apps.studies.fedsm import load_spec, run_fedsm
    from fedseg.data.synth import synthesize
    from fedseg.simulation.runner import run

    root = tmp_path_factory.mktemp("report")
    spec = synthesize("fundus", root / "data", scale=0.05, size=32)
    quiet = {"progress": False, "log": lambda s: None}
    for method in ("local", "centralized", "fedavg", "autofedavg"):
        run(spec, out=root / "runs" / method, overrides=SMALL, method=method, rounds=2, seed=0, **quiet)
    cfg, workload, data = load_spec(spec, SMALL, method="fedsm", rounds=2, seed=0)
    run_fedsm(cfg, workload, data, out=root / "runs" / "unseen-site6", heldout="site6", gammas=[0.0, 0.9], **quiet)
    return root / "runs"


@pytest.fixture(scope="module")
def full_report(runs):
    out = runs.parent / "report.html"
    build_report([runs], out, ReportOptions(directions=2, steps=5, loss_cases=4, cases=1, tsne_cases=6), progress=False)
    return out


def test_report_of_every_method_has_every_section_and_is_valid_html(full_report):
    """All runs given → every table and figure: Table 3 always, Table 2 (autofedavg + fedavg),
    FedSM routing and Table 5 (the unseen-site run), curves, α (autofedavg), loss surface,
    t-SNE (FedSM selector) and predictions."""
    # Execute
    c = check_html(full_report)
    # Assert
    assert c.sections == [
        "headline",
        "table3",
        "distributions",
        "table2",
        "fedsm",
        "table5",
        "curves",
        "alpha",
        "loss-surface",
        "tsne",
        "predictions",
        "runs",
        "config",
    ]
    assert c.figures == [
        "fig-distributions",
        "fig-fedsm-history",
        "fig-curves",
        "fig-history",
        "fig-alpha",
        "fig-loss-surface",
        "fig-tsne-0",
        "fig-predictions",
    ]
    assert full_report.stat().st_size < 2_000_000


def test_report_tables_name_every_method_site_and_test(full_report):
    text = full_report.read_text(encoding="utf-8")
    t3 = text.split('<section id="table3">')[1].split("</section>")[0]
    for label in (
        "site1 Local",
        "Centralized",
        "FedAvg",
        "Auto-FedAvg-N-Dirichlet",
        "FedSM (unseen site6)",
        "Client Avg Dice",
    ):
        assert label in t3
    for s in ("site1", "site6"):
        assert f"<th>{s}</th>" in t3
    t2 = text.split('<section id="table2">')[1].split("</section>")[0]
    assert "Wilcoxon signed-rank p-values vs FedAvg" in t2 and "local gen" in t2
    t5 = text.split('<section id="table5">')[1].split("</section>")[0]
    row = [r for r in t5.split("<tr>") if r.startswith("<td>site6</td>")]
    assert len(row) == 1 and row[0].count("N/A") == 1  # its own personalized model does not exist
    ls = text.split('<section id="loss-surface">')[1].split("</section>")[0]
    for name in ("local/site1", "FedAvg (global)", "FedSM (unseen site6) (fedsm: personal/site1)"):
        assert name in ls


def test_sections_appear_only_for_what_the_runs_contain(runs, tmp_path):
    """A FedAvg run alone: no Table 2 (needs Auto-FedAvg), no α, no FedSM sections; model sections skipped on request."""
    out = build_report([runs / "fedavg"], tmp_path / "r.html", ReportOptions(models=False), progress=False)
    c = check_html(out)
    assert c.sections == ["headline", "table3", "distributions", "curves", "runs", "config"]
    assert c.figures == ["fig-distributions", "fig-curves", "fig-history"]


def test_cli_report_and_its_errors(runs, tmp_path, capsys):
    # Execute: the verb writes the file and says where it is
    out = tmp_path / "sub" / "r.html"
    assert main(["report", str(runs / "fedavg"), str(runs / "autofedavg"), "--html", str(out), "--no-models"]) == 0
    # Assert
    assert str(out.resolve()) in capsys.readouterr().out
    assert "alpha" in check_html(out).sections
    # bad inputs: a folder that is not a run, an even grid
    assert main(["report", str(tmp_path / "nowhere"), "--html", str(out)]) == 2
    assert "does not exist; give the output folder of a finished run" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "holds no results.json" in capsys.readouterr().err
    assert main(["report", str(runs / "fedavg"), "--steps", "4"]) == 2
    assert "odd number >= 3" in capsys.readouterr().err


def test_model_sections_explain_missing_checkpoints(runs, tmp_path):
    """A run folder copied without checkpoints still gets its tables; the model sections say why they are empty."""
    import shutil

    bare = tmp_path / "fedavg"
    bare.mkdir()
    for name in ("results.json", "config.toml"):
        shutil.copy(runs / "fedavg" / name, bare / name)
    out = build_report([bare], tmp_path / "r.html", ReportOptions(directions=1, steps=3), progress=False)
    c = check_html(out)
    assert "loss-surface" in c.sections and "predictions" not in c.sections
    assert "no checkpoints/best.json" in out.read_text(encoding="utf-8")


def test_run_with_tensorboard_writes_per_round_scalars(runs, tmp_path, capsys):
    """`fedseg run --tensorboard` logs train loss per site, validation Dice, bytes at step = round."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    spec = runs.parent / "data" / "federation.toml"
    out = tmp_path / "tb"
    sets = [x for s in SMALL for x in ("--set", s)]
    assert (
        main(["run", str(spec), "--method", "fedavg", "--rounds", "2", "--out", str(out), "--tensorboard", *sets]) == 0
    )
    assert "tensorboard --logdir" in capsys.readouterr().out
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train_loss/site1", "val_dice/global/site6", "val_score/global", "bytes/total/sent", "time_s"} <= tags
    assert [e.step for e in acc.Scalars("train_loss/site1")] == [1, 2]
    history = json.loads((out / "results.json").read_text())["history"]
    assert acc.Scalars("val_score/global")[-1].value == pytest.approx(history[-1]["val_score"]["global"])


def test_tensorboard_logger_writes_alpha(runs, tmp_path):
    """Auto-FedAvg's α per site becomes scalars alpha/<site>."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fedseg.apps.report.tensorboard import TensorBoardLogger

    history = json.loads((runs / "autofedavg" / "results.json").read_text())["history"]
    with TensorBoardLogger(tmp_path / "tb") as log:
        for entry in history:
            log(entry)
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    values = [e.value for e in acc.Scalars("alpha/site1")]
    assert values == pytest.approx([e["alpha"]["site1"] for e in history])


def test_tensorboard_flag_without_tensorboard_says_how_to_install(runs, tmp_path, monkeypatch, capsys):
    """Without the tensorboard package, `--tensorboard` stops before training with the install command."""
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import fail
    spec = runs.parent / "data" / "federation.toml"
    out = tmp_path / "nope"
    assert main(["run", str(spec), "--out", str(out), "--rounds", "1", "--tensorboard"]) == 2
    assert "pip install 'fedseg[report]'" in capsys.readouterr().err
    assert not (out / "results.json").exists()


# ------------------------------------------------------------------ hand-made run folders (no training)
def _fake_run(
    folder: Path,
    method: str,
    seed: int,
    per_case: dict[str, list[float]],
    settings: dict | None = None,
    routing_acc: float | None = None,
) -> Path:
    """A run folder with a results.json in the documented format (docs/results-format.md), numbers given by hand."""
    sites = list(per_case)
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    psd = {s: mean(v) for s, v in per_case.items()}
    pooled = [x for v in per_case.values() for x in v]
    primary = "fedsm" if method.startswith("fedsm") else "global"

    def row(name, dice, home=None):
        return {
            "name": name,
            "home_site": home,
            "best_round": 2,
            "best_val_dice": 0.5,
            "per_site_dice": dice,
            "client_avg_dice": mean(list(dice.values())),
            "global_dice": mean(pooled),
        }

    rows = [row(primary, psd)]
    pcd = {primary: per_case}
    if primary == "fedsm":
        rows.append(row("global", {s: v - 0.1 for s, v in psd.items()}))
        rows += [row(f"personal/{s}", {t: v - 0.05 for t, v in psd.items()}, s) for s in sites]
    history = []
    for r in (1, 2, 3):
        e = {
            "round": r,
            "train_loss": {s: 1.0 / r for s in sites},
            "bytes": {s: {"sent": 1000, "received": 1000} for s in sites},
            "val_dice": {primary: {s: 0.2 * r for s in sites}},
            "val_score": {primary: 0.2 * r},
        }
        if routing_acc is not None:
            e["routing_acc"] = {s: routing_acc for s in sites}
            e["selector_loss"] = {s: 2.0 / r for s in sites}
        history.append(e)
    cls = REGISTRY[method]
    results = {
        "method": method,
        "label": cls.label_for(cls.Params()),
        "primary": cls.primary,
        "sites": sites,
        "seed": seed,
        "metric_names": ["disc"],
        "per_site_dice": psd,
        "client_avg_dice": mean(list(psd.values())),
        "global_dice": mean(pooled),
        "num_cases": {s: len(v) for s, v in per_case.items()},
        "rows": rows,
        "per_case_dice": pcd,
        "history": history,
        "config": {"method": method, "seed": seed, **({"fedsm": settings} if settings else {})},
        "wall_time_s": 1.0,
    }
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps(results))
    return folder


def _section(text: str, sec: str) -> str:
    return text.split(f'<section id="{sec}">')[1].split("</section>")[0]


def test_two_variants_of_one_method_get_two_rows_and_seeds_of_one_variant_one(tmp_path):
    """FedSM with γ = 0.9 and with γ = auto (both seed 0) stay two methods everywhere; FedAvg's seeds 0 and 1 merge into mean ± sd."""
    # Prepare: a compare-like folder
    cases = {"a": [0.6, 0.7, 0.8], "b": [0.2, 0.3]}
    _fake_run(tmp_path / "runs" / "fedsm" / "seed0", "fedsm", 0, cases, routing_acc=0.5)
    _fake_run(
        tmp_path / "runs" / "fedsm-gamma=auto" / "seed0",
        "fedsm",
        0,
        {"a": [0.9, 0.9, 0.9], "b": [0.5, 0.5]},
        {"gamma": "auto"},
        1.0,
    )
    _fake_run(tmp_path / "runs" / "fedavg" / "seed0", "fedavg", 0, cases)
    _fake_run(tmp_path / "runs" / "fedavg" / "seed1", "fedavg", 1, {"a": [0.5, 0.6, 0.7], "b": [0.1, 0.2]})
    # Execute
    out = build_report([tmp_path / "runs"], tmp_path / "r.html", ReportOptions(models=False), progress=False)
    # Assert
    c = check_html(out)
    assert c.sections[0] == "headline" and c.sections[-2:] == ["runs", "config"]
    text = out.read_text(encoding="utf-8")
    head = _section(text, "headline")
    assert head.count("<td>FedSM</td>") == 1 and head.count("<td>FedSM (gamma=auto)</td>") == 1
    assert head.count("<td>FedAvg</td>") == 1 and "<td>0, 1</td>" in head
    fedavg_row = head.split("<td>FedAvg</td>")[1].split("</tr>")[0]
    assert "± 0.0707" in fedavg_row  # sd of Client Avg over the two seeds: 0.475 and 0.375
    auto_row = head.split("<td>FedSM (gamma=auto)</td>")[1].split("</tr>")[0]
    assert auto_row.split("<td>")[2].startswith("0.7000")  # its own Client Avg (0.9 + 0.5) / 2, not merged with γ = 0.9
    t3 = _section(text, "table3")
    assert "<td>FedSM</td>" in t3 and "<td>FedSM (gamma=auto)</td>" in t3
    runs_table = _section(text, "runs")
    for label in ("<td>FedSM</td>", "<td>FedSM (gamma=auto)</td>", "<td>FedAvg seed 0</td>", "<td>FedAvg seed 1</td>"):
        assert runs_table.count(label) == 1
    fedsm = _section(text, "fedsm")
    assert "<h3>FedSM</h3>" in fedsm and "<h3>FedSM (gamma=auto)</h3>" in fedsm
    assert "γ setting: auto" in fedsm
    assert "routing on test is not in results.json" in fedsm  # --no-models: it is not computed


def test_headline_intervals_and_differences():
    """One seed each → bootstrap intervals; a run against an identical copy → Δ = 0 with a [0, 0] interval;
    runs on different sites → no Δ."""
    from fedseg.apps.report.numbers import headline

    base = {
        "method": "fedavg",
        "sites": ["a", "b"],
        "seed": 0,
        "client_avg_dice": 0.5,
        "global_dice": 0.52,
        "per_case_dice": {"global": {"a": [0.4, 0.5, 0.6], "b": [0.5, 0.5]}},
        "rows": [{"name": "global", "best_round": 7}],
    }
    same = {**base, "method": "fedprox"}
    other_sites = {**base, "method": "centralized", "sites": ["a"], "per_case_dice": {"global": {"a": [0.4, 0.5, 0.6]}}}
    rows = {r["label"]: r for r in headline({"FedAvg": [base], "FedProx": [same], "C": [other_sites]}, boot=500)}
    lo, hi = rows["FedAvg"]["client_avg"]["ci"]
    assert lo < 0.5 < hi and rows["FedAvg"]["best_round"] == "7"
    d = rows["FedProx"]["delta"]["FedAvg"]["client_avg"]
    assert d["value"] == 0.0 and d["ci"] == (0.0, 0.0)
    assert rows["C"]["delta"]["FedAvg"]["client_avg"]["value"] is None
    assert rows["FedAvg"]["delta"]["centralized"]["global"]["value"] is None


def test_variant_labels_name_the_settings_that_differ():
    from fedseg.apps.report.runs import variant_labels

    runs = [
        {"method": "fedsm", "label": "FedSM", "config": {}},
        {"method": "fedsm", "label": "FedSM", "config": {"fedsm": {"gamma": "auto"}}},
        {"method": "fedsm", "label": "FedSM", "config": {"fedsm": {"gamma": 0.5, "lam": 0.3}}},
        {"method": "fedavg", "label": "FedAvg", "config": {}},
        {"method": "fedsm", "config": {"fedsm": {"gamma": "auto"}}, "label": "fedsm (gamma=auto)"},
    ]
    assert variant_labels(runs) == [
        "FedSM",
        "FedSM (gamma=auto)",
        "FedSM (gamma=0.5, lam=0.3)",
        "FedAvg",
        "fedsm (gamma=auto)",
    ]
    # one variant only: the plain name, whatever its settings
    assert variant_labels([{"method": "fedsm", "label": "FedSM", "config": {"fedsm": {"gamma": "auto"}}}]) == ["FedSM"]


def test_table2_rows_are_the_methods_reported_by_a_global_model_or_by_the_sites_models():
    """Table 2's rows follow each method's ``primary`` candidate in the registry, not a list of names."""
    from fedseg.apps.report.sections import _table2_row

    tested = {"per_case_dice": {"global": {"a": [0.5]}}}
    for method in ("fedavg", "fedavg-even", "fedprox", "centralized", "autofedavg", "scaffold", "fga"):
        assert _table2_row({"method": method, **tested}), method
    assert _table2_row({"method": "local"}) and _table2_row({"method": "ditto", **tested})
    assert not _table2_row({"method": "fedsm", **tested})  # reported by its composite, not the global model
    assert not _table2_row({"method": "fedavg"})  # no per-case Dice of the global model: no paired test


def test_fedsm_findings_say_where_the_images_went():
    """Sentences generated from the numbers: a site that lost because 40 % of its images went to another
    site's personalized model; a site whose images all went to its own model; all-to-GM summarised first."""
    from fedseg.apps.report.numbers import fedsm_findings

    summary = {
        "sites": ["s1", "s2"],
        "models": ["global", "personal/s1", "personal/s2"],
        "dice": {
            "s1": {"fedsm": 0.60, "global": 0.65, "personal/s1": 0.70, "personal/s2": 0.51},
            "s2": {"fedsm": 0.80, "global": 0.70, "personal/s1": 0.40, "personal/s2": 0.80},
        },
        "selection": {
            "s1": {"global": 0.6, "personal/s1": 0.0, "personal/s2": 0.4},
            "s2": {"global": 0.0, "personal/s1": 0.0, "personal/s2": 1.0},
        },
        "routing_acc": None,
    }
    s1, s2 = fedsm_findings(summary)
    assert s1.startswith("s1: composite 0.600 vs global model 0.650 (-0.050, lost)")
    assert "40 % to PM s2 (Dice 0.510 on s1)" in s1 and "40 % went to another site's personalized model" in s1
    assert (
        "100 % to PM s2 (its own)" in s2 and "(+0.100, gained)" in s2 and "mostly to its own personalized model" in s2
    )
    mixed = fedsm_findings({**summary, "mode": "mix"})  # the ensemble mixes all models: only the selector's top choice
    assert "the selector's top choice for its images was 60 % to GM" in mixed[0] and "another site's" not in mixed[0]
    summary["selection"] = {s: {"global": 1.0, "personal/s1": 0.0, "personal/s2": 0.0} for s in ("s1", "s2")}
    summary["dice"]["s1"]["fedsm"] = 0.65
    first, *_ = fedsm_findings(summary)
    assert first.startswith("Every test image of every site went to the global model")


def test_routing_computed_from_the_checkpoint_matches_the_one_recorded_in_training(runs):
    """`fedseg fedsm` records the routing on test in results["fedsm"]; the report recomputes it from
    checkpoints/best.* for runs that lack it. On a run that has both, the two agree: shares and Dice of every
    model on every site, at the run's γ and at γ = 0 (where the selector's argmax decides, so the images spread
    over the personalized models), and the per-image names in the predictions give the same shares."""
    from fedseg.apps.report.model_sections import routed_models, routing_on_test
    from fedseg.apps.report.numbers import model_short
    from fedseg.apps.report.runs import DataCache, RunModels, load_runs
    from fedseg.site.batches import batch_of, dataset_len

    # Prepare
    (run,) = load_runs([runs / "unseen-site6"])
    m = RunModels.open(run, DataCache())
    recorded = run.results["fedsm"]
    spread = 0
    for gamma in (None, 0.0):
        # Execute
        computed = routing_on_test(m, gamma)
        # Assert
        assert computed["models"] == recorded["models"]
        for s, rec in recorded["per_site"].items():
            want = rec["selection"] if gamma is None else rec["selection_by_gamma"]["0.0"]
            got = computed["per_site"][s]
            assert got["n"] == rec["n"] and got["routing_acc"] == rec["routing_acc"]
            assert got["selection"] == pytest.approx(want)
            assert got["dice_per_model"] == pytest.approx(rec["dice_per_model"])
            test = m.data[s].test
            x, _ = batch_of(test, torch.arange(dataset_len(test)))
            names = routed_models(m, x.to(m.site(s).dtype), gamma)
            shares = {name: names.count("→ " + model_short(name)) / len(names) for name in recorded["models"]}
            assert shares == pytest.approx(want)
            spread += sum(1 for v in want.values() if v)
    assert spread > len(recorded["per_site"]) + 1  # at γ = 0 some site's images go to more than one model, or not to GM


def test_fedsm_section_computes_the_routing_of_a_run_that_did_not_record_it(runs, tmp_path):
    """A FedSM run made by `fedseg run`/`compare` has no results["fedsm"]: with models, the report computes the
    routing matrix from the checkpoint; with --no-models it says how to get it."""
    import shutil

    run = tmp_path / "fedsm"
    shutil.copytree(runs / "unseen-site6", run)
    res = json.loads((run / "results.json").read_text())
    recorded = res.pop("fedsm")
    (run / "results.json").write_text(json.dumps(res))
    out = build_report(
        [run],
        tmp_path / "r.html",
        ReportOptions(directions=1, steps=3, loss_cases=2, cases=0, tsne_cases=3),
        progress=False,
    )
    fedsm = _section(out.read_text(encoding="utf-8"), "fedsm")
    per = recorded.get("gamma_per_model")  # the default profile: one threshold per personalized model
    at = f"γ per model {', '.join(f'{float(g):g}' for g in per)}" if per else f"γ = {recorded['gamma']:g}"
    assert f"Routing on test (at {at})" in fedsm and "of each model inside it" in fedsm
    row = fedsm.split("<td>site1</td>")[2].split("</tr>")[0]  # the routing table's row of site1
    assert row.count("%") == len(recorded["models"])
    out = build_report([run], tmp_path / "r2.html", ReportOptions(models=False), progress=False)
    assert "routing on test is not in results.json" in _section(out.read_text(encoding="utf-8"), "fedsm")
