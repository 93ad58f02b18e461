"""Independent per-case jobs over a pool of worker processes (the synthetic federations' cases).

Each synthetic case draws from its own generator, seeded by (run seed, site, split, case), and writes its
own files, so the files are the same bytes whatever the number of processes and whichever finishes first.
Workers are started with ``spawn`` (no state copied from a parent that may hold threads) and run their
numerical libraries single-threaded (:data:`WORKER_ENV`), so ``workers`` processes use ``workers`` cores.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from typing import Any

import numpy as np

from fedseg.foundation.errors import ConfigError

#: The most processes :func:`default_workers` picks.
MAX_WORKERS = 8
#: Estimated serial seconds of work per process below which fewer processes are used: starting one
#: costs a fresh interpreter importing NumPy, SciPy and the writers (and whatever the main script imports).
SECONDS_PER_WORKER = 3.0


def default_workers() -> int:
    """``min(cores this process may use, 8)``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_WORKERS))


def pool_size(workers: int | None, jobs: int, serial_seconds: float) -> int:
    """Processes to run ``jobs`` jobs with (1: in this process).

    ``workers`` given: that many, at most one per job. ``None``: :func:`default_workers`, but no more than
    one per :data:`SECONDS_PER_WORKER` of estimated serial work (``serial_seconds``), so a small federation
    is written in this process rather than waiting for interpreters to start.
    """
    if workers is None:
        return max(1, min(default_workers(), jobs, int(serial_seconds / SECONDS_PER_WORKER)))
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"synth: workers must be a positive integer, got {workers!r} -> pass e.g. workers=4")
    return max(1, min(workers, jobs))


#: Environment of the worker processes, where not set already: one thread for the BLAS and OpenMP pools
#: (the processes are the parallelism).
WORKER_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def keep_temporaries_in_heap() -> None:
    """Allocate and free one 16 MiB block, so glibc's malloc serves blocks up to that size from its heap.

    glibc raises its mmap threshold to the largest mapped block freed (up to 32 MiB) and trims its heap
    beyond twice that; without this, the megabyte-sized NumPy temporaries of a case are mapped, faulted in
    and unmapped again and again (a quarter of a 256 px fundus case's time, in system calls). With another
    allocator it does nothing useful and nothing harmful; allocation never changes a number.
    """
    np.empty(2 << 20)


@contextlib.contextmanager
def _worker_environment() -> Iterator[None]:
    """Set :data:`WORKER_ENV` in ``os.environ`` for the processes started inside; restore it after."""
    added = {k: v for k, v in WORKER_ENV.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def run_jobs(fn: Callable[[Any], Any], jobs: Sequence[Any], workers: int, done: Callable[[], Any]) -> None:
    """Call ``fn(job)`` for every job, in ``workers`` spawned processes (1: here, in order).

    ``fn`` must be a module-level function and each job picklable; ``done()`` is called in this process
    after each job. The first job that raises stops the rest and its error is raised here.
    """
    if workers <= 1:
        keep_temporaries_in_heap()
        for job in jobs:
            fn(job)
            done()
        return
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=keep_temporaries_in_heap) as pool:
        with _worker_environment():  # the workers start while the first jobs are submitted
            pending = {pool.submit(fn, job) for job in jobs}
        while pending:
            finished, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for future in finished:
                error = future.exception()
                if error is not None:
                    for other in pending:
                        other.cancel()
                    raise error
                done()
