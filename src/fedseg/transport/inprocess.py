"""Simulation: every site in this process, called one after another."""

from __future__ import annotations

from pathlib import Path

from fedseg.arrays import clone
from fedseg.errors import PayloadError
from fedseg.site import Reply, Site, Task
from fedseg.transport.base import Traffic


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
    """

    def __init__(self, sites: list[Site], extra: list[Site] | None = None):
        self._sites = {s.name: s for s in [*sites, *(extra or [])]}
        self.sites = tuple(s.name for s in sites)
        self.traffic = Traffic()

    def site(self, name: str) -> Site:
        return self._sites[name]

    def ask(self, tasks: dict[str, Task], optional: bool = False) -> dict[str, Reply]:
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

    def snapshot_sites(self) -> dict[str, tuple[dict, dict]]:
        """Every site's state (live tensors, not copies) + metadata — what :meth:`save_sites` writes —
        for the engine's checkpoint writer, which copies them to host memory at once."""
        return {name: s.state_arrays(copy=False) for name, s in self._sites.items()}

    def save_sites(self, folder: Path) -> None:
        for s in self._sites.values():
            s.save(folder)

    def restore_sites(self, folder: Path) -> None:
        for s in self._sites.values():
            s.restore(folder)

    def close(self) -> None:
        pass
