"""FT: FedAvg, then local fine-tuning (Wang et al., "Federated Evaluation of On-device
Personalization", 2019 — reference [47] of the FedSM paper, Table 6 "FT").

The global model follows FedAvg exactly (same site code, streams and optimizer
state, so its trajectory is FedAvg's bitwise).  On every round the engine
evaluates, each site receives the new global model w_{r+1} and fine-tunes a copy
for ``ft.steps`` optimizer steps on its own training data (random stream
``"finetune"``), with a *fresh* optimizer of the run's kind (``train.optimizer``,
Adam by default) at ``ft.lr``:

    θ_k = FineTune_k(w_{r+1}; steps, lr)

θ_k is the site's personalized model (``site.models["personal"]``, candidate
``personal/<site>``).  ``ft.steps = 0`` gives θ_k = w_{r+1}, i.e. FedAvg.
Default (our choice): one round of local work (``train.local_epochs``/``local_steps``);
FedSM's ablation says only that every method was "tuned for best results"
(Section 4.3) and gives no values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedseg.algorithms.fedavg import train_global
from fedseg.algorithms.personal import (
    PersonalizationBase,
    PersonalizedAlgorithm,
    aggregate_global,
    check_nonneg_int,
    check_positive,
    finetune,
    local_work,
    personal_candidates,
    personalize_handler,
    store_personal,
)
from fedseg.algorithms.weighting import Weighting
from fedseg.foundation.arrays import Arrays, prefixed, strip_prefix
from fedseg.foundation.messages import Task
from fedseg.seams.algorithm import Candidate, ServerContext
from fedseg.site.calls import Asks
from fedseg.site.runtime import Site

__all__ = ["FT", "FTParams", "FineTuning"]


@dataclass(frozen=True)
class FTParams:
    """Settings of FT (``[ft]``).

    steps
        Fine-tuning optimizer steps (>= 0); None = one round of local work.
    lr
        Fine-tuning learning rate; None = ``train.lr``.
    """

    steps: int | None = None
    """Fine-tuning optimizer steps (>= 0); none = one round of local work."""
    lr: float | None = None
    """Fine-tuning learning rate; none = train.lr."""
    weighting: Weighting = "samples"

    def validate(self) -> None:
        check_nonneg_int("ft", "steps", self.steps)
        check_positive("ft", "lr", self.lr, allow_none=True)


class FineTuning(PersonalizationBase):
    """FT's personalization (:class:`fedseg.algorithms.personal.Personalization`): the global model
    takes FedAvg's step; the personalized model is w_r fine-tuned ``ft.steps`` steps with a fresh
    optimizer (stream ``"finetune"``)."""

    name = "ft"
    title = "FT"
    section = "ft"

    def personal_step(self, site: Site, global_arrays: Arrays, rnd: int) -> Asks[dict[str, Any]]:
        return (
            yield from finetune(
                site,
                global_arrays,
                rnd,
                steps=local_work(site, self.params.steps),
                lr=self.params.lr,
                optimizer="train",
                stream="finetune",
            )
        )


class FT(PersonalizedAlgorithm):
    name = "ft"
    title = "FT"
    section = "ft"
    Personal = FineTuning
    Params = FTParams
    primary = None

    def server_round(self, ctx: ServerContext, state: Arrays, rnd: int) -> tuple[Arrays, dict[str, Any]]:
        replies = ctx.ask({s: Task("train", state, {"round": rnd}) for s in ctx.sites})
        new = dict(state)
        new.update(aggregate_global(replies, self.params.weighting))
        metrics: dict[str, Any] = {"train_loss": {s: r.metrics.get("loss") for s, r in replies.items()}}
        if ctx.is_eval_round(rnd):
            glob = prefixed("global", strip_prefix("global", new))
            personal = ctx.ask({s: Task("personalize", glob, {"round": rnd}) for s in ctx.sites})
            store_personal(new, personal)
            metrics["finetune_loss"] = {s: r.metrics.get("loss") for s, r in personal.items()}
        return new, metrics

    def candidates(self, state: Arrays, ctx: ServerContext) -> list[Candidate]:
        return personal_candidates(state, ctx)

    def site_handlers(self):
        # train: FedAvg's site half; personalize: fine-tune the sent global model, send θ_k back
        return {"train": train_global, "personalize": personalize_handler(self.personal)}
