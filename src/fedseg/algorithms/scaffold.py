"""SCAFFOLD (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning", ICML 2020).

Algorithm 1 with option II control variates.  Round r, server model x and server
control variate c; each site i keeps its own control variate c_i (``site.store``,
saved with the site, so a restarted site resumes exactly):

* local steps  y ← y − η_l (g_i(y) − c_i + c)                       (Alg. 1 line 10)
* option II    c_i⁺ = c_i − c + (x − y) / (K η_l)                   (Alg. 1 line 12)
* the site sends y and Δc_i = c_i⁺ − c_i, and keeps c_i⁺
* server       x ← x + η_g Σ_{i∈S} p_i (y_i − x)                    (line 16: (1 − η_g) x + η_g Σ p_i y_i)
               c ← c + |S|/N · Σ_{i∈S} p_i Δc_i                     (line 17)

Conventions (the paper uses SGD and p_i = 1/|S|):

* p_i are FedAvg's weights (``scaffold.weighting``, n_i / n by default) for both
  x and c, so that round 1 (c = c_i = 0) is FedAvg bitwise and c estimates the
  same weighted objective Σ p_i f_i that x minimizes; ``weighting = "even"`` is the paper's.
* K is the number of optimizer steps the site took this round and η_l is
  ``train.lr``.  Where the correction enters (``scaffold.correction``):

  - ``"step"`` (default): after each optimizer step the weights move by
    −η_l (c − c_i).  With plain SGD this is the paper's y − η_l (g − c_i + c)
    exactly (up to rounding); with Adam it treats the optimizer's step direction
    as the "gradient" oracle, which is what option II's (x − y)/(K η_l) then
    measures, so c, c_i and the correction are all in the same units.
  - ``"gradient"``: (c − c_i) is added to the gradient before the optimizer step
    (the paper's line 10 read literally).  With Adam this mixes scales: c_i is a
    mean Adam direction (entries of order 1) while gradients of a Dice loss are
    orders of magnitude smaller, so after Adam's normalization the correction
    dominates the step.  The benchmark (docs/results/baselines.md) shows the damage.

  Either way round 1 (c = c_i = 0) is FedAvg bitwise.
* With ``privacy.secure_aggregation = true`` the sites' y_i and Δc_i are one secure sum weighted by the
  public p_i (:mod:`fedseg.algorithms.secure`); the server's two updates need nothing else.
* Control variates cover the trainable parameters only (buffers are averaged as
  in FedAvg, without correction).  The server's c starts absent (= 0) and first
  appears after round 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, cast

import torch

from fedseg.algorithms.fedavg import aggregation_weights
from fedseg.algorithms.personal import check_positive
from fedseg.algorithms.secure import secure_ask
from fedseg.algorithms.weighting import Weighting
from fedseg.foundation.arrays import Arrays, add, lerp, prefixed, scale, strip_prefix, sub, weighted_mean, zeros_like
from fedseg.foundation.messages import Reply, Task
from fedseg.seams.algorithm import Algorithm, Candidate, ServerContext
from fedseg.site.calls import Asks
from fedseg.site.runtime import Site, steps_per_round

__all__ = ["Scaffold", "ScaffoldParams", "control_update", "correction", "server_control_update", "server_model_update"]


def correction(c: Mapping[str, torch.Tensor], c_i: Mapping[str, torch.Tensor]) -> Arrays:
    """c − c_i, the term added to each local gradient (Alg. 1 line 10: g − c_i + c)."""
    return sub(c, c_i)


def control_update(
    c_i: Mapping[str, torch.Tensor],
    c: Mapping[str, torch.Tensor],
    x: Mapping[str, torch.Tensor],
    y: Mapping[str, torch.Tensor],
    steps: float,
    lr: float,
) -> Arrays:
    """Option II: c_i⁺ = c_i − c + (x − y) / (K η_l)  (Alg. 1 line 12).

    Parameters
    ----------
    c_i, c
        Site and server control variates (parameter names → tensors).
    x, y
        Parameters at the start and at the end of the site's local work.
    steps
        K, the number of local optimizer steps taken (> 0).
    lr
        η_l, the local learning rate.
    """
    if steps <= 0:
        raise ValueError(f"SCAFFOLD option II needs at least one local step, got {steps}")
    return add(sub(c_i, c), sub(x, y), alpha=1.0 / (steps * lr))


def server_model_update(
    x: Mapping[str, torch.Tensor], ys: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float], server_lr: float
) -> Arrays:
    """x + η_g Σ p_i (y_i − x), computed as (1 − η_g) x + η_g Σ p_i y_i (``torch.lerp``; η_g = 1 gives FedAvg bitwise)."""
    return lerp(dict(x), weighted_mean(ys, weights), server_lr)


def server_control_update(
    c: Mapping[str, torch.Tensor] | None,
    dcs: Sequence[Mapping[str, torch.Tensor]],
    weights: Sequence[float],
    fraction: float,
) -> Arrays:
    """c + |S|/N · Σ p_i Δc_i (Alg. 1 line 17); ``c = None`` means c = 0."""
    mean = weighted_mean(dcs, weights)
    return scale(mean, fraction) if c is None else add(c, mean, alpha=fraction)


@dataclass(frozen=True)
class ScaffoldParams:
    """Settings of SCAFFOLD (``[scaffold]``).

    server_lr
        Global step size η_g (paper Alg. 1; η_g = 1 in its experiments).
    weighting
        p_i: 'samples' (n_i / n, as FedAvg here) or 'even' (1 / |S|, the paper).
    correction
        'step': −η_l (c − c_i) applied to the weights after each optimizer step;
        'gradient': (c − c_i) added to the gradient before it (see the module docstring).
    """

    server_lr: float = 1.0
    """Global step size eta_g of the server update."""
    weighting: Weighting = "samples"
    correction: Literal["step", "gradient"] = "step"
    """Control-variate correction: 'step' (applied to the weights after each optimizer step) or 'gradient' (added to the gradient before it)."""

    def validate(self) -> None:
        check_positive("scaffold", "server_lr", self.server_lr)


class _CorrectedStep:
    """The site's optimizer, followed after each step by w ← w − η_l (c − c_i) (``correction = "step"``)."""

    def __init__(self, opt: torch.optim.Optimizer, model: torch.nn.Module, corr: Arrays, lr: float):
        self.opt, self.model, self.corr, self.lr = opt, model, corr, lr

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.opt.step()
        self.after_step()

    def after_step(self) -> None:
        """w ← w − η_l (c − c_i) on the model's parameters (also called by :mod:`fedseg.execution.vectorize` after its stacked step)."""
        with torch.no_grad():
            for k, p in self.model.named_parameters():
                p.sub_(self.corr[k], alpha=self.lr)


