"""Grids of runs: `compare --tune` chooses on validation and reports on test, `sweep` runs and resumes any grid,
`--jobs` gives the results of the runs one after another."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedseg.apps.studies import jobs
from fedseg.apps.studies.grid import _own_key, choose, grid_points, parse_grid, split_values, validation_score
from fedseg.apps.studies.jobs import Job, requested_config, run_point
from fedseg.cli import main
from fedseg.foundation.errors import ConfigError
from fedseg.seams.checkpoint import save_json
from tests.support.helpers import SETS, SMALL, fake_results, fake_run, synth_fundus


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    return synth_fundus(tmp_path_factory.mktemp("fed"))


def test_grid_axes_and_points():
    assert split_values("[4,8],[8,16], x") == ["[4,8]", "[8,16]", "x"]
    assert parse_grid("train.lr=3e-4,1e-3") == (None, "train.lr", ["3e-4", "1e-3"])
    assert parse_grid("fedsm:lam=0.3,0.5") == ("fedsm", "fedsm.lam", ["0.3", "0.5"])
    assert parse_grid("fedavg:train.lr=1e-3") == ("fedavg", "train.lr", ["1e-3"])
    pts = grid_points([("train.lr", ["1", "2"]), ("train.batch_size", ["4", "8", "16"])])
    assert len(pts) == 6 and pts[0] == {"train.lr": "1", "train.batch_size": "4"}
    assert grid_points([]) == [{}]
    assert _own_key("fedsm", "lam=0.3,0.5") == "fedsm:lam=0.3,0.5"
    assert _own_key("fedsm", "rounds=2,4") == "rounds=2,4"  # a top-level setting
    assert _own_key("fedsm", "train.lr=1") == "train.lr=1"
    with pytest.raises(ConfigError, match="expected KEY=V1,V2"):
        parse_grid("train.lr")
    with pytest.raises(ConfigError, match="unknown method 'nope'"):
        parse_grid("nope:x=1")
    with pytest.raises(ConfigError, match="--seeds"):
        parse_grid("seed=1,2")
    with pytest.raises(ConfigError, match="given twice"):
        parse_grid("train.lr=1,1")


class _ValidationOnly(dict):
    """A results document that fails the test on a read of anything but what validation needs."""

    ALLOWED = frozenset({"rows", "primary", "sites", "method", "name", "home_site", "best_val_dice"})

    def __getitem__(self, k):
        assert k in self.ALLOWED, f"the choice read {k!r}"
        return super().__getitem__(k)

    def get(self, k, default=None):
        assert k in self.ALLOWED, f"the choice read {k!r}"
        return super().get(k, default)


def test_validation_score_is_the_rows_selection_score_and_reads_no_test_number():
    """A primary method is scored by its primary candidate's best validation score, a method of site-owned
    models by the mean of each site's own model's; the test numbers are never read."""
    r = fake_results(0.7, 0.1)
    assert validation_score(_ValidationOnly(r, rows=[_ValidationOnly(x) for x in r["rows"]])) == 0.7
    r = fake_results(0.5, 0.9, primary=None)
    assert validation_score(_ValidationOnly(r, rows=[_ValidationOnly(x) for x in r["rows"]])) == pytest.approx(0.5)
    assert choose([[0.5, 0.7], [0.65, 0.6], [float("nan")]]) == 1  # means 0.6 < 0.625; NaN never wins
    assert choose([[0.5], [0.5]]) == 0  # a tie: the earlier point


# validation and test Dice by learning rate: the test-best (3e-3, then 3e-4) is not the validation-best (1e-3)
VAL = {"3e-4": 0.70, "1e-3": 0.80, "3e-3": 0.60}
TEST = {"3e-4": 0.90, "1e-3": 0.50, "3e-3": 0.95}


def _fake_run(test: dict):
    """Runs whose validation score is VAL's and test Dice ``test``'s for their learning rate, each seed 0.01 apart."""
    return fake_run(lambda lr, seed: (VAL[lr] + 0.01 * seed, test[lr] - 0.01 * seed))


def test_compare_tune_chooses_on_validation_and_reports_test(spec, tmp_path, monkeypatch, capsys):
    """Per method the grid point with the best mean validation score over the seeds is chosen (1e-3), though
    another point has the best test Dice; its test Dice (mean over seeds) is the table's; changing every test
    number leaves the choice as it is."""
    monkeypatch.setattr(jobs, "run", _fake_run(TEST))
    args = ["compare", str(spec), "--methods", "fedavg", "--seeds", "0,1", "--tune", "train.lr=3e-4,1e-3,3e-3"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    rec = json.loads((tmp_path / "a" / "tuning.json").read_text())
    m = rec["methods"][0]
    assert m["points"][m["chosen"]]["point"] == {"train.lr": "1e-3"}
    assert m["points"][0]["validation"] == pytest.approx([0.70, 0.71])
    table = (tmp_path / "a" / "comparison.md").read_text()
    assert "FedAvg [train.lr=1e-3]" in table and "0.4950" in table  # mean of 0.50 and 0.49 on test
    assert "0.9" not in table.split("Tuning on validation")[0]  # no other point's test number
    assert "✓" in table and "0.8050 ± 0.0071" in table  # validation score of the chosen point
    summary = json.loads((tmp_path / "a" / "comparison.json").read_text())
    assert {r["tuning"]["chosen"]["train.lr"] for r in summary} == {"1e-3"}
    # every test number changed (the validation-best now worst on test): the same choice
    flipped = {k: 1.0 - v for k, v in TEST.items()}
    monkeypatch.setattr(jobs, "run", _fake_run(flipped))
    assert main([*args, "--out", str(tmp_path / "b")]) == 0
    m2 = json.loads((tmp_path / "b" / "tuning.json").read_text())["methods"][0]
    assert m2["chosen"] == m["chosen"]
    # a second call reuses the finished points
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    assert capsys.readouterr().out.count("already done") == 6


def test_per_method_axis_and_its_errors(spec, tmp_path, monkeypatch):
    monkeypatch.setattr(jobs, "run", _fake_run(TEST))
    out = tmp_path / "c"
    args = ["compare", str(spec), "--methods", "fedavg,fedavg-even", "--out", str(out)]
    assert main([*args, "--tune", "fedavg:train.lr=3e-4,1e-3"]) == 0
    rec = json.loads((out / "tuning.json").read_text())
    assert [len(m["points"]) for m in rec["methods"]] == [2, 1]
    with pytest.raises(ConfigError, match="--methods does not run"):
        from fedseg.apps.studies.compare import compare

        compare(spec, ["fedavg"], tmp_path / "d", tune=["local:train.lr=1e-3"])
    assert main([*args[:-1], str(tmp_path / "e"), "--tune", "train.nope=1,2"]) == 2


def test_sweep_resumes_a_point_and_refuses_another_runs_folder(spec, tmp_path, capsys):
    """A finished point is reused, a half-finished one continued by the engine's resume to the numbers of an
    uninterrupted run; a folder of a run with other settings is refused."""
    from fedseg.simulation.runner import run

    out = tmp_path / "sw"
    base = [*SMALL, "eval.every=1", "checkpoint_every=1", "device=cpu"]
    # interrupt the lr=1e-3 point after round 1 of 2, as a killed sweep would leave it
    job = Job(str(spec), str(out / "train.lr=1e-3" / "seed0"), (*base, "train.lr=1e-3"), "fedavg", 0, 2)
    Path(job.folder).mkdir(parents=True)
    save_json(job.requested(), Path(job.folder) / "point.json")
    assert (
        run(spec, out=job.folder, overrides=list(job.overrides), method="fedavg", seed=0, rounds=2, stop_after=1)
        is None
    )
    args = ["sweep", str(spec), "--method", "fedavg", "--grid", "train.lr=1e-2,1e-3", "--rounds", "2"]
    args += ["--out", str(out), *[x for s in base for x in ("--set", s)]]
    assert main(args) == 0
    log = capsys.readouterr().out
    assert "resuming" in log and "already done" not in log
    assert (out / "sweep.md").is_file() and (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    resumed = json.loads((out / "train.lr=1e-3" / "seed0" / "results.json").read_text())
    whole = run(spec, out=tmp_path / "whole", overrides=[*base, "train.lr=1e-3"], method="fedavg", seed=0, rounds=2)
    assert resumed["client_avg_dice"] == whole["client_avg_dice"]
    assert [e["round"] for e in resumed["history"]] == [1, 2]
    assert main(args) == 0
    assert capsys.readouterr().out.count("already done") == 2
    # the same folder asked for with another setting: one error naming it
    other = Job(str(spec), job.folder, (*base, "train.lr=1e-3", "train.batch_size=4"), "fedavg", 0, 2)
    with pytest.raises(ConfigError, match=r"other settings \(train.batch_size\)"):
        run_point(other)


def test_requested_config_fails_on_a_bad_value_before_running(spec):
    with pytest.raises(ConfigError, match="train.lr"):
        requested_config(spec, ["train.lr=abc"], "fedavg", 0, 1)


def test_track_mlflow_without_mlflow_is_one_clear_error(spec, tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    args = ["sweep", str(spec), "--method", "fedavg", "--grid", "train.lr=1e-3", "--out", str(tmp_path / "s")]
    assert main([*args, "--track", "mlflow"]) == 2
    assert "pip install 'fedseg[track]'" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()  # refused before any run


def test_fedsm_study_over_seeds_gives_each_seed_its_own_process(spec, tmp_path, monkeypatch):
    """`fedseg fedsm sweep --seeds 0,1 --devices cpu,cpu`: each seed's study is one call of the process map,
    on its own device, into its own folder (the processes' numbers equal the sequential ones:
    test_devices_give_the_runs_of_one_after_another)."""
    from fedseg.apps.studies import fedsm, fedsm_seeds

    seen = {}

    def fake_map(fn, calls, n, log, devices=None):
        seen.update(fn=fn, calls=calls, n=n, devices=devices)
        for (_, folder), kw in calls:
            folder.mkdir(parents=True)
            row = {"lam": 0.7, "client_avg_dice": 0.5 + kw["seed"], "global_dice": 0.4, "dice_by_gamma": {}}
            (folder / "sweep.json").write_text(json.dumps([row]))
        return [([None], None) for _ in calls]

    monkeypatch.setattr(fedsm_seeds, "map_in_processes", fake_map)
    fedsm_seeds.over_seeds("sweep", spec, tmp_path, [0, 1], log=lambda m: None, devices=["cpu", "cpu"], lam=[0.7])
    assert seen["fn"] is fedsm.sweep and seen["n"] == 2 and list(seen["devices"]) == ["cpu", "cpu"]
    assert [(c[0][1].name, c[1]["seed"], c[1]["jobs"]) for c in seen["calls"]] == [("seed0", 0, 1), ("seed1", 1, 1)]
    assert (tmp_path / "sweep.md").is_file()


def test_placement_of_independent_runs(monkeypatch):
    """--devices: one process per device; --jobs: that many on the runs' device; neither: one process per CUDA
    device where there are several (never where the runs are set to a device), else one after another."""
    import torch

    from fedseg.apps.studies.jobs import StudyOptions, default_devices, placement

    assert placement(None, ["cpu", "cpu"]) == (2, ("cpu", "cpu"))
    assert placement(3, None) == (3, None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert placement(None, None) == (2, ("cuda:0", "cuda:1"))
    assert default_devices(["device=cpu"]) is None
    assert placement(None, None, ["train.lr=1e-3", "device=cuda:1"]) == (1, None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert placement(None, None) == (1, None)
    with pytest.raises(ConfigError, match="--jobs 0"):
        placement(0, None)
    with pytest.raises(ConfigError, match="--devices names no device"):
        placement(None, [" "])
    with pytest.raises(ConfigError, match="--jobs 0"):
        StudyOptions(jobs=0)


def test_devices_give_the_runs_of_one_after_another(spec, tmp_path):
    """`compare --tune train.lr=1e-3,1e-2 --devices cpu,cpu` and `fedsm sweep --lam 0.5,0.7 --devices cpu,cpu`
    (one process per device, one torch thread each) write the checkpoints of the sequential commands bit for
    bit, the same tables and the same tuning choice; the report of the tuned folder shows the choice."""
    import torch

    from fedseg.apps.report import ReportOptions, build_report

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the sequential runs with one thread, as each device's process
    try:
        args = ["compare", str(spec), "--methods", "fedavg", "--seeds", "0", "--rounds", "1", *SETS]
        args += ["--tune", "train.lr=1e-3,1e-2"]
        for name, extra in (("seq", ["--jobs", "1"]), ("dev", ["--devices", "cpu,cpu"])):
            assert main([*args, "--out", str(tmp_path / name), *extra]) == 0
        for lr in ("1e-3", "1e-2"):
            rel = Path("fedavg") / f"train.lr={lr}" / "seed0"
            a, b = (json.loads((tmp_path / x / rel / "results.json").read_text()) for x in ("seq", "dev"))
            assert a["per_case_dice"] == b["per_case_dice"]
            ckpt = rel / "checkpoints" / "best.safetensors"
            assert (tmp_path / "seq" / ckpt).read_bytes() == (tmp_path / "dev" / ckpt).read_bytes()
        chosen = json.loads((tmp_path / "seq" / "tuning.json").read_text())
        assert chosen == json.loads((tmp_path / "dev" / "tuning.json").read_text())
        html = build_report([tmp_path / "seq"], tmp_path / "r.html", ReportOptions(models=False), progress=False)
        text = html.read_text()
        assert 'id="tuning"' in text and 'id="fig-tuning-0"' in text
        method = chosen["methods"][0]
        assert f"FedAvg [{method['points'][method['chosen']]['text']}]" in text
        args = ["fedsm", "sweep", str(spec), "--lam", "0.5,0.7", "--gamma", "0", "--rounds", "1", *SETS]
        for name, extra in (("fseq", ["--jobs", "1"]), ("fdev", ["--devices", "cpu,cpu"])):
            assert main([*args, "--out", str(tmp_path / name), *extra]) == 0
        for lam in ("0.5", "0.7"):
            rel = Path(f"lam{lam}") / "checkpoints" / "best.safetensors"
            assert (tmp_path / "fseq" / rel).read_bytes() == (tmp_path / "fdev" / rel).read_bytes()
        assert (tmp_path / "fseq" / "sweep.md").read_text() == (tmp_path / "fdev" / "sweep.md").read_text()
    finally:
        torch.set_num_threads(threads)
