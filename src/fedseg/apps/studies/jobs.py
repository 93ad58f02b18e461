"""Independent runs of a grid or a comparison: one run reused, resumed or started (:func:`run_point`), many
one after another or in spawned processes (:func:`run_jobs`, :func:`map_in_processes`), as
:class:`StudyOptions` say.

A run's folder gets ``point.json`` before it starts: the resolved settings it was asked to run with.  A later
call reuses the folder's finished run (``results.json``) or continues its checkpoint (the engine's resume, bitwise
the uninterrupted run) only when they are the same settings, and refuses a folder of other settings by name.
Runs in processes of their own (``--jobs N``, one torch thread each; ``--devices``, one process per device), as
Ray tasks or as Slurm array tasks (``--launcher``, :mod:`fedseg.apps.studies.launchers`) compute what they compute
one after another: every random draw is seeded by (run seed, site, round); each worker writes its run's folder
and the driver reads ``results.json`` back, so only names cross processes (the output folder is one every worker
sees).  Runs already finished are read on the driver and never dispatched again.
Without ``--jobs`` or ``--devices`` a machine with several CUDA devices runs one process on each
(:func:`default_devices`), and any other machine runs the runs one after another.

With tracking on, the process that runs a run logs its metrics to MLflow after every round
(:class:`~fedseg.apps.tracking.LiveRun`, through the engine's ``on_round`` hook) under the study's parent run.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from fedseg.algorithms import get_algorithm, known_sections
from fedseg.apps.studies.launchers import LaunchOptions, LocalLauncher, RunSpec, fault_hook, launch_all, launcher_for
from fedseg.apps.tracking import LiveRun, TrackTarget
from fedseg.foundation.config import RunConfig, load_run_config
from fedseg.foundation.errors import ConfigError
from fedseg.seams.checkpoint import PROGRESS, save_json
from fedseg.simulation.runner import run

__all__ = [
    "IGNORED",
    "POINT_FILE",
    "Job",
    "StudyOptions",
    "check_point",
    "default_devices",
    "map_in_processes",
    "placement",
    "point_text",
    "requested_config",
    "resolved_settings",
    "run_jobs",
    "run_point",
]

POINT_FILE = "point.json"
"""Written into a grid run's folder before it starts: the resolved settings it was asked to run with (defaults
filled in, before a volume federation's plan), by which a later call recognizes the run as its own."""

IGNORED = ("device", "tracking", "checkpoint_keep")
"""Settings that do not make a run another one (``--devices`` places runs of one grid on several devices;
``[tracking]`` says where a finished run is logged; ``checkpoint_keep`` what it keeps once finished)."""


@dataclasses.dataclass(frozen=True)
class StudyOptions:
    """What a study of several runs (``compare``, ``sweep``, the FedSM studies) passes to each of its runs and how
    it runs them.

    ``seeds``: one run per seed (each point, each method entry); ``rounds``: the runs' number of rounds (None:
    the config's); ``overrides``: ``KEY=VALUE`` settings of every run; ``jobs``: the independent runs in that
    many spawned processes with one torch thread each (1: one after another); ``devices``: one process per
    device (``("cuda:0", "cuda:1")``, ``("cpu", "cpu")``), each run on its process's device; ``jobs`` and
    ``devices`` both None: :func:`default_devices`.  ``progress``/``log``: progress bars and messages;
    ``track``: ``"mlflow"`` logs every run (``"off"``/None: the config's ``[tracking]``); ``track_uri``: the
    MLflow tracking store every run logs to (a server the workers reach; implies ``track="mlflow"``);
    ``launch``: where the runs run (:class:`~fedseg.apps.studies.launchers.LaunchOptions`: this machine, Ray or
    Slurm)."""

    seeds: tuple[int, ...] = (0,)
    rounds: int | None = None
    overrides: tuple[str, ...] = ()
    jobs: int | None = None
    devices: tuple[str, ...] | None = None
    progress: bool = True
    log: Callable[[str], None] = print
    track: str | None = None
    track_uri: str | None = None
    launch: LaunchOptions = dataclasses.field(default_factory=LaunchOptions)

    def __post_init__(self) -> None:
        object.__setattr__(self, "seeds", tuple(int(s) for s in self.seeds))
        object.__setattr__(self, "overrides", tuple(self.overrides))
        if self.devices is not None:
            object.__setattr__(self, "devices", tuple(self.devices))
        if self.jobs is not None and self.jobs < 1:
            raise ConfigError(f"--jobs {self.jobs}: give at least 1")
        if self.devices is not None and not self.devices:
            raise ConfigError("--devices names no device; give e.g. cuda:0,cuda:1 or cpu,cpu")
        self.launch.check_placement(self.jobs, self.devices)

    def placement(self) -> tuple[int, tuple[str, ...] | None]:
        """(processes, devices) of :func:`placement` for these options."""
        return placement(self.jobs, self.devices, self.overrides)


