"""FedSM's model selection (Alg. 2) at the sites and on the server: the selector's roles and its
optimizer moments as arrays, composite inference (γ-gated routing, argmax, the ensemble mix),
routing statistics of a composite (only sums and counts leave a site), and the choice of γ.

The maths (``route``, ``routing_accuracy``, ``oracle_labels``, ``ensemble_mix``) is in
:mod:`fedseg.algorithms.softpull`; this module applies it to a site's data and models.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fedseg.algorithms.softpull import ensemble_mix, oracle_labels, route
from fedseg.foundation.arrays import Arrays, check_compatible, strip_prefix
from fedseg.foundation.errors import PayloadError
from fedseg.foundation.messages import Task
from fedseg.seams.algorithm import Candidate
from fedseg.seams.transport import Transport
from fedseg.site.batches import dataset_len
from fedseg.site.runtime import Site

__all__ = [
    "SelectorFactory",
    "check_route_metrics",
    "classes_of",
    "composite_predict",
    "load_by_reference",
    "load_composite",
    "mean_routing",
    "oracle_accuracy",
    "pick_gamma",
    "pick_gamma_per_model",
    "route_task",
    "selector_probs",
    "selector_role",
    "thresholds",
]

PER_MODEL = "per-model"
"""The ``gamma`` of a ``"route"`` selection made with the composite's per-model thresholds."""

SelectorFactory = Callable[[Site, int], Callable[[], nn.Module]]
"""``factory(site, num_classes)``: the site's builder of a fresh selector with ``num_classes`` outputs."""


# --------------------------------------------------------------- selector roles
def selector_role(num_classes: int, prefix: str = "") -> str:
    """Role name of a selector with ``num_classes`` outputs (the count is part of the
    name so that a restarted site can rebuild the right shape before loading weights)."""
    return f"{prefix}selector@{num_classes}"


def classes_of(role: str) -> int | None:
    """The output count of a selector role (:func:`selector_role`), None for any other role."""
    head, sep, tail = role.rpartition("@")
    if sep and head.endswith("selector") and tail.isdigit():
        return int(tail)
    return None


# ------------------------------------------------------------------ at a site
@torch.no_grad()
def selector_probs(site: Site, selector: nn.Module, split: str) -> torch.Tensor:
    """(N, C) float64 softmax of ``selector`` over a split's images (eval mode)."""
    selector.eval()
    out = [torch.softmax(selector(x).double(), dim=1) for x, _ in site.eval_batches(split)]
    return torch.cat(out).cpu() if out else torch.zeros(0, 1, dtype=torch.float64)


@torch.no_grad()
def oracle_accuracy(site: Site, selector: nn.Module, models: Sequence[nn.Module], split: str) -> float:
    """Fraction of a split's images whose selector argmax is Eq. 1's label (the model of ``models`` —
    global first, then the personalized ones — with the lowest workload loss on the image, each predicting
    as the workload evaluates: sliding windows over volumes); NaN if empty."""
    ds = site.data.split(split)
    n = dataset_len(ds)
    if n == 0:
        return float("nan")
    was = selector.training
    selector.eval()
    hits = 0
    for x, y in site.eval_batches(split, cast_labels=True):
        labels = oracle_labels([site.workload.predict(m, x) for m in models], y, site.workload.loss)
        hits += int((selector(x).argmax(dim=1) == labels).sum())
    selector.train(was)
    return hits / n


def load_composite(
    site: Site, arrays: Arrays, config: Mapping[str, Any], factory: SelectorFactory, prefix: str
) -> tuple[nn.Module, list[nn.Module]]:
    """Selector and models [global, personal_1 … personal_K] of a composite payload, loaded at the site
    (:func:`load_by_reference`: the payload's tensors become the models' weights)."""
    c = int(config["num_classes"])
    role = selector_role(c, prefix)
    sel = load_by_reference(site, role, strip_prefix("selector", arrays), factory(site, c))
    # under train.bn_policy = "local": the site's own running statistics — those of its
    # personalized model for its own, those of its global model for the others
    models = [load_by_reference(site, f"{prefix}global", strip_prefix("global", arrays), bn_from="global")]
    for j, s in enumerate(config["sites"]):
        models.append(
            load_by_reference(
                site,
                f"{prefix}p{j}",
                strip_prefix(f"personal/{s}", arrays),
                bn_from="personal" if s == site.name else "global",
            )
        )
    sel.eval()
    for m in models:
        m.eval()
    return sel, models


