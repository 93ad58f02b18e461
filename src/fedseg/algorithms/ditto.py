"""Ditto (Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021), Algorithm 1.

Each site k solves, besides FedAvg's global problem,

    min_{v_k}  F_k(v_k) + λ/2 ||v_k − w*||²                 (paper Eq. 2)

Round r: the site receives w_r and

1. trains the global model exactly as FedAvg does (same code, stream ``"train"``,
   optimizer ``"global"``), so the global trajectory is FedAvg's **bitwise**;
2. runs ``ditto.steps`` steps on its personal model v_k (``site.models["personal"]``,
   initialized to the first global model it receives, w_0) with gradient
   ∇F_k(v_k) + λ (v_k − w_r), on its own random stream ``"personal"`` and its own
   persistent optimizer ``"personal"`` (Alg. 1 lines 6–8, anchor = the received w_r).

λ = 0 is pure local training of v_k.  Convention: the proximal gradient is
added before the optimizer step, so with the papers' Adam it is preconditioned
(the paper uses SGD; ``train.optimizer = "sgd"`` reproduces it).  Default λ = 0.1
(the paper tunes λ per dataset from a small grid; ours is untuned), personal work
per round = one round of local work (the paper's s local epochs = the global's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedseg.algorithms.fedprox import proximal_loss
from fedseg.algorithms.personal import (
    PersonalizationBase,
    PersonalizedAlgorithm,
    aggregate_global,
    check_nonneg_int,
    check_positive,
    local_work,
    personal_candidates,
    store_personal,
    train_handler,
)
from fedseg.algorithms.weighting import Weighting
from fedseg.foundation.arrays import Arrays, prefixed, strip_prefix
from fedseg.foundation.errors import ConfigError
from fedseg.foundation.messages import Task
from fedseg.seams.algorithm import Candidate, ServerContext
from fedseg.site.calls import Asks
from fedseg.site.runtime import Site

__all__ = ["Ditto", "DittoParams", "DittoPersonalization"]


@dataclass(frozen=True)
class DittoParams:
    """Settings of Ditto (``[ditto]``).

    lam
        λ >= 0, pull of the personal model towards the global one (Eq. 2); 0 = local training.
    steps
        Personal optimizer steps per round (>= 0); None = one round of local work.
    lr
        Learning rate of the personal optimizer; None = ``train.lr``.
    """

    lam: float = 0.1
    """Pull lambda >= 0 of the personal model towards the global one; 0 = local training."""
    steps: int | None = None
    """Personal optimizer steps per round (>= 0); none = one round of local work."""
    lr: float | None = None
    """Learning rate of the personal optimizer; none = train.lr."""
    weighting: Weighting = "samples"

    def validate(self) -> None:
        if not (self.lam >= 0.0 and self.lam < float("inf")):
            raise ConfigError(f"ditto.lam = {self.lam}; it must be a finite number >= 0 (0 = pure local training)")
        check_nonneg_int("ditto", "steps", self.steps)
        check_positive("ditto", "lr", self.lr, allow_none=True)


class DittoPersonalization(PersonalizationBase):
    """Ditto's personalization (:class:`fedseg.algorithms.personal.Personalization`): the global
    model takes FedAvg's step; the site's persistent v_k is trained on F_k(v) + λ/2 ||v − w_r||²."""

    name = "ditto"
    title = "Ditto"
    section = "ditto"

    def personal_step(self, site: Site, global_arrays: Arrays, rnd: int) -> Asks[dict[str, Any]]:
        """One round of Ditto's personal update at ``site`` towards ``global_arrays`` (w_r).

        Trains ``site.models["personal"]`` (created from ``global_arrays`` on first use)
        on F_k(v) + λ/2 ||v − w_r||² for ``ditto.steps`` steps; returns ``{"loss", "steps"}``.
        """
        if "personal" not in site.models:
            site.load("personal", global_arrays)
        model = site.models["personal"]
        anchor = {k: global_arrays[k] for k, _ in model.named_parameters()}
        opt = site.optimizer("personal", lr=self.params.lr)
        return (
            yield from site.fit(
                "personal",
                rnd,
                stream="personal",
                optimizer=opt,
                extra_loss=proximal_loss(anchor, self.params.lam),
                steps=local_work(site, self.params.steps),
            )
        )


class Ditto(PersonalizedAlgorithm):
    name = "ditto"
    title = "Ditto"
    section = "ditto"
    Personal = DittoPersonalization
    Params = DittoParams
    primary = None

    def server_round(self, ctx: ServerContext, state: Arrays, rnd: int) -> tuple[Arrays, dict[str, Any]]:
        conf = {"round": rnd, "report_personal": ctx.is_eval_round(rnd)}
        replies = ctx.ask(
            {s: Task("train", prefixed("global", strip_prefix("global", state)), conf) for s in ctx.sites}
        )
        new = dict(state)
        new.update(aggregate_global(replies, self.params.weighting))
        store_personal(new, replies)
        return new, {
            "train_loss": {s: r.metrics.get("loss") for s, r in replies.items()},
            "personal_loss": {s: r.metrics.get("personal_loss") for s, r in replies.items()},
        }

    def candidates(self, state: Arrays, ctx: ServerContext) -> list[Candidate]:
        return personal_candidates(state, ctx)

    def site_handlers(self):
        # one round of the site step; v_k is sent on evaluation rounds
        return {"train": train_handler(self.personal)}
