"""Simulation: every site in this process, called one after another (or vectorized: :mod:`fedseg.simulation.vectorize`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from fedseg.foundation.arrays import Arrays, clone
from fedseg.foundation.errors import PayloadError
from fedseg.foundation.messages import Reply, Task
from fedseg.seams.checkpoint import restore_site, save_site
from fedseg.seams.transport import Traffic
from fedseg.simulation.vectorize.scheduler import Handler
from fedseg.site.calls import Asks, Executor

if TYPE_CHECKING:  # pragma: no cover
    from fedseg.simulation.vectorize import VectorizedExecutor


class HostedSite(Protocol):
    """What the in-process transport uses of a site (the site runtime's ``Site``): it answers a task
    alone (``handle``) or hands its handler and its own executor to the vectorized executor (``asks``,
    ``executor``), and saves and restores its state."""

    name: str
    algorithm: Any  # the site half: its name, for the log
    executor: Executor

    def handle(self, task: Task) -> Reply: ...

    def asks(self, task: Task) -> Asks[Reply]: ...

    def state_arrays(self, copy: bool = True) -> tuple[Arrays, dict[str, Any]]: ...

    def load_state_arrays(self, arrays: Arrays, meta: dict[str, Any]) -> None: ...


S = TypeVar("S", bound=HostedSite)


class InProcessTransport(Generic[S]):
    """Calls ``site.handle(task)`` directly.

    Tensors are copied in both directions, so a site can never alias the server's
    state (as with a real network, nothing is shared).

    Parameters
    ----------
    sites
        The federation's sites, in order.
    extra
        Sites addressable by name but not part of the federation (the pooled
        data of centralized training).
    vectorized
        A :class:`fedseg.simulation.vectorize.VectorizedExecutor` (``simulation.vectorize``): it drives the
        handlers of an ask's tasks together, so that their local training is one vectorized computation.
    """

    def __init__(
        self,
        sites: Sequence[S],
        extra: Sequence[S] | None = None,
        vectorized: VectorizedExecutor | None = None,
    ):
        self._sites = {s.name: s for s in [*sites, *(extra or [])]}
        self.sites = tuple(s.name for s in sites)
        self.traffic = Traffic()
        self.vectorized = vectorized

    def site(self, name: str) -> S:
        return self._sites[name]

    def ask(self, tasks: dict[str, Task], optional: bool = False) -> dict[str, Reply]:
        if self.vectorized is not None and len(tasks) > 1 and all(t.kind != "evaluate" for t in tasks.values()):
            return self._ask_vectorized(tasks)
        replies = {}
        for name, task in tasks.items():
            site = self._sites.get(name)
            if site is None:
                raise PayloadError(f"no site named {name!r}; sites are {sorted(self._sites)}")
            reply = site.handle(Task(task.kind, clone(task.arrays), dict(task.config)))
            reply = Reply(clone(reply.arrays), reply.metrics, reply.num_samples)
            self.traffic.record(name, task, reply)
            replies[name] = reply
        return replies

    def _ask_vectorized(self, tasks: dict[str, Task]) -> dict[str, Reply]:
        unknown = [n for n in tasks if n not in self._sites]
        if unknown:
            raise PayloadError(f"no site named {unknown[0]!r}; sites are {sorted(self._sites)}")
        handlers = []
        for n, t in tasks.items():
            site = self._sites[n]
            asks = site.asks(Task(t.kind, clone(t.arrays), dict(t.config)))
            handlers.append(Handler(n, t.kind, asks, site.executor, site.algorithm.name))
        replies = {}
        for (name, task), reply in zip(tasks.items(), self.vectorized.run(handlers)):  # type: ignore[union-attr]
            reply = Reply(clone(reply.arrays), reply.metrics, reply.num_samples)
            self.traffic.record(name, task, reply)
            replies[name] = reply
        return replies

    def snapshot_sites(self) -> dict[str, tuple[dict, dict]]:
        """Every site's state (live tensors, not copies) + metadata — what :meth:`save_sites` writes —
        for the engine's checkpoint writer, which copies them to host memory at once."""
        return {name: s.state_arrays(copy=False) for name, s in self._sites.items()}

    def save_sites(self, folder: Path) -> None:
        for s in self._sites.values():
            save_site(s, folder)

    def restore_sites(self, folder: Path) -> None:
        for s in self._sites.values():
            restore_site(s, folder)

    def close(self) -> None:
        pass
