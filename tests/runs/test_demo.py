"""`fedseg demo`'s settings: the demo's learning rate reaches every run, and `--set` puts the papers' back."""

from __future__ import annotations

from pathlib import Path

import fedseg.apps.studies.compare as studies
from fedseg.cli import main
from fedseg.foundation.config.loader import apply_overrides


def _capture(monkeypatch, tmp_path: Path) -> dict:
    """Stand-ins for synthesis, training and the report that record what the demo asks of them."""
    seen: dict = {}

    def synthesize(preset, out, **kw):
        seen["preset"] = preset
        return Path(out) / "federation.toml"

    def compare(spec, methods, out, options):
        seen["methods"], seen["overrides"] = tuple(methods), list(options.overrides)
        return [], "table"

    monkeypatch.setattr(studies, "synthesize", synthesize)
    monkeypatch.setattr(studies, "compare", compare)
    monkeypatch.setattr(studies, "build_report", lambda *a, **k: tmp_path / "report.html")
    return seen


def test_demo_trains_every_method_at_the_demo_learning_rate(monkeypatch, tmp_path):
    seen = _capture(monkeypatch, tmp_path)
    assert main(["demo", "--out", str(tmp_path)]) == 0
    assert seen["preset"] == "fundus" and seen["methods"] == studies.DEMO_METHODS
    assert apply_overrides({}, seen["overrides"])["train"]["lr"] == float(studies.DEMO_LR) == 1e-2
    # the documented learning rate is the one the demo uses
    page = (Path(__file__).parents[2] / "docs" / "results" / "demo.md").read_text()
    assert f"Adam **{studies.DEMO_LR}**" in page and "--set train.lr=1e-3" in page


def test_demo_set_wins_over_the_demo_settings(monkeypatch, tmp_path):
    """`fedseg demo --set train.lr=1e-3` is the papers' learning rate: given after the demo's own settings, it is
    the one the runs resolve (a later override of the same key replaces the earlier)."""
    seen = _capture(monkeypatch, tmp_path)
    assert main(["demo", "--out", str(tmp_path), "--set", "train.lr=1e-3", "--set", "eval.every=4"]) == 0
    resolved = apply_overrides({}, seen["overrides"])
    assert resolved["train"]["lr"] == 1e-3 and resolved["eval"]["every"] == 4
    assert resolved["train"]["batch_size"] == 4  # the demo's other settings stay
