"""Start-up cost of each launcher of a study's runs (:mod:`fedseg.apps.studies.launchers`).

Two runs that do nothing (``os.getpid`` as the run) go through each launcher, so the time from the call to the
last result is what the launcher adds to a study: starting worker processes (each imports fedseg and torch), a
local Ray cluster, submitit's job files and processes.  Each launcher is timed ``--repeats`` times; the table
gives the minimum and the median (the machine may be shared: the minimum is the least disturbed).

* local, in this process: the runs one after another in the driver (no start-up);
* local, 2 processes: the spawned process pool of ``--jobs 2``;
* ray, local cluster: ``ray.init`` of a 2-CPU cluster without dashboard on 127.0.0.1, the two tasks, shutdown;
* ray, running cluster: the two tasks on a cluster started before the timing (fresh worker processes);
* slurm path, submitit's local executor: one ``map_array`` of two tasks, each a process of its own.

    cd benchmarks && ../.venv/bin/python launchers.py --repeats 3 --md ../docs/results/launchers.md
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _report import emit, md_table

from fedseg.apps.studies.launchers import LaunchOptions, LocalLauncher, RayLauncher, RunSpec, SlurmLauncher, launch_all


def _specs(folder: Path) -> list[RunSpec]:
    return [RunSpec(f"noop{i}", os.getpid, folder=str(folder / f"noop{i}")) for i in range(2)]


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--md", help="also write the Markdown here")
    ap.add_argument("--out", default="runs/bench-launchers", help="summary.json goes here")
    a = ap.parse_args()
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # a local cluster bound to 127.0.0.1 only
    import ray

    quiet = lambda m: None  # noqa: E731
    work = Path(tempfile.mkdtemp(prefix="launch", dir="/tmp"))
    temp = str(work / "ray")
    init = {
        "address": "local",
        "num_cpus": 2,
        "include_dashboard": False,
        "log_to_driver": False,
        "_node_ip_address": "127.0.0.1",
        "_temp_dir": temp,
        "object_store_memory": 80 * 1024 * 1024,
    }

    def local_cluster() -> None:
        ray.init(**init)
        try:
            launch_all(RayLauncher(LaunchOptions(launcher="ray"), quiet), _specs(work), quiet)
        finally:
            ray.shutdown()

    cases: list[tuple[str, Callable[[], object]]] = [
        ("local, in this process", lambda: launch_all(LocalLauncher(1, log=quiet), _specs(work), quiet)),
        ("local, 2 processes (--jobs 2)", lambda: launch_all(LocalLauncher(2, log=quiet), _specs(work), quiet)),
        ("ray, a local cluster started and stopped", local_cluster),
        (
            "slurm path, submitit's local executor",
            lambda: launch_all(
                SlurmLauncher(LaunchOptions(launcher="slurm", slurm_cluster="local"), work / "slurm", quiet, 0.1),
                _specs(work),
                quiet,
            ),
        ),
    ]
    times: dict[str, list[float]] = {}
    for name, fn in cases:
        times[name] = [_time(fn) for _ in range(a.repeats)]
    ray.init(**init)
    try:
        name = "ray, a running cluster (fresh workers)"
        times[name] = []
        for _ in range(a.repeats):
            times[name].append(
                _time(lambda: launch_all(RayLauncher(LaunchOptions(launcher="ray"), quiet), _specs(work), quiet))
            )
            ray.shutdown()  # the next repeat's workers start fresh: a cluster up before the timing
            ray.init(**init)
    finally:
        ray.shutdown()
    shutil.rmtree(work, ignore_errors=True)
    load = os.getloadavg()
    rows = [
        [name, f"{min(t):.2f}", f"{statistics.median(t):.2f}", ", ".join(f"{x:.2f}" for x in t)]
        for name, t in times.items()
    ]
    md = [
        "# Launchers: start-up cost",
        "",
        "Part of [Results](../results.md).",
        "",
        "**Command:** `benchmarks/launchers.py` — two runs that do nothing (`os.getpid`) through each launcher of "
        "`--launcher local|ray|slurm`; the time from the call to the last result, which is what the launcher "
        "adds to a study (worker processes importing fedseg and torch, Ray's processes, submitit's job files).",
        "",
        "```",
        f"cd benchmarks && ../.venv/bin/python launchers.py --repeats {a.repeats} --md ../docs/results/launchers.md",
        "```",
        "",
        f"**Machine:** this machine: {os.cpu_count()}-core CPU ({platform.machine()}), shared with other work "
        f"(load average {load[0]:.1f} at the end); minimum of {a.repeats} repeats, seconds.",
        "",
        *md_table(["launcher", "min, s", "median, s", "each, s"], rows),
        "",
        "Reading: the launcher's cost is paid once per study (a cluster or a process pool) and per worker process "
        "(importing fedseg and torch), not per round; against a run of minutes to hours on a GPU it is small. "
        "On a shared machine the times are upper bounds.",
    ]
    emit(md, a.md, Path(a.out), {"seconds": times, "repeats": a.repeats, "loadavg": load})


if __name__ == "__main__":
    main()
