"""A transport over any request/reply channel to long-lived site runtimes.

:class:`RemoteTransport` implements fedseg's :class:`~fedseg.transport.base.Transport`
on top of one function ``call(site, op, payload, timeout) -> bytes`` (NVFlare's
Collab proxies in deployment, :class:`LoopbackChannel` in tests).  It encodes
tasks (:mod:`fedseg.deploy.wire`), sends them to all sites in parallel, waits at
most ``deploy.round_deadline_s``, validates every reply and applies the fault
rule:

* a site that errors, times out or sends an invalid reply is **left out** of the
  exchange, with the reason logged and recorded in :attr:`dropouts`;
* a site whose last call failed is pinged first (``deploy.probe_timeout_s``) and
  left out at once if it does not answer, so a dead site costs one deadline, not
  one per exchange; it is back as soon as it answers a ping;
* if fewer than ``min(deploy.min_sites, sites asked)`` valid replies remain, the
  exchange fails with :class:`DeployError` (the engine's last checkpoint stays
  valid; resume with ``fedseg deploy run --resume OUT``);
* otherwise the algorithm sees only the valid replies (FedAvg then averages over
  the sites that answered, weights renormalised).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fedseg.errors import FedsegError, PayloadError
from fedseg.site import Reply, Task
from fedseg.transport.base import Traffic

from fedseg.deploy.params import DeployParams
from fedseg.deploy.wire import check_reply, decode_reply, encode_task

__all__ = ["Call", "DeployError", "LoopbackChannel", "RemoteTransport"]

Call = Callable[[str, str, bytes, float], bytes]


class DeployError(FedsegError):
    """A deployed exchange could not complete (too few sites answered)."""


def _parallel(fns: dict[str, Callable[[], Any]], timeout: float) -> dict[str, tuple[bool, Any]]:
    """Run each function in its own daemon thread; ``{key: (ok, result or exception)}`` after at most
    ``timeout`` s plus a grace of min(5 s, 10 %) for the carrier's own timeout to fire.

    A function still running then is abandoned (its thread is a daemon) and
    reported as a :class:`TimeoutError`.
    """
    out: dict[str, tuple[bool, Any]] = {}
    lock = threading.Lock()

    def runner(key: str, fn: Callable[[], Any]) -> None:
        try:
            res = (True, fn())
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            res = (False, e)
        with lock:
            out[key] = res

    threads = {k: threading.Thread(target=runner, args=(k, f), daemon=True, name=f"fedseg-ask-{k}") for k, f in fns.items()}
    for t in threads.values():
        t.start()
    end = time.monotonic() + timeout + min(5.0, 0.1 * timeout)
    for t in threads.values():
        t.join(max(0.0, end - time.monotonic()))
    with lock:
        res = dict(out)
    for k in fns:
        if k not in res:
            res[k] = (False, TimeoutError(f"no answer within the deadline of {timeout:g} s"))
    return res


class RemoteTransport:
    """Transport to remote site runtimes through ``call`` (see module docstring).

    Parameters
    ----------
    sites
        Site names in federation order.
    call
        ``call(site, op, payload, timeout) -> bytes``; raises on failure.
    params
        Deadline, minimum number of sites, payload limit.
    log
        Where dropouts and rejections are reported.
    record
        A JSON-lines file every dropout is appended to (the run's record across jobs).
    """

    def __init__(self, sites: list[str] | tuple[str, ...], call: Call, params: DeployParams, log: Callable[[str], None] = print,
                 record: Path | None = None):
        self.record = record
        self.sites = tuple(sites)
        self.call = call
        self.params = params
        self.log = log
        self.traffic = Traffic()
        self.wire_bytes = {"sent": 0, "received": 0}
        self.dropouts: list[dict[str, Any]] = []
        self.round_source: Callable[[], int] = lambda: 0
        self._schema: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        self._down: set[str] = set()  # sites whose last exchange failed: pinged before the next one

    # ---------------------------------------------------------------- control
    def _control(self, op: str, body: dict[str, Any], timeout: float, sites: tuple[str, ...] | None = None) -> dict[str, Any]:
        """Send a JSON control operation to every site; ``{site: reply dict}`` of those that answered."""
        payload = json.dumps(body).encode()

        def send(s: str) -> bytes:
            self._probe(s, timeout)
            return self.call(s, op, payload, timeout)

        results = _parallel({s: (lambda s=s: send(s)) for s in (sites or self.sites)}, timeout)
        out = {}
        for s, (ok, res) in results.items():
            if ok:
                out[s] = json.loads(res)
                self._down.discard(s)
            else:
                self._down.add(s)
                self._drop(s, op, f"{type(res).__name__}: {res}")
        return out

    def setup(self, desc: dict[str, Any]) -> dict[str, Any]:
        """Send the run description to every site (they load their data); returns their summaries."""
        out = self._control("setup", desc, self.params.setup_timeout_s)
        need = min(self.params.min_sites, len(self.sites))
        if len(out) < need:
            raise DeployError(f"only {len(out)} of {len(self.sites)} sites ({sorted(out)}) set up the run; deploy.min_sites = {self.params.min_sites}; check the sites' logs")
        return out

    def _send(self, site: str, blob: bytes, deadline: float) -> bytes:
        """One task to one site; a site that failed its last exchange must first answer a short ping."""
        self._probe(site, deadline)
        return self.call(site, "task", blob, deadline)

    def _probe(self, site: str, timeout: float) -> None:
        """Ping a site whose last call failed; raise ConnectionError if it still does not answer."""
        if site not in self._down:
            return
        probe = min(self.params.probe_timeout_s, timeout)
        try:
            self.call(site, "ping", b"{}", probe)
        except Exception as e:  # noqa: BLE001 - reported as the reason of the dropout
            raise ConnectionError(f"still unreachable (no answer to a ping within {probe:g} s: {type(e).__name__}: {e})") from e

    def _drop(self, site: str, kind: str, reason: str) -> None:
        rnd = self.round_source()
        entry = {"round": rnd, "site": site, "task": kind, "reason": reason}
        self.dropouts.append(entry)
        if self.record is not None:  # kept across the jobs of a supervised run
            with self.record.open("a") as fh:
                fh.write(json.dumps(entry) + "\n")
        self.log(f"[deploy] round {rnd}: site {site} left out of '{kind}': {reason}")

    # -------------------------------------------------------------- transport
    def ask(self, tasks: dict[str, Task], optional: bool = False) -> dict[str, Reply]:
        unknown = sorted(set(tasks) - set(self.sites))
        if unknown:
            raise PayloadError(f"no site named {unknown}; sites are {list(self.sites)}")
        blobs = {s: encode_task(t) for s, t in tasks.items()}
        deadline = self.params.round_deadline_s
        results = _parallel({s: (lambda s=s: self._send(s, blobs[s], deadline)) for s in tasks}, deadline)
        replies: dict[str, Reply] = {}
        for s in tasks:  # keep the order of the request (= federation order for broadcasts)
            ok, res = results[s]
            task = tasks[s]
            self.wire_bytes["sent"] += len(blobs[s])
            if not ok:
                self.traffic.record(s, task, None)
                self._down.add(s)
                self._drop(s, task.kind, f"{type(res).__name__}: {res}")
                continue
            self._down.discard(s)
            try:
                self.wire_bytes["received"] += len(res)
                reply = decode_reply(res, self.params.max_payload_bytes)
                key = (s, task.kind)
                check_reply(task, reply, self._schema.get(key), what=f"reply of site {s} to '{task.kind}'")
            except PayloadError as e:
                self.traffic.record(s, task, None)
                self._drop(s, task.kind, f"rejected: {e}")
                continue
            # remember the layout only (zero-stride views take no memory)
            known = self._schema.setdefault(key, {})
            known.update({k: torch.empty((), dtype=v.dtype).expand(v.shape) for k, v in reply.arrays.items() if k not in known})
            self.traffic.record(s, task, reply)
            replies[s] = reply
        need = min(self.params.min_sites, len(tasks))
        if len(replies) < need:
            raise DeployError(
                f"only {len(replies)} of {len(tasks)} sites answered '{next(iter(tasks.values())).kind}' validly "
                f"(deploy.min_sites = {self.params.min_sites}); the run stops here and can be resumed from its last checkpoint"
            )
        return replies

    def save_sites(self, folder: Path) -> None:
        """Ask every site to checkpoint its own state (models, optimizer moments) for the current round."""
        self._control("checkpoint", {"round": self.round_source()}, self.params.round_deadline_s)

    def restore_sites(self, folder: Path) -> None:
        """Ask every site to reload its checkpoint of the round the server resumes from."""
        progress = Path(folder).parent / "progress.json"
        rnd = int(json.loads(progress.read_text())["round"]) if progress.is_file() else self.round_source()
        out = self._control("restore", {"round": rnd}, self.params.setup_timeout_s)
        for s, r in sorted(out.items()):
            self.log(f"[deploy] site {s} restored its checkpoint of round {r.get('restored')}")

    def close(self) -> None:
        pass


class LoopbackChannel:
    """``call`` into in-process :class:`~fedseg.deploy.site.SiteRuntime` objects, through bytes (tests, benchmarks).

    ``faults`` maps a site to ``"die"`` (raise ConnectionError), ``"hang"`` (tasks sleep past
    the deadline), ``"freeze"`` (every operation but setup times out after its timeout, as the
    carrier reports a stopped process) or a callable ``(op, reply_bytes) -> bytes`` that rewrites a task's reply.
    """

    def __init__(self, runtimes: dict[str, Any], faults: dict[str, Any] | None = None):
        self.runtimes = runtimes
        self.faults = dict(faults or {})

    def __call__(self, site: str, op: str, payload: bytes, timeout: float) -> bytes:
        fault = self.faults.get(site)
        if fault == "die":
            raise ConnectionError(f"site {site} is unreachable")
        if fault == "hang" and op == "task":
            time.sleep(timeout + 30.0)
        if fault == "freeze" and op != "setup":  # the carrier's own call timeout fires
            time.sleep(timeout)
            raise TimeoutError(f"site {site}: no answer within {timeout:g} s")
        out = self.runtimes[site].call(op, payload)
        if callable(fault) and op == "task":
            out = fault(op, out)
        return out
