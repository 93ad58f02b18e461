"""The command line: help, synth → validate → run → resume → evaluate → compare, and its errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fedseg.cli import main

SMALL = [
    "--set",
    "model.channels=[4,8,16]",
    "--set",
    "model.strides=[2,2]",
    "--set",
    "model.num_res_units=1",
    "--set",
    "train.batch_size=8",
]


def test_help_lists_every_verb_with_a_purpose():
    out = subprocess.run(
        [sys.executable, "-m", "fedseg.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for verb in ("demo", "synth", "validate", "run", "evaluate", "compare", "sweep"):
        assert verb in out


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    out = tmp_path_factory.mktemp("fed") / "fundus"
    assert main(["synth", "--preset", "fundus", "--out", str(out), "--scale", "0.05", "--size", "32"]) == 0
    return out / "federation.toml"


def test_validate_ok_and_bad(spec, tmp_path, capsys):
    assert main(["validate", str(spec)]) == 0
    assert "OK" in capsys.readouterr().out
    # a missing image is reported with its file and the run refuses to start
    datalist = json.loads((spec.parent / "site1" / "datalist.json").read_text())
    victim = spec.parent / "site1" / datalist["training"][0]["image"]
    victim.rename(victim.with_suffix(".bak"))
    try:
        assert main(["validate", str(spec)]) == 1
        assert victim.name in capsys.readouterr().out
        assert main(["run", str(spec), "--out", str(tmp_path / "r"), "--rounds", "1", *SMALL]) == 2
        assert victim.name in capsys.readouterr().err
    finally:
        victim.with_suffix(".bak").rename(victim)


def test_run_resume_evaluate_compare(spec, tmp_path, capsys):
    out = tmp_path / "run"
    keep = ["--set", "checkpoint_keep=all"]  # resumed with more rounds below
    assert main(["run", str(spec), "--method", "fedavg", "--rounds", "2", "--out", str(out), *SMALL, *keep]) == 0
    res = json.loads((out / "results.json").read_text())
    for key in ("method", "sites", "seed", "per_site_dice", "client_avg_dice", "global_dice", "history", "config"):
        assert key in res
    assert res["label"] == "FedAvg" and res["primary"] == "global"
    assert (out / "results.md").read_text().count("| FedAvg |") == 1  # rows carry the algorithm's label
    assert (out / "checkpoints" / "best.safetensors").is_file()
    # resume with more rounds continues from round 2
    assert main(["run", "--resume", str(out), "--rounds", "3"]) == 0
    assert [e["round"] for e in json.loads((out / "results.json").read_text())["history"]] == [1, 2, 3]
    assert main(["evaluate", str(out)]) == 0
    assert "global" in capsys.readouterr().out
    assert (
        main(
            [
                "compare",
                str(spec),
                "--methods",
                "fedavg,fedavg-even",
                "--seeds",
                "0,1",
                "--rounds",
                "1",
                "--out",
                str(tmp_path / "cmp"),
                *SMALL,
            ]
        )
        == 0
    )
    table = (tmp_path / "cmp" / "comparison.md").read_text()
    assert "| FedAvg - even |" in table and "±" in table


def test_bad_override_is_one_clear_error(spec, tmp_path, capsys):
    assert main(["run", str(spec), "--out", str(tmp_path / "r"), "--set", "train.lr=abc"]) == 2
    assert "train.lr: expected a number" in capsys.readouterr().err


def test_method_entries_with_settings():
    from fedseg.apps.studies.compare import parse_method_entry, split_method_entries
    from fedseg.foundation.errors import ConfigError

    assert split_method_entries("local, fedsm:personalization=ft,lam=0.5,fedavg") == [
        "local",
        "fedsm:personalization=ft,lam=0.5",
        "fedavg",
    ]
    assert parse_method_entry("fedsm-extra:personalization=ditto") == (
        "fedsm-extra",
        ["fedsm.personalization=ditto"],
        "fedsm-extra (personalization=ditto)",
    )
    assert parse_method_entry("fedavg") == ("fedavg", [], "fedavg")
    with pytest.raises(ConfigError, match="unknown method 'nope'"):
        parse_method_entry("nope:x=1")
    with pytest.raises(ConfigError, match="must be key=value"):
        parse_method_entry("fedsm:personalization")


def test_compare_gives_each_variant_its_own_row(spec, tmp_path):
    methods = ["fedavg:weighting=samples", "fedavg:weighting=even"]
    assert (
        main(
            [
                "compare",
                str(spec),
                "--methods",
                ",".join(methods),
                "--rounds",
                "1",
                "--out",
                str(tmp_path / "cmp"),
                *SMALL,
            ]
        )
        == 0
    )
    table = (tmp_path / "cmp" / "comparison.md").read_text()
    assert "| fedavg (weighting=samples) |" in table and "| fedavg (weighting=even) |" in table
