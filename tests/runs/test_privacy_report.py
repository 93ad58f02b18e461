"""ε of a DP run in the results table (``table3``: ``fedseg compare``'s table and a run's ``results.md``) and in the
HTML report."""

from __future__ import annotations

import dataclasses
import json

import pytest

from fedseg.apps.report import ReportOptions, build_report
from fedseg.evaluation.tables import privacy_of, table3
from fedseg.foundation.config import PrivacyConfig
from fedseg.simulation.runner import simulate
from tests.support.helpers import tiny_config, tiny_sites

pytest.importorskip("opacus")

QUIET = {"progress": False, "log": lambda m: None}


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """One FedAvg round with DP-SGD (σ = 1) and the same without DP."""
    from fedseg.site.workload import segmentation_workload
    from tests.support.helpers import TINY_MODEL

    wl = segmentation_workload(2, 1, ["fg"], TINY_MODEL)
    root = tmp_path_factory.mktemp("dp-runs")
    cfg = tiny_config("fedavg", rounds=1)
    dp = dataclasses.replace(cfg, privacy=PrivacyConfig(dp="sample", noise_multiplier=1.0, delta=1e-4))
    simulate(dp, wl, tiny_sites(3), out=root / "dp", **QUIET)
    simulate(cfg, wl, tiny_sites(3), out=root / "plain", **QUIET)
    return root


def _results(path):
    return json.loads((path / "results.json").read_text())


def test_table_shows_epsilon_of_the_dp_run(two_runs):
    """The DP run's row is its own (``FedAvg (dp=sample)``) with the largest ε any site spent, the run without
    DP shows ∞, and the note states δ and the accountant; a table of runs without DP has no ε column."""
    dp, plain = _results(two_runs / "dp"), _results(two_runs / "plain")
    eps = max(s["epsilon"] for s in dp["privacy"]["sites"].values())
    assert eps > 0 and privacy_of(dp)["epsilon"] == eps and privacy_of(plain) is None
    md = table3([dp, plain])
    rows = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| FedAvg")}
    assert sorted(rows) == ["FedAvg", "FedAvg (dp=sample)"]
    assert rows["FedAvg (dp=sample)"].rstrip(" |").endswith(f"{eps:.2f}")
    assert rows["FedAvg"].rstrip(" |").endswith("∞")
    assert "| ε |" in md and "δ = 0.0001, accountant rdp" in md
    assert "ε" not in table3([plain])
    assert f"{eps:.2f}" in (two_runs / "dp" / "results.md").read_text()


def test_report_shows_epsilon_per_site(two_runs, tmp_path):
    """The report's Dice table carries the ε column and its privacy section one row per site of the DP run with
    that site's ε, δ and accountant; the DP run is a variant of its own in every section; a report of runs
    without DP has no privacy section."""
    dp = _results(two_runs / "dp")
    out = build_report(
        [two_runs / "dp", two_runs / "plain"], tmp_path / "r.html", ReportOptions(models=False), progress=False
    )
    text = out.read_text()
    section = text.split('<section id="privacy">')[1].split("</section>")[0]
    for site, s in dp["privacy"]["sites"].items():
        row = [r for r in section.split("<tr>") if f"<td>{site}</td>" in r]
        assert len(row) == 1 and f"<td>{s['epsilon']:.3f}</td>" in row[0] and "<td>rdp</td>" in row[0]
    t3 = text.split('<section id="table3">')[1].split("</section>")[0]
    assert "<th>ε</th>" in t3 and "FedAvg (dp=sample)" in t3
    headline = text.split('<section id="headline">')[1].split("</section>")[0]
    assert "FedAvg (dp=sample)" in headline  # its own variant, not a seed of the run without DP
    plain = build_report([two_runs / "plain"], tmp_path / "p.html", ReportOptions(models=False), progress=False)
    assert 'id="privacy"' not in plain.read_text()


def test_seeded_randomness_shows_infinite_epsilon_against_the_server(two_runs, tmp_path):
    """A run with ``privacy.dp_randomness = "seeded"`` (results: ``epsilon_against_server = "inf"``) shows its ε
    with "(∞ vs server)" in the table, a note saying why, and "∞ (seeded)" per site in the report; a run with
    the OS-keyed randomness shows neither."""
    import shutil

    dp = _results(two_runs / "dp")
    assert dp["privacy"]["dp_randomness"] == "os" and dp["privacy"]["epsilon_against_server"] == "epsilon"
    assert "∞ vs server" not in table3([dp])
    seeded = json.loads(json.dumps(dp))
    seeded["privacy"].update(dp_randomness="seeded", epsilon_against_server="inf")
    assert privacy_of(seeded)["seeded"] and not privacy_of(dp)["seeded"]
    md = table3([seeded])
    row = next(line for line in md.splitlines() if line.startswith("| FedAvg (dp=sample)"))
    assert row.rstrip(" |").endswith("(∞ vs server)") and "the server knows the seed" in md
    run = tmp_path / "seeded"
    shutil.copytree(two_runs / "dp", run)
    (run / "results.json").write_text(json.dumps(seeded))
    text = build_report([run], tmp_path / "s.html", ReportOptions(models=False), progress=False).read_text()
    section = text.split('<section id="privacy">')[1].split("</section>")[0]
    assert "<td>∞ (seeded)</td>" in section