def default_devices(overrides: Sequence[str] = ()) -> tuple[str, ...] | None:
    """Every visible CUDA device where there are several (``("cuda:0", "cuda:1", …)``), else None (the runs one
    after another); None also where ``overrides`` set the device (``device=cpu``): the runs go where they say."""
    if any(o.partition("=")[0].strip() == "device" for o in overrides):
        return None
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return tuple(f"cuda:{i}" for i in range(n)) if n > 1 else None


def placement(
    jobs: int | None, devices: Sequence[str] | None, overrides: Sequence[str] = ()
) -> tuple[int, tuple[str, ...] | None]:
    """How many processes run a study's independent runs, and on which devices: ``devices`` given → one process
    per device; else ``jobs`` given → that many processes, on the runs' configured device; neither →
    :func:`default_devices` (one process per CUDA device where there are several, else 1 process)."""
    if devices is not None:
        devs = tuple(d.strip() for d in devices if d.strip())
        if not devs:
            raise ConfigError("--devices names no device; give e.g. cuda:0,cuda:1 or cpu,cpu")
        return len(devs), devs
    if jobs is not None:
        if jobs < 1:
            raise ConfigError(f"--jobs {jobs}: give at least 1")
        return jobs, None
    auto = default_devices(overrides)
    return (len(auto), auto) if auto else (1, None)


def point_text(point: Mapping[str, str]) -> str:
    """``{"train.lr": "1e-3"}`` → ``"train.lr=1e-3"`` (several settings joined by ``", "``)."""
    return ", ".join(f"{k}={v}" for k, v in point.items())


def _plain(x: Any) -> Any:
    return json.loads(json.dumps(x, default=list))


def requested_config(
    config: str | Path, overrides: Sequence[str], method: str, seed: int, rounds: int | None
) -> dict[str, Any]:
    """The resolved settings of one run (the method's defaults filled in), as JSON, without :data:`IGNORED`;
    a bad key or value fails here, before anything runs."""
    fields: dict[str, Any] = {"method": method, "seed": seed}
    if rounds is not None:
        fields["rounds"] = rounds
    return resolved_settings(load_run_config(config, list(overrides), known_sections(), **fields))


def resolved_settings(cfg: RunConfig) -> dict[str, Any]:
    """``cfg``'s resolved settings (the method's defaults filled in) as JSON, without :data:`IGNORED`: what
    ``point.json`` holds."""
    d = _plain(get_algorithm(cfg).resolved_config().to_dict())
    for k in IGNORED:
        d.pop(k, None)
    return d


def check_point(folder: str | Path, want: Mapping[str, Any]) -> None:
    """Refuse a run folder whose ``point.json`` holds other settings than ``want``, naming the settings that differ."""
    marker = Path(folder) / POINT_FILE
    if marker.is_file():
        diff = _differences(want, json.loads(marker.read_text()))
        if diff:
            raise ConfigError(
                f"{folder} holds a run with other settings ({', '.join(diff[:8])}); remove the folder or give "
                "another --out"
            )


