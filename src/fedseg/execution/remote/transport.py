"""A transport over any request/reply channel to long-lived site runtimes.

:class:`RemoteTransport` implements fedseg's :class:`~fedseg.seams.transport.Transport`
on top of one function ``call(site, op, payload, timeout) -> bytes`` (NVFlare's
Collab proxies in deployment, :class:`LoopbackChannel` in tests).  It encodes
tasks (:mod:`fedseg.execution.remote.wire`), sends them to all sites in parallel, waits at
most ``deploy.round_deadline_s``, validates every reply and applies the fault
rule:

* a site that errors, times out or sends an invalid reply is **left out** of the
  exchange, with the reason logged and recorded in :attr:`dropouts`.  Invalid is
  anything that fails to decode (whatever the exception) or breaks a rule: the
  checks of :func:`~fedseg.execution.remote.wire.check_reply`; tensor names and metric
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
import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fedseg.execution.remote.params import DeployParams
from fedseg.execution.remote.wire import check_reply, decode_reply, encode_task, parse_json_object
from fedseg.foundation.arrays import Arrays, is_float
from fedseg.foundation.config import TrainConfig
from fedseg.foundation.errors import FedsegError, PayloadError
from fedseg.foundation.messages import SPLITS, Reply, Task
from fedseg.seams.checkpoint import read_progress
from fedseg.seams.transport import Traffic
from fedseg.site.runtime import steps_per_round

__all__ = ["Call", "DeployError", "LoopbackChannel", "RemoteTransport"]

Call = Callable[[str, str, bytes, float], bytes]


class DeployError(FedsegError):
    """A deployed exchange could not complete (too few sites answered)."""


def _declared_counts(summary: dict[str, Any]) -> dict[str, int]:
    """``{"training": n, "validation": m, "testing": t}`` from a site's setup summary (the last two when given)."""
    out = {}
    for split, field in (("training", "num_train"), ("validation", "num_validation"), ("testing", "num_testing")):
        n = summary.get(field)
        if n is None and split != "training":
            continue
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise PayloadError(f"{field} must be an integer >= 0, got {n!r}")
        out[split] = n
    return out


def _task_key(task: Task) -> str:
    """What fixes a reply's tensor names: the task kind, its non-numeric settings and the names it sent."""
    if task.kind.startswith("secagg/"):  # secure aggregation's steps: their replies' layout is fixed by the kind
        return json.dumps([task.kind])
    conf = {
        k: v
        for k, v in task.config.items()
        if k != "secagg" and (isinstance(v, bool) or not isinstance(v, (int, float)))
    }  # secure aggregation's keys and shares change every exchange, its masked names do not
    return json.dumps([task.kind, conf, sorted(task.arrays)], sort_keys=True, default=str)


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "number"
    names: dict[type, str] = {str: "string", list: "list", dict: "object"}
    return names.get(type(v), type(v).__name__)


def _metric_kinds(metrics: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(k), _kind(v)) for k, v in metrics.items()))


def _metrics_mismatch(expected: dict[str, str], got: tuple[tuple[str, str], ...]) -> str:
    """'' when ``got`` has the expected keys with compatible kinds (null is compatible with any), else the difference."""
    have = dict(got)
    missing, extra = sorted(set(expected) - set(have)), sorted(set(have) - set(expected))
    if missing or extra:
        return f"keys differ from the expected set (missing {missing[:5]}, unexpected {extra[:5]})"
    wrong = [
        f"{k} is a {have[k]}, expected a {v}"
        for k, v in expected.items()
        if "null" not in (v, have[k]) and v != have[k]
    ]
    return "; ".join(wrong[:3])


