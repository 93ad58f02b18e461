"""FedAvg (McMahan et al. 2017), as used by all three papers.

Round r: every site trains the global model w_r for one round of local work
(``train.local_epochs`` or ``train.local_steps``) with its own optimizer, whose
moments persist across rounds by default (FedSM reference code); the server sets

    w_{r+1} = Σ_k p_k w_{r+1}^{(k)},   p_k = n_k / n   ("samples", the papers')   or   p_k = 1/K   ("even").

FedAvg's defaults are ``weighting = "samples"`` with ``normalize = "steps"`` (FedNova's normalized average in
its standard form, Wang et al. 2020): site k's update Δ_k = w_{r+1}^{(k)} − w_r is divided by its τ_k local
steps of the round and

    w_{r+1} = w_r + τ_eff Σ_k p_k Δ_k / τ_k,   τ_eff = Σ_k p_k τ_k,   p_k = n_k / n.

With a round of one epoch τ_k grows with n_k, so the plain average weighs site k's data by p_k τ_k (∝ n_k² under
``"samples"``): the largest site's style takes the global model and the small sites whose style differs fail
(docs/results/defaults.md).  Normalized, site k's data count p_k = n_k / n, their share in centralized
training, and τ_eff keeps the papers' global step.  ``weighting = "even"`` gives every site 1/K (the client
average the tables report) with a smaller τ_eff, the plain mean of the τ_k.  ``--set fedavg.weighting=samples
fedavg.normalize=none`` is the papers' FedAvg, bitwise (``fedavg-even`` keeps the plain average with p_k = 1/K).

``fedavg.aggregation = "trimmed_mean" | "median"`` replaces the weighted mean by a
coordinate-wise robust rule (:func:`fedseg.foundation.arrays.aggregate`); the default
``"mean"`` is the papers' rule, bitwise.

Only the sites that replied are averaged (weights renormalized over them).

With ``privacy.secure_aggregation = true`` each site sends n_k · w_k (or w_k under ``"even"``) masked in
fixed point and the server unmasks only the sum and divides it by Σ n_k (:mod:`fedseg.algorithms.secure`):
the same average to within ``privacy.secagg_fraction_bits``' quantization bound.  The robust rules need
every site's model and refuse it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from fedseg.algorithms.secure import secure_ask
from fedseg.algorithms.weighting import Weighting
from fedseg.foundation.arrays import (
    Aggregation,
    Arrays,
    aggregate,
    check_aggregation,
    is_float,
    prefixed,
    strip_prefix,
)
from fedseg.foundation.errors import ConfigError
from fedseg.foundation.messages import Reply, Task
from fedseg.seams.algorithm import Algorithm, Candidate, ServerContext
from fedseg.site.batches import steps_per_round
from fedseg.site.calls import Asks
from fedseg.site.runtime import Site

Normalize = Literal["none", "steps"]
"""FedAvg's ``normalize``: 'steps' (each site's update divided by its local steps, FedNova) or 'none' (the plain average)."""


def aggregation_weights(num_samples: Sequence[int], weighting: str) -> list[float]:
    """FedAvg's p_k (:data:`~fedseg.algorithms.weighting.Weighting`): ``"samples"`` → n_k / n, ``"even"`` → 1 / K."""
    if weighting == "samples":
        total = sum(num_samples)
        if total <= 0:
            raise ValueError(f"sites reported {list(num_samples)} training samples; cannot weight by samples")
        return [n / total for n in num_samples]
    if weighting == "even":
        return [1.0 / len(num_samples)] * len(num_samples)
    raise ValueError(f"unknown weighting {weighting!r}; use 'samples' or 'even'")


@dataclass(frozen=True)
class FedAvgParams:
    """Settings of FedAvg.

    weighting
        'samples' (p_k = n_k / n, the papers' FedAvg) or 'even' (p_k = 1/K)
        (:data:`~fedseg.algorithms.weighting.Weighting`).
    aggregation
        'mean' (Σ_k p_k w_k, the papers' FedAvg), 'trimmed_mean' or 'median'
        (coordinate-wise, robust to a hostile or broken site; :func:`fedseg.foundation.arrays.aggregate`).
    trim
        Fraction of sites dropped at each end per coordinate by 'trimmed_mean', in [0, 0.5).

    The settings of FedProx and FedSM extend these (:class:`~fedseg.algorithms.fedprox.FedProxParams`,
    :class:`~fedseg.algorithms.fedsm.params.FedSMParams`); ``section`` names their config section in errors.
    """

    section: ClassVar[str] = "fedavg"
    weighting: Weighting = "samples"
    aggregation: Aggregation = "mean"
    """How site models are combined: 'mean' (weighted average, the paper), 'trimmed_mean' or 'median' (coordinate-wise, robust to a hostile or broken site)."""
    trim: float = 0.1
    """Fraction of sites dropped at each end per coordinate by 'trimmed_mean', in [0, 0.5)."""

    def validate(self) -> None:
        check_aggregation(self.aggregation, self.trim, self.section)


