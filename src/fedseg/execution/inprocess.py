"""Simulation: every site in this process, called one after another (or vectorized: :mod:`fedseg.execution.vectorize`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from fedseg.foundation.arrays import clone
from fedseg.foundation.errors import PayloadError
from fedseg.foundation.messages import Reply, Task
from fedseg.seams.checkpoint import restore_site, save_site
from fedseg.seams.transport import Traffic
from fedseg.site.runtime import Site

if TYPE_CHECKING:  # pragma: no cover
    from fedseg.execution.vectorize import VectorizedExecutor


class InProcessTransport:
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
        A :class:`fedseg.execution.vectorize.VectorizedExecutor` (``simulation.vectorize``): it drives the
        handlers of an ask's tasks together, so that their local training is one vectorized computation.
    """

    def __init__(
        self, sites: list[Site], extra: list[Site] | None = None, vectorized: VectorizedExecutor | None = None
    ):
        self._sites = {s.name: s for s in [*sites, *(extra or [])]}
        self.sites = tuple(s.name for s in sites)
        self.traffic = Traffic()
        self.vectorized = vectorized

    def site(self, name: str) -> Site:
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
        calls = [(self._sites[n], Task(t.kind, clone(t.arrays), dict(t.config))) for n, t in tasks.items()]
        replies = {}
        for (name, task), reply in zip(tasks.items(), self.vectorized.run(calls)):  # type: ignore[union-attr]
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
