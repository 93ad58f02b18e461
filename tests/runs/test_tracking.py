"""MLflow tracking: runs written by `--track mlflow` and read back through MLflow's own client, from the local
SQLite store beside the output and from an `mlflow server` started on 127.0.0.1."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

mlflow = pytest.importorskip("mlflow", reason="MLflow is not installed (pip install 'fedseg[track]')")
from mlflow.tracking import MlflowClient  # noqa: E402

from fedseg.apps.studies import jobs  # noqa: E402
from fedseg.apps.tracking import flatten, round_metrics, tracking_params  # noqa: E402
from fedseg.cli import main  # noqa: E402
from fedseg.foundation.errors import ConfigError  # noqa: E402
from tests.support.helpers import SETS, fake_run, synth_fundus  # noqa: E402


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    return synth_fundus(tmp_path_factory.mktemp("fed"))


def test_flatten_metrics_and_settings():
    assert flatten({"train": {"lr": 1e-3, "x": [1, 2]}, "method": "fedavg"}) == {
        "train.lr": "0.001",
        "train.x": "[1, 2]",
        "method": "fedavg",
    }
    hist = [
        {
            "round": 1,
            "train_loss": {"site1": 0.5, "site2": None},
            "val_dice": {"global@site1": {"site1": 0.7}},
            "val_score": {"global": float("nan")},
            "bytes": {"site1": {"sent": 10, "received": 4}, "site2": {"sent": 5, "received": 4}},
            "epsilon": {"site1": 2.0},
        }
    ]
    got = {name: (v, step) for name, v, step in round_metrics(hist)}
    assert got == {
        "train_loss/site1": (0.5, 1),
        "val_dice/global_site1/site1": (0.7, 1),  # '@' is not a metric name character
        "bytes_sent": (15.0, 1),
        "bytes_received": (8.0, 1),
        "epsilon/site1": (2.0, 1),
    }
    assert tracking_params({"backend": "mlflow"}).backend == "mlflow"
    with pytest.raises(ConfigError, match="tracking.backend"):
        tracking_params({"backend": "wandb"})


_fake_run = fake_run(lambda lr, seed: ({"1e-3": 0.8, "1e-2": 0.6}[lr], 0.55), folder=True)
"""Finished runs' folders without training: validation score 0.8 at train.lr=1e-3, 0.6 at 1e-2; client average 0.55."""


def _check_store(client: MlflowClient, out: Path) -> None:
    """One parent run of the compare, its four runs nested under it with their settings, per-round metrics,
    validation score and files; the parent holds the table, the tuning record and the report."""
    exp = client.get_experiment_by_name("fedseg")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("fedseg.kind") == "compare"]
    assert len(parents) == 1
    pid = parents[0].info.run_id
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == pid]
    assert len(children) == 4
    chosen = [r for r in children if r.data.metrics["chosen"] == 1.0]
    assert {r.data.params["train.lr"] for r in chosen} == {"0.001"}
    c = chosen[0]
    assert c.data.params["fedseg.grid_point"] == "train.lr=1e-3"
    assert c.data.metrics["validation_score"] == pytest.approx(0.8)
    hist = client.get_metric_history(c.info.run_id, "val_dice/global/s1")
    assert [(m.step, m.value) for m in sorted(hist, key=lambda m: m.step)] == [(1, 0.4), (2, 0.8)]
    files = {a.path for a in client.list_artifacts(c.info.run_id)}
    assert {"results.json", "config.toml", "checkpoints"} <= files
    assert [a.path for a in client.list_artifacts(c.info.run_id, "checkpoints")] == ["checkpoints/best.safetensors"]
    local = client.download_artifacts(c.info.run_id, "results.json", str(out / "dl"))
    assert json.loads(Path(local).read_text())["client_avg_dice"] == 0.55
    parent_files = {a.path for a in client.list_artifacts(pid)}
    assert {"comparison.md", "tuning.json", "report.html"} <= parent_files
    assert parents[0].data.metrics["fedavg/client_avg_dice"] == pytest.approx(0.55)


ARGS = ["--methods", "fedavg", "--seeds", "0,1", "--tune", "train.lr=1e-3,1e-2", "--track", "mlflow"]


def test_compare_logs_nested_runs_to_a_local_store(spec, tmp_path, monkeypatch):
    monkeypatch.setattr(jobs, "run", _fake_run)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "cmp"
    assert main(["compare", str(spec), *ARGS, "--out", str(out)]) == 0
    assert (out / "mlflow.db").is_file()
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    _check_store(client, out)
    # continued: nothing is logged twice
    assert main(["compare", str(spec), *ARGS, "--out", str(out)]) == 0
    assert len(client.search_runs([client.get_experiment_by_name("fedseg").experiment_id])) == 5


