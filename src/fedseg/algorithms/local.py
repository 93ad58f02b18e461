"""Local training: each site trains its own model on its own data only.

Every site's model is validated on its own validation split (best round per site)
and, at the end, tested on every site's test split (the model × site matrix of
FedSM's Table 3 "Client k Local" rows).  Rounds only set the evaluation schedule.
"""

from __future__ import annotations

from typing import Any

from fedseg.foundation.arrays import Arrays, prefixed, strip_prefix
from fedseg.foundation.messages import Reply, Task
from fedseg.seams.algorithm import Algorithm, Candidate, ServerContext
from fedseg.site.batches import steps_per_round
from fedseg.site.calls import Asks
from fedseg.site.runtime import Site


def train_local(site: Site, task: Task) -> Asks[Reply]:
    """Train the site's own model one round; on the first round it starts from the sent weights."""
    if "local" not in site.models:
        site.load("local", task.arrays)
    metrics = yield from site.fit("local", task.config["round"], stream="train")
    return Reply(arrays=site.arrays("local"), metrics=metrics, num_samples=site.num_train)


class Local(Algorithm):
    name = "local"
    title = "Local only"
    section = "local"
    primary = None

    def init_state(self, ctx: ServerContext) -> Arrays:
        init = ctx.init_arrays("global")
        state: Arrays = {}
        for s in ctx.sites:
            state.update(prefixed(f"local/{s}", init))
        return state

    def server_round(self, ctx: ServerContext, state: Arrays, rnd: int) -> tuple[Arrays, dict[str, Any]]:
        replies = ctx.ask(
            {s: Task("train", strip_prefix(f"local/{s}", state) if rnd == 1 else {}, {"round": rnd}) for s in ctx.sites}
        )
        new = dict(state)
        for s, rep in replies.items():
            new.update(prefixed(f"local/{s}", rep.arrays))
        return new, {"train_loss": {s: r.metrics.get("loss") for s, r in replies.items()}}

    def candidates(self, state: Arrays, ctx: ServerContext) -> list[Candidate]:
        return [
            Candidate(f"local/{s}", strip_prefix(f"local/{s}", state), val_sites=(s,), home_site=s) for s in ctx.sites
        ]

    def dp_steps_per_round(self, cfg, n: int) -> int | None:
        """DP-SGD: every local step of the round (``Site.fit``) is privatized."""
        return steps_per_round(cfg.train, n)

    def site_handlers(self):
        return {"train": train_local}