def _differences(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _differences(x, y, f"{prefix}{k}.")
        elif x != y:
            out.append(f"{prefix}{k}")
    return out


@dataclasses.dataclass(frozen=True)
class Job:
    """One run of a grid: the run config or federation spec, its output folder, its overrides (the grid point's
    among them), method, seed, rounds, and the grid point (its text goes into the run's label)."""

    config: str
    folder: str
    overrides: tuple[str, ...]
    method: str
    seed: int
    rounds: int | None = None
    point: tuple[tuple[str, str], ...] = ()

    def requested(self) -> dict[str, Any]:
        return requested_config(self.config, self.overrides, self.method, self.seed, self.rounds)


def run_point(
    job: Job,
    progress: bool = False,
    log: Callable[[str], None] = print,
    device: str | None = None,
    track: TrackTarget | None = None,
) -> dict[str, Any]:
    """Run one grid point into ``job.folder``, or reuse / resume what is there; returns its ``results.json``.

    * ``results.json`` present and ``point.json`` equal to the settings asked for → reused;
    * a checkpoint of those settings → continued with the engine's resume (bitwise the uninterrupted run);
    * a folder of a run with other settings → one error naming the settings that differ;
    * else the run starts.  A run's label gets its grid point (``FedAvg [train.lr=1e-3]``).

    ``track``: the run's metrics go to MLflow after every round, from this process, nested under
    ``track.parent_id``; its final numbers and kept files when it ends.
    """
    folder = Path(job.folder)
    want = job.requested()
    marker, done = folder / POINT_FILE, folder / "results.json"
    check_point(folder, want)
    if done.is_file():  # a folder without point.json (written before grids had it) is taken as it is
        log(f"{job.method} seed {job.seed} {point_text(dict(job.point))}: already done ({done})")
        return json.loads(done.read_text())
    overrides = [*job.overrides, *([f"device={device}"] if device else [])]
    fields: dict[str, Any] = {"rounds": job.rounds} if job.rounds is not None else {}
    t0 = time.perf_counter()
    name = f"{job.method} seed {job.seed}" + (f" [{point_text(dict(job.point))}]" if job.point else "")
    live = LiveRun(track, folder, name, log) if track is not None else None
    hooks = [h for h in (live, fault_hook(folder)) if h is not None]
    on_round = _chain(hooks) if hooks else None
    checkpoints = folder / "checkpoints"
    if (folder / "config.toml").is_file() and (
        (checkpoints / PROGRESS).is_file() or (checkpoints / f"{PROGRESS}.next").is_file()  # a commit cut short
    ):
        log(f"{job.method} seed {job.seed} {point_text(dict(job.point))}: resuming {folder}")
        res = run(
            folder / "config.toml",  # (resume reads the folder's own config.toml)
            out=folder,
            overrides=[f"device={device}"] if device else [],
            resume=True,
            progress=progress,
            log=log,
            on_round=on_round,
        )
    else:
        folder.mkdir(parents=True, exist_ok=True)
        save_json(want, marker)
        res = run(
            job.config,
            out=folder,
            overrides=overrides,
            progress=progress,
            log=log,
            on_round=on_round,
            method=job.method,
            seed=job.seed,
            **fields,
        )
    if res is None:
        raise ConfigError(f"{folder}: the run stopped before its last round; run the same command again to resume it")
    if job.point:
        res["label"] = f"{res['label']} [{point_text(dict(job.point))}]"
        save_json(res, done)
    if live is not None:
        live.finish()
    log(
        f"{res['label']} seed {job.seed}: client avg Dice {res['client_avg_dice']:.4f} in "
        f"{time.perf_counter() - t0:.0f} s"
    )
    return res


def _chain(hooks: Sequence[Callable[[dict[str, Any]], None]]) -> Callable[[dict[str, Any]], None]:
    def on_round(entry: dict[str, Any]) -> None:
        for h in hooks:
            h(entry)

    return on_round


def _configured_device(job: Job) -> str:
    fields: dict[str, Any] = {"method": job.method, "seed": job.seed}
    return str(load_run_config(job.config, list(job.overrides), known_sections(), **fields).device)


# ------------------------------------------------------------- parallel runs
def _run_job(job: Job, track: TrackTarget | None = None, **kwargs: Any) -> str:
    run_point(job, track=track, **kwargs)
    return job.folder  # the driver reads results.json from the folder: nothing but names crosses processes


def run_jobs(
    jobs: Sequence[Job],
    n_jobs: int | None = 1,
    devices: Sequence[str] | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    launch: LaunchOptions | None = None,
    track: TrackTarget | None = None,
    root: str | Path | None = None,
) -> list[dict[str, Any]]:
    """Run ``jobs`` (each :func:`run_point`) and return their results in order.

    ``launch`` (default: this machine): ``n_jobs`` > 1 runs them in that many spawned processes with one torch
    thread each; ``devices`` (``["cuda:0", "cuda:1"]`` or ``["cpu", "cpu"]``) runs one process per device, each
    run on its process's device; both None: :func:`placement`'s default; ``launch.launcher`` ``"ray"`` or
    ``"slurm"``: one Ray task or Slurm array task per run (:mod:`fedseg.apps.studies.launchers`).  A run computes
    the same numbers wherever it runs: every random draw is seeded by (run seed, site, round), so the results
    equal those of the runs one after another with one torch thread.  Finished runs are read here and not
    dispatched; a run that fails is named (with its log) in one error after the others have finished.
    ``track``: every run logs to MLflow as it goes (:func:`run_point`); ``root``: the study's output folder
    (runs are named by their folder below it).
    """
    for j in jobs:  # every bad setting fails before anything runs
        j.requested()
    launch = launch or LaunchOptions()
    if launch.remote:
        n_jobs, devices = 1, None
    else:
        if n_jobs is None and devices is None and jobs and _configured_device(jobs[0]) == "cpu":
            n_jobs = 1  # the runs are set to the CPU: no CUDA devices by default
        n_jobs, devices = placement(n_jobs, devices, jobs[0].overrides if jobs else ())
    todo = [j for j in jobs if not (Path(j.folder) / "results.json").is_file()]
    for j in jobs:
        if j not in todo:  # finished: its settings checked and read here
            run_point(j, progress=progress, log=log)
    specs = [
        RunSpec(
            _run_name(j, root),
            _run_job,
            (j,),
            {"track": track},
            folder=j.folder,
            local_kwargs={"progress": progress, "log": log},
            placed=True,
        )
        for j in todo
    ]
    launch_all(launcher_for(launch, n_jobs or 1, devices, root or ".", log), specs, log)
    out = [json.loads((Path(j.folder) / "results.json").read_text()) for j in jobs]
    if len(specs) > 1 and (launch.remote or (n_jobs or 1) > 1):  # (one after another: run_point said it)
        for j in todo:
            r = out[jobs.index(j)]
            log(f"{r['label']} seed {j.seed}: client avg Dice {r['client_avg_dice']:.4f}")
    return out


def _run_name(job: Job, root: str | Path | None) -> str:
    folder = Path(job.folder)
    if root is not None:
        try:
            return folder.resolve().relative_to(Path(root).resolve()).as_posix()
        except ValueError:
            pass
    return folder.as_posix()


def map_in_processes(
    fn: Callable[..., Any],
    calls: Sequence[tuple[tuple, dict]],
    n_jobs: int,
    log: Callable[[str], None] = print,
    devices: Sequence[str] | None = None,
    what: str = "studies",
) -> list[Any]:
    """``[fn(*args, **kwargs) for args, kwargs in calls]``, in ``n_jobs`` spawned processes with one torch thread
    each when ``n_jobs`` > 1 (``fn`` a module-level function; what it returns crosses back to this process).

    ``devices``: one process per device, and ``fn`` gets its process's device as ``device=`` (one after another:
    the first device)."""
    if devices:
        n_jobs = len(devices)
    if n_jobs < 1:
        raise ConfigError(f"--jobs {n_jobs}: give at least 1")
    specs = [
        RunSpec(str(args[1]) if len(args) > 1 else f"{what} {i}", fn, tuple(args), dict(kwargs), placed=bool(devices))
        for i, (args, kwargs) in enumerate(calls)
    ]
    return launch_all(LocalLauncher(n_jobs, devices, log), specs, log)
