"""Launchers of a study's runs: the same bytes on a local Ray cluster (127.0.0.1) and through the Slurm code path
(submitit's local executor) as on this machine's launcher; a worker killed mid-run leaves a study that finishes on
the next call with its finished runs untouched; failures come back named by run."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from fedseg.apps.studies import launchers
from fedseg.apps.studies.grid import sweep
from fedseg.apps.studies.jobs import Job, StudyOptions, run_point
from fedseg.apps.studies.launchers import LaunchOptions, Outcome, RunSpec, StudyRunsFailed, fault_hook, launch_all
from fedseg.cli import build_parser, main
from fedseg.commands.options import study_options
from fedseg.foundation.errors import ConfigError
from tests.support.helpers import SETS, SMALL, assert_same_checkpoints, synth_fundus

LRS = ("1e-3", "1e-2")
BASE = [
    *SMALL,
    "eval.every=1",
    "checkpoint_every=1",
    "checkpoint_background=false",
    "device=cpu",
    "checkpoint_keep=all",
]
"""One grid's settings: a small U-Net, every round validated and checkpointed (synchronously, so that a worker
killed after a round leaves that round's checkpoint behind), and a finished run's whole state kept (compared
byte for byte)."""
BASE_ARGS = [x for s in BASE for x in ("--set", s)]
LOOPBACK = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray's switch which, set to 0, binds a local cluster to the loopback address."""


# ------------------------------------------------------------- without any cluster
def test_launch_options_and_the_command_line():
    a = build_parser().parse_args(
        [
            *("sweep", "f.toml", "--method", "fedavg", "--grid", "train.lr=1", "--out", "o", "--launcher", "ray"),
            *("--gpus-per-run", "0.5", "--ray-address", "head:6379", "--track-uri", "http://h:5000"),
        ]
    )
    opts = study_options(a, [])
    assert opts.launch == LaunchOptions(launcher="ray", gpus_per_run=0.5, ray_address="head:6379")
    assert opts.track_uri == "http://h:5000" and opts.launch.remote
    assert not StudyOptions().launch.remote
    with pytest.raises(ConfigError, match="--launcher 'k8s'"):
        LaunchOptions(launcher="k8s")
    with pytest.raises(ConfigError, match="--cpus-per-run 0"):
        LaunchOptions(cpus_per_run=0)
    with pytest.raises(ConfigError, match="--slurm-time 0"):
        LaunchOptions(launcher="slurm", slurm_time=0)
    with pytest.raises(ConfigError, match="--cpus-per-run and --gpus-per-run instead"):
        StudyOptions(jobs=2, launch=LaunchOptions(launcher="ray"))


class _Reversed:
    """A launcher whose runs finish in the reverse order of submission, run ``fail`` dying as a worker would."""

    name = "reversed"

    def __init__(self, fail: int | None = None):
        self.fail = fail

    def launch(self, specs):
        for i, s in reversed(list(enumerate(specs))):
            yield Outcome(s, error="its worker process died (log: x/worker.log)") if i == self.fail else Outcome(s, i)


def test_launch_all_keeps_the_order_and_names_every_failed_run():
    specs = [RunSpec(f"lr{i}/seed0", print) for i in range(3)]
    assert launch_all(_Reversed(), specs) == [0, 1, 2]
    said: list[str] = []
    with pytest.raises(StudyRunsFailed, match=r"1 of 3 runs failed \(lr1/seed0: its worker process died") as e:
        launch_all(_Reversed(fail=1), specs, said.append)
    assert "run the same command again" in str(e.value)
    assert said == ["lr1/seed0: failed: its worker process died (log: x/worker.log)"]


def test_the_fault_switch_never_ends_the_drivers_process(monkeypatch, tmp_path):
    """FEDSEG_FAULT_EXIT applies in worker processes only: in the driver (and for another run's folder) no hook."""
    monkeypatch.setenv(launchers.FAULT_ENV, "lr=1@2")
    assert fault_hook(tmp_path / "lr=1") is None
    monkeypatch.setattr(launchers, "_IN_WORKER", True)
    assert fault_hook(tmp_path / "lr=2") is None and fault_hook(tmp_path / "lr=1") is not None


