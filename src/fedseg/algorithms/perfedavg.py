"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar, "Personalized Federated Learning with
Theoretical Guarantees: A Model-Agnostic Meta-Learning Approach", NeurIPS 2020).

Objective (paper Eq. 3): F(w) = Σ_i p_i f_i(w − α ∇f_i(w)), the loss *after* one
step of local adaptation.  Each local step at site i draws three independent batches
D, D', D'' (random streams ``"train"``, ``"meta"``, ``"hessian"``) and computes
(Algorithm 1, lines 7–9):

    w̃ = w − α ∇f_i(w; D)
    FO (Per-FedAvg (FO)):  g = ∇f_i(w̃; D')
    HF (Per-FedAvg (HF)):  g = ∇f_i(w̃; D') − α ∇²f_i(w; D'') ∇f_i(w̃; D')
    w ← w − β g

The Hessian-vector product is exact double backprop (``perfedavg.hvp =
"autograd"``, ``torch.autograd.grad(..., create_graph=True)``) or the paper's
central finite difference [∇f(w + δ v) − ∇f(w − δ v)] / (2δ)
(``"finite_difference"``, Section 4 of the paper).  The server averages like FedAvg.

Convention: g is handed to the site's optimizer as the gradient (``train.optimizer``,
Adam by default, β = ``train.lr``); with ``train.optimizer = "sgd"`` and momentum 0
it is the paper's outer step.  The inner step α is plain gradient descent as in the paper.

Personalization (evaluation): on the rounds the engine evaluates, each site adapts
the new global model with ``perfedavg.personal_steps`` plain gradient steps of size
α on its own training batches (stream ``"adapt"``) — the one-step adaptation the
objective is built for — giving candidate ``personal/<site>``.

Defaults: FO, α = 0.01, δ = 0.001, one adaptation step (our choices, in the range
the paper's experiments use; FedSM's Table 6 gives no values).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch.func import functional_call

from fedseg.algorithms.personal import (
    PersonalizationBase,
    PersonalizedAlgorithm,
    aggregate_global,
    check_nonneg_int,
    check_positive,
    finetune,
    personal_candidates,
    personalize_handler,
    store_personal,
)
from fedseg.algorithms.weighting import Weighting
from fedseg.foundation.arrays import Arrays, prefixed, strip_prefix
from fedseg.foundation.messages import Reply, Task
from fedseg.seams.algorithm import Candidate, ServerContext
from fedseg.site.calls import Asks
from fedseg.site.runtime import LossSums, Site

__all__ = [
    "MetaAdaptation",
    "PerFedAvg",
    "PerFedAvgParams",
    "hvp_autograd",
    "hvp_finite_difference",
    "local_round",
    "meta_gradient",
]

Params_ = dict[str, torch.Tensor]


def hvp_autograd(
    loss_fn: Callable[[Params_], torch.Tensor], params: Mapping[str, torch.Tensor], v: Mapping[str, torch.Tensor]
) -> Arrays:
    """Exact Hessian-vector product ∇²f(w) v by double backprop.

    Parameters
    ----------
    loss_fn
        ``loss_fn(params) -> scalar`` f(w), differentiable twice.
    params
        The point w (name → tensor); need not require grad.
    v
        The vector (same names and shapes), treated as a constant.
    """
    p = {k: t.detach().requires_grad_(True) for k, t in params.items()}
    grads = torch.autograd.grad(loss_fn(p), list(p.values()), create_graph=True)
    inner = cast(torch.Tensor, sum((g * v[k].detach()).sum() for k, g in zip(p, grads)))  # params: >= 1
    hv = torch.autograd.grad(inner, list(p.values()), allow_unused=True)
    return {k: (h.detach() if h is not None else torch.zeros_like(p[k])) for k, h in zip(p, hv)}