@dataclass(frozen=True)
class FedAvgRunParams(FedAvgParams):
    """Settings of FedAvg: sample weights and the step-normalized average (FedNova's standard form) by default,
    chosen by measurement (docs/results/defaults.md); ``--set fedavg.normalize=none`` is the papers' FedAvg.

    normalize
        'steps': each site's update is divided by its local steps of the round and the weighted mean of those
        rescaled by the weighted mean of the steps (FedNova); 'none': the plain weighted average of the models.
    """

    weighting: Weighting = "samples"
    normalize: Normalize = "steps"
    """'steps': average the sites' updates per local step and scale by the mean steps (FedNova: a site's share of the global model does not grow with its steps a round); 'none': the plain average of the models (the papers')."""

    def validate(self) -> None:
        super().validate()
        if self.normalize not in ("none", "steps"):
            raise ConfigError(f"{self.section}.normalize = {self.normalize!r}; use 'steps' or 'none'")


def sent_update(site: Site, task: Task, role: str, start: Arrays) -> Arrays:
    """What a FedAvg-style site sends after training ``role`` from ``start``: its weights, or under
    ``privacy.dp = "client"`` ``start`` plus its clipped update with its share of the noise
    (``site.dp.client_update``; K = the sites it masks with under secure aggregation)."""
    if site.cfg.privacy.dp == "client":
        return prefixed(role, site.dp.client_update(role, start, task))
    return prefixed(role, site.arrays(role))


def rescale(start: Arrays, mean: Arrays, factor: float) -> Arrays:
    """``start + factor · (mean − start)`` for floating-point tensors (others as in ``mean``)."""
    out: Arrays = {}
    for k, v in mean.items():
        s = start.get(k)
        out[k] = v if s is None or not is_float(v) else s + factor * (v - s)
    return out


def step_update(start: Arrays, sent: Arrays, steps: int) -> Arrays:
    """``(sent − start) / steps`` for floating-point tensors (others as sent): the update per local step that a
    site sends under ``normalize = "steps"`` when the server sees only the sum (secure aggregation) or the site
    clips and noises its update (client-level DP)."""
    out: Arrays = {}
    for k, v in sent.items():
        s = start.get(k)
        out[k] = v if s is None or not is_float(v) else (v - s) / steps
    return out


def apply_update(start: Arrays, update: Arrays, factor: float) -> Arrays:
    """``start + factor · update`` for floating-point tensors (others as in ``update``): the server's side of
    :func:`step_update`, with ``factor`` = τ̄."""
    out: Arrays = {}
    for k, u in update.items():
        s = start.get(k)
        out[k] = u if s is None or not is_float(u) else s + factor * u
    return out


def train_global(site: Site, task: Task, role: str = "global") -> Asks[Reply]:
    """Site half of FedAvg-style methods: load the sent model, train it one round, send it back (its update per
    local step when the task asks for ``normalize``: :func:`step_update`)."""
    start = strip_prefix(role, task.arrays)
    site.load(role, start)
    opt = site.optimizer(role, reset=site.cfg.train.reset_optimizer)
    metrics = yield from site.fit(role, task.config["round"], optimizer=opt, steps=task.config.get("steps"))
    if task.config.get("normalize") == "steps":
        steps = max(1, int(metrics["steps"]))
        if site.cfg.privacy.dp == "client":  # the clipped, noised update divided: the server's τ̄ is post-processing
            sent = step_update(start, strip_prefix(role, sent_update(site, task, role, start)), steps)
        else:
            sent = step_update(start, site.arrays(role), steps)
        return Reply(arrays=prefixed(role, sent), metrics=metrics, num_samples=site.num_train)
    return Reply(arrays=sent_update(site, task, role, start), metrics=metrics, num_samples=site.num_train)


