"""pFedMe (T. Dinh, Tran, Nguyen, "Personalized Federated Learning with Moreau Envelopes",
NeurIPS 2020), Algorithm 1 — "Per-FedMe" in the FedSM paper's Table 6.

Bi-level problem (paper Eq. 2–3): the personal model of site i is

    θ̂_i(w) = argmin_θ  f_i(θ) + λ/2 ||θ − w||²

and the local model w_i descends the Moreau envelope, whose gradient is λ (w − θ̂_i(w)).
Round t: the site sets w_{i,0} = w_t, θ = w_t, and for each of its R local steps
(one batch D each):

1. inner solve, K steps of gradient descent on the same batch (Alg. 1 line 7;
   the authors' ``pFedMeOptimizer``):  θ ← θ − η_p (∇f_i(θ; D) + λ (θ − w_{i,r}))
   (θ is warm-started across the batches of a round, as in the authors' code);
2. outer step (line 8):  w_{i,r+1} = w_{i,r} − η λ (w_{i,r} − θ̂).

Server (line 12):  w_{t+1} = (1 − β) w_t + β Σ_i p_i w_{i,R}   (p_i = n_i / n, the
authors' ``persionalized_aggregate_parameters``); β = 1 is the plain (weighted)
average, β = 0 would freeze the global model and is rejected.

Conventions: the outer gradient λ (w − θ̂) is given to the site's optimizer
(``train.optimizer``, Adam by default, moments kept across rounds like FedAvg's),
so with Adam the step is preconditioned; ``train.optimizer = "sgd"`` with momentum 0
and ``train.lr = η`` is the paper's update.  The inner solver is plain gradient
descent as in the paper.  The personalized model θ̂_i of the round's last batch is
the site's personal model (``site.models["personal"]``, candidate ``personal/<site>``).
Defaults λ = 15, K = 5, η_p = 0.09, β = 1 are those of the authors' ``main.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fedseg.algorithms.fedavg import aggregation_weights
from fedseg.algorithms.personal import (
    Combine,
    PersonalizationBase,
    PersonalizedAlgorithm,
    PersonalStep,
    check_positive,
    personal_candidates,
    store_personal,
    train_handler,
)
from fedseg.algorithms.weighting import Weighting
from fedseg.foundation.arrays import Arrays, lerp, prefixed, strip_prefix, weighted_mean
from fedseg.foundation.errors import ConfigError
from fedseg.foundation.messages import Task
from fedseg.seams.algorithm import Candidate, ServerContext
from fedseg.site.calls import Asks
from fedseg.site.runtime import LossSums, Site

__all__ = [
    "MoreauEnvelope",
    "PFedMe",
    "PFedMeParams",
    "inner_update",
    "local_round",
    "moreau_gradient",
    "server_update",
]


def inner_update(
    theta: Mapping[str, torch.Tensor],
    grads: Mapping[str, torch.Tensor],
    w: Mapping[str, torch.Tensor],
    lam: float,
    lr: float,
) -> Arrays:
    """One inner step θ − η_p (g + λ (θ − w))  (Alg. 1 line 7, authors' ``pFedMeOptimizer.step``)."""
    return {k: t - lr * (grads[k] + lam * (t - w[k])) for k, t in theta.items()}


def moreau_gradient(w: Mapping[str, torch.Tensor], theta: Mapping[str, torch.Tensor], lam: float) -> Arrays:
    """∇ of the Moreau envelope at w: λ (w − θ̂)  (paper Prop. 1; Alg. 1 line 8)."""
    return {k: lam * (v - theta[k]) for k, v in w.items()}


def server_update(
    w: Mapping[str, torch.Tensor], locals_: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float], beta: float
) -> Arrays:
    """(1 − β) w_t + β Σ p_i w_i  (Alg. 1 line 12), via ``torch.lerp`` so β = 1 is exactly the weighted mean."""
    return lerp(dict(w), weighted_mean(locals_, weights), beta)


@dataclass(frozen=True)
class PFedMeParams:
    """Settings of pFedMe (``[pfedme]``).

    lam
        λ > 0, regularization between personal and local models.
    inner_steps
        K >= 1, gradient steps of the inner problem per batch.
    personal_lr
        η_p > 0, step size of the inner steps.
    beta
        β > 0, server mixing: 1 = average of the sites' models (must not be 0).
    weighting
        p_i: 'samples' (n_i / n, authors' code) or 'even'.
    """

    lam: float = 15.0
    """Regularization lambda > 0 between a site's personalized model and its local copy of the global model."""
    inner_steps: int = 5
    """Gradient steps K >= 1 on the inner (personalized-model) problem per batch."""
    personal_lr: float = 0.09
    """Step size > 0 of the inner steps."""
    beta: float = 1.0
    """Server mixing beta > 0: 1 = the average of the sites' models."""
    weighting: Weighting = "samples"

    def validate(self) -> None:
        check_positive("pfedme", "lam", self.lam)
        if self.inner_steps < 1:
            raise ConfigError(f"pfedme.inner_steps = {self.inner_steps}; the inner problem needs K >= 1 steps")
        check_positive("pfedme", "personal_lr", self.personal_lr)
        if not (self.beta > 0.0 and self.beta < float("inf")):
            raise ConfigError(
                f"pfedme.beta = {self.beta}; it must be > 0 (beta = 0 freezes the global model; 1 = plain average)"
            )