def grad_of(loss_fn: Callable[[Params_], torch.Tensor], params: Mapping[str, torch.Tensor]) -> Arrays:
    """∇f(w) as arrays (zeros for parameters the loss does not use)."""
    p = {k: t.detach().requires_grad_(True) for k, t in params.items()}
    gs = torch.autograd.grad(loss_fn(p), list(p.values()), allow_unused=True)
    return {k: (g.detach() if g is not None else torch.zeros_like(p[k])) for k, g in zip(p, gs)}


def hvp_finite_difference(
    loss_fn: Callable[[Params_], torch.Tensor],
    params: Mapping[str, torch.Tensor],
    v: Mapping[str, torch.Tensor],
    delta: float,
) -> Arrays:
    """[∇f(w + δ v) − ∇f(w − δ v)] / (2δ), the paper's Hessian-free estimate (error O(δ²) ||v||³)."""
    plus = grad_of(loss_fn, {k: t.detach() + delta * v[k] for k, t in params.items()})
    minus = grad_of(loss_fn, {k: t.detach() - delta * v[k] for k, t in params.items()})
    return {k: (plus[k] - minus[k]) / (2.0 * delta) for k in params}


def meta_gradient(
    g_outer: Mapping[str, torch.Tensor], alpha: float, hv: Mapping[str, torch.Tensor] | None = None
) -> Arrays:
    """(I − α ∇²f) ∇f(w̃) given the HVP ``hv`` = ∇²f ∇f(w̃); ``hv = None`` is the FO variant (g_outer)."""
    if hv is None:
        return {k: g.clone() for k, g in g_outer.items()}
    return {k: g - alpha * hv[k] for k, g in g_outer.items()}


@dataclass(frozen=True)
class PerFedAvgParams:
    """Settings of Per-FedAvg (``[perfedavg]``).

    variant
        'fo' (first order) or 'hf' (Hessian-free: with a Hessian-vector product).
    alpha
        α > 0, step size of the inner (adaptation) step.
    hvp
        HF only: 'autograd' (exact, double backprop) or 'finite_difference'.
    delta
        δ > 0 of the finite-difference HVP.
    personal_steps
        Adaptation steps (of size α) that make the personalized model at evaluation.
    """

    variant: Literal["fo", "hf"] = "fo"
    """'fo' (first order) or 'hf' (Hessian-free, with a Hessian-vector product)."""
    alpha: float = 0.01
    """Step size alpha > 0 of the inner (adaptation) step."""
    hvp: Literal["autograd", "finite_difference"] = "autograd"
    """'hf' only: how the Hessian-vector product is computed, 'autograd' (exact, double backprop) or 'finite_difference'."""
    delta: float = 1e-3
    """Step delta > 0 of the finite-difference Hessian-vector product."""
    personal_steps: int = 1
    """Adaptation steps (of size alpha) that make a site's personalized model at evaluation."""
    weighting: Weighting = "samples"

    def validate(self) -> None:
        check_positive("perfedavg", "alpha", self.alpha)
        check_positive("perfedavg", "delta", self.delta)
        check_nonneg_int("perfedavg", "personal_steps", self.personal_steps, allow_none=False)


