"""The checks on every reply a :class:`~fedseg.deployment.transport.RemoteTransport` receives (its module
says the fault rule they serve): sample counts against the site's setup declaration, evaluation scores
against the schema (a site's per-site means expanded to the per-case layout), reply layouts against every
other reply to the same task, and update norms against the median of the other sites'.  A rejected reply
is left out of its exchange by the transport (:meth:`ReplyChecks._reject`)."""

from __future__ import annotations

import json
import math
import statistics
from typing import Any

from fedseg.deployment.params import DeployParams
from fedseg.foundation.arrays import Arrays, is_float
from fedseg.foundation.config import TrainConfig
from fedseg.foundation.errors import PayloadError
from fedseg.foundation.messages import SPLITS, Reply, Task
from fedseg.site.batches import steps_per_round


def declared_counts(summary: dict[str, Any]) -> dict[str, int]:
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


class ReplyChecks:
    """The reply checks of :class:`~fedseg.deployment.transport.RemoteTransport`, which holds their
    state (declared in the annotations below) and records each rejection (:meth:`_reject`)."""

    params: DeployParams
    train: TrainConfig | None
    num_metrics: int | None
    declared: dict[str, dict[str, int]]
    aggregated: set[str]
    _exact: dict[tuple[str, str], bool]
    _names: dict[str, tuple[frozenset[str], tuple]]
    _norms: dict[tuple[str, frozenset[str], str], dict[str, float]]

    def _reject(self, site: str, task: Task, error: BaseException | str) -> None:
        """Leave ``site`` out of the exchange of ``task`` for ``error`` (the transport's)."""
        raise NotImplementedError

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
        takes 100× its steps, and its honest update is many times larger
        (``tests/deploy/test_deploy_adversarial.py::test_honest_site_with_many_more_cases_is_not_rejected``); the steps
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