def local_round(site: Site, global_arrays: Arrays, rnd: int, params: PFedMeParams) -> Asks[dict[str, Any]]:
    """One round of pFedMe's site work from w_t; leaves w_{i,R} in ``models["global"]`` and θ̂ in ``models["personal"]``.

    Returns ``{"loss": mean f_i(θ) over the last inner steps, "steps": R}``.
    """
    w_model = site.load("global", global_arrays)
    theta = site.load("personal", global_arrays)
    opt = site.optimizer("global", reset=site.cfg.train.reset_optimizer)
    w_model.train()
    theta.train()
    t_params = dict(theta.named_parameters())
    sums = LossSums(site.device)
    for x, y in site.batches(rnd, "train"):
        w_now = {k: p.detach().clone() for k, p in w_model.named_parameters()}
        for _ in range(params.inner_steps):
            # ∇f_i(θ) on the batch (Site.gradient: one vmapped call for all sites in a vectorized simulation)
            grads, loss = yield from site.gradient("personal", x, y)
            with torch.no_grad():
                new = inner_update(
                    {k: p.detach() for k, p in t_params.items()},
                    {k: grads[k] for k in t_params},
                    w_now,
                    params.lam,
                    params.personal_lr,
                )
                for k, p in t_params.items():
                    p.copy_(new[k])
        g = moreau_gradient(w_now, {k: p.detach() for k, p in t_params.items()}, params.lam)
        opt.zero_grad(set_to_none=True)
        for k, p in w_model.named_parameters():
            p.grad = g[k].clone()
        opt.step()
        sums.add("loss", loss)
    return {"loss": sums.means().get("loss", 0.0), "steps": sums.count("loss")}


class MoreauEnvelope(PersonalizationBase):
    """pFedMe's personalization (:class:`fedseg.algorithms.personal.Personalization`): the site step
    is pFedMe's Moreau-envelope local round (:func:`local_round`: w_{i,R} and θ̂ of the round's last
    batch); the server step mixes the global model as pFedMe does, ``(1 − β) w + β Σ p_k w_k``
    (:func:`server_update`, its own rule: a robust ``combine`` of FedSM is not applied to it)."""

    name = "pfedme"
    title = "pFedMe"
    section = "pfedme"
    fp16_unsupported_by = "pFedMe, whose inner solve steps θ with raw gradients"

    def site_step(self, site: Site, task: Task) -> Asks[PersonalStep]:
        m = yield from local_round(site, strip_prefix("global", task.arrays), task.config["round"], self.params)
        return PersonalStep({"loss": m["loss"], "personal_loss": m["loss"], "steps": m["steps"]})

    def combine_global(
        self, state: Arrays, models: Sequence[Arrays], weights: Sequence[float], combine: Combine
    ) -> Arrays:
        return server_update(strip_prefix("global", state), models, weights, self.params.beta)


class PFedMe(PersonalizedAlgorithm):
    name = "pfedme"
    title = "pFedMe"
    section = "pfedme"
    Personal = MoreauEnvelope
    Params = PFedMeParams
    primary = None

    def server_round(self, ctx: ServerContext, state: Arrays, rnd: int) -> tuple[Arrays, dict[str, Any]]:
        p = self.params
        conf = {"round": rnd, "report_personal": ctx.is_eval_round(rnd)}
        w = strip_prefix("global", state)
        replies = ctx.ask({s: Task("train", prefixed("global", w), conf) for s in ctx.sites})
        names = list(replies)
        weights = aggregation_weights([replies[s].num_samples for s in names], p.weighting)
        new = dict(state)
        new.update(
            prefixed(
                "global", server_update(w, [strip_prefix("global", replies[s].arrays) for s in names], weights, p.beta)
            )
        )
        store_personal(new, replies)
        return new, {"train_loss": {s: r.metrics.get("loss") for s, r in replies.items()}}

    def candidates(self, state: Arrays, ctx: ServerContext) -> list[Candidate]:
        return personal_candidates(state, ctx)

    def site_handlers(self):
        # one round of the site step; θ̂ is sent on evaluation rounds
        return {"train": train_handler(self.personal)}
