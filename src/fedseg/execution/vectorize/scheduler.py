"""The cooperative scheduler: every site's handler in its own thread, one thread running at a time.

A handler runs in site order until it parks in :meth:`Site.fit`, :meth:`Site.gradient` or
:meth:`Site.step_with_gradient` (the site's executor is the :class:`~fedseg.execution.vectorize.VectorizedExecutor`,
which hands the call to :meth:`_Worker.park_fit` and the like) or returns; the main thread then computes the
parked calls together and resumes each thread with its own result.  Every line of a handler outside those
calls runs exactly as it does sequentially, one site after another.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from fedseg.foundation.messages import Reply, Task
from fedseg.site.runtime import Site


class ExecutorState(Protocol):
    """What the stacked fit loop (``fit``) and the lockstep functions (``lockstep``) use of the
    :class:`~fedseg.execution.vectorize.executor.VectorizedExecutor` they work for; its module imports theirs,
    so they name it by this protocol."""

    cuda_graphs: bool
    vectorized_fits: int
    vectorized_gradients: int
    vectorized_applies: int
    _arenas: dict[tuple, Any]  # CUDA-graph arenas by group key and stack size, least recently used first

    def say(self, msg: str) -> None: ...

    def structure(self, model: nn.Module) -> Any: ...

    def _train_group(self, items: list[Any]) -> list[dict[str, float]]: ...

    def _gradients(self, *args: Any) -> tuple[Any, Any]: ...


@dataclass
class FitCall:
    """The arguments of one site's :meth:`Site.fit` call."""

    site: Site
    role: str
    rnd: int
    stream: str
    optimizer: Any
    extra_loss: Callable[[nn.Module], torch.Tensor] | None
    after_backward: Callable[[nn.Module], None] | None
    steps: int | None


@dataclass
class GradientCall:
    """The arguments of one site's :meth:`Site.gradient` call (a lockstep gradient-averaging step)."""

    site: Site
    role: str
    x: torch.Tensor
    target: Any
    loss: Callable[[torch.Tensor, Any], torch.Tensor] | None
    at: Any = None  # the weights to differentiate at (name → tensor), None: the model's own


@dataclass
class ApplyCall:
    """The arguments of one site's :func:`fedseg.algorithms.fga.apply_gradient` call (validated there):
    a lockstep step with the averaged gradient."""

    site: Site
    model: nn.Module
    optimizer: Any
    grad: Any  # parameter name → gradient


_SEQUENTIAL = object()
"""Result handed to a parked thread: run your ``fit`` yourself, sequentially."""


class _Aborted(BaseException):
    """Raised in a parked site thread when another site's handler failed (the ask is abandoned)."""


class _IntraOpThreads:
    """One intra-op thread in the site threads, all of them in the main thread (which runs the stacked steps).

    torch's CPU kernels parallelize with OpenMP, and every thread that enters a parallel region gets an
    OpenMP team of its own.  With K site threads each holding a team, the process manages more OpenMP
    threads than there are cores, and libgomp then lets the workers of *every* team (the main thread's
    as well) spin only briefly before sleeping, so each parallel region of the stacked step waits for its
    workers to be woken, which makes the vectorized rounds slower than sequential ones at torch's default
    2 threads on a 2-core CPU.  The handlers'
    own work between parks is small, so their threads run with one intra-op thread (no team); a fit or
    gradient a site thread computes itself (the sequential fallback) gets the full count back while it runs.

    ``torch.set_num_threads`` sets the calling thread's OpenMP count and the process-wide default that a
    thread takes on its first parallel call; a site thread therefore takes its own value first
    (:func:`torch.get_num_threads`) and then sets 1, and the main thread puts the default back after it.
    """

    def __init__(self) -> None:
        self.full = torch.get_num_threads()  # in the main thread: its count
        self.changed = False

    def site_thread(self) -> None:
        """At the start of a site thread."""
        if self.full > 1:
            torch.get_num_threads()  # this thread's lazy initialization, with the process-wide default
            torch.set_num_threads(1)
            self.changed = True

    def restore_default(self) -> None:
        """In the main thread, after a site thread ran: the process-wide default back to the main thread's."""
        if self.changed:
            torch.set_num_threads(self.full)
            self.changed = False

    @contextlib.contextmanager
    def full_count(self) -> Iterator[None]:
        """``with``: the site thread computes with the full count (its sequential fallback), then one again."""
        if self.full == 1:
            yield
            return
        torch.set_num_threads(self.full)
        try:
            yield
        finally:
            torch.set_num_threads(1)
            self.changed = True


