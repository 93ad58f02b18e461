"""A transport over any request/reply channel to long-lived site runtimes.

:class:`RemoteTransport` implements fedseg's :class:`~fedseg.seams.transport.Transport`
on top of one function ``call(site, op, payload, timeout) -> bytes`` (NVFlare's
Collab proxies in deployment, :class:`LoopbackChannel` in tests).  It encodes
tasks (:mod:`fedseg.deployment.wire`), sends them to all sites in parallel, waits at
most ``deploy.round_deadline_s``, validates every reply and applies the fault
rule:

* a site that errors, times out or sends an invalid reply is **left out** of the
  exchange, with the reason logged and recorded in :attr:`dropouts`.  Invalid is
  anything that fails to decode (whatever the exception) or breaks a rule
  (:mod:`fedseg.deployment.checks`): the
  checks of :func:`~fedseg.deployment.wire.check_reply`; tensor names and metric
  layout other than every reply to the same task; a sample count other than the
  one the site declared at setup; evaluation scores outside the schema (asked
  candidates, declared case count, values in [0, 1]); an update ‖w_k − w‖ (of a
  training task: per √(local step), the steps given by the declared count), or the
  norm of the tensors a reply returns that its task did not send (a lockstep step's
  gradient, SCAFFOLD's control change), more than ``deploy.max_update_ratio`` times
  the median of the other replies' (of the other sites' last accepted ones when the
  exchange has one reply, as CWT's visits);
* a site whose last call failed is pinged first (``deploy.probe_timeout_s``) and
  left out at once if it does not answer, so a dead site costs one deadline, not
  one per exchange; it is back as soon as it answers a ping;
* if fewer than ``min(deploy.min_sites, sites asked)`` valid replies remain (and the
  algorithm did not ask with ``optional=True``, e.g. CWT's one-site visits), the
  exchange fails with :class:`DeployError` (the engine's last checkpoint stays
  valid; resume with ``fedseg deploy run --resume OUT``);
* otherwise the algorithm sees only the valid replies (FedAvg then averages over
  the sites that answered, weights renormalised).
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fedseg.deployment.checks import ReplyChecks, declared_counts
from fedseg.deployment.params import DeployParams
from fedseg.deployment.wire import check_reply, decode_reply, encode_task, parse_json_object
from fedseg.foundation.config import TrainConfig
from fedseg.foundation.errors import FedsegError, PayloadError
from fedseg.foundation.messages import Reply, Task
from fedseg.seams.checkpoint import read_progress
from fedseg.seams.transport import Traffic

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
        except BaseException as e:
            res = (False, e)
        with lock:
            out[key] = res

    threads = {
        k: threading.Thread(target=runner, args=(k, f), daemon=True, name=f"fedseg-ask-{k}") for k, f in fns.items()
    }
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


class RemoteTransport(ReplyChecks):
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
    num_metrics
        Scores per case in an evaluation reply (the workload's metric count); None: not checked.
    reply_check
        ``reply_check(task, reply)`` raises for a malformed reply to one of the algorithm's own task kinds
        (``Algorithm.check_reply``, e.g. FedSM's ``"route"``); the reply is then rejected like any other.
    """

    def __init__(
        self,
        sites: list[str] | tuple[str, ...],
        call: Call,
        params: DeployParams,
        log: Callable[[str], None] = print,
        record: Path | None = None,
        num_metrics: int | None = None,
        reply_check: Callable[[Task, Reply], None] | None = None,
        train: TrainConfig | None = None,
    ):
        self.reply_check = reply_check
        self.train = train  # the run's training settings: a lockstep site's steps per round follow from them
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
        self.num_metrics = num_metrics
        self.declared: dict[str, dict[str, int]] = {}  # each site's case counts, from its setup reply
        self.refusals: dict[str, str] = {}  # sites that refused the run by their own policy: why
        self.aggregated: set[str] = set()  # sites that answered an evaluation with per-site means only
        self._exact: dict[tuple[str, str], bool] = {}  # (site, task key): its replies claim exactly the declared count
        self._names: dict[
            str, tuple[frozenset[str], tuple]
        ] = {}  # expected reply layout (names, metric kinds) per task key
        # the last accepted update norms per (task kind, tensor groups, part) and site: the reference of a
        # reply with no other of its kind in its exchange (CWT's visits)
        self._norms: dict[tuple[str, frozenset[str], str], dict[str, float]] = {}

    # ---------------------------------------------------------------- control
    def _control(
        self, op: str, body: dict[str, Any], timeout: float, sites: tuple[str, ...] | None = None
    ) -> dict[str, Any]:
        """Send a JSON control operation to every site; ``{site: reply dict}`` of those that answered."""
        payload = json.dumps(body).encode()

        def send(s: str) -> bytes:
            self._probe(s, timeout)
            return self.call(s, op, payload, timeout)

        results = _parallel({s: functools.partial(send, s) for s in (sites or self.sites)}, timeout)
        out = {}
        for s, (ok, res) in results.items():
            if ok:
                self._down.discard(s)
                try:
                    out[s] = parse_json_object(res, f"reply of site {s} to '{op}'")
                except Exception as e:
                    self._drop(s, op, f"rejected: {type(e).__name__}: {e}")
            else:
                self._down.add(s)
                self._drop(s, op, f"{type(res).__name__}: {res}")
        return out

    def exchange(
        self, op: str, body: dict[str, Any], timeout: float, sites: tuple[str, ...] | None = None
    ) -> dict[str, dict[str, Any]]:
        """Send one JSON operation to every site (or ``sites``); ``{site: reply}`` of those that answered
        with a JSON object (the others are recorded as dropouts), e.g. a volume run's planning."""
        return self._control(op, body, timeout, sites)

    def setup(self, desc: dict[str, Any]) -> dict[str, Any]:
        """Send the run description to every site (they load their data); returns their summaries."""
        out = self._control("setup", desc, self.params.setup_timeout_s)
        for site, summary in list(out.items()):
            if "refused" in summary:  # the site's own policy: it takes no part in this run
                del out[site]
                self.refusals[site] = str(summary["refused"])[:2000]
                self._drop(site, "setup", f"refused the run: {self.refusals[site]}")
                continue
            try:
                self.declared[site] = declared_counts(summary)
            except Exception as e:
                del out[site]
                self._drop(site, "setup", f"rejected: setup summary {str(summary)[:200]}: {type(e).__name__}: {e}")
        need = min(self.params.min_sites, len(self.sites))
        if len(out) < need:
            refused = "".join(f"; {why}" for why in self.refusals.values())
            raise DeployError(
                f"only {len(out)} of {len(self.sites)} sites ({sorted(out)}) set up the run; deploy.min_sites = "
                f"{self.params.min_sites}; check the sites' logs{refused}"
            )
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
        except Exception as e:
            raise ConnectionError(
                f"still unreachable (no answer to a ping within {probe:g} s: {type(e).__name__}: {e})"
            ) from e

    def _drop(self, site: str, kind: str, reason: str) -> None:
        rnd = self.round_source()
        entry = {"round": rnd, "site": site, "task": kind, "reason": reason}
        self.dropouts.append(entry)
        if self.record is not None:  # kept across the jobs of a supervised run
            with self.record.open("a") as fh:  # one line per append, synced; a torn last line is skipped on reading
                fh.write(json.dumps(entry) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        self.log(f"[deploy] round {rnd}: site {site} left out of '{kind}': {reason}")

    # -------------------------------------------------------------- transport
    def ask(self, tasks: dict[str, Task], optional: bool = False) -> dict[str, Reply]:
        unknown = sorted(set(tasks) - set(self.sites))
        if unknown:
            raise PayloadError(f"no site named {unknown}; sites are {list(self.sites)}")
        blobs = {s: encode_task(t) for s, t in tasks.items()}
        deadline = self.params.round_deadline_s
        results = _parallel({s: functools.partial(self._send, s, blobs[s], deadline) for s in tasks}, deadline)
        decoded: dict[str, Reply] = {}
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
            try:  # whatever a site sends, a failure here is a rejected reply, never the end of the run
                self.wire_bytes["received"] += len(res)
                reply = decode_reply(res, self.params.max_payload_bytes)
                what = f"reply of site {s} to '{task.kind}'"
                check_reply(task, reply, self._schema.get((s, task.kind)), what=what)
                self._check_samples(s, task, reply, what)
                if task.kind == "evaluate":
                    if "per_case" not in reply.metrics and "mean" in reply.metrics:
                        reply = self._expand_means(s, task, reply, what)
                    self._check_scores(s, task, reply, what)
                if self.reply_check is not None:  # the algorithm's own task kinds (Algorithm.check_reply)
                    self.reply_check(task, reply)
            except Exception as e:
                self._reject(s, task, e)
                continue
            decoded[s] = reply
        self._check_names(tasks, decoded)
        self._check_updates(tasks, decoded)
        replies: dict[str, Reply] = {}
        for s, reply in decoded.items():
            key = (s, tasks[s].kind)
            # remember the layout only (zero-stride views take no memory)
            known = self._schema.setdefault(key, {})
            known.update(
                {k: torch.empty((), dtype=v.dtype).expand(v.shape) for k, v in reply.arrays.items() if k not in known}
            )
            self.traffic.record(s, tasks[s], reply)
            replies[s] = reply
        need = 0 if optional else min(self.params.min_sites, len(tasks))  # optional: the algorithm copes with none
        if len(replies) < need:
            raise DeployError(
                f"only {len(replies)} of {len(tasks)} sites answered '{next(iter(tasks.values())).kind}' validly "
                f"(deploy.min_sites = {self.params.min_sites}); the run stops here and can be resumed from its last checkpoint"
            )
        return replies

    # ------------------------------------------------------------- validation
    def _reject(self, site: str, task: Task, error: BaseException | str) -> None:
        reason = (
            error
            if isinstance(error, str)
            else (str(error) if isinstance(error, PayloadError) else f"{type(error).__name__}: {error}")
        )
        self.traffic.record(site, task, None)
        self._drop(site, task.kind, f"rejected: {reason[:500]}")

    def save_sites(self, folder: Path) -> None:
        """Ask every site to checkpoint its own state (models, optimizer moments) for the current round."""
        self._control("checkpoint", {"round": self.round_source()}, self.params.round_deadline_s)

    def restore_sites(self, folder: Path) -> None:
        """Ask every site to reload its checkpoint of the round the server resumes from."""
        progress = read_progress(Path(folder).parent)
        rnd = int(progress["round"]) if progress is not None else self.round_source()
        out = self._control("restore", {"round": rnd}, self.params.setup_timeout_s)
        for s, r in sorted(out.items()):
            self.log(f"[deploy] site {s} restored its checkpoint of round {r.get('restored')}")

    def close(self) -> None:
        pass


class LoopbackChannel:
    """``call`` into in-process :class:`~fedseg.deployment.site.SiteRuntime` objects, through bytes (tests, benchmarks).

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