def test_run_track_mlflow_logs_a_real_run(spec, tmp_path, monkeypatch):
    """`fedseg run --track mlflow`: the resolved config as parameters, validation Dice per site and round, the
    best checkpoints as artifacts."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    args = ["run", str(spec), "--out", str(out), "--rounds", "2", "--track", "mlflow", *SETS]
    assert main([*args, "--set", "train.lr=0.002", "--set", "device=cpu"]) == 0
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    (r,) = client.search_runs([client.get_experiment_by_name("fedseg").experiment_id])
    assert r.data.params["train.lr"] == "0.002" and r.data.params["model.channels"] == "[4, 8, 16]"
    res = json.loads((out / "results.json").read_text())
    site = res["sites"][0]
    hist = client.get_metric_history(r.info.run_id, f"val_dice/global/{site}")
    assert [m.step for m in sorted(hist, key=lambda m: m.step)] == [1, 2]
    assert hist[-1].value == pytest.approx(res["history"][hist[-1].step - 1]["val_dice"]["global"][site])
    assert r.data.metrics["client_avg_dice"] == pytest.approx(res["client_avg_dice"])
    assert r.data.metrics["bytes_sent"] > 0
    arts = {a.path for a in client.list_artifacts(r.info.run_id, "checkpoints")}
    assert arts == {"checkpoints/best.safetensors", "checkpoints/best.json"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_compare_logs_to_a_tracking_server(spec, tmp_path, monkeypatch):
    """The same comparison logged to an `mlflow server` on 127.0.0.1 (MLFLOW_TRACKING_URI) and read back from it."""
    pytest.importorskip("mlflow.server", reason="the tracking server needs the full 'mlflow' package (fedseg[track])")
    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    cmd += ["--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}"]
    cmd += ["--artifacts-destination", str(tmp_path / "server-artifacts")]
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                lines = [x for x in (tmp_path / "server.log").read_text().splitlines() if x.strip()]
                tail = lines[-1][-300:] if lines else "no output"
                pytest.fail(f"mlflow server did not start on 127.0.0.1 within 240 s: {tail}")
            time.sleep(1)
        monkeypatch.setattr(jobs, "run", _fake_run)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        out = tmp_path / "cmp"
        assert main(["compare", str(spec), *ARGS, "--out", str(out)]) == 0
        assert not (out / "mlflow.db").exists()
        _check_store(MlflowClient(uri), out)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_deploy_rehearse_logs_the_servers_results(spec, tmp_path, monkeypatch):
    """`fedseg deploy rehearse --track mlflow` logs the run the server wrote into OUT (FLARE replaced by a
    stand-in that writes a finished run's folder)."""
    from fedseg.deployment import run as dep

    def rehearse(config, sites, out, **kw):
        res = _fake_run(config, out=Path(out), seed=0)
        (Path(out) / "results.md").write_text("| FedAvg |\n")
        return res

    monkeypatch.setattr(dep, "rehearse", rehearse)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "dep"
    out.mkdir()
    assert main(["deploy", "rehearse", str(spec), "--out", str(out), "--track", "mlflow"]) == 0
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    (r,) = client.search_runs([client.get_experiment_by_name("fedseg").experiment_id])
    assert r.data.tags["fedseg.folder"] == str(out.resolve()) and r.data.params["train.lr"] == "0.001"
    assert "checkpoints" in {a.path for a in client.list_artifacts(r.info.run_id)}


def test_mlflow_reads_a_runs_rounds_while_it_runs(spec, tmp_path, monkeypatch):
    """A study's run logs each round's metrics as the round ends, from the process that runs it, through the
    engine's ``on_round`` hook: held after round 2 of 3 (a test hook after the tracker's), MLflow's client reads
    rounds 1 and 2 of a RUNNING run nested under the study's parent, before any results.json exists; released,
    the same MLflow run ends FINISHED with round 3, its final numbers and its kept models."""
    import threading

    from fedseg.apps.studies.jobs import Job, run_point
    from fedseg.apps.tracking import MlflowTracker
    from tests.support.helpers import SMALL

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "study"
    tracker = MlflowTracker(out)
    parent = tracker.parent(out, "sweep")
    reached, release = threading.Event(), threading.Event()
    real = jobs.run

    def held(*args, on_round=None, **kwargs):
        def hook(entry):
            on_round(entry)
            if entry["round"] == 2:
                reached.set()
                assert release.wait(300)

        return real(*args, on_round=hook, **kwargs)

    monkeypatch.setattr(jobs, "run", held)
    job = Job(str(spec), str(out / "lr"), (*SMALL, "device=cpu", "eval.every=1"), "fedavg", 0, 3)
    kwargs = {"log": lambda m: None, "track": tracker.target(parent)}
    worker = threading.Thread(target=run_point, args=(job,), kwargs=kwargs)
    worker.start()
    client = MlflowClient(tracker.uri)
    try:
        assert reached.wait(300)
        (r,) = client.search_runs([tracker.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent}'")
        assert r.info.status == "RUNNING" and not (out / "lr" / "results.json").exists()
        keys = [k for k in r.data.metrics if k.startswith("val_dice/global/")]
        assert keys and "time_s" in r.data.metrics
        assert sorted(m.step for m in client.get_metric_history(r.info.run_id, keys[0])) == [1, 2]
    finally:
        release.set()
        worker.join(300)
    done = client.get_run(r.info.run_id)
    res = json.loads((out / "lr" / "results.json").read_text())
    assert done.info.status == "FINISHED" and done.data.metrics["client_avg_dice"] == pytest.approx(
        res["client_avg_dice"]
    )
    hist = sorted(client.get_metric_history(r.info.run_id, keys[0]), key=lambda m: m.step)
    site = keys[0].rsplit("/", 1)[1]
    assert [m.value for m in hist] == pytest.approx([e["val_dice"]["global"][site] for e in res["history"]])
    assert {a.path for a in client.list_artifacts(r.info.run_id, "checkpoints")} >= {"checkpoints/best.safetensors"}
    assert done.data.params["train.lr"]  # the resolved config, logged when the run ended
