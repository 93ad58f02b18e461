"""FedSM under secure aggregation (``privacy.secure_aggregation = true``): the server learns sums only.

Each round's ``"train"`` reply is one secure sum (:func:`fedseg.algorithms.secure.secure_ask`) of

* the global model, weighted by the public n_k (``fedsm.weighting``): Σ n_k w_{g,k}, whose mean is
  Alg. 1 line 15;
* the personalized models, unweighted, under one name for every site (``personal_sum/…``):
  S = Σ_k w_{p,k};
* with ``fedsm.selector_training = "fedavg"`` or ``"fedrs"``, the selector (and its shared Adam moments),
  weighted by ``fedsm.selector_weighting``.

The server then sends S and the list of summed sites back (task ``"fedsm_pull"``), and each site forms
its own SoftPull model, λ w_{p,k} + (1 − λ)/(K − 1) · (S − w_{p,k})
(:func:`fedseg.algorithms.softpull.soft_pull_from_sum`), which it keeps: the server holds no personalized
model.  The selector trained by lockstep gradient averaging (``"fga"``, the default) and the global model
under ``fedsm.global_training = "fga"`` are secure sums per step already
(:func:`fedseg.algorithms.lockstep.lockstep_round`).

Validation and test.  A site validates its own personalized model where it is (predictor
``"fedsm-held"``), and on every evaluation round keeps the best one by that same validation score
(strictly better, as the engine's best round) in its saved store.  FedSM's output is the composite of
the global model, the selector and *every* site's personalized model, which Alg. 2 routes each image to:
after the last round each site releases its best personalized model (task ``"fedsm_release"``) and the
composite is assembled from them as without secure aggregation; these final models are what the server
sees of the personalized models.  During training the composite is not validated (it would need the
models the server does not hold).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

from fedseg.algorithms.secure import secure_ask
from fedseg.algorithms.softpull import soft_pull_from_sum
from fedseg.foundation.arrays import Arrays, clone, prefixed, strip_prefix
from fedseg.foundation.errors import PayloadError
from fedseg.foundation.messages import Reply, Task
from fedseg.seams.algorithm import Algorithm, Candidate, ServerContext
from fedseg.site.runtime import Site, dataset_len

__all__ = [
    "HELD",
    "PERSONAL_SUM",
    "held_candidates",
    "held_predictor",
    "pull",
    "release",
    "release_round",
    "train_round",
    "unsupported",
    "validation_score",
]

PERSONAL_SUM = "personal_sum"
"""Name prefix of a site's personalized model in a masked ``"train"`` reply (the same for every site, so
that the sum is S = Σ_k w_{p,k}) and of S in the ``"fedsm_pull"`` task."""

HELD = "fedsm-held"
"""Predictor kind of a personalized model held at its site (validated there)."""

_BEST = "fedsm_best_personal"  # site.store: the best personalized model so far and its validation score


def unsupported(alg: Any) -> str | None:
    """Why this FedSM variant (``alg``: a :class:`~fedseg.algorithms.fedsm.method.FedSM`) needs one site's
    arrays at the server under secure aggregation, or None."""
    p = alg.params
    if alg.two_phase:
        return (
            "its selector phase sends every site's frozen personalized model to every site, and those models are "
            "what secure aggregation keeps at their sites (use method fedsm)"
        )
    if p.personalization != "softpull":
        return f"fedsm.personalization = {p.personalization!r} is not a sum (use --set fedsm.personalization=softpull)"
    if p.selector_training == "fedaws":
        return (
            "fedsm.selector_training = 'fedaws' sets each class embedding of the selector from its own site's selector "
            "(use --set fedsm.selector_training=fga)"
        )
    if p.aggregation != "mean":
        return (
            f"fedsm.aggregation = {p.aggregation!r} ranks the sites' values coordinate by coordinate "
            "(use --set fedsm.aggregation=mean)"
        )
    return None


# ----------------------------------------------------------------- on the server
def train_round(
    alg: Any, ctx: ServerContext, tasks: dict[str, Task], new: Arrays, rnd: int, train_models: bool, train_sel: bool
) -> dict[str, Reply]:
    """The round's ``"train"`` tasks as one secure sum (module doc), the global model's and the selector's
    means into ``new``, then S to the summed sites (``"fedsm_pull"``); returns the summed replies (metrics
    only).  ``new`` loses the initial personalized models the first round sends."""
    p = alg.params
    by_prefix = {f"{PERSONAL_SUM}/": "even"}
    if train_sel:
        by_prefix.update({"selector/": p.selector_weighting, "selector_optim/": p.selector_weighting})
    result = secure_ask(ctx, tasks, p.weighting, by_prefix)
    if len(result.replies) == 0:
        raise PayloadError(f"{alg.name}: no site's masked input was summed in round {rnd}")
    if result.rejected:  # a replayed or misdirected masked input: no aggregate and no SoftPull this round
        kept = [
            name
            for name, on in (("global model", train_models and not alg.global_by_fga), ("selector", train_sel))
            if on
        ]
        ctx.log(
            f"[secagg] {alg.name} round {rnd}: "
            + (f"the {' and '.join(kept)} keep{'' if len(kept) > 1 else 's'} the previous weights; " if kept else "")
            + "each site keeps the personalized model it trained (no SoftPull this round)"
        )
        for k in [k for k in new if k.startswith("personal/")]:
            del new[k]
        return result.replies
    mean = result.mean()  # the global model: Σ n_k w_k / Σ n_k (fedsm.weighting)
    if train_models and not alg.global_by_fga:
        new.update({k: v for k, v in mean.items() if k.startswith("global/")})
    if train_sel:
        for prefix in ("selector", "selector_optim"):
            part = strip_prefix(prefix, result.total)
            if part:
                w = result.weight_of(p.selector_weighting)
                new.update(prefixed(prefix, {k: _mean(v, w, result.dtypes[f"{prefix}/{k}"]) for k, v in part.items()}))
    for k in [k for k in new if k.startswith("personal/")]:
        del new[k]  # the sites hold their personalized models from now on
    if train_models:
        summed = [s for s in ctx.sites if s in result.replies]
        total = {k: v for k, v in result.total.items() if k.startswith(f"{PERSONAL_SUM}/")}
        config = {"round": rnd, "sites": summed, "validate": ctx.is_eval_round(rnd)}
        ctx.ask({s: Task("fedsm_pull", total, config) for s in summed})
    return result.replies


def _mean(total: torch.Tensor, weight: float, dtype: str) -> torch.Tensor:
    t = getattr(torch, dtype)
    return (total / weight).to(t) if t.is_floating_point else total.to(t)


def held_candidates(sites: tuple[str, ...] | list[str]) -> list[Candidate]:
    """Each site's personalized model, validated where it is held (:func:`held_predictor`)."""
    return [
        Candidate(f"personal/{s}", {}, predictor=HELD, val_sites=(s,), home_site=s, config={"bn_role": "personal"})
        for s in sites
    ]


