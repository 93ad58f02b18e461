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

from fedseg.algorithms.base import Algorithm, Candidate, ServerContext
from fedseg.algorithms.fedavg import train_global
from fedseg.algorithms.personal import (
    aggregate_global,
    check_nonneg_int,
    check_positive,
    check_weighting,
    finetune,
    is_eval_round,
    local_work,
    personal_candidates,
    personalize_handler,
    store_personal,
)
from fedseg.core.arrays import Arrays, prefixed, strip_prefix
from fedseg.core.messages import Task
from fedseg.core.site import Site

__all__ = ["FT", "FTParams", "personal_step"]


@dataclass(frozen=True)
class FTParams:
    """Settings of FT (``[ft]``).

    steps
        Fine-tuning optimizer steps (>= 0); None = one round of local work.
    lr
        Fine-tuning learning rate; None = ``train.lr``.
    weighting
        FedAvg weights of the global model: 'samples' or 'even'.
    """

    steps: int | None = None
    lr: float | None = None
    weighting: str = "samples"

    def validate(self) -> None:
        check_nonneg_int("ft", "steps", self.steps)
        check_positive("ft", "lr", self.lr, allow_none=True)
        check_weighting("ft", self.weighting)


def personal_step(site: Site, global_arrays: Arrays, rnd: int, params: FTParams) -> tuple[Arrays, dict[str, Any]]:
    """FT's personalization of ``global_arrays`` at ``site`` (reusable outside this algorithm)."""
    return finetune(
        site,
        global_arrays,
        rnd,
        steps=local_work(site, params.steps),
        lr=params.lr,
        optimizer="train",
        stream="finetune",
    )


# Site half of the ``personalize`` task: fine-tune the sent global model, send θ_k back.
personalize_ft = personalize_handler(FTParams, personal_step)


class FT(Algorithm):
    name = "ft"
    title = "FT"
    section = "ft"
    Params = FTParams
    primary = None
    summary = "FT: FedAvg, then each site fine-tunes the global model on its own data"

    def server_round(self, ctx: ServerContext, state: Arrays, rnd: int) -> tuple[Arrays, dict[str, Any]]:
        replies = ctx.ask({s: Task("train", state, {"round": rnd}) for s in ctx.sites})
        new = dict(state)
        new.update(aggregate_global(replies, self.params.weighting))
        metrics: dict[str, Any] = {"train_loss": {s: r.metrics.get("loss") for s, r in replies.items()}}
        if is_eval_round(ctx.cfg, rnd):
            glob = prefixed("global", strip_prefix("global", new))
            conf = {"round": rnd, "params": {"steps": self.params.steps, "lr": self.params.lr}}
            personal = ctx.ask({s: Task("personalize", glob, conf) for s in ctx.sites})
            store_personal(new, personal)
            metrics["finetune_loss"] = {s: r.metrics.get("loss") for s, r in personal.items()}
        return new, metrics

    def candidates(self, state: Arrays, ctx: ServerContext) -> list[Candidate]:
        return personal_candidates(state, ctx)

    def site_handlers(self):
        return {"train": train_global, "personalize": personalize_ft}
