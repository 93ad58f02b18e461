"""Independent runs of a grid or a comparison: one run reused, resumed or started (:func:`run_point`), many
one after another or in spawned processes (:func:`run_jobs`, :func:`map_in_processes`), as
:class:`StudyOptions` say.

A run's folder gets ``point.json`` before it starts: the resolved settings it was asked to run with.  A later
call reuses the folder's finished run (``results.json``) or continues its checkpoint (the engine's resume, bitwise
the uninterrupted run) only when they are the same settings, and refuses a folder of other settings by name.
Runs in processes of their own (``--jobs N``, one torch thread each; ``--devices``, one process per device)
compute what they compute one after another: every random draw is seeded by (run seed, site, round); each
process writes its run's folder and the parent reads ``results.json`` back, so only names cross processes.
Without ``--jobs`` or ``--devices`` a machine with several CUDA devices runs one process on each
(:func:`default_devices`), and any other machine runs the runs one after another.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

from fedseg.algorithms import get_algorithm, known_sections
from fedseg.foundation.config import load_run_config
from fedseg.foundation.errors import ConfigError
from fedseg.seams.checkpoint import PROGRESS, save_json
from fedseg.simulation.runner import run

__all__ = [
    "IGNORED",
    "POINT_FILE",
    "Job",
    "StudyOptions",
    "default_devices",
    "map_in_processes",
    "placement",
    "point_text",
    "requested_config",
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
    ``track``: ``"mlflow"`` logs every run (``"off"``/None: the config's ``[tracking]``)."""

    seeds: tuple[int, ...] = (0,)
    rounds: int | None = None
    overrides: tuple[str, ...] = ()
    jobs: int | None = None
    devices: tuple[str, ...] | None = None
    progress: bool = True
    log: Callable[[str], None] = print
    track: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "seeds", tuple(int(s) for s in self.seeds))
        object.__setattr__(self, "overrides", tuple(self.overrides))
        if self.devices is not None:
            object.__setattr__(self, "devices", tuple(self.devices))
        if self.jobs is not None and self.jobs < 1:
            raise ConfigError(f"--jobs {self.jobs}: give at least 1")
        if self.devices is not None and not self.devices:
            raise ConfigError("--devices names no device; give e.g. cuda:0,cuda:1 or cpu,cpu")

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
    cfg = load_run_config(config, list(overrides), known_sections(), **fields)
    d = _plain(get_algorithm(cfg).resolved_config().to_dict())
    for k in IGNORED:
        d.pop(k, None)
    return d


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
    job: Job, progress: bool = False, log: Callable[[str], None] = print, device: str | None = None
) -> dict[str, Any]:
    """Run one grid point into ``job.folder``, or reuse / resume what is there; returns its ``results.json``.

    * ``results.json`` present and ``point.json`` equal to the settings asked for → reused;
    * a checkpoint of those settings → continued with the engine's resume (bitwise the uninterrupted run);
    * a folder of a run with other settings → one error naming the settings that differ;
    * else the run starts.  A run's label gets its grid point (``FedAvg [train.lr=1e-3]``).
    """
    folder = Path(job.folder)
    want = job.requested()
    marker, done = folder / POINT_FILE, folder / "results.json"
    if marker.is_file():
        diff = _differences(want, json.loads(marker.read_text()))
        if diff:
            raise ConfigError(
                f"{folder} holds a run with other settings ({', '.join(diff[:8])}); remove the folder or give "
                "another --out"
            )
    if done.is_file():  # a folder without point.json (written before grids had it) is taken as it is
        log(f"{job.method} seed {job.seed} {point_text(dict(job.point))}: already done ({done})")
        return json.loads(done.read_text())
    overrides = [*job.overrides, *([f"device={device}"] if device else [])]
    fields: dict[str, Any] = {"rounds": job.rounds} if job.rounds is not None else {}
    t0 = time.perf_counter()
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
            method=job.method,
            seed=job.seed,
            **fields,
        )
    if res is None:
        raise ConfigError(f"{folder}: the run stopped before its last round; run the same command again to resume it")
    if job.point:
        res["label"] = f"{res['label']} [{point_text(dict(job.point))}]"
        save_json(res, done)
    log(
        f"{res['label']} seed {job.seed}: client avg Dice {res['client_avg_dice']:.4f} in "
        f"{time.perf_counter() - t0:.0f} s"
    )
    return res


