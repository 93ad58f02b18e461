"""Where a study's independent runs run: this machine's processes, a Ray cluster or a Slurm queue.

A study (``compare``, ``compare --tune``, ``sweep``, ``fedsm sweep|unseen``, ``--seeds``) turns its runs into
:class:`RunSpec` s — a module-level function, its arguments and the run's folder — and hands them to a
:class:`Launcher`, which yields an :class:`Outcome` per run as each one finishes.  The study's tables, tuning
choice and report are written on the driver once every run is in (:func:`launch_all`).

* :class:`LocalLauncher` (``--launcher local``, the default): one after another in this process, or in spawned
  processes with one torch thread each (``--jobs``, ``--devices``).
* :class:`RayLauncher` (``--launcher ray``): one Ray task per run on a local cluster it starts or on the cluster
  at ``--ray-address``; each task asks for ``--cpus-per-run`` CPUs and ``--gpus-per-run`` GPUs.
* :class:`SlurmLauncher` (``--launcher slurm``): one submitit array job (``executor.map_array``), a task per run,
  with ``--slurm-partition``, ``--slurm-time`` and the GPUs per run; submitit's local executor
  (``slurm_cluster="local"``) runs the same code path in processes of this machine.

A run computes the same bytes under every launcher: the worker calls the same function with the same arguments
into the same folder, every random draw is seeded by (run seed, site, round), and a worker runs with
``cpus_per_run`` torch threads (1 by default, as the local processes).  Outside this process a run's messages go
to ``<folder>/worker.log`` (appended), and a run that fails — an exception, or its worker process, node or job
dying — comes back as an :class:`Outcome` naming the run and its log; the other runs go on.  Nothing is
retried automatically: the same command again keeps the finished runs and resumes the others from their
checkpoints (:func:`fedseg.apps.studies.jobs.run_point`).

The driver's ``FEDSEG_*`` and ``MLFLOW_TRACKING_URI`` environment variables travel with each run (a remote
worker's own environment is its node's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any, Protocol

import torch

from fedseg.foundation.errors import ConfigError, FedsegError

__all__ = [
    "LAUNCHERS",
    "LaunchOptions",
    "Launcher",
    "LocalLauncher",
    "Outcome",
    "RayLauncher",
    "RunSpec",
    "SlurmLauncher",
    "StudyRunsFailed",
    "fault_hook",
    "launch_all",
    "launcher_for",
]

LAUNCHERS = ("local", "ray", "slurm")
WORKER_LOG = "worker.log"
"""A run's messages when it runs outside the driver's process (in its folder, appended on every attempt)."""
_FORWARDED = ("MLFLOW_TRACKING_URI",)
FAULT_ENV = "FEDSEG_FAULT_EXIT"
"""Fault injection for tests of interrupted studies: ``"<text>@<round>"`` makes a worker process running a run
whose folder contains ``<text>`` exit at once (code 17, nothing cleaned up) right after that round, before the
round's checkpoint, as a killed worker would.  Honoured only in worker processes, never in the driver's."""
_IN_WORKER = False


class StudyRunsFailed(FedsegError):
    """Some runs of a study failed; the others finished and are kept."""


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """How a study's runs are dispatched (``--launcher`` and its options).

    ``launcher``: ``"local"`` (this machine: ``jobs``/``devices`` of :class:`~fedseg.apps.studies.jobs.StudyOptions`),
    ``"ray"`` or ``"slurm"``.  ``cpus_per_run``: CPUs a Ray or Slurm run asks for, and its torch threads;
    ``gpus_per_run``: GPUs it asks for (the run's ``device = "auto"`` then finds CUDA).  ``ray_address``: a running
    cluster (``ray://head:10001`` or ``head:6379``; None: a local cluster started for the study, or the one this
    process is already connected to).  ``slurm_partition``, ``slurm_time`` (minutes per run), ``slurm_folder``
    (submitit's job files; None: ``OUT/slurm``), ``slurm_parallelism`` (most array tasks at once; None: all),
    ``slurm_cluster`` (``"slurm"``; ``"local"``/``"debug"``: submitit's executors on this machine, for trying a
    study out)."""

    launcher: str = "local"
    cpus_per_run: int = 1
    gpus_per_run: float = 0.0
    ray_address: str | None = None
    slurm_partition: str | None = None
    slurm_time: int = 60
    slurm_folder: str | None = None
    slurm_parallelism: int | None = None
    slurm_cluster: str = "slurm"

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ConfigError(f"--launcher {self.launcher!r}: use one of {', '.join(LAUNCHERS)}")
        if self.cpus_per_run < 1:
            raise ConfigError(f"--cpus-per-run {self.cpus_per_run}: give at least 1")
        if self.gpus_per_run < 0:
            raise ConfigError(f"--gpus-per-run {self.gpus_per_run}: give 0 or more")
        if self.slurm_time < 1:
            raise ConfigError(f"--slurm-time {self.slurm_time}: give the minutes a run may take (at least 1)")
        if self.slurm_cluster not in ("slurm", "local", "debug"):
            raise ConfigError(f"slurm_cluster {self.slurm_cluster!r}: use 'slurm', 'local' or 'debug'")
        if self.slurm_parallelism is not None and self.slurm_parallelism < 1:
            raise ConfigError(f"--slurm-parallelism {self.slurm_parallelism}: give at least 1")

    @property
    def remote(self) -> bool:
        """True for launchers whose runs leave this machine's process pool (Ray, Slurm)."""
        return self.launcher != "local"

    def check_placement(self, jobs: int | None, devices: Sequence[str] | None) -> None:
        """Refuse ``--jobs``/``--devices`` (this machine's placement) with a Ray or Slurm launcher."""
        if self.remote and (jobs is not None or devices is not None):
            raise ConfigError(
                f"--jobs and --devices place runs on this machine; with --launcher {self.launcher} give the "
                "resources of each run with --cpus-per-run and --gpus-per-run instead"
            )


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run of a study: ``fn(*args, **kwargs)`` (``fn`` a module-level function) writing into ``folder``.

    ``name`` names the run in messages and failures (its folder relative to the study's output);
    ``local_kwargs`` are added when it runs in the driver's own process (progress bars, the driver's log);
    ``placed``: ``fn`` takes the device of its local process as ``device=``."""

    name: str
    fn: Callable[..., Any]
    args: tuple = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    folder: str | None = None
    local_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    placed: bool = False

    @property
    def log_path(self) -> str | None:
        return str(Path(self.folder) / WORKER_LOG) if self.folder else None


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What came back of one run: its value, or ``error`` (the exception or the death of its worker) and where
    its log is."""

    spec: RunSpec
    value: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class Launcher(Protocol):
    """Runs :class:`RunSpec` s and yields their :class:`Outcome` s as they finish (in any order)."""

    name: str

    def launch(self, specs: Sequence[RunSpec]) -> Iterator[Outcome]: ...


# ------------------------------------------------------------- the worker side
def forwarded_env() -> dict[str, str]:
    """The driver's environment that travels with each run: ``FEDSEG_*`` and ``MLFLOW_TRACKING_URI``."""
    return {k: v for k, v in os.environ.items() if k.startswith("FEDSEG_") or k in _FORWARDED}


def execute(spec: RunSpec, env: Mapping[str, str], threads: int, device: str | None = None) -> Any:
    """Run ``spec`` in a worker process (a pool process, a Ray task, a Slurm task): the driver's ``env``, ``threads``
    torch threads, its messages (stdout and stderr) appended to ``<folder>/worker.log``.  An exception's traceback
    goes to that log and it is raised again as one line (its type and message), which the driver names by run."""
    global _IN_WORKER
    _IN_WORKER = True
    torch.set_num_threads(threads)
    kwargs = {**spec.kwargs, **({"device": device} if spec.placed else {})}
    log_path = spec.log_path
    with contextlib.ExitStack() as stack:
        stack.enter_context(_environment(env))  # a worker process that runs several runs: each with its own
        if log_path is not None:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
            f = stack.enter_context(open(log_path, "a", buffering=1))
            f.write(
                f"--- {spec.name}: started on {_host()} (pid {os.getpid()}) at {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
            )
            stack.enter_context(contextlib.redirect_stdout(f))
            stack.enter_context(contextlib.redirect_stderr(f))
        try:
            value = spec.fn(*spec.args, **kwargs)
        except BaseException as e:
            text = "".join(traceback.format_exception(e))
            print(text, file=sys.stderr)
            raise RuntimeError(f"{type(e).__name__}: {e}") from None
        print(f"--- {spec.name}: finished at {time.strftime('%Y-%m-%d %H:%M:%S')}")
    return value


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def fault_hook(folder: str | Path) -> Callable[[dict[str, Any]], None] | None:
    """The :data:`FAULT_ENV` exit for a run in ``folder``, as an ``on_round`` hook; None where it does not apply."""
    text, _, rnd = os.environ.get(FAULT_ENV, "").rpartition("@")
    if not (_IN_WORKER and text and rnd.isdigit() and text in Path(folder).as_posix()):
        return None

    def hook(entry: dict[str, Any]) -> None:
        if int(entry["round"]) == int(rnd):
            sys.stdout.flush()
            os._exit(17)

    return hook


def _host() -> str:
    return socket.gethostname()


def _portable(spec: RunSpec) -> RunSpec:
    """``spec`` as it travels to another process: without what is only for the driver's own process (its data
    in memory, its console)."""
    return dataclasses.replace(spec, local_kwargs={})


def _failure(spec: RunSpec, what: str, more: str = "") -> Outcome:
    """A failed run's outcome: the last line of ``what`` (an error's text), ``more``, and where its log is."""
    lines = [x.strip() for x in what.splitlines() if x.strip()]
    where = f" (log: {spec.log_path})" if spec.log_path and Path(spec.log_path).is_file() else ""
    return Outcome(spec, error=f"{lines[-1] if lines else 'failed'}{more}{where}")


# ------------------------------------------------------------- local
_DEVICE: str | None = None


def _init_worker(devices: Any) -> None:
    """A pool process: one torch thread (the runs share the machine's cores), and its device from the queue."""
    torch.set_num_threads(1)
    global _DEVICE
    _DEVICE = devices.get() if devices is not None else None


def _execute_in_pool(spec: RunSpec, env: Mapping[str, str]) -> Any:
    return execute(spec, env, 1, _DEVICE)


class LocalLauncher:
    """This machine: the runs one after another in this process (``processes`` 1), or in ``processes`` spawned
    processes with one torch thread each; ``devices``: one process per device (one after another: the first)."""

    name = "local"

    def __init__(self, processes: int = 1, devices: Sequence[str] | None = None, log: Callable[[str], None] = print):
        self.processes = len(devices) if devices else processes
        self.devices = tuple(devices) if devices else None
        self.log = log

    def launch(self, specs: Sequence[RunSpec]) -> Iterator[Outcome]:
        if self.processes == 1 or len(specs) <= 1:
            dev = self.devices[0] if self.devices else None
            for s in specs:  # in this process, as before there were launchers: an exception stops the study
                extra = {"device": dev} if s.placed else {}
                yield Outcome(s, s.fn(*s.args, **{**s.kwargs, **s.local_kwargs, **extra}))
            return
        ctx = multiprocessing.get_context("spawn")
        queue = None
        if self.devices:
            queue = ctx.Queue()  # handed to each worker as it starts: one device per process
            for d in self.devices:
                queue.put(d)
        self.log(
            f"running {len(specs)} runs in {self.processes} processes"
            + (f" on {', '.join(self.devices)}" if self.devices else "")
        )
        env = forwarded_env()
        with ProcessPoolExecutor(self.processes, mp_context=ctx, initializer=_init_worker, initargs=(queue,)) as pool:
            futures = {pool.submit(_execute_in_pool, _portable(s), env): s for s in specs}
            pending = set(futures)
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    s = futures[fut]
                    try:
                        yield Outcome(s, fut.result())
                    except Exception as e:  # the run's exception, or its process died (BrokenProcessPool)
                        yield _failure(s, str(e) or f"its worker process died ({type(e).__name__})")


# ------------------------------------------------------------- Ray
_RAY_LOCK = threading.Lock()
_RAY_USERS = 0
_RAY_STARTED = False


class RayLauncher:
    """One Ray task per run (``num_cpus`` = ``cpus_per_run``, ``num_gpus`` = ``gpus_per_run``, no automatic
    retry), on the cluster at ``ray_address`` (else ``RAY_ADDRESS``), or on the cluster this process is connected
    to, or on a local cluster started for the study (no dashboard) and shut down after it."""

    name = "ray"

    def __init__(self, options: LaunchOptions, log: Callable[[str], None] = print):
        self.options = options
        self.log = log

    def launch(self, specs: Sequence[RunSpec]) -> Iterator[Outcome]:
        try:
            import ray
        except ImportError as e:
            raise ConfigError(
                f"--launcher ray needs Ray ({e}); install it with: pip install 'fedseg[cluster]'"
            ) from None
        o = self.options
        global _RAY_USERS, _RAY_STARTED
        with _RAY_LOCK:  # studies side by side (a FedSM study per seed) share one connection
            if not ray.is_initialized():
                address = o.ray_address or os.environ.get("RAY_ADDRESS")
                if address:
                    ray.init(address=address, log_to_driver=False)
                else:
                    ray.init(address="local", include_dashboard=False, log_to_driver=False)
                    _RAY_STARTED = True
            _RAY_USERS += 1
        self.log(f"running {len(specs)} runs as Ray tasks ({o.cpus_per_run} CPU, {o.gpus_per_run:g} GPU each)")
        task = ray.remote(execute)
        env = forwarded_env()
        try:
            refs = {
                task.options(name=s.name, num_cpus=o.cpus_per_run, num_gpus=o.gpus_per_run, max_retries=0).remote(
                    _portable(s), env, o.cpus_per_run
                ): s
                for s in specs
            }
            pending = list(refs)
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                for ref in done:
                    s = refs[ref]
                    try:
                        yield Outcome(s, ray.get(ref))
                    except ray.exceptions.RayError as e:  # the run's exception, or its worker or node died
                        cause = getattr(e, "cause", None)
                        yield _failure(s, str(cause) if isinstance(cause, Exception) else _ray_text(e))
        finally:
            with _RAY_LOCK:
                _RAY_USERS -= 1
                if _RAY_STARTED and _RAY_USERS == 0:  # the local cluster started for the study ends with it
                    ray.shutdown()
                    _RAY_STARTED = False


def _ray_text(e: Exception) -> str:
    lines = [x for x in str(e).splitlines() if x.strip()]
    return f"its Ray worker failed ({type(e).__name__}: {lines[0] if lines else ''})"


# ------------------------------------------------------------- Slurm
class SlurmLauncher:
    """One submitit array job (``executor.map_array``), a task per run, each with ``cpus_per_run`` CPUs,
    ``gpus_per_run`` GPUs, ``slurm_time`` minutes, on ``slurm_partition``; submitit's job files in
    ``slurm_folder`` (its own stdout/stderr per task beside them)."""

    name = "slurm"

    def __init__(
        self, options: LaunchOptions, folder: str | Path, log: Callable[[str], None] = print, poll_s: float = 1.0
    ):
        self.options = options
        self.folder = Path(options.slurm_folder or folder)
        self.log = log
        self.poll_s = poll_s

    def launch(self, specs: Sequence[RunSpec]) -> Iterator[Outcome]:
        try:
            import submitit
        except ImportError as e:
            raise ConfigError(
                f"--launcher slurm needs submitit ({e}); install it with: pip install 'fedseg[cluster]'"
            ) from None
        o = self.options
        if o.gpus_per_run and o.gpus_per_run != int(o.gpus_per_run):
            raise ConfigError(f"--gpus-per-run {o.gpus_per_run:g}: Slurm gives whole GPUs; give 0, 1, 2, …")
        ex = submitit.AutoExecutor(folder=self.folder / "%j", cluster=o.slurm_cluster)
        params: dict[str, Any] = {
            "name": "fedseg",
            "timeout_min": o.slurm_time,
            "cpus_per_task": o.cpus_per_run,
            "tasks_per_node": 1,
            "nodes": 1,
        }
        if o.gpus_per_run:
            params["gpus_per_node"] = int(o.gpus_per_run)
        if o.slurm_partition:
            params["slurm_partition"] = o.slurm_partition
        if o.slurm_parallelism:
            params["slurm_array_parallelism"] = o.slurm_parallelism
        ex.update_parameters(**params)
        env = forwarded_env()
        n = len(specs)
        jobs = ex.map_array(execute, [_portable(s) for s in specs], [env] * n, [o.cpus_per_run] * n)
        self.log(
            f"submitted {n} runs to {o.slurm_cluster} as array job {jobs[0].job_id.split('_')[0] if jobs else '-'}"
        )
        pending = list(zip(jobs, specs))
        while pending:
            still = []
            for job, s in pending:
                if not job.done():
                    still.append((job, s))
                    continue
                try:
                    yield Outcome(s, job.result())
                except Exception as e:  # the run's exception, or its job died (timeout, node failure, scancel)
                    yield _failure(s, str(e), f" (Slurm job {job.job_id}; its output: {job.paths.stdout})")
            pending = still
            if pending:
                time.sleep(self.poll_s)


# ------------------------------------------------------------- the driver side
def launcher_for(
    options: LaunchOptions, processes: int, devices: Sequence[str] | None, out: str | Path, log: Callable[[str], None]
) -> Launcher:
    """The launcher ``options`` name; ``processes``/``devices``: the local one's placement."""
    if options.launcher == "ray":
        return RayLauncher(options, log)
    if options.launcher == "slurm":
        return SlurmLauncher(options, Path(out) / "slurm", log)
    return LocalLauncher(processes, devices, log)


def launch_all(launcher: Launcher, specs: Sequence[RunSpec], log: Callable[[str], None] = print) -> list[Any]:
    """Every run's value, in the order of ``specs``, once every run is in.  Runs that failed are named in one
    :class:`StudyRunsFailed` raised after the others finished (their folders kept for the next attempt)."""
    if not specs:  # every run already finished: no cluster started, nothing submitted
        return []
    values: dict[int, Any] = {}
    failed: list[Outcome] = []
    index = {id(s): i for i, s in enumerate(specs)}
    for outcome in launcher.launch(specs):
        if outcome.ok:
            values[index[id(outcome.spec)]] = outcome.value
        else:
            failed.append(outcome)
            log(f"{outcome.spec.name}: failed: {outcome.error}")
    if failed:
        names = "; ".join(f"{o.spec.name}: {o.error}" for o in failed)
        raise StudyRunsFailed(
            f"{len(failed)} of {len(specs)} runs failed ({names}); the finished runs are kept: run the same command "
            "again to run the failed ones (a checkpointed run resumes)"
        )
    return [values[i] for i in range(len(specs))]