def load_by_reference(
    site: Site, role: str, arrays: Arrays, factory: Callable[[], nn.Module] | None = None, bn_from: str | None = None
) -> nn.Module:
    """:meth:`Site.load` of a model that only evaluates, without the copy: after the same checks (names, shapes,
    dtypes) the arrays become the role's weights (``load_state_dict(assign=True)``; moved only when on another
    device).  The arrays must be the site's own and unchanged while the model is used: a task's payload, which the
    transport hands to this site alone, or a checkpoint's.  Under ``train.bn_policy = "local"`` the payload lacks
    the running statistics, which come from the site's role ``bn_from``: :meth:`Site.load` copies them."""
    if site.cfg.train.bn_policy == "local":
        return site.load(role, arrays, factory, bn_from=bn_from)
    model = site.model(role, factory)
    own = model.state_dict()
    check_compatible(own, arrays, what=f"site {site.name}: model '{role}'")
    model.load_state_dict({k: v.to(own[k].device) for k, v in arrays.items()}, assign=True)
    return model


def thresholds(config: Mapping[str, Any], gamma: float | None = None) -> float | list[float]:
    """What a composite's ``config`` routes with (Alg. 2): its per-personalized-model thresholds
    (``gamma_per_model``, set under ``fedsm.gamma = "auto-per-model"``) or its one γ (``gamma``, 0.9 when
    absent); a given ``gamma`` overrides both."""
    if gamma is not None:
        return float(gamma)
    per = config.get("gamma_per_model")
    return [float(g) for g in per] if per is not None else float(config.get("gamma", 0.9))