# ------------------------------------------------------------- runs on a cluster
@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    return synth_fundus(tmp_path_factory.mktemp("fed"))


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster for the module: 2 CPUs, no dashboard, its services bound to 127.0.0.1 only (Ray
    otherwise takes the machine's outward address), its files in a short temp folder."""
    loopback = os.environ.get(LOOPBACK)
    os.environ[LOOPBACK] = "0"  # read by Ray's processes (and by Ray when first imported): the loopback address
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'fedseg[cluster]')")
    from ray._private import ray_constants

    cluster = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False  # (Ray imported before this fixture)
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's sockets need a short path
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
        _temp_dir=temp,
        object_store_memory=80 * 1024 * 1024,
    )
    assert all(n["NodeManagerAddress"] == "127.0.0.1" for n in ray.nodes())
    yield ray
    ray.shutdown()
    ray_constants.ENABLE_RAY_CLUSTER = cluster
    if loopback is None:
        os.environ.pop(LOOPBACK, None)
    else:
        os.environ[LOOPBACK] = loopback
    shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def local_compare(spec, tmp_path_factory):
    """`compare --tune` of fedavg over two learning rates, 1 round, with this machine's launcher (one after
    another, one torch thread): the reference every launcher's runs are compared with."""
    out = tmp_path_factory.mktemp("local") / "cmp"
    args = ["compare", str(spec), "--methods", "fedavg", "--rounds", "1", "--tune", f"train.lr={','.join(LRS)}"]
    assert main([*args, *SETS, "--set", "device=cpu", "--out", str(out)]) == 0
    return out, args


def _digest(folder: Path) -> dict[str, str]:
    """sha256 of every checkpoint file of a run (weights, best models, site states, records)."""
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((folder / "checkpoints").rglob("*"))
        if p.is_file() and p.name != "progress.json"  # (its history holds wall-clock times)
    }


def test_compare_tune_and_sweep_on_ray_are_the_local_bytes(spec, ray_cluster, local_compare, tmp_path):
    """`compare --tune --launcher ray` and `sweep --launcher ray` (one Ray task per run, one CPU and torch thread
    each) write the checkpoints of the local launcher byte for byte, the same tuning choice; the runs are
    tracked live from the Ray workers, nested under the study's parent run."""
    MlflowClient = pytest.importorskip("mlflow.tracking", reason="MLflow is not installed").MlflowClient

    ref, args = local_compare
    out = tmp_path / "ray"
    ray_args = [*args, *SETS, "--set", "device=cpu", "--launcher", "ray", "--track", "mlflow"]
    assert main([*ray_args, "--out", str(out)]) == 0
    for lr in LRS:
        rel = Path("fedavg") / f"train.lr={lr}" / "seed0"
        assert _digest(out / rel) == _digest(ref / rel) and _digest(ref / rel)
        assert "finished" in (out / rel / "worker.log").read_text()
    assert json.loads((out / "tuning.json").read_text()) == json.loads((ref / "tuning.json").read_text())
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("fedseg").experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("fedseg.kind") == "compare"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 2 and all(r.data.tags.get("fedseg.live") == "1" for r in children)
    for r in children:
        res = json.loads((Path(r.data.tags["fedseg.folder"]) / "results.json").read_text())
        site = res["sites"][0]
        (m,) = client.get_metric_history(r.info.run_id, f"val_dice/global/{site}")
        assert m.step == 1 and m.value == pytest.approx(res["history"][0]["val_dice"]["global"][site])
        assert "validation_score" in r.data.metrics and r.info.status == "FINISHED"
    # a sweep of the same grid: the same runs, the same bytes
    sw = tmp_path / "sweep"
    cmd = ["sweep", str(spec), "--method", "fedavg", "--grid", f"train.lr={','.join(LRS)}", "--rounds", "1"]
    assert main([*cmd, *SETS, "--set", "device=cpu", "--launcher", "ray", "--out", str(sw)]) == 0
    for lr in LRS:
        assert _digest(sw / f"train.lr={lr}" / "seed0") == _digest(ref / "fedavg" / f"train.lr={lr}" / "seed0")


