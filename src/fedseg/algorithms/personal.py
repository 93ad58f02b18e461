"""Machinery shared by the personalization methods (FT, APFL, Per-FedAvg, pFedMe, Ditto).

Each personalization method keeps one personalized model per site (``site.models
["personal"]``, saved with the site) and reports it to the server only on the
rounds the engine evaluates (:func:`is_eval_round`), so that the other rounds
cost no extra bytes.  The server keeps the latest personalized models in its flat
state under ``personal/<site>/...`` and offers them as candidates with
``home_site=<site>`` (:func:`personal_candidates`): with ``primary = None`` the
method's row is each site's personalized model on its own test set, and the
model × site matrix in ``results["rows"]`` shows how they fare on the other sites.
The global model, where a method has one, is the candidate ``global``.

The site-side "personal steps" are plain functions of (site, global arrays,
round, settings) so that another framework (FedSM's personalization ablation)
can call them directly: :func:`finetune` here (FT, Per-FedAvg's adaptation step),
:func:`fedseg.algorithms.ditto.personal_step`, :func:`fedseg.algorithms.pfedme.local_round`,
:func:`fedseg.algorithms.apfl.local_round`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fedseg.algorithms.base import Candidate, ServerContext
from fedseg.algorithms.fedavg import aggregation_weights
from fedseg.core.arrays import Arrays, prefixed, strip_prefix, weighted_mean
from fedseg.core.config import RunConfig
from fedseg.core.errors import ConfigError
from fedseg.core.messages import Reply
from fedseg.core.site import Site

__all__ = [
    "aggregate_global",
    "check_nonneg_int",
    "check_positive",
    "check_weighting",
    "finetune",
    "is_eval_round",
    "local_work",
    "personal_candidates",
    "store_personal",
]


def is_eval_round(cfg: RunConfig, rnd: int) -> bool:
    """True on the rounds the engine validates (every ``eval.every`` rounds and the last one)."""
    return rnd % cfg.eval.every == 0 or rnd == cfg.rounds


def check_weighting(section: str, weighting: str) -> None:
    """Raise ConfigError unless ``weighting`` is 'samples' or 'even'."""
    if weighting not in ("samples", "even"):
        raise ConfigError(f"{section}.weighting = {weighting!r}; use 'samples' (n_k / n) or 'even' (1 / K)")


def aggregate_global(replies: Mapping[str, Reply], weighting: str, prefix: str = "global") -> Arrays:
    """FedAvg's Σ_k p_k w^{(k)} over the replies' ``prefix/...`` arrays, still prefixed."""
    names = list(replies)
    p = aggregation_weights([replies[s].num_samples for s in names], weighting)
    return prefixed(prefix, weighted_mean([strip_prefix(prefix, replies[s].arrays) for s in names], p))


def store_personal(state: Arrays, replies: Mapping[str, Reply], prefix: str = "personal") -> None:
    """Copy each reply's ``prefix/...`` arrays into ``state`` as ``prefix/<site>/...`` (in place)."""
    for s, rep in replies.items():
        own = strip_prefix(prefix, rep.arrays)
        if own:
            state.update(prefixed(f"{prefix}/{s}", own))


def personal_candidates(state: Arrays, ctx: ServerContext, with_global: bool = True) -> list[Candidate]:
    """``global`` (if present and wanted) and ``personal/<site>`` (home_site = site, validated on its site only)."""
    out = []
    if with_global:
        g = strip_prefix("global", state)
        if g:
            out.append(Candidate("global", g))
    for s in ctx.sites:
        own = strip_prefix(f"personal/{s}", state)
        if own:
            out.append(Candidate(f"personal/{s}", own, val_sites=(s,), home_site=s))
    return out


def finetune(
    site: Site,
    arrays: Arrays,
    rnd: int,
    steps: int,
    lr: float | None = None,
    optimizer: str = "train",
    role: str = "personal",
    stream: str = "finetune",
) -> tuple[Arrays, dict[str, Any]]:
    """Copy ``arrays`` into the site's ``role`` model and train it ``steps`` steps on local data.

    Parameters
    ----------
    site
        The site (its training split, seeded batches from stream ``stream``).
    arrays
        Starting weights (the global model).
    rnd
        Round number (keys the random stream).
    steps
        Optimizer steps; 0 returns ``arrays``' values unchanged.
    lr
        Learning rate (None: ``train.lr``).
    optimizer
        ``"train"``: a fresh optimizer of the run's kind (``train.optimizer``, Adam by
        default) — FT; ``"sgd"``: plain gradient descent w ← w − lr ∇f — Per-FedAvg's
        adaptation step.
    role, stream
        Model role and random stream name.

    Returns
    -------
    (arrays, metrics)
        The fine-tuned weights (those shared with the server) and ``{"loss", "steps"}``.
    """
    model = site.load(role, arrays)
    if steps <= 0:
        return site.arrays(role), {"loss": None, "steps": 0}
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=lr or site.cfg.train.lr, momentum=0.0)
    else:
        opt = site.optimizer(role, reset=True, lr=lr)
    metrics = site.fit(role, rnd, stream=stream, optimizer=opt, steps=steps)
    return site.arrays(role), metrics


def personalize_handler(params_cls: type, step: Any) -> Any:
    """Site half of a ``personalize`` task for a method whose personalization is ``step``.

    ``step(site, global_arrays, round, params) -> (arrays, metrics)`` is applied to the
    sent ``global/`` model; the reply carries the result under ``personal/``.
    """

    def handle(site: Site, task: Any) -> Reply:
        params = params_cls(**task.config["params"])
        arrays, metrics = step(site, strip_prefix("global", task.arrays), task.config["round"], params)
        return Reply(arrays=prefixed("personal", arrays), metrics=metrics, num_samples=site.num_train)

    return handle


def local_work(site: Site, steps: int | None) -> int:
    """Steps of one round of local work (``steps`` if given, else the run's ``train.local_*``)."""
    return site.steps_per_round() if steps is None else steps


def check_nonneg_int(section: str, key: str, value: int | None, allow_none: bool = True) -> None:
    if value is None:
        if not allow_none:
            raise ConfigError(f"{section}.{key} must be set to an integer >= 0")
        return
    if value < 0:
        raise ConfigError(
            f"{section}.{key} = {value}; it must be >= 0"
            + (" (or none for one round of local work)" if allow_none else "")
        )


def check_positive(section: str, key: str, value: float | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or not (value > 0.0 and value < float("inf")):
        raise ConfigError(f"{section}.{key} = {value}; it must be a finite number > 0")