def release_round(ctx: ServerContext) -> dict[str, Arrays]:
    """After the last round: each site's best personalized model (``"fedsm_release"``), for the composite."""
    # the site's name in the task: each site's reply has names of its own (personal/<site>/…)
    replies = ctx.ask({s: Task("fedsm_release", {}, {"site": s}) for s in ctx.sites}, optional=True)
    return {s: strip_prefix(f"personal/{s}", r.arrays) for s, r in replies.items()}


# ------------------------------------------------------------------- at a site
def validation_score(per_case: list[list[float]]) -> float:
    """A candidate's validation score on one site's cases as the engine computes it: the mean over the cases
    of each case's mean over the metric's channels (both of the engine's best criteria on one site)."""
    case_means = [sum(case) / len(case) for case in per_case]
    return sum(case_means) / len(case_means)


def _predict(site: Site) -> Callable[[torch.Tensor], torch.Tensor]:
    model = site.model("personal")
    model.eval()
    return lambda x: site.workload.predict(model, x)


def pull(site: Site, task: Task) -> Reply:
    """``"fedsm_pull"``: SoftPull of the site's personalized model from S (module doc); on an evaluation
    round, its validation score, and the model kept in the site's store when the score is its best."""
    lam = float(cast(Algorithm, site.algorithm).params.lam)
    summed = list(task.config.get("sites", []))
    if site.name not in summed:
        raise PayloadError(f"site {site.name}: asked to pull its personalized model but not among the summed {summed}")
    total = strip_prefix(PERSONAL_SUM, task.arrays)
    own = site.arrays("personal")
    if sorted(total) != sorted(own):
        raise PayloadError(f"site {site.name}: the sum of the personalized models does not have the model's names")
    site.load("personal", soft_pull_from_sum(own, total, len(summed), lam))
    metrics: dict[str, Any] = {}
    if task.config.get("validate") and dataset_len(site.data.val) > 0:
        score = validation_score(site.score(_predict(site), "validation").tolist())
        best = site.store.get(f"{_BEST}_score")
        if best is None or score > float(best):
            site.store.update(prefixed(_BEST, clone(site.arrays("personal"))))
            site.store[f"{_BEST}_score"] = torch.tensor(score, dtype=torch.float64)
        metrics["personal_val"] = score
    return Reply(metrics=metrics, num_samples=site.num_train)


def release(site: Site, task: Task) -> Reply:
    """``"fedsm_release"``: the site's best personalized model by its validation (its current one without
    validation cases), for FedSM's composite."""
    if task.config.get("site") != site.name:
        raise PayloadError(f"site {site.name}: asked to release the personalized model of {task.config.get('site')!r}")
    best = strip_prefix(_BEST, site.store)
    arrays = best if best else site.arrays("personal")
    return Reply(arrays=prefixed(f"personal/{site.name}", clone(arrays)), num_samples=site.num_train)


def held_predictor(site: Site, arrays: Arrays, config: dict) -> Callable[[torch.Tensor], torch.Tensor]:
    """The ``"fedsm-held"`` predictor: the site's own personalized model as it holds it now."""
    if "personal" not in site.models:
        raise PayloadError(f"site {site.name}: holds no personalized model to evaluate yet")
    return _predict(site)