def _state(folder: Path) -> dict[str, tuple[int, str]]:
    """(mtime in ns, sha256) of every file of a run folder."""
    return {
        p.relative_to(folder).as_posix(): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_a_worker_killed_mid_run_leaves_a_study_that_finishes_on_the_next_call(
    spec, ray_cluster, tmp_path, monkeypatch, capsys
):
    """The Ray worker of the lr=1e-2 run exits after round 2 of 3 (before that round's checkpoint): the study
    fails naming that run and its log, the lr=1e-3 run finishes; the same command again leaves the finished run's
    files untouched (mtime, bytes), resumes the killed one from its round-1 checkpoint, and its checkpoints are
    the uninterrupted run's bytes."""
    out = tmp_path / "sw"
    cmd = ["sweep", str(spec), "--method", "fedavg", "--grid", f"train.lr={','.join(LRS)}", "--rounds", "3"]
    cmd += [*BASE_ARGS, "--launcher", "ray", "--out", str(out)]
    monkeypatch.setenv(launchers.FAULT_ENV, "train.lr=1e-2@2")
    assert main(cmd) == 2
    err = capsys.readouterr().err
    killed, kept = out / "train.lr=1e-2" / "seed0", out / "train.lr=1e-3" / "seed0"
    assert "1 of 2 runs failed (train.lr=1e-2/seed0:" in err and str(killed / "worker.log") in err
    assert not (killed / "results.json").exists() and (kept / "results.json").is_file()
    assert json.loads((killed / "checkpoints" / "progress.json").read_text())["round"] == 1
    before = _state(kept)
    monkeypatch.delenv(launchers.FAULT_ENV)
    assert main(cmd) == 0
    assert _state(kept) == before
    assert "resuming" in (killed / "worker.log").read_text()
    whole = Job(str(spec), str(tmp_path / "whole"), (*BASE, "train.lr=1e-2"), "fedavg", 0, 3)
    run_point(whole, log=lambda m: None)
    assert_same_checkpoints(killed, whole.folder)
    assert (out / "sweep.md").is_file()


def test_the_slurm_code_path_on_submitits_local_executor_gives_the_same_bytes(spec, local_compare, tmp_path):
    """`sweep` through the Slurm launcher — one submitit array (``map_array``), each run a task in a process of
    its own — on submitit's local executor: the checkpoints of the local launcher's runs, byte for byte."""
    pytest.importorskip("submitit", reason="submitit is not installed (pip install 'fedseg[cluster]')")
    ref, _ = local_compare
    out = tmp_path / "slurm"
    opts = StudyOptions(
        rounds=1,
        overrides=(*SMALL, "device=cpu"),
        progress=False,
        log=lambda m: None,
        launch=LaunchOptions(launcher="slurm", slurm_cluster="local", slurm_time=10),
    )
    sweep(spec, "fedavg", [f"train.lr={','.join(LRS)}"], out, opts)
    for lr in LRS:
        assert _digest(out / f"train.lr={lr}" / "seed0") == _digest(ref / "fedavg" / f"train.lr={lr}" / "seed0")
    assert list((out / "slurm").glob("*/*_log.out"))  # submitit's job files, one folder per array task


def test_fedsm_sweep_over_seeds_on_ray_is_the_local_bytes_and_is_reused(spec, ray_cluster, tmp_path, capsys):
    """`fedseg fedsm sweep --seeds 0,1 --launcher ray`: both seeds' studies planned side by side on the driver
    (which loads no data), each run a Ray task: the checkpoints of the sequential command byte for byte and the
    same table over seeds; the same command again reuses every run (point.json) and dispatches none."""
    args = ["fedsm", "sweep", str(spec), "--lam", "0.5", "--gamma", "0", "--rounds", "1", "--seeds", "0,1", *SETS]
    args += ["--set", "device=cpu"]
    assert main([*args, "--out", str(tmp_path / "seq"), "--jobs", "1"]) == 0
    assert main([*args, "--out", str(tmp_path / "ray"), "--launcher", "ray"]) == 0
    for seed in (0, 1):
        rel = Path(f"seed{seed}") / "lam0.5"
        assert _digest(tmp_path / "ray" / rel) == _digest(tmp_path / "seq" / rel) and _digest(tmp_path / "seq" / rel)
        assert (tmp_path / "ray" / rel / "point.json").is_file()
    assert (tmp_path / "ray" / "sweep.md").read_text() == (tmp_path / "seq" / "sweep.md").read_text()
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "ray"), "--launcher", "ray"]) == 0
    out = capsys.readouterr().out
    assert out.count("already done") == 2 and "Ray tasks" not in out