def composite_predict(
    site: Site, sel: nn.Module, models: list[nn.Module], mode: str, gamma: float | Sequence[float]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The composite's prediction (Alg. 2): per image, the model the selector routes to — ``"gate"``:
    the personalized model of the top class when its probability exceeds γ, else the global model;
    ``"argmax"``: the top class (K + 1 classes, FedSM-extra) — or ``"mix"``: the ensemble's
    softmax-weighted mix of every model's output."""
    wl = site.workload

    @torch.no_grad()
    def predict(x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(sel(x), dim=1)
        if mode == "mix":
            return ensemble_mix(probs, [wl.predict(m, x) for m in models])
        return predict_routed(site, models, x, route(probs, gamma) if mode == "gate" else probs.argmax(dim=1))

    return predict


def predict_routed(site: Site, models: Sequence[nn.Module], x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Each image ``x[i]`` segmented by ``models[idx[i]]`` (one forward pass per model used)."""
    out: torch.Tensor | None = None
    for j in idx.unique().tolist():
        mask = idx == j
        o = site.workload.predict(models[j], x[mask])
        if out is None:
            out = o.new_zeros((x.shape[0], *o.shape[1:]))
        out[mask] = o
    assert out is not None
    return out


# ----------------------------------------------------------------- on the server
def check_route_metrics(config: Mapping[str, Any], metrics: Mapping[str, Any]) -> None:
    """Raise :class:`PayloadError` unless ``metrics`` is what :func:`.validation.route_stats` returns for a route
    task of ``config``: ``n`` a count, ``routing_acc`` null or in [0, 1], ``dice_sum_per_model`` K + 1 sums in
    [0, n] (null with ``per_model = false``), ``candidate_sums`` (asked with ``candidates``) the global and the
    site's personalized model's sums in [0, n] (the latter null at a site outside the federation), and one selection per γ asked (plus the per-model one when the config has thresholds; one
    for argmax / mix) with ``dice_sum`` in [0, n], ``counts`` K + 1 counts adding up to n and, γ-gated,
    ``dice_sum_by_top`` K sums in [0, n] adding up to ``dice_sum`` (and ``n_by_top``, K counts adding up to
    n).  A deployed site's reply is checked before the server reads it (``Algorithm.check_reply``): a malformed one is rejected, not a crash."""
    sites = list(config.get("sites", []))
    k = int(config.get("num_classes", len(sites)))
    models = len(sites) + 1
    gate = config.get("mode", "gate") == "gate"
    want = (len(config.get("gammas", [])) + (config.get("gamma_per_model") is not None)) if gate else 1
    n = metrics.get("n")

    def bad(what: str) -> PayloadError:
        return PayloadError(f"route reply: {what}")

    def number(x: Any, hi: float) -> bool:
        return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and -1e-9 <= x <= hi + 1e-9

    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise bad(f"n = {str(n)[:40]} is not a case count")
    acc = metrics.get("routing_acc")
    if acc is not None and not number(acc, 1.0):
        raise bad(f"routing_acc = {str(acc)[:40]} is not null or in [0, 1]")
    per_model = metrics.get("dice_sum_per_model")
    if not config.get("scores", True):  # routing only: counts, nothing scored
        _check_counts_only(metrics, want, models, n, bad)
        return
    if not config.get("per_model", True):
        if per_model is not None:
            raise bad("dice_sum_per_model was not asked for (per_model = false) and must be null")
    elif not isinstance(per_model, list) or len(per_model) != models or not all(number(x, n) for x in per_model):
        raise bad(f"dice_sum_per_model is not {models} sums in [0, {n}]")
    if config.get("candidates"):
        sums = metrics.get("candidate_sums")
        own = sums.get("personal", 0.0) if isinstance(sums, dict) else None
        if (
            not isinstance(sums, dict)
            or set(sums) != {"global", "personal"}
            or not number(sums["global"], n)
            or not (own is None or number(own, n))
        ):
            raise bad(f"candidate_sums is not the global and personalized models' sums in [0, {n}]: {str(sums)[:80]}")
    by_top_n = metrics.get("n_by_top")
    if gate and (
        not isinstance(by_top_n, list)
        or len(by_top_n) != k
        or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in by_top_n)
        or sum(by_top_n) != n
    ):
        raise bad(f"n_by_top is not {k} counts adding up to n = {n}: {str(by_top_n)[:80]}")
    sels = metrics.get("selections")
    if not isinstance(sels, list) or len(sels) != want:
        raise bad(f"{len(sels) if isinstance(sels, list) else 'no'} selections, expected {want}")
    for sel in sels:
        if not isinstance(sel, dict) or not number(sel.get("dice_sum"), n):
            raise bad(f"a selection's dice_sum is not in [0, {n}]: {str(sel)[:80]}")
        counts = sel.get("counts")
        if (
            not isinstance(counts, list)
            or len(counts) != models
            or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts)
            or sum(counts) != n
        ):
            raise bad(f"a selection's counts are not {models} counts adding up to n = {n}: {str(counts)[:80]}")
        if gate:
            by_top = sel.get("dice_sum_by_top")
            if (
                not isinstance(by_top, list)
                or len(by_top) != k
                or not all(number(x, n) for x in by_top)
                or abs(sum(by_top) - sel["dice_sum"]) > 1e-6 * max(1, n)
            ):
                raise bad(
                    f"a selection's dice_sum_by_top is not {k} sums adding up to its dice_sum: {str(by_top)[:80]}"
                )


def _check_counts_only(metrics: Mapping[str, Any], want: int, models: int, n: int, bad: Any) -> None:
    """The rest of :func:`check_route_metrics` for a ``scores = false`` reply (:func:`_routing_only`)."""
    if metrics.get("dice_sum_per_model") is not None or metrics.get("n_by_top") is not None:
        raise bad("dice_sum_per_model and n_by_top were not asked for (scores = false) and must be null")
    sels = metrics.get("selections")
    if not isinstance(sels, list) or len(sels) != want:
        raise bad(f"{len(sels) if isinstance(sels, list) else 'no'} selections, expected {want}")
    for sel in sels:
        counts = sel.get("counts") if isinstance(sel, dict) else None
        if not isinstance(sel, dict) or sel.get("dice_sum") is not None:
            raise bad(f"a selection's dice_sum was not asked for (scores = false): {str(sel)[:80]}")
        if (
            not isinstance(counts, list)
            or len(counts) != models
            or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts)
            or sum(counts) != n
        ):
            raise bad(f"a selection's counts are not {models} counts adding up to n = {n}: {str(counts)[:80]}")


def mean_routing(accs: Mapping[str, Any] | None) -> float | None:
    """Mean over sites of the per-site routing accuracies (None / NaN left out); None if there is none."""
    vals = [float(v) for v in (accs or {}).values() if v is not None and not math.isnan(float(v))]
    return sum(vals) / len(vals) if vals else None


def route_task(
    transport: Transport,
    candidate: Candidate,
    sites: Sequence[str],
    split: str,
    gammas: Sequence[float | None],
    per_model: bool = True,
    scores: bool = True,
    optional: bool = False,
    candidates: bool = False,
) -> dict[str, dict[str, Any]]:
    """Ask ``sites`` for the routing statistics of a ``"fedsm"`` candidate on ``split``; returns ``{site: metrics}``.
    ``per_model = False``: without each model's Dice (:func:`.validation.route_stats`), what choosing γ needs; ``scores =
    False``: where the selector sends the cases and nothing scored (the selector alone runs); ``optional``: the
    sites that answer validly, however few (a deployment's ``deploy.min_sites`` not applied); ``candidates`` (with
    ``per_model = False``): each site's sums of the global and its own personalized model's scores too, from the
    same pass over its cases (:func:`.validation.one_pass`)."""
    config = {**candidate.config, "split": split, "gammas": [float(g) for g in gammas if g is not None]}
    if not per_model:
        config["per_model"] = False
    if not scores:
        config["scores"] = False
    if candidates:
        config["candidates"] = True
    replies = transport.ask({s: Task("route", dict(candidate.arrays), config) for s in sites}, optional=optional)
    return {s: r.metrics for s, r in replies.items()}


