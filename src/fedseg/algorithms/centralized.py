"""Centralized training: all sites' training data pooled in one place (the upper bound).

Simulation only — pooling violates the premise of federated learning.  The pooled
data is an extra site (``POOLED``) that only this method addresses; the model is
validated on each real site's validation split and tested on each test split.
One round is one round of local work on the pooled data (one epoch of the union
with ``train.local_epochs = 1``; with ``train.local_steps`` it takes K times the
steps of one site, the same total budget).
"""

from __future__ import annotations

from typing import Any

from fedseg.algorithms.fedavg import train_global
from fedseg.foundation.arrays import Arrays, strip_prefix
from fedseg.foundation.messages import Task
from fedseg.seams.algorithm import Algorithm, Candidate, ServerContext

POOLED = "pooled"


class Centralized(Algorithm):
    name = "centralized"
    title = "Centralized"
    section = "centralized"
    needs_pooled_site = True

    def server_round(self, ctx: ServerContext, state: Arrays, rnd: int) -> tuple[Arrays, dict[str, Any]]:
        steps = None if ctx.cfg.train.local_steps is None else ctx.cfg.train.local_steps * len(ctx.sites)
        reply = ctx.ask({POOLED: Task("train", state, {"round": rnd, "steps": steps})})[POOLED]
        new = dict(state)
        new.update(reply.arrays)
        return new, {"train_loss": {POOLED: reply.metrics.get("loss")}}

    def candidates(self, state: Arrays, ctx: ServerContext) -> list[Candidate]:
        return [Candidate("global", strip_prefix("global", state))]

    def site_handlers(self):
        return {"train": train_global}
