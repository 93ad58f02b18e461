"""A site's privacy ledger (:class:`Ledger`: every privatized release, booked before it leaves the site, in
a file no one else can rewind) and the accountant's view of its entries (:class:`Tally`), from which
:class:`~fedseg.site.dp.SiteDP` computes ε (the derivations are :mod:`fedseg.site.dp`'s).

Every privatized release is booked before it leaves the site, in an
append-only ledger outside the site's checkpointed state: the server's ``restore`` reloads models and
optimizers but cannot rewind ε.  In simulation the ledger is kept in memory and, with an output folder,
in ``<out>/privacy/<site>.jsonl``; a deployed site keeps it in ``<workdir>/privacy-ledger.jsonl`` (one line per
booking, each naming its run).  ε is computed from the ledger only, and a site refuses (:class:`PayloadError`
naming ``privacy.epsilon``) a privatized step or update that would take it past ``privacy.epsilon``,
whatever the server asks — ``privacy.budget_action`` only decides whether the server stops before a round
its forecast says would not fit."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from fedseg.foundation.errors import PayloadError

__all__ = ["Ledger", "Tally"]


class Ledger:
    """A site's append-only privacy ledger: one JSON object per booking (``kind`` "sample", "client" or
    "reveal"), kept in memory and, once :meth:`attach`-ed, appended and fsynced to a JSON-lines file.  No
    method removes or rewrites an entry; the site's checkpoint does not hold it, so ``restore`` cannot
    rewind it."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self.other_runs: dict[str, list[dict[str, Any]]] = {}
        """The entries of the other runs the file holds, per run (the site's other releases on the same data)."""
        self.path: Path | None = None
        self.run: str | None = None

    def attach(self, path: str | Path, run: str | None = None, fresh: bool = False) -> None:
        """Keep the ledger in ``path`` (JSON lines), reading the entries of ``run`` it already holds (and those
        of every other run into :attr:`other_runs`).  ``fresh`` starts the file anew (a simulation started from
        scratch in the same folder)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if fresh and path.exists():
            path.unlink()
        kept = self.entries
        self.entries, self.path, self.run = [], path, run
        self.other_runs = {}
        if path.exists():
            lines = path.read_text().splitlines()
            for i, line in enumerate(lines):
                if not line.strip():
                    continue
                try:
                    entry = json.loads(line)
                    ok = isinstance(entry, dict) and entry.get("kind") in ("sample", "client", "reveal")
                except ValueError:
                    ok = False
                if not ok:
                    if i == len(lines) - 1:  # a last line cut short by a crash: that booking's step never ran
                        break
                    raise PayloadError(
                        f"the privacy ledger {path} is unreadable at line {i + 1}; restore it from a backup (its "
                        "entries are the site's spent ε: deleting it would let runs spend it again)"
                    )
                if entry.get("run") == run:
                    self.entries.append(entry)
                else:
                    self.other_runs.setdefault(str(entry.get("run")), []).append(entry)
        for entry in kept:  # bookings made before the file was attached
            self.append(entry)

    def append(self, entry: dict[str, Any]) -> None:
        entry = {**entry, "run": self.run}
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(entry, sort_keys=True) + "\n")
                f.flush()
                os.fsync(f.fileno())
        self.entries.append(entry)


class Tally:
    """The accountant's view of ledger entries: per batch (σ, q, models), per exchange its latest (σ_eff, q),
    and the count of each (σ_eff, q) — :meth:`fedseg.site.dp.SiteDP.history`."""

    def __init__(self, counts: dict[tuple[float, float], int], source: list | None = None):
        self.counts = counts
        self.batches: dict[str, tuple[float, float, int]] = {}
        self.exchanges: dict[str, tuple[float, float]] = {}
        self.source, self.seen = source, 0

    def add(self, e: dict[str, Any], fallback: Tally | None = None) -> None:
        if e["kind"] == "sample":
            key = e["batch"]
            prior: tuple[float, float, int] | None = self.batches.get(key) or (
                fallback.batches.get(key) if fallback is not None else None
            )
            if prior is not None:
                self._count((prior[0] / math.sqrt(prior[2]), prior[1]), -1)
            if prior is not None:
                sigma, q, m = prior[0], prior[1], prior[2] + 1
            else:
                sigma, q, m = e["sigma"], e["q"], 1
            self.batches[key] = (sigma, q, m)
            self._count((sigma / math.sqrt(m), q), 1)
        else:  # "client" / "reveal": the exchange's latest booking replaces its earlier one
            key = e["exchange"]
            latest = self.exchanges.get(key) or (fallback.exchanges.get(key) if fallback is not None else None)
            if latest is not None:
                self._count(latest, -1)
            self.exchanges[key] = (e["sigma"], e["q"])
            self._count((e["sigma"], e["q"]), 1)

    def _count(self, key: tuple[float, float], n: int) -> None:
        self.counts[key] = self.counts.get(key, 0) + n