def _configured_device(job: Job) -> str:
    fields: dict[str, Any] = {"method": job.method, "seed": job.seed}
    return str(load_run_config(job.config, list(job.overrides), known_sections(), **fields).device)


# ------------------------------------------------------------- parallel runs
_DEVICE: str | None = None


def _init_worker(devices: Any) -> None:
    """A worker process: one torch thread (the runs share the machine's cores), and its device from the queue."""
    torch.set_num_threads(1)
    global _DEVICE
    _DEVICE = devices.get() if devices is not None else None


def _run_in_worker(job: Job) -> str:
    run_point(job, progress=False, device=_DEVICE)
    return job.folder  # the parent reads results.json from the folder: nothing but names crosses processes


def run_jobs(
    jobs: Sequence[Job],
    n_jobs: int | None = 1,
    devices: Sequence[str] | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Run ``jobs`` (each :func:`run_point`) and return their results in order.

    ``n_jobs`` > 1 runs them in that many spawned processes with one torch thread each; ``devices``
    (``["cuda:0", "cuda:1"]`` or ``["cpu", "cpu"]``) runs one process per device, each run on its process's
    device; both None: :func:`placement`'s default.  A run computes the same numbers in a process of its own: every random draw is seeded by
    (run seed, site, round), so the results equal those of the runs one after another with one torch thread.
    """
    for j in jobs:  # every bad setting fails before anything runs
        j.requested()
    if n_jobs is None and devices is None and jobs and _configured_device(jobs[0]) == "cpu":
        n_jobs = 1  # the runs are set to the CPU: no CUDA devices by default
    n_jobs, devices = placement(n_jobs, devices, jobs[0].overrides if jobs else ())
    if n_jobs == 1 or len(jobs) <= 1:
        dev = devices[0] if devices else None
        return [run_point(j, progress=progress, log=log, device=dev) for j in jobs]
    ctx = multiprocessing.get_context("spawn")
    queue = None
    if devices:
        queue = ctx.Queue()  # handed to each worker as it starts: one device per process
        for d in devices:
            queue.put(d)
    log(f"running {len(jobs)} runs in {n_jobs} processes" + (f" on {', '.join(devices)}" if devices else ""))
    with ProcessPoolExecutor(n_jobs, mp_context=ctx, initializer=_init_worker, initargs=(queue,)) as pool:
        folders = list(pool.map(_run_in_worker, jobs))
    out = [json.loads((Path(f) / "results.json").read_text()) for f in folders]
    for j, r in zip(jobs, out):
        log(f"{r['label']} seed {j.seed}: client avg Dice {r['client_avg_dice']:.4f}")
    return out


def _call(call: tuple[Callable[..., Any], tuple, dict, bool]) -> Any:
    fn, args, kwargs, placed = call
    return fn(*args, **kwargs, **({"device": _DEVICE} if placed else {}))


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
    placed = bool(devices)
    if n_jobs == 1 or len(calls) <= 1:
        extra = {"device": devices[0]} if devices else {}
        return [fn(*args, **kwargs, **extra) for args, kwargs in calls]
    ctx = multiprocessing.get_context("spawn")
    queue = None
    if devices:
        queue = ctx.Queue()
        for d in devices:
            queue.put(d)
    log(f"running {len(calls)} {what} in {n_jobs} processes" + (f" on {', '.join(devices)}" if devices else ""))
    with ProcessPoolExecutor(n_jobs, mp_context=ctx, initializer=_init_worker, initargs=(queue,)) as pool:
        return list(pool.map(_call, [(fn, a, k, placed) for a, k in calls]))