def _validation_cases(replies: Mapping[str, Mapping[str, Any]], criterion: str) -> tuple[list[Mapping[str, Any]], int]:
    """The route replies with validation cases and their total case count, for choosing γ by ``criterion``
    (``eval.best_criterion``: ``"cases"`` or ``"sites"``); a ValueError naming the fix otherwise."""
    if criterion not in ("cases", "sites"):
        raise ValueError(f"criterion = {criterion!r}; use 'cases' or 'sites' (eval.best_criterion)")
    with_cases = [r for r in replies.values() if r["n"]]
    if not with_cases:
        raise ValueError("no cases to choose gamma on: the sites' validation splits are empty")
    return with_cases, sum(r["n"] for r in with_cases)


def pick_gamma(
    replies: Mapping[str, Mapping[str, Any]], gammas: Sequence[float], criterion: str = "cases"
) -> tuple[float, float]:
    """γ with the best validation Dice (first of ties); returns (γ, Dice).

    ``criterion`` is the run's ``eval.best_criterion``: ``"cases"``, the mean over the pooled
    cases Σ_sites dice_sum / Σ_sites n; ``"sites"``, the mean over the sites with cases of their
    mean dice_sum / n (the papers' client average)."""
    with_cases, total_n = _validation_cases(replies, criterion)
    best: tuple[float, float] | None = None
    for i, g in enumerate(gammas):
        if criterion == "sites":
            dice = sum(r["selections"][i]["dice_sum"] / r["n"] for r in with_cases) / len(with_cases)
        else:
            dice = sum(r["selections"][i]["dice_sum"] for r in with_cases) / total_n
        if best is None or dice > best[1]:
            best = (float(g), dice)
    assert best is not None
    return best


def pick_gamma_per_model(
    replies: Mapping[str, Mapping[str, Any]], gammas: Sequence[float], criterion: str = "cases", margin: float = 0.0
) -> tuple[list[float], float]:
    """One γ per personalized model (``fedsm.gamma = "auto-per-model"``), each the best of ``gammas`` on
    validation; returns (the K thresholds, the validation Dice they give).

    A case's routed model depends only on the threshold of its top class j (Alg. 2 with γ_j), so the
    validation Dice — a weighted sum over cases (``criterion`` as in :func:`pick_gamma`: weight 1/N of all
    cases, or 1/(n_site · sites) per site's case) — splits into one term per j: the weighted sum of
    ``dice_sum_by_top[j]`` over the sites.  Maximizing each term on its own maximizes the sum; one
    common γ is one choice of the vector, so this Dice is never below :func:`pick_gamma`'s.  Ties keep the
    earlier γ of the grid.  A personalized model that is no case's top class keeps the grid's first γ.

    ``margin`` > 0 (``fedsm.gamma_margin``; ``gammas`` must hold 1.0): model j keeps the best γ only where it
    beats γ_j = 1 (every case of top class j to the global model) by at least ``margin`` in the mean Dice of
    those cases — by the same weights, (d(γ) − d(1)) / Σ weight · ``n_by_top[j]`` ≥ ``margin`` — and gets 1
    otherwise."""
    with_cases, total_n = _validation_cases(replies, criterion)
    if margin > 0 and 1.0 not in gammas:
        raise ValueError(f"margin = {margin} needs 1.0 in the γ grid {list(gammas)} (all to the global model)")
    weight = [1 / total_n if criterion == "cases" else 1 / (r["n"] * len(with_cases)) for r in with_cases]
    k = len(with_cases[0]["selections"][0]["dice_sum_by_top"])
    chosen: list[float] = []
    total = 0.0
    for j in range(k):
        d = [
            sum(w * r["selections"][i]["dice_sum_by_top"][j] for w, r in zip(weight, with_cases))
            for i in range(len(gammas))
        ]
        i = max(range(len(gammas)), key=d.__getitem__)  # the first of ties
        if margin > 0 and gammas[i] != 1.0:
            one = list(gammas).index(1.0)
            cases = sum(w * r["n_by_top"][j] for w, r in zip(weight, with_cases))
            if d[i] - d[one] < margin * cases:
                i = one
        chosen.append(float(gammas[i]))
        total += d[i]
    return chosen, total