def local_round(site: Site, global_arrays: Arrays, rnd: int, params: PerFedAvgParams) -> Asks[dict[str, Any]]:
    """One round of Per-FedAvg local steps on ``models["global"]`` from ``global_arrays``."""
    model = site.load("global", global_arrays)
    opt = site.optimizer("global", reset=site.cfg.train.reset_optimizer)
    model.train()
    loss_f = site.workload.loss
    streams = [site.batches(rnd, "train"), site.batches(rnd, "meta")]
    if params.variant == "hf":
        streams.append(site.batches(rnd, "hessian"))
    sums = LossSums(site.device)
    for batches in zip(*streams):
        w = {k: p.detach() for k, p in model.named_parameters()}

        def loss_on(batch):
            x, y = batch

            def f(p):
                with site.autocast():
                    return loss_f(functional_call(model, p, (x,)), y)  # noqa: B023 (f is used before the next batch)

            return f

        def grad_at(batch, at):
            # ∇f at ``at`` (Site.gradient: one vmapped call for all sites in a vectorized simulation)
            g, value = yield from site.gradient("global", batch[0], batch[1], at=at)
            return {k: g[k] if k in g else torch.zeros_like(t) for k, t in at.items()}, value

        g1, _ = yield from grad_at(batches[0], w)
        w_tilde = {k: w[k] - params.alpha * g1[k] for k in w}
        g2, loss2 = yield from grad_at(batches[1], w_tilde)
        hv = None
        if params.variant == "hf":
            hess = loss_on(batches[2])
            hv = (
                hvp_autograd(hess, w, g2)
                if params.hvp == "autograd"
                else hvp_finite_difference(hess, w, g2, params.delta)
            )
        g = meta_gradient(g2, params.alpha, hv)
        opt.zero_grad(set_to_none=True)
        for k, p in model.named_parameters():
            p.grad = g[k]
        opt.step()
        sums.add("loss", loss2)
    return {"loss": sums.means().get("loss", 0.0), "steps": sums.count("loss")}


class MetaAdaptation(PersonalizationBase):
    """Per-FedAvg's personalization (:class:`fedseg.algorithms.personal.Personalization`): the global
    model takes Per-FedAvg's meta step (:func:`local_round`); the personalized model is the global
    model adapted by ``perfedavg.personal_steps`` plain gradient steps of size α (stream ``"adapt"``)."""

    name = "perfedavg"
    title = "Per-FedAvg"
    section = "perfedavg"
    fp16_unsupported_by = (
        "Per-FedAvg, whose meta-gradient uses raw gradients (the inner step w − α∇f, the Hessian-vector product)"
    )

    def global_step(self, site: Site, global_arrays: Arrays, rnd: int, steps: int | None) -> Asks[dict[str, Any]]:
        return (yield from local_round(site, global_arrays, rnd, self.params))

    def personal_step(self, site: Site, global_arrays: Arrays, rnd: int) -> Asks[dict[str, Any]]:
        return (
            yield from finetune(
                site,
                global_arrays,
                rnd,
                steps=self.params.personal_steps,
                lr=self.params.alpha,
                optimizer="sgd",
                stream="adapt",
            )
        )


class PerFedAvg(PersonalizedAlgorithm):
    name = "perfedavg"
    title = "Per-FedAvg"
    section = "perfedavg"
    Personal = MetaAdaptation
    Params = PerFedAvgParams
    primary = None

    def server_round(self, ctx: ServerContext, state: Arrays, rnd: int) -> tuple[Arrays, dict[str, Any]]:
        conf = {"round": rnd}
        glob = prefixed("global", strip_prefix("global", state))
        replies = ctx.ask({s: Task("train", glob, conf) for s in ctx.sites})
        new = dict(state)
        new.update(aggregate_global(replies, self.params.weighting))
        metrics: dict[str, Any] = {"train_loss": {s: r.metrics.get("loss") for s, r in replies.items()}}
        if ctx.is_eval_round(rnd):
            personal = ctx.ask(
                {s: Task("personalize", prefixed("global", strip_prefix("global", new)), conf) for s in ctx.sites}
            )
            store_personal(new, personal)
        return new, metrics

    def candidates(self, state: Arrays, ctx: ServerContext) -> list[Candidate]:
        return personal_candidates(state, ctx)

    def site_handlers(self):
        return {"train": self._train, "personalize": personalize_handler(self.personal)}

    def _train(self, site: Site, task: Task) -> Asks[Reply]:
        """Site half: one round of Per-FedAvg's meta steps on the sent global model."""
        metrics = yield from self.personal.global_step(
            site, strip_prefix("global", task.arrays), task.config["round"], None
        )
        return Reply(arrays=prefixed("global", site.arrays("global")), metrics=metrics, num_samples=site.num_train)