def update_norms(sent: Arrays, returned: Arrays) -> dict[str, float]:
    """The size of a reply's change, in two parts (float64): ``"delta"`` = ‖returned − sent‖ over the floating
    tensors present in both (a trained model against the one sent), ``"new"`` = ‖returned‖ over the floating
    tensors the task did not send (a lockstep step's gradient ``grad/…``, SCAFFOLD's control change ``dc/…``, a
    personalized model the server does not hold).  A part the reply does not have is absent."""
    common = [k for k, v in returned.items() if k in sent and is_float(v) and v.shape == sent[k].shape]
    fresh = [k for k, v in returned.items() if k not in sent and is_float(v)]
    out = {}
    if common:
        out["delta"] = math.sqrt(sum(float((returned[k].double() - sent[k].double()).pow(2).sum()) for k in common))
    if fresh:
        out["new"] = math.sqrt(sum(float(returned[k].double().pow(2).sum()) for k in fresh))
    return out


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
                self.declared[site] = _declared_counts(summary)
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

    def _check_samples(self, site: str, task: Task, reply: Reply, what: str) -> None:
        """A site's sample counts are the ones it declared at setup, never a reply's claim (nor are its steps
        per round, which a lockstep round waits for: they follow from the declared count and the run's settings).

        A task that names a split (evaluation) must be answered with that split's
        declared case count.  Any other reply may not claim more than the declared
        training cases, and must claim exactly them if its first reply of that kind
        did (FedAvg's n_k); kinds that report a step's batch (FGA) stay below it.
        """
        counts = self.declared.get(site)
        if counts is None:
            return
        n = reply.num_samples
        split = task.config.get("split")
        if isinstance(split, str) and SPLITS.get(split) in counts:
            want = counts[SPLITS[split]]
            if n != want:
                raise PayloadError(f"{what}: claims {n} {split} cases, but the site declared {want} at setup")
            return
        n_train = counts["training"]
        claim = reply.metrics.get("steps_per_round")
        if claim is not None and self.train is not None:  # a lockstep round lasts as long as its longest site
            want = steps_per_round(self.train, n_train)
            if claim != want:
                raise PayloadError(
                    f"{what}: claims {claim} steps per round, but the run's settings give {want} for the "
                    f"{n_train} training cases the site declared at setup"
                )
        if n > n_train:
            raise PayloadError(f"{what}: claims {n} training samples, but the site declared {n_train} at setup")
        exact = self._exact.setdefault((site, _task_key(task)), n == n_train)
        if exact and n != n_train:
            raise PayloadError(
                f"{what}: claims {n} training samples, but the site declared {n_train} at setup (and claimed them before)"
            )

    def _expand_means(self, site: str, task: Task, reply: Reply, what: str) -> Reply:
        """An evaluation reply of a site whose policy sends aggregates only (``mean``: each candidate's mean
        scores over its cases; ``test_mean`` likewise per test metric) as the per-case layout the engine reads:
        the mean once per case of the site's declared count.  Each site's mean, and every mean over cases
        pooled across sites, are then exact; a spread over the site's cases, paired per-case statistics and
        the per-case lists in results.json are not available for it (its cases all show its mean)."""
        n = reply.num_samples
        split = task.config.get("split")
        want = (self.declared.get(site) or {}).get(SPLITS.get(split or "", ""))
        if want is not None and n != want:
            raise PayloadError(f"{what}: claims {n} {split} cases, but the site declared {want} at setup")

        def expand(means: Any, label: str) -> dict[str, list[list[float]]]:
            if not isinstance(means, dict):
                raise PayloadError(f"{what}: {label} is a {type(means).__name__}, not {{candidate: mean scores}}")
            out: dict[str, Any] = {}
            for name, m in means.items():
                if m is None and n == 0:
                    out[name] = []
                elif isinstance(m, list) and n > 0:
                    out[name] = [list(m) for _ in range(n)]
                else:
                    raise PayloadError(f"{what}: {label} of {name!r} is {str(m)[:80]}, not one mean per metric")
            return out

        metrics = {k: v for k, v in reply.metrics.items() if k not in ("mean", "test_mean")}
        metrics["per_case"] = expand(reply.metrics["mean"], "mean")
        if "test_mean" in reply.metrics:
            test = reply.metrics["test_mean"]
            if not isinstance(test, dict):
                raise PayloadError(f"{what}: test_mean is a {type(test).__name__}, not a mapping")
            metrics["test_metrics"] = {k: expand(v, f"test_mean {k!r}") for k, v in test.items()}
        self.aggregated.add(site)
        return Reply(reply.arrays, metrics, n)

    def _check_scores(self, site: str, task: Task, reply: Reply, what: str) -> None:
        """Evaluation metrics: exactly the candidates asked for, the site's declared number of cases of the
        split, each case a list of ``num_metrics`` scores in [0, 1]; test metrics (``test_metrics``, e.g. HD95
        in mm) for the same candidates and cases, each a finite non-negative number."""
        per_case = reply.metrics.get("per_case")
        asked = [c.get("name") for c in task.config.get("candidates", [])]
        if not isinstance(per_case, dict) or sorted(per_case) != sorted(asked):
            got = sorted(per_case)[:5] if isinstance(per_case, dict) else type(per_case).__name__
            raise PayloadError(f"{what}: scores {got}, but was asked for the candidates {asked}")
        split = task.config.get("split")
        want = (self.declared.get(site) or {}).get(SPLITS.get(split or "", ""))
        for name, cases in per_case.items():
            if not isinstance(cases, list):
                raise PayloadError(f"{what}: scores of {name!r} are a {type(cases).__name__}, not a list of cases")
            if want is not None and len(cases) != want:
                raise PayloadError(
                    f"{what}: {len(cases)} {split} cases scored for {name!r}, but the site declared {want} at setup"
                )
            for case in cases:
                if (
                    not isinstance(case, list)
                    or not case
                    or (self.num_metrics is not None and len(case) != self.num_metrics)
                ):
                    raise PayloadError(
                        f"{what}: a case of {name!r} is {str(case)[:80]}, not a list of {self.num_metrics or 'the'} metric scores"
                    )
                if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0.0 <= x <= 1.0 for x in case):
                    raise PayloadError(f"{what}: a score of {name!r} is outside [0, 1]: {str(case)[:80]}")
        extra = reply.metrics.get("test_metrics", {})
        if not isinstance(extra, dict):
            raise PayloadError(f"{what}: test_metrics is a {type(extra).__name__}, not a mapping")
        for metric, by_cand in extra.items():
            if not isinstance(by_cand, dict) or sorted(by_cand) != sorted(asked):
                raise PayloadError(f"{what}: test metric {metric!r} does not score exactly the candidates {asked}")
            for name, cases in by_cand.items():
                if not isinstance(cases, list) or len(cases) != len(per_case[name]):
                    raise PayloadError(
                        f"{what}: test metric {metric!r} of {name!r} does not give one entry per scored case"
                    )
                for case in cases:  # distances: finite and non-negative, one per metric column
                    if not (
                        isinstance(case, list)
                        and len(case) == len(per_case[name][0] if per_case[name] else case)
                        and all(
                            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
                            for x in case
                        )
                    ):
                        raise PayloadError(
                            f"{what}: a case of test metric {metric!r} of {name!r} is {str(case)[:80]}, not a list "
                            "of finite non-negative numbers"
                        )

    def _check_names(self, tasks: dict[str, Task], decoded: dict[str, Reply]) -> None:
        """Reply tensor names must equal the expected set, and the metrics must carry the expected keys with
        values of the expected JSON kinds (number, string, list, object, bool; null stands for any): what every
        reply to the same task (kind, non-numeric settings, tensor names sent) carried before.  The first time
        a task is seen, the layout most of its replies carry (on a tie, the one whose tensor names equal the
        names sent, then the first site's in federation order) becomes the expected one."""
        groups: dict[str, list[str]] = {}
        for s in decoded:
            groups.setdefault(_task_key(tasks[s]), []).append(s)
        for key, members in groups.items():
            expected = self._names.get(key)
            if expected is None:
                layouts = [(frozenset(decoded[s].arrays), _metric_kinds(decoded[s].metrics)) for s in members]
                sent = frozenset(tasks[members[0]].arrays)
                distinct = list(dict.fromkeys(layouts))
                expected = max(distinct, key=lambda x: (layouts.count(x), x[0] == sent))
                self._names[key] = expected
            names, kinds = expected
            for s in members:
                got = frozenset(decoded[s].arrays)
                what = f"reply of site {s} to '{tasks[s].kind}'"
                if got != names:
                    missing, extra = sorted(names - got), sorted(got - names)
                    self._reject(
                        s,
                        tasks[s],
                        f"{what}: tensor names differ from the expected set (missing {missing[:5]}, unexpected {extra[:5]})",
                    )
                    del decoded[s]
                    continue
                bad = _metrics_mismatch(dict(kinds), _metric_kinds(decoded[s].metrics))
                if bad:
                    self._reject(s, tasks[s], f"{what}: metrics {bad}")
                    del decoded[s]

    def _local_steps(self, site: str, task: Task) -> int | None:
        """The local optimizer steps of a ``"train"`` task at ``site``, from the run's settings and the site's
        declared training count (None for other task kinds, or when either is unknown)."""
        counts = self.declared.get(site)
        if task.kind != "train" or self.train is None or counts is None:
            return None
        return steps_per_round(self.train, counts["training"])

    def _check_updates(self, tasks: dict[str, Task], decoded: dict[str, Reply]) -> None:
        """Reject a reply whose change (each part of :func:`update_norms`: the update ‖w_k − w‖ of what the task
        sent, the norm of what it returns new) is more than ``deploy.max_update_ratio`` times the median of the
        same part of the exchange's other replies of the same kind (the same top-level tensor groups) — or,
        where it has none (CWT visits one site at a time), of the other sites' last accepted ones.

        A training update is compared per √(local step): in epoch mode a site with 100× the cases of another
        takes 100× its steps, and its honest update is ~20× larger (measured: 4 vs 400 training cases,
        ``tests/test_deploy_adversarial.py::test_honest_site_with_many_more_cases_is_not_rejected``); the steps
        follow from the site's declared count, never from its reply."""
        ratio = self.params.max_update_ratio
        if not ratio:
            return
        norms = {s: update_norms(tasks[s].arrays, decoded[s].arrays) for s in decoded}
        steps = {s: self._local_steps(s, tasks[s]) for s in decoded}
        for s, n in norms.items():
            local = steps[s]
            if "delta" in n and local is not None:
                n["delta"] /= math.sqrt(local)
        kinds = {
            s: (tasks[s].kind, frozenset(k.split("/", 1)[0] for k, v in decoded[s].arrays.items() if is_float(v)))
            for s in decoded
        }
        bad: dict[str, str] = {}
        for part, what in (("delta", "update norm"), ("new", "update norm (of the tensors it returns new)")):
            sizes = {s: n[part] for s, n in norms.items() if part in n}
            for s, size in sizes.items():
                others = [v for k, v in sizes.items() if k != s and kinds[k] == kinds[s]] or [
                    v for k, v in self._norms.get((*kinds[s], part), {}).items() if k != s
                ]
                med = statistics.median(others) if others else 0.0
                if s not in bad and med > 0 and size > ratio * med:
                    per = " per √(local step)" if part == "delta" and steps[s] is not None else ""
                    bad[s] = (
                        f"reply of site {s} to '{tasks[s].kind}': {what}{per} {size:.4g} is {size / med:.3g}x the median "
                        f"{med:.4g} of the other sites' (deploy.max_update_ratio = {ratio:g})"
                    )
        for s, reason in bad.items():
            self._reject(s, tasks[s], reason)
            del decoded[s]
        for s, n in norms.items():
            if s not in bad:
                for part, v in n.items():
                    self._norms.setdefault((*kinds[s], part), {})[s] = v

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
    """``call`` into in-process :class:`~fedseg.apps.deploy.site.SiteRuntime` objects, through bytes (tests, benchmarks).

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
