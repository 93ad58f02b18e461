"""APFL (Deng, Kamani, Mahdavi, "Adaptive Personalized Federated Learning", 2020), Algorithm 1.

Each site i keeps a local model v_i and a mixing weight α_i ∈ [0, 1]; its
personalized model is the mixture (paper Eq. 3 / Alg. 1)

    v̄_i = α_i v_i + (1 − α_i) w.

Per local step, on one batch ξ (stream ``"train"``), from the same iterate:

    w   ← w − η ∇f_i(w; ξ)                    (the global model's local copy: FedAvg's step)
    v_i ← v_i − η ∇_v f_i(v̄_i; ξ)             (= α_i ∇f_i(v̄_i), the chain rule through the mixture)
    α_i ← clip_[0,1](α_i − η_α ∇_α f_i(v̄_i; ξ)),  ∇_α = ⟨v_i − w, ∇f_i(v̄_i)⟩   (paper Eq. 10)

and the server averages the w's like FedAvg.  Because the w step is exactly FedAvg's
site step (the v and α updates only read w, detached), the global trajectory is FedAvg's.

Mixing: ``apfl.mix = "parameters"`` (default) mixes weights as the paper defines
v̄; it is the object of the paper's analysis and gives one deployable model per
site.  The issue filed for fedseg reports that the authors' code mixes *outputs*
(α v_i(x) + (1 − α) w(x), logits here); ``apfl.mix = "outputs"`` does that, the α
gradient then being ⟨v_i(x) − w(x), ∂f/∂out⟩.  Either way the personalized candidate
``personal/<site>`` predicts with the mixture, using the site's α_i and v_i and the
*new* global model w_{r+1}.

Conventions: the gradients of w and v go to the site's optimizers (``train.optimizer``,
Adam by default; moments of both kept across rounds, as FedAvg keeps them); α takes
plain gradient steps of size ``apfl.alpha_lr`` (default ``train.lr``, the paper uses
the same η for α) and is clipped to [0, 1].  v_i starts as the first global model
received; α_i starts at ``apfl.alpha`` = 0.5 (our choice; ``learn_alpha = false``
keeps it fixed, the paper's fixed-α variant).  v_i, α_i and both optimizers live
at the site (``site.models``, ``site.optimizers``, ``site.store["apfl/alpha"]``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch

from fedseg.algorithms.personal import (
    PersonalizationBase,
    PersonalizedAlgorithm,
    PersonalStep,
    aggregate_global,
    check_positive,
    train_handler,
)
from fedseg.algorithms.weighting import Weighting
from fedseg.foundation.arrays import Arrays, dot, prefixed, strip_prefix, sub
from fedseg.foundation.config import RunConfig
from fedseg.foundation.errors import ConfigError
from fedseg.foundation.messages import Reply, Task
from fedseg.seams.algorithm import Candidate, ServerContext
from fedseg.site.calls import Asks
from fedseg.site.runtime import LossSums, Site

__all__ = [
    "APFL",
    "APFLParams",
    "AdaptiveMixture",
    "alpha_gradient",
    "alpha_step",
    "local_round",
    "mix_outputs",
    "mix_parameters",
    "mixture_gradients",
]


def mix_parameters(v: Mapping[str, torch.Tensor], w: Mapping[str, torch.Tensor], alpha: float) -> Arrays:
    """v̄ = α v + (1 − α) w over v's names (``torch.lerp(w, v, α)``: α = 0 gives w, α = 1 gives v exactly).

    Integer tensors come from ``w``.
    """
    return {k: (torch.lerp(w[k], t, float(alpha)) if t.is_floating_point() else w[k].clone()) for k, t in v.items()}


def mix_outputs(out_v: torch.Tensor, out_w: torch.Tensor, alpha: float) -> torch.Tensor:
    """α v(x) + (1 − α) w(x) (``torch.lerp``: α = 0 gives w(x), α = 1 gives v(x) exactly)."""
    return torch.lerp(out_w, out_v, float(alpha))


def mixture_gradients(
    v: Mapping[str, torch.Tensor], w: Mapping[str, torch.Tensor], grad_mixed: Mapping[str, torch.Tensor], alpha
) -> tuple[Arrays, torch.Tensor]:
    """The chain rule through v̄ = α v + (1 − α) w, from ∇f(v̄) (a parameter it does not name: zero):
    ∇_v f(v̄) = α ∇f(v̄), and ∂f(v̄)/∂α = ⟨v − w, ∇f(v̄)⟩ (paper Eq. 10) as a float64 scalar tensor on the
    gradients' device (no host read).  ``alpha``: a float or a scalar tensor of the weights' dtype."""
    g = {k: grad_mixed[k] if k in grad_mixed else torch.zeros_like(t) for k, t in v.items()}
    return {k: alpha * gk for k, gk in g.items()}, dot(sub(dict(v), dict(w)), g)


def alpha_gradient(
    v: Mapping[str, torch.Tensor], w: Mapping[str, torch.Tensor], grad_mixed: Mapping[str, torch.Tensor]
) -> float:
    """∂f(v̄)/∂α = ⟨v − w, ∇f(v̄)⟩ for parameter mixing (paper Eq. 10), as a float (:func:`mixture_gradients`)."""
    return float(mixture_gradients(v, w, grad_mixed, 1.0)[1])


def alpha_step(alpha, grad, lr: float):
    """α − η_α ∂f/∂α, clipped to [0, 1] (floats, or tensors kept on the device by the local loop)."""
    new = alpha - lr * grad
    return new.clamp(0.0, 1.0) if isinstance(new, torch.Tensor) else min(1.0, max(0.0, new))


@dataclass(frozen=True)
class APFLParams:
    """Settings of APFL (``[apfl]``).

    alpha
        Initial mixing weight α_i in [0, 1] (0 = global model, 1 = local model).
    learn_alpha
        Learn α_i by gradient descent (adaptive APFL) or keep it fixed.
    alpha_lr
        Step size of α; None = ``train.lr``.
    mix
        'parameters' (v̄ = α v + (1 − α) w, the paper) or 'outputs' (mix the logits).
    """

    alpha: float = 0.5
    """Initial mixing weight alpha in [0, 1] (0 = global model, 1 = local model)."""
    learn_alpha: bool = True
    """Learn alpha by gradient descent (adaptive APFL) instead of keeping it fixed."""
    alpha_lr: float | None = None
    """Step size of the gradient steps on alpha; none = train.lr."""
    mix: Literal["parameters", "outputs"] = "parameters"
    """What is mixed: 'parameters' (alpha v + (1 - alpha) w) or 'outputs' (the two models' logits)."""
    weighting: Weighting = "samples"

    def validate(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"apfl.alpha = {self.alpha}; the mixing weight must lie in [0, 1]")
        check_positive("apfl", "alpha_lr", self.alpha_lr, allow_none=True)


def local_round(site: Site, global_arrays: Arrays, rnd: int, params: APFLParams) -> Asks[dict[str, Any]]:
    """One round of APFL at ``site``: updates ``models["global"]`` (w), ``models["personal"]`` (v) and α.

    With ``mix = "parameters"`` every step is two batch gradients without a step (:meth:`Site.gradient`:
    ∇f(w) and ∇f(v̄) at the mixture v̄ = α v + (1 − α) w) and two optimizer steps
    (:meth:`fedseg.site.runtime.Site.step_with_gradient`: w with ∇f(w), v with ∇_v f(v̄) = α ∇f(v̄)), then α's step
    with ⟨v − w, ∇f(v̄)⟩ (:func:`mixture_gradients`, kept on the device; v, w before their steps).  A vectorized simulation
    computes the K sites' gradients as one vmapped call each and takes their steps as one fused step;
    sequentially this is the arithmetic of autograd through the mixture (α's gradient summed in float64).
    ``mix = "outputs"`` differentiates through the output mixture in its own loop (sequential)."""
    w_model = site.load("global", global_arrays)
    if "personal" not in site.models:
        site.load("personal", global_arrays)
    v_model = site.models["personal"]
    opt_w = site.optimizer("global", reset=site.cfg.train.reset_optimizer)
    opt_v = site.optimizer("personal")
    # α stays a float64 tensor on the device (the same arithmetic as Python floats), read once per round
    alpha = (
        site.store["apfl/alpha"].reshape(())
        if "apfl/alpha" in site.store
        else torch.tensor(params.alpha, dtype=torch.float64)
    )
    alpha = alpha.to(site.device)
    lr_a = params.alpha_lr or site.cfg.train.lr
    w_model.train()
    v_model.train()
    v_params = dict(v_model.named_parameters())
    sums = LossSums(site.device)
    for x, y in site.batches(rnd, "train"):
        if params.mix == "parameters":
            loss_w, loss_v, grad_a = yield from _parameter_mixing_step(
                site, w_model, v_model, opt_w, opt_v, alpha, x, y
            )
        else:
            loss_w, loss_v, grad_a = _output_mixing_step(site, w_model, v_model, v_params, opt_w, opt_v, alpha, x, y)
        if params.learn_alpha and grad_a is not None:
            alpha = alpha_step(alpha, grad_a.detach().to(alpha.device, torch.float64), lr_a)
        sums.add("loss", loss_w)
        sums.add("personal_loss", loss_v)
    means = sums.means()
    site.store["apfl/alpha"] = alpha.detach().reshape(1).to("cpu", torch.float64)
    return {
        "loss": means.get("loss", 0.0),
        "personal_loss": means.get("personal_loss", 0.0),
        "alpha": float(alpha.detach()),
        "steps": sums.count("loss"),
    }


def _parameter_mixing_step(site: Site, w_model, v_model, opt_w, opt_v, alpha, x, y):
    """One step of w, v (and α's gradient) for v̄ = α v + (1 − α) w, through Site.gradient / Site.step_with_gradient."""
    g_w, loss_w = yield from site.gradient("global", x, y)  # w: exactly FedAvg's local step (Site.fit's arithmetic)
    a = alpha.to(site.dtype)
    # views of the weights before this step's updates (read below before the steps change them)
    w_now = {k: p.detach() for k, p in w_model.named_parameters()}
    v_now = {k: p.detach() for k, p in v_model.named_parameters()}
    mixed = {k: a * v_now[k] + (1 - a) * w_now[k] for k in v_now}
    g_mix, loss_v = yield from site.gradient("personal", x, y, at=mixed)
    g_v, grad_a = mixture_gradients(v_now, w_now, g_mix, a)  # read before the steps below change v, w
    yield from site.step_with_gradient(w_model, opt_w, g_w)
    yield from site.step_with_gradient(v_model, opt_v, g_v)
    return loss_w, loss_v, grad_a


def _output_mixing_step(site: Site, w_model, v_model, v_params, opt_w, opt_v, alpha, x, y):
    """One step of w, v (and α's gradient) for the output mixture α v(x) + (1 − α) w(x), by autograd."""
    loss_f = site.workload.loss
    opt_w.zero_grad(set_to_none=True)
    with site.autocast():
        out_w = w_model(x)
        loss_w = loss_f(out_w, y)
    loss_w.backward()
    a = alpha.to(site.dtype).requires_grad_(True)
    with site.autocast():
        out_v = v_model(x)
    out = a * out_v + (1 - a) * out_w.detach()
    with site.autocast():
        loss_v = loss_f(out, y)
    grads = torch.autograd.grad(loss_v, [*v_params.values(), a], allow_unused=True)
    opt_v.zero_grad(set_to_none=True)
    for p, g in zip(v_params.values(), grads):
        p.grad = torch.zeros_like(p) if g is None else g
    opt_w.step()
    opt_v.step()
    return loss_w.detach(), loss_v.detach(), grads[-1]


class AdaptiveMixture(PersonalizationBase):
    """APFL's personalization (:class:`fedseg.algorithms.personal.Personalization`): the site step is
    one APFL round (:func:`local_round`: w's FedAvg step, v_k and α_k); it sends α_k as the extra
    array ``alpha``.  The server step stores the mixture α_k v_k + (1 − α_k) w_{r+1} with the new
    global model — one model per site, so ``apfl.mix = "parameters"`` only (an output mixture is
    not one model; :meth:`APFL.personalization` refuses it)."""

    name = "apfl"
    title = "APFL"
    section = "apfl"
    fp16_unsupported_by = (
        "APFL, whose v and α updates use raw gradients at the mixture (α's gradient enters its update directly)"
    )

    def site_step(self, site: Site, task: Task) -> Asks[PersonalStep]:
        m = yield from local_round(site, strip_prefix("global", task.arrays), task.config["round"], self.params)
        alpha = site.store["apfl/alpha"]
        metrics = {"loss": m["loss"], "personal_loss": m["personal_loss"], "steps": m["steps"], "alpha": m["alpha"]}
        return PersonalStep(metrics, extra={"alpha": alpha.clone()})

    def personal_model(self, own: Arrays, new_global: Arrays, reply: Reply) -> Arrays:
        return mix_parameters(own, new_global, float(reply.arrays["alpha"]))


def _outputs_predictor(site: Site, arrays: Arrays, config: dict):
    v = site.load("eval_personal", strip_prefix("personal", arrays))
    w = site.load("eval", strip_prefix("global", arrays))
    v.eval()
    w.eval()
    alpha = float(arrays["alpha"])
    return lambda x: mix_outputs(site.workload.predict(v, x), site.workload.predict(w, x), alpha)


class APFL(PersonalizedAlgorithm):
    name = "apfl"
    title = "APFL"
    section = "apfl"
    Personal = AdaptiveMixture
    Params = APFLParams
    primary = None

    @classmethod
    def personalization(cls, cfg: RunConfig) -> AdaptiveMixture:
        """APFL's personalization as one model per site, with the settings of ``[apfl]`` (inside FedSM,
        Table 6: the selector routes to one personalized model per site, so ``apfl.mix = "parameters"``)."""
        personal = cast(AdaptiveMixture, super().personalization(cfg))  # Personal = AdaptiveMixture
        if personal.params.mix != "parameters":
            raise ConfigError(
                f"apfl.mix = {personal.params.mix!r} cannot be used inside FedSM: the selector routes to one "
                "personalized model per site; use apfl.mix = 'parameters' (alpha*v + (1-alpha)*w)"
            )
        return personal

    def server_round(self, ctx: ServerContext, state: Arrays, rnd: int) -> tuple[Arrays, dict[str, Any]]:
        p = self.params
        conf = {"round": rnd, "report_personal": ctx.is_eval_round(rnd)}
        replies = ctx.ask(
            {s: Task("train", prefixed("global", strip_prefix("global", state)), conf) for s in ctx.sites}
        )
        new = dict(state)
        new.update(aggregate_global(replies, p.weighting))
        for s, rep in replies.items():
            v = strip_prefix("personal", rep.arrays)
            if v:
                new.update(prefixed(f"personal/{s}", v))
                new[f"alpha/{s}"] = rep.arrays["alpha"]
        return new, {
            "train_loss": {s: r.metrics.get("loss") for s, r in replies.items()},
            "personal_loss": {s: r.metrics.get("personal_loss") for s, r in replies.items()},
            "alpha": {s: r.metrics.get("alpha") for s, r in replies.items()},
        }

    def candidates(self, state: Arrays, ctx: ServerContext) -> list[Candidate]:
        w = strip_prefix("global", state)
        out = [Candidate("global", w)]
        for s in ctx.sites:
            v = strip_prefix(f"personal/{s}", state)
            if not v:
                continue
            alpha = state[f"alpha/{s}"]
            if self.params.mix == "parameters":
                arrays = mix_parameters(v, w, float(alpha))
                out.append(Candidate(f"personal/{s}", arrays, val_sites=(s,), home_site=s))
            else:
                arrays = {**prefixed("personal", v), **prefixed("global", w), "alpha": alpha.clone()}
                out.append(Candidate(f"personal/{s}", arrays, predictor="apfl_outputs", val_sites=(s,), home_site=s))
        return out

    def site_handlers(self):
        # one APFL round (the site step); sends w, and v_i, α_i on evaluation rounds
        return {"train": train_handler(self.personal)}

    def predictors(self):
        return {**super().predictors(), "apfl_outputs": _outputs_predictor}
