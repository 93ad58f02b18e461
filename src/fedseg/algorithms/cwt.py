"""Cyclic weight transfer (CWT): Chang et al. 2018; as compared in Remedios et al. 2020.

One round is one cycle: the model visits the sites in ``order``; at each visit the
site loads the weights left by the previous site, trains one round of local work
(``train.local_epochs``, the paper's E epochs, or ``train.local_steps``) and passes
them on:

    Θ ← train_{s_1}(Θ) → train_{s_2}(·) → … → train_{s_K}(·)

Each visit is one ``ctx.ask({site: task})``.  The model after a round is the one at
the last site of the cycle, the **ending site**: with two sites the paper reports
"Cyclic A" (ends at A) and "Cyclic B" (ends at B); ``cwt.end`` rotates the default
order so that it ends there, or ``cwt.order`` names the whole cycle.

The optimizer at a visit (``cwt.optimizer``):

* ``"keep"`` (default): each site's own Adam moments persist across its visits (the
  reference MNIST script, ``RESET_MOMENTUM = False``);
* ``"reset"``: a fresh Adam at every visit (the reference ``train_cyclic.py``);
* ``"transfer"``: the moments travel with the weights, so CWT is exactly sequential
  training over the sites' batches (three model-sized arrays per message).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch

from fedseg.foundation.arrays import Arrays, prefixed, strip_prefix
from fedseg.foundation.errors import ConfigError
from fedseg.foundation.messages import Reply, Task
from fedseg.seams.algorithm import Algorithm, Candidate, ServerContext
from fedseg.site.calls import Asks
from fedseg.site.runtime import Site

__all__ = ["CWT", "CWTParams", "load_optimizer_arrays", "optimizer_arrays", "train_cwt", "visit_order"]

ROLE = "global"


@dataclass(frozen=True)
class CWTParams:
    """Settings of CWT.

    order
        Site names in visiting order, each site once (a list, or a comma-separated
        string: ``--set cwt.order=siteB,siteA``); None = federation order.
    end
        The ending site (the paper's "Cyclic A"/"Cyclic B"): the default order rotated
        to end there.  With ``order`` set, it must be its last entry.
    optimizer
        ``"keep"`` (default), ``"reset"`` or ``"transfer"`` (see the module docstring).
    """

    order: tuple[str, ...] | str | None = None
    """Site names in visiting order, each once (a list, or comma-separated: --set cwt.order=siteB,siteA); none = federation order."""
    end: str | None = None
    """Site the cycle ends at (the default order rotated to end there); with order set it must be its last entry."""
    optimizer: Literal["keep", "reset", "transfer"] = "keep"
    """Optimizer state handed between sites: 'keep' (each site its own), 'reset' (fresh every visit) or 'transfer' (passed along with the model)."""

    def validate(self) -> None:
        if self.order is not None and not _names(self.order):
            raise ConfigError("cwt.order is empty; list the sites in visiting order, e.g. --set cwt.order=siteB,siteA")


def _names(order: tuple[str, ...] | str) -> tuple[str, ...]:
    items = order.split(",") if isinstance(order, str) else order
    return tuple(s.strip() for s in items if s.strip())


def visit_order(
    sites: Sequence[str], order: tuple[str, ...] | str | None = None, end: str | None = None
) -> tuple[str, ...]:
    """The cycle of one round.

    Parameters
    ----------
    sites
        The federation's sites, in federation order.
    order
        Explicit cycle (a permutation of ``sites``), or None.
    end
        Ending site: without ``order``, ``sites`` rotated to end there; with it, a check.

    Examples
    --------
    >>> visit_order(["A", "B", "C"], end="A")
    ('B', 'C', 'A')
    """
    sites = tuple(sites)
    if order is None:
        cycle = sites
        if end is not None:
            if end not in sites:
                raise ConfigError(f"cwt.end = {end!r} is not a site; sites are {list(sites)}")
            i = sites.index(end)
            cycle = sites[i + 1 :] + sites[: i + 1]
    else:
        cycle = _names(order)
        unknown = [s for s in cycle if s not in sites]
        if unknown:
            raise ConfigError(f"cwt.order names unknown site(s) {unknown}; sites are {list(sites)}")
        if sorted(cycle) != sorted(sites):
            raise ConfigError(f"cwt.order = {list(cycle)} must list every site exactly once; sites are {list(sites)}")
        if end is not None and cycle[-1] != end:
            raise ConfigError(
                f"cwt.end = {end!r} but cwt.order ends at {cycle[-1]!r}; set one of them or make them agree"
            )
    return cycle


def optimizer_arrays(opt: torch.optim.Optimizer) -> Arrays:
    """An optimizer's per-parameter state as flat arrays ``<param index>/<key>`` (Adam: step, exp_avg, exp_avg_sq)."""
    out: Arrays = {}
    for idx, st in opt.state_dict()["state"].items():
        for key, v in st.items():
            t = v if torch.is_tensor(v) else torch.tensor(v)
            out[f"{idx}/{key}"] = t.detach().clone()
    return out


def load_optimizer_arrays(opt: torch.optim.Optimizer, arrays: Arrays) -> None:
    """Load :func:`optimizer_arrays` output into ``opt`` (its hyper-parameters are kept)."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in arrays.items():
        idx, key = k.split("/", 1)
        state.setdefault(int(idx), {})[key] = v
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})


def train_cwt(site: Site, task: Task) -> Asks[Reply]:
    """One visit: load the previous site's weights (and moments with ``transfer``), train, pass them on."""
    params: CWTParams = cast(Algorithm, site.algorithm).params
    mode = params.optimizer
    site.load(ROLE, strip_prefix(ROLE, task.arrays))
    opt = site.optimizer(ROLE, reset=mode != "keep")
    moments = strip_prefix("optim", task.arrays)
    if mode == "transfer" and moments:
        load_optimizer_arrays(opt, moments)
    metrics = yield from site.fit(ROLE, task.config["round"], stream="train", optimizer=opt)
    arrays = prefixed(ROLE, site.arrays(ROLE))
    if mode == "transfer":
        arrays.update(prefixed("optim", optimizer_arrays(opt)))
    return Reply(arrays=arrays, metrics=metrics, num_samples=site.num_train)


class CWT(Algorithm):
    name = "cwt"
    title = "CWT"
    section = "cwt"
    Params = CWTParams

    def secure_aggregation_unsupported(self) -> str | None:
        return "one site's model goes on to the next site through the server: there is no sum to hide it in"

    def cycle(self, ctx: ServerContext) -> tuple[str, ...]:
        return visit_order(ctx.sites, self.params.order, self.params.end)

    def init_state(self, ctx: ServerContext) -> Arrays:
        self.cycle(ctx)  # fail before training on a bad order
        return prefixed(ROLE, ctx.init_arrays(ROLE))

    def server_round(self, ctx: ServerContext, state: Arrays, rnd: int) -> tuple[Arrays, dict[str, Any]]:
        cur = dict(state)
        losses, skipped = {}, []
        for s in self.cycle(ctx):
            # one site at a time: a visit without a valid reply (a deployed site left out) is skipped and the
            # model goes on to the next site unchanged
            reply = ctx.ask({s: Task("train", cur, {"round": rnd})}, optional=True).get(s)
            if reply is None:
                skipped.append(s)
                continue
            cur.update(reply.arrays)
            losses[s] = reply.metrics.get("loss")
        metrics: dict[str, Any] = {"train_loss": losses, "order": list(self.cycle(ctx))}
        if skipped:
            metrics["skipped"] = skipped
        return cur, metrics

    def candidates(self, state: Arrays, ctx: ServerContext) -> list[Candidate]:
        return [Candidate(ROLE, strip_prefix(ROLE, state))]

    def site_handlers(self):
        return {"train": train_cwt}