def train_scaffold(site: Site, task: Task) -> Asks[Reply]:
    """Site half: corrected local steps from x, option II update of c_i; sends y and Δc_i."""
    rnd = task.config["round"]
    model = site.load("global", strip_prefix("global", task.arrays))
    x = {k: v.detach().clone() for k, v in model.named_parameters()}
    c = strip_prefix("control", task.arrays) or zeros_like(x)
    c_i = strip_prefix("scaffold/c", site.store) or zeros_like(x)
    corr = correction(c, c_i)

    opt = site.optimizer("global", reset=site.cfg.train.reset_optimizer)
    lr = opt.param_groups[0]["lr"]
    params: ScaffoldParams = cast(Algorithm, site.algorithm).params
    mode = params.correction

    def after_backward(m: torch.nn.Module) -> None:
        for k, p in m.named_parameters():
            if p.grad is not None:
                p.grad.add_(corr[k])

    if mode == "gradient":
        metrics = yield from site.fit(
            "global", rnd, stream="train", optimizer=opt, after_backward=after_backward, steps=task.config.get("steps")
        )
    else:
        metrics = yield from site.fit(
            "global",
            rnd,
            stream="train",
            # the executors step any object with zero_grad() and step() (site.calls.local_fit)
            optimizer=cast(torch.optim.Optimizer, _CorrectedStep(opt, model, corr, lr)),
            steps=task.config.get("steps"),
        )
    y = {k: v.detach().clone() for k, v in model.named_parameters()}
    c_new = control_update(c_i, c, x, y, metrics["steps"], lr)
    site.store.update(prefixed("scaffold/c", c_new))
    arrays = prefixed("global", site.arrays("global"))
    arrays.update(prefixed("dc", sub(c_new, c_i)))
    metrics["correction_norm"] = float(sum(v.double().pow(2).sum() for v in corr.values()) ** 0.5)
    return Reply(arrays=arrays, metrics=metrics, num_samples=site.num_train)


class Scaffold(Algorithm):
    name = "scaffold"
    title = "Scaffold"
    section = "scaffold"
    Params = ScaffoldParams

    summed_kinds: ClassVar[frozenset[str]] = frozenset({"train"})

    def secure_aggregation_unsupported(self) -> str | None:
        return None  # x and c are updated from Σ p_i y_i and Σ p_i Δc_i only

    def server_round(self, ctx: ServerContext, state: Arrays, rnd: int) -> tuple[Arrays, dict[str, Any]]:
        tasks = {s: Task("train", state, {"round": rnd}) for s in ctx.sites}
        x = strip_prefix("global", state)
        c = strip_prefix("control", state) or None
        if ctx.cfg.privacy.secure_aggregation:  # one secure sum of y_i and Δc_i, weighted by the public p_i
            result = secure_ask(ctx, tasks, self.params.weighting)
            replies, mean = result.replies, result.mean()
            names = list(replies)
            if result.rejected:  # a replayed or misdirected masked input: no update this round
                ctx.log(f"[secagg] round {rnd}: the global model and control variate keep their previous values")
                return dict(state), {
                    "train_loss": {s: replies[s].metrics.get("loss") for s in names},
                    "correction_norm": {s: replies[s].metrics.get("correction_norm") for s in names},
                }
            new_x = lerp(dict(x), strip_prefix("global", mean), self.params.server_lr)
            mean_dc = strip_prefix("dc", mean)
            fraction = len(names) / len(ctx.sites)
            new_c = scale(mean_dc, fraction) if c is None else add(c, mean_dc, alpha=fraction)
        else:
            replies = ctx.ask(tasks)
            names = list(replies)
            p = aggregation_weights([replies[s].num_samples for s in names], self.params.weighting)
            new_x = server_model_update(
                x, [strip_prefix("global", replies[s].arrays) for s in names], p, self.params.server_lr
            )
            new_c = server_control_update(
                c, [strip_prefix("dc", replies[s].arrays) for s in names], p, len(names) / len(ctx.sites)
            )
        new = prefixed("global", new_x)
        new.update(prefixed("control", new_c))
        return new, {
            "train_loss": {s: replies[s].metrics.get("loss") for s in names},
            "correction_norm": {s: replies[s].metrics.get("correction_norm") for s in names},
        }

    def candidates(self, state: Arrays, ctx: ServerContext) -> list[Candidate]:
        return [Candidate("global", strip_prefix("global", state))]

    def dp_steps_per_round(self, cfg, n: int) -> int | None:
        """DP-SGD: every local step of the round (``Site.fit``) is privatized."""
        return steps_per_round(cfg.train, n)

    def site_handlers(self):
        return {"train": train_scaffold}
