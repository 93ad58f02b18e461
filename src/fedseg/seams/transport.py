"""The transport seam between the engine's server half and the sites."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from fedseg.foundation.arrays import nbytes
from fedseg.foundation.messages import Reply, Task


@dataclass
class Traffic:
    """Bytes of tensor data sent to and received from each site since the last :meth:`take`."""

    sent: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)

    def record(self, site: str, task: Task, reply: Reply | None) -> None:
        self.sent[site] = self.sent.get(site, 0) + nbytes(task.arrays)
        if reply is not None:
            self.received[site] = self.received.get(site, 0) + nbytes(reply.arrays)

    def take(self) -> dict[str, dict[str, int]]:
        """Per-site ``{"sent": bytes, "received": bytes}`` since the previous call, then reset."""
        out = {
            s: {"sent": self.sent.get(s, 0), "received": self.received.get(s, 0)}
            for s in sorted(set(self.sent) | set(self.received))
        }
        self.sent, self.received = {}, {}
        return out


class Transport(Protocol):
    """Delivers tasks to named sites and returns their replies.

    ``ask`` sends every task at once (sites work in parallel where the transport
    allows) and returns the replies of the sites that answered; with
    ``optional=False`` a missing reply is an error.
    """

    sites: tuple[str, ...]
    traffic: Traffic

    def ask(self, tasks: dict[str, Task], optional: bool = False) -> dict[str, Reply]: ...

    def save_sites(self, folder: Path) -> None:
        """Persist every site's state (simulation); deployed sites persist their own."""

    def restore_sites(self, folder: Path) -> None:
        """Reload what :meth:`save_sites` wrote."""

    def close(self) -> None: ...