class FedAvg(Algorithm):
    name = "fedavg"
    title = "FedAvg"
    section = "fedavg"
    Params: ClassVar[type] = FedAvgRunParams
    sends_clipped_update: ClassVar[bool] = True
    """Its site half sends :func:`sent_update` (client-level DP's clipped, noised update when asked)."""
    summed_kinds: ClassVar[frozenset[str]] = frozenset({"train"})

    def weighting(self) -> Weighting:
        return self.params.weighting

    def secure_aggregation_unsupported(self) -> str | None:
        rule = getattr(self.params, "aggregation", "mean")
        if rule != "mean":
            return (
                f"{self.section}.aggregation = {rule!r} ranks the sites' values coordinate by coordinate, which needs "
                f"every site's model (use --set {self.section}.aggregation=mean)"
            )
        return None

    def normalize(self) -> str:
        """``normalize`` of the method's settings; 'none' for subclasses whose settings have none (FedProx, FWA)."""
        return getattr(self.params, "normalize", "none")

    def _steps(self, ctx: ServerContext, counts: Sequence[int]) -> list[int]:
        """τ_k: the local steps of a round over n_k training cases as the run's settings count them
        (:func:`~fedseg.site.runtime.steps_per_round`, what each site trains); a site's own report of its steps
        does not scale the global step."""
        return [steps_per_round(ctx.cfg.train, n) for n in counts]

    def server_round(self, ctx: ServerContext, state: Arrays, rnd: int) -> tuple[Arrays, dict[str, Any]]:
        config: dict[str, Any] = {"round": rnd}
        normalize = self.normalize()
        # the sites send their update per step (step_update) when the server sees only a sum (secure aggregation)
        # or each update is clipped and noised at the site (client-level DP): the server's τ̄ is then
        # post-processing of the mean; otherwise the server weighs the sites' plain models
        at_site = normalize == "steps" and (ctx.cfg.privacy.secure_aggregation or ctx.cfg.privacy.dp == "client")
        if at_site:
            config["normalize"] = normalize
        task = Task("train", state, config)
        new = dict(state)
        if ctx.cfg.privacy.secure_aggregation:  # the sites mask n_k · w_k (or w_k); the server unmasks the sum only
            result = secure_ask(ctx, {s: task for s in ctx.sites}, self.weighting())
            if result.rejected:  # a replayed or misdirected masked input: no update this round
                ctx.log(f"[secagg] round {rnd}: the global model keeps its previous weights")
            mean = result.mean()  # empty when rejected
            replies = result.replies
            if mean and at_site:
                counts = [replies[s].num_samples for s in replies]
                p = aggregation_weights(counts, self.weighting())
                mean = apply_update(state, mean, sum(pk * t for pk, t in zip(p, self._steps(ctx, counts))))
            new.update(mean)
            return new, {"train_loss": {s: replies[s].metrics.get("loss") for s in replies}}
        replies = ctx.ask({s: task for s in ctx.sites})
        names = list(replies)
        counts = [replies[s].num_samples for s in names]
        p = aggregation_weights(counts, self.weighting())
        rule = (
            getattr(self.params, "aggregation", "mean"),
            getattr(self.params, "trim", 0.0),
        )  # subclasses with their own settings: mean
        models = [replies[s].arrays for s in names]
        if normalize == "steps":
            steps = self._steps(ctx, counts)
            mean_steps = sum(pk * t for pk, t in zip(p, steps))
            if at_site:  # client-level DP: the sites sent their clipped, noised updates per step
                new.update(apply_update(state, aggregate(models, p, *rule), mean_steps))
                return new, {"train_loss": {s: replies[s].metrics.get("loss") for s in names}}
            if len(set(steps)) > 1:  # equal steps: FedNova's average is the plain one (kept bitwise)
                models = [rescale(state, m, mean_steps / t) for m, t in zip(models, steps)]
        new.update(aggregate(models, p, *rule))
        return new, {"train_loss": {s: replies[s].metrics.get("loss") for s in names}}

    def candidates(self, state: Arrays, ctx: ServerContext) -> list[Candidate]:
        return [Candidate("global", strip_prefix("global", state))]

    def dp_client_unsupported(self) -> str | None:
        """Client-level DP bounds one site's part of the plain mean of the updates: the sites' noise shares
        sum to N(0, σ²C²) on Σ_k Δ̃_k, which the server divides by K.  Weights n_k / n or a robust rule would
        change that sensitivity, so they refuse it; so does a subclass whose site half sends no clipped
        update (:attr:`sends_clipped_update`)."""
        if not self.sends_clipped_update:
            return "its site half does not send a clipped, noised update"
        p = self.params
        if getattr(p, "weighting", "even") != "even" or getattr(p, "aggregation", "mean") != "mean":
            section = self.section or self.name
            return (
                f"it needs the plain mean of the clipped updates: set {section}.weighting = 'even' and "
                f"{section}.aggregation = 'mean' (--set {section}.weighting=even), or use method fedavg-even"
            )
        return None

    def dp_steps_per_round(self, cfg, n: int) -> int | None:
        """DP-SGD: every local step of the round (``Site.fit``) is privatized."""
        return steps_per_round(cfg.train, n)

    def site_handlers(self):
        return {"train": train_global}


class FedAvgEven(FedAvg):
    name = "fedavg-even"
    title = "FedAvg - even"

    @classmethod
    def parse_params(cls, cfg) -> FedAvgParams:
        """``[fedavg]``'s settings with ``weighting = "even"`` and the plain average (``normalize = "none"``)
        whatever that section says: what this method runs, so ``config.toml`` and ``results.json["config"]``
        record it."""
        return dataclasses.replace(super().parse_params(cfg), weighting="even", normalize="none")
