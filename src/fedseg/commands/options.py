"""What several verbs share: their common options and the study options read from them."""

from __future__ import annotations

import argparse

from fedseg.apps.studies.jobs import StudyOptions
from fedseg.apps.studies.launchers import LAUNCHERS, LaunchOptions


def split_csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def study_options(a: argparse.Namespace, overrides: list[str]) -> StudyOptions:
    return StudyOptions(
        seeds=tuple(int(s) for s in split_csv(a.seeds)),
        rounds=a.rounds,
        overrides=tuple(overrides),
        jobs=a.jobs,
        devices=tuple(split_csv(a.devices)) if a.devices else None,
        track=a.track,
        track_uri=a.track_uri,
        launch=launch_options(a),
    )


def launch_options(a: argparse.Namespace) -> LaunchOptions:
    return LaunchOptions(
        launcher=a.launcher,
        cpus_per_run=a.cpus_per_run,
        gpus_per_run=a.gpus_per_run,
        ray_address=a.ray_address,
        slurm_partition=a.slurm_partition,
        slurm_time=a.slurm_time,
        slurm_folder=a.slurm_folder,
        slurm_parallelism=a.slurm_parallelism,
    )


def device_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        metavar="DEVICE",
        help="auto (the config's default: CUDA when available, else cpu), cpu, cuda or cuda:N (same as --set device=...); "
        "mixed precision: --set train.precision=bf16 or fp16 (default fp32). The device and precision used are "
        "printed at the start and recorded in results.json and config.toml",
    )


def track_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--track",
        choices=["mlflow", "off"],
        help="log runs to MLflow (parameters, per-round metrics, results, best checkpoints; a compare or sweep "
        "nests its runs under one parent run): a SQLite store OUT/mlflow.db, or MLFLOW_TRACKING_URI when set; "
        "default: the config's [tracking] section (off)",
    )


def jobs_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--jobs",
        type=int,
        metavar="N",
        help="independent runs in N processes with one torch thread each (1: one after another; the same "
        "results either way)",
    )
    p.add_argument(
        "--devices",
        metavar="D1,D2",
        help="one process per device, e.g. cuda:0,cuda:1 (or cpu,cpu); each run on its process's device, the "
        "same results as one after another. Default (neither --jobs nor --devices): every visible CUDA device "
        "where there are several, else one run after another",
    )


def launch_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("where the runs run (docs/studies.md)")
    g.add_argument(
        "--launcher",
        choices=list(LAUNCHERS),
        default="local",
        help="local: this machine (--jobs, --devices; default); ray: one Ray task per run (a local cluster, or "
        "--ray-address); slurm: one Slurm array task per run (submitit). The same results whichever runs them; "
        "OUT must be a folder every worker sees; run the command again to keep finished runs and resume the rest",
    )
    g.add_argument(
        "--cpus-per-run",
        type=int,
        default=1,
        metavar="N",
        help="ray/slurm: CPUs (and torch threads) per run (default 1)",
    )
    g.add_argument(
        "--gpus-per-run",
        type=float,
        default=0.0,
        metavar="G",
        help="ray/slurm: GPUs per run (default 0; Ray takes fractions)",
    )
    g.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="ray: a running cluster (head:6379 or ray://head:10001); default: a local one",
    )
    g.add_argument("--slurm-partition", metavar="NAME", help="slurm: the partition the runs go to")
    g.add_argument(
        "--slurm-time", type=int, default=60, metavar="MIN", help="slurm: minutes a run may take (default 60)"
    )
    g.add_argument("--slurm-folder", metavar="DIR", help="slurm: submitit's job files and logs (default: OUT/slurm)")
    g.add_argument("--slurm-parallelism", type=int, metavar="N", help="slurm: most array tasks running at once")


def track_uri_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--track-uri",
        metavar="URI",
        help="MLflow tracking store every run logs to as it goes (e.g. http://host:5000, one the workers reach); "
        "turns --track mlflow on; default: the config's tracking.uri, MLFLOW_TRACKING_URI, else OUT/mlflow.db",
    )
