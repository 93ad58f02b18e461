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

from fedseg.cli import main
from fedseg.report import ReportOptions, build_report

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
    from fedseg.data.synth import synthesize
    from fedseg.fedsm_experiments import load_spec, run_fedsm
    from fedseg.runner import run

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


@pytest.mark.slow
def test_report_of_every_method_has_every_section_and_is_valid_html(full_report):
    """All runs given → every table and figure: Table 3 always, Table 2 (autofedavg + fedavg),
    FedSM routing and Table 5 (the unseen-site run), curves, α (autofedavg), loss surface,
    t-SNE (FedSM selector) and predictions."""
    # Execute
    c = check_html(full_report)
    # Assert
    assert c.sections == ["runs", "config", "table3", "table2", "routing", "table5", "curves", "alpha", "loss-surface", "tsne", "predictions"]
    assert c.figures == ["fig-curves", "fig-alpha", "fig-loss-surface", "fig-tsne-0", "fig-predictions"]
    assert full_report.stat().st_size < 2_000_000


@pytest.mark.slow
def test_report_tables_name_every_method_site_and_test(full_report):
    text = full_report.read_text(encoding="utf-8")
    t3 = text.split('<section id="table3">')[1].split("</section>")[0]
    for label in ("site1 Local", "Centralized", "FedAvg", "Auto-FedAvg-N-Dirichlet", "FedSM (unseen site6)", "Client Avg Dice"):
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
    assert c.sections == ["runs", "config", "table3", "curves"]
    assert c.figures == ["fig-curves"]


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
    assert main(["run", str(spec), "--method", "fedavg", "--rounds", "2", "--out", str(out), "--tensorboard", *sets]) == 0
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

    from fedseg.report.tensorboard import TensorBoardLogger

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