class _Worker:
    """One site's handler in its own thread; it runs only between :meth:`resume` and its next park."""

    def __init__(self, site: Site, task: Task, threads: _IntraOpThreads):
        self.site, self.task, self.threads = site, task, threads
        self._go, self._yielded = threading.Event(), threading.Event()
        self.call: FitCall | GradientCall | ApplyCall | None = None
        self.result: Any = None
        self.reply: Reply | None = None
        self.error: BaseException | None = None
        self.done = self.fitted = self.abort = False
        self.thread = threading.Thread(target=self._main, daemon=True, name=f"fedseg-site-{site.name}")

    def owns_current_thread(self) -> bool:
        """Whether the caller runs in this worker's thread (its handler's own calls)."""
        return threading.current_thread() is self.thread

    def _main(self) -> None:
        self._go.wait()
        self._go.clear()
        try:
            if self.abort:
                raise _Aborted
            self.threads.site_thread()
            self.reply = self.site.handle(self.task)
        except _Aborted:
            pass
        except BaseException as e:  # handed to the main thread, re-raised there
            self.error = e
        finally:
            self.done = True
            self._yielded.set()

    def park_fit(
        self,
        site: Site,
        role: str,
        rnd: int,
        stream: str,
        optimizer: Any,
        extra_loss: Any,
        after_backward: Any,
        steps: int | None,
    ) -> dict[str, float]:
        """:meth:`Site.fit`: trained together with the other sites' parked fits, or here (:meth:`Site.fit_here`)."""
        result = self._wait(FitCall(site, role, rnd, stream, optimizer, extra_loss, after_backward, steps))
        if result is _SEQUENTIAL:
            with self.threads.full_count():
                return site.fit_here(role, rnd, stream, optimizer, extra_loss, after_backward, steps)
        return result

    def park_gradient(
        self, site: Site, role: str, x: torch.Tensor, target: Any, loss: Any, at: Any = None
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """:meth:`Site.gradient`: computed together with the others' parked gradients, or here."""
        result = self._wait(GradientCall(site, role, x, target, loss, at))
        if result is _SEQUENTIAL:
            with self.threads.full_count():
                return site.gradient_here(role, x, target, loss, at)
        return result

    def park_apply(self, site: Site, model: nn.Module, optimizer: Any, grad: Any) -> None:
        """:meth:`Site.step_with_gradient`: one step together with the others' parked steps, or here."""
        if self._wait(ApplyCall(site, model, optimizer, grad)) is _SEQUENTIAL:
            site.step_with_gradient_here(model, optimizer, grad)

    def _wait(self, call: FitCall | GradientCall | ApplyCall) -> Any:
        """Park this thread with ``call`` until the main thread hands it a result (or aborts the ask)."""
        self.fitted = True
        self.call = call
        self._yielded.set()
        self._go.wait()
        self._go.clear()
        self.call = None
        if self.abort:
            raise _Aborted
        result, self.result = self.result, None
        return result

    def resume(self) -> None:
        """Let the thread run until it parks or its handler returns (called by the main thread)."""
        self._yielded.clear()
        if not self.thread.is_alive() and not self.done:
            self.thread.start()
        self._go.set()
        self._yielded.wait()
        self.threads.restore_default()


def run_handlers(workers: list[_Worker], together: dict[type, Callable[[list[Any]], list[Any]]]) -> None:
    """Resume every worker in order until it parks or returns; then hand each kind of parked call
    (``together``: call type → the function computing a list of them) its results; until all are done.
    A handler's error aborts the others and is raised here."""
    try:
        live = list(workers)
        while live:
            for w in live:
                w.resume()
                if w.error is not None:
                    raise w.error
            live = [w for w in workers if not w.done]
            if not live:
                break
            for kind, compute in together.items():
                group = [w for w in live if isinstance(w.call, kind)]
                if group:
                    for w, r in zip(group, compute([w.call for w in group])):
                        w.result = r
    except BaseException:
        for w in workers:
            if not w.done:
                w.abort = True
                w.resume()
        raise
    finally:
        for w in workers:
            if w.thread.is_alive():
                w.thread.join()


def site_names(names: Sequence[str]) -> str:
    """ "site a" or "sites a, b, c", for the log."""
    return ("site " if len(names) == 1 else "sites ") + ", ".join(names)
