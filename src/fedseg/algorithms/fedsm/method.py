"""FedSM the method: its server half and its site half, for FedSM, FedSM-extra and the ensemble
(the overview: :mod:`fedseg.algorithms.fedsm`; the settings: :mod:`.params`).

The personalized models are made by a :class:`~fedseg.algorithms.personal.Personalization`
(``fedsm.personalization``: SoftPull, the paper's, or a Table 6 method, :data:`PERSONALIZATIONS`);
the selector is trained by :mod:`fedseg.algorithms.fedsm.selector` and routes by
:mod:`fedseg.algorithms.fedsm.selection`; the candidates, their validation in one pass over each site's cases
and the final assembly are :class:`~fedseg.algorithms.fedsm.candidates.FedSMCandidates`' (:mod:`.candidates`,
the sites' half in :mod:`.validation`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from fedseg.algorithms.apfl import APFL
from fedseg.algorithms.ditto import Ditto
from fedseg.algorithms.fedavg import aggregation_weights
from fedseg.algorithms.fedsm import fedaws
from fedseg.algorithms.fedsm import secure as sm_secure
from fedseg.algorithms.fedsm import selector as sel_training
from fedseg.algorithms.fedsm.candidates import FedSMCandidates
from fedseg.algorithms.fedsm.params import FedSMParams
from fedseg.algorithms.fedsm.selection import (
    check_route_metrics,
    classes_of,
    composite_predict,
    load_composite,
    thresholds,
)
from fedseg.algorithms.fedsm.validation import route_stats
from fedseg.algorithms.fga import FP16_GRADIENT_AVERAGING, gradient_step, lockstep_round, without_resync
from fedseg.algorithms.ft import FT
from fedseg.algorithms.perfedavg import PerFedAvg
from fedseg.algorithms.personal import Personalization
from fedseg.algorithms.pfedme import PFedMe
from fedseg.algorithms.softpull import SoftPull, check_lambda
from fedseg.foundation.arrays import Arrays, aggregate, clone, prefixed
from fedseg.foundation.config import RunConfig
from fedseg.foundation.errors import ConfigError, PayloadError
from fedseg.foundation.messages import Reply, Task
from fedseg.seams.algorithm import ServerContext
from fedseg.site.batches import steps_per_round
from fedseg.site.calls import Asks
from fedseg.site.runtime import Site

__all__ = ["PERSONALIZATIONS", "FedSM", "FedSMEnsemble", "FedSMExtra"]

#: ``fedsm.personalization`` → the :class:`~fedseg.algorithms.personal.Personalization` that makes
#: the personalized models, built from the run config (a method's settings come from its own
#: section, e.g. ``ditto.lam``; SoftPull's λ is ``fedsm.lam``).
PERSONALIZATIONS: dict[str, Callable[[RunConfig, FedSMParams], Personalization]] = {
    "softpull": lambda cfg, params: SoftPull(params.lam, train_global=params.global_training != "fga"),
    "ft": lambda cfg, params: FT.personalization(cfg),
    "apfl": lambda cfg, params: APFL.personalization(cfg),
    "perfedavg": lambda cfg, params: PerFedAvg.personalization(cfg),
    "pfedme": lambda cfg, params: PFedMe.personalization(cfg),
    "ditto": lambda cfg, params: Ditto.personalization(cfg),
}


class FedSM(FedSMCandidates):
    """FedSM: global + SoftPull personalized models + model selector (Alg. 1, Alg. 2)."""

    name = "fedsm"
    title = "FedSM"
    section = "fedsm"
    Params = FedSMParams
    primary = "fedsm"
    labels = "site"  # Eq. 2
    mode = "gate"  # Alg. 2
    two_phase = False

    @classmethod
    def parse_params(cls, cfg) -> FedSMParams:
        """``[fedsm]`` validated, with the settings left unset filled in from ``fedsm.profile`` (for this
        variant: its selector learns Eq. 2's site labels, or targets from the models' losses)."""
        return super().parse_params(cfg).resolved(site_labels=cls.labels == "site")

    def __init__(self, cfg: RunConfig):
        super().__init__(cfg)
        self.selector_rounds = 0
        if self.two_phase:
            if cfg.rounds < 2:
                raise ConfigError(
                    f"{self.name} needs rounds >= 2 (model rounds, then selector rounds); got rounds = {cfg.rounds}"
                )
            s = self.params.selector_rounds if self.params.selector_rounds is not None else math.ceil(cfg.rounds / 3)
            if not 1 <= s < cfg.rounds:
                raise ConfigError(
                    f"fedsm.selector_rounds = {s} must be between 1 and rounds - 1 = {cfg.rounds - 1}: "
                    "the first rounds train the global and personalized models, the last ones the selector"
                )
            self.selector_rounds = s
        if self.params.gamma_margin > 0 and (
            self.params.gamma != "auto-per-model" or 1.0 not in self.params.gamma_grid
        ):
            raise ConfigError(
                f"fedsm.gamma_margin = {self.params.gamma_margin} applies to fedsm.gamma = 'auto-per-model' with 1.0 "
                f"in fedsm.gamma_grid (got gamma = {self.params.gamma!r}, grid {list(self.params.gamma_grid)}); "
                "set both, or fedsm.gamma_margin = 0"
            )
        self.personal: Personalization = PERSONALIZATIONS[self.params.personalization](cfg, self.params)
        """How the personalized models are made (SoftPull, or a Table 6 method's personalization)."""
        self.selector_factory = sel_training.selector_factory(self.params.selector_width, self.params.selector_hidden)
        self._aws_head: str | None = None  # fedaws: the selector's class-embedding layer (_fedaws_step)

    def label(self) -> str:
        """ "FedSM" (…-extra, …-ensemble), with the personalization in brackets when it is not SoftPull
        (Table 6: "FedSM (Ditto)")."""
        return self.title if isinstance(self.personal, SoftPull) else f"{self.title} ({self.personal.title})"

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), **self.personal.settings()}

    def resolved_params(self) -> dict[str, dict[str, Any]]:
        return {**super().resolved_params(), **self.personal.settings()}

    # ------------------------------------------------------------ helpers
    def model_factory(self, site: Site, role: str) -> Callable[[], nn.Module] | None:
        c = classes_of(role)
        return None if c is None else self.selector_factory(site, c)

    # --------------------------------------------------------- server half
    def init_state(self, ctx: ServerContext) -> Arrays:
        try:
            if isinstance(self.personal, SoftPull):
                check_lambda(self.params.lam, len(ctx.sites))
        except ValueError as e:
            raise ConfigError(f"{self.name}: {e}") from None
        init = ctx.init_arrays("global")
        state = prefixed("global", init)
        for s in ctx.sites:
            # own copies: tensors the sites never send back (batch-norm statistics under
            # train.bn_policy = "local") must not be shared between entries of the checkpoint
            state.update(prefixed(f"personal/{s}", clone(init)))
        if not self.two_phase:
            state.update(self._init_selector(ctx))
        return state

    def _init_selector(self, ctx: ServerContext) -> Arrays:
        c = self.num_classes(len(ctx.sites))
        return sel_training.init_selector(ctx, c, self.params.selector_width, self.params.selector_hidden)

    def phase(self, rnd: int) -> str:
        if not self.two_phase:
            return "joint"
        return "models" if rnd <= self.cfg.rounds - self.selector_rounds else "selector"

    def first_selector_round(self) -> int:
        """The first round that trains the selector (1, or the first round of the selector phase)."""
        return self.cfg.rounds - self.selector_rounds + 1 if self.two_phase else 1

    def server_round(self, ctx: ServerContext, state: Arrays, rnd: int) -> tuple[Arrays, dict[str, Any]]:
        phase = self.phase(rnd)
        new = dict(state)
        if phase == "selector" and not any(k.startswith("selector/") for k in state):
            new.update(self._init_selector(ctx))
        by_fga = self.params.selector_training == "fga"
        train_models = phase in ("joint", "models")
        train_selector = phase in ("joint", "selector")
        before = {k: v for k, v in new.items() if k.startswith("selector/")}
        metrics: dict[str, Any] = {"phase": phase}
        if train_models or (train_selector and not by_fga):
            metrics.update(self._train_round(ctx, state, new, rnd, phase, train_selector and not by_fga))
        if train_models and self.global_by_fga:
            metrics.update(self._global_fga_round(ctx, state, new, rnd))
        if train_selector and by_fga:
            sites = list(ctx.sites)
            config = {"phase": phase, "sites": sites, "num_classes": self.num_classes(len(sites)), "mode": self.mode}
            metrics.update(
                sel_training.fga_round(
                    ctx, new, rnd, config, rnd == self.first_selector_round(), self.params.max_selector_steps
                )
            )
        if train_selector:
            sel_training.keep_best_selector(new, before, metrics.get("routing_acc"), rnd - 1)
        return new, metrics

    @property
    def global_by_fga(self) -> bool:
        """The global model trains by lockstep gradient averaging (``fedsm.global_training = "fga"``)."""
        return self.params.global_training == "fga"

    def _global_fga_round(self, ctx: ServerContext, state: Arrays, new: Arrays, rnd: int) -> dict[str, Any]:
        """One round of the global model's gradient averaging (``"global_step"`` lockstep exchanges,
        :func:`fedseg.algorithms.fga.lockstep_round`), on the same seeded batches as the round's
        personalized-model steps; the sites' global models and Adam moments persist across rounds (Alg. 1 of
        the third paper), so the initial weights go out with the first round only (and to a stale site)."""
        first = {k: v for k, v in state.items() if k.startswith("global/")} if rnd == 1 else {}
        weights, m, _ = lockstep_round(
            ctx, rnd, kind="global_step", first=first, weighting=self.params.weighting, prefix="global", state=state
        )
        kept = without_resync(new, "global")  # resync entries: only while a deployed site is stale
        new.clear()
        new.update({**kept, **weights})
        out: dict[str, Any] = {"train_loss": m["train_loss"], "global_steps": m["steps"]}
        if "in_sync" in m:
            out["global_in_sync"] = m["in_sync"]
        if "stale" in m:
            out["global_stale"] = m["stale"]
        return out

    def _train_round(
        self, ctx: ServerContext, state: Arrays, new: Arrays, rnd: int, phase: str, train_selector: bool
    ) -> dict[str, Any]:
        """One ``"train"`` task per site (models and/or the locally trained selector), aggregated into ``new``."""
        sites = list(ctx.sites)
        train_models = phase in ("joint", "models")
        base = {
            "round": rnd,
            "phase": phase,
            "sites": sites,
            "num_classes": self.num_classes(len(sites)),
            "mode": self.mode,
            "train_selector": train_selector,
        }
        shared: Arrays = {}
        if train_models and not self.global_by_fga:
            shared.update({k: v for k, v in new.items() if k.startswith("global/")})
        if train_selector:
            shared.update({k: v for k, v in new.items() if k.startswith(("selector/", "selector_optim/"))})
            if phase == "selector":
                shared.update({k: v for k, v in new.items() if k.startswith(("global/", "personal/"))})
        tasks = {}
        for s in sites:
            arrays = dict(shared)
            if train_models and self.personal.server_holds_personal:
                # SoftPull: each site trains the personalized model the server holds for it (the other
                # personalizations keep their state at the site, or start from w_r); under secure aggregation
                # the server holds them only until the first round has sent them
                arrays.update({k: v for k, v in new.items() if k.startswith(f"personal/{s}/")})
            tasks[s] = Task("train", arrays, dict(base))
        if self.secure:
            replied = sm_secure.train_round(self, ctx, tasks, new, rnd, train_models, train_selector)
            return self._round_metrics(replied)
        replies = ctx.ask(tasks)
        names = [s for s in sites if s in replies]
        if not names:
            raise PayloadError(f"{self.name}: no site replied in round {rnd}")
        replied = {s: replies[s] for s in names}
        counts = [replies[s].num_samples for s in names]
        if train_models:
            p = aggregation_weights(counts, self.params.weighting)
            new.update(self.personal.server_step(state, replied, sites, p, self._combine))
        if train_selector:
            new.update(
                sel_training.average_selector(
                    replied, counts, self.params.selector_weighting, self.params.share_selector_moments
                )
            )
            if self.params.selector_training == "fedaws" and phase == "joint":
                new.update(self._fedaws_step(ctx, new, replied))
        return self._round_metrics(replied)

    @staticmethod
    def _round_metrics(replies: dict[str, Reply]) -> dict[str, Any]:
        """The round's per-site training metrics from the ``"train"`` replies."""
        names = list(replies)
        metrics: dict[str, Any] = {}
        for key, mkey in (
            ("train_loss", "loss"),
            ("personal_loss", "personal_loss"),
            ("selector_loss", "selector_loss"),
            ("routing_acc", "routing_acc"),
            ("alpha", "alpha"),
        ):
            vals = {s: replies[s].metrics.get(mkey) for s in names}
            if any(v is not None for v in vals.values()):
                metrics[key] = vals
        return metrics

    def secure_aggregation_unsupported(self) -> str | None:
        return sm_secure.unsupported(self)

    def summed(self, task: Task) -> bool:
        """The round's ``"train"`` reply (:func:`.secure.train_round`) and each lockstep step's gradient of the
        selector or the global model (``step`` set) are summed."""
        if task.kind in ("selector_step", "global_step"):
            return task.config.get("step") is not None
        return task.kind == "train"

    def _fedaws_step(self, ctx: ServerContext, averaged: Arrays, replied: dict[str, Reply]) -> Arrays:
        """FedAwS's server step on the averaged Eq. 2 selector (:func:`.fedaws.server_step`): each class
        embedding from its site, then the spread-out step."""
        sites = list(ctx.sites)
        c = self.num_classes(len(sites))
        if self._aws_head is None:  # the class-embedding layer of the run's selector, found once
            assert ctx.workload is not None  # init_state built the run's selector from it
            with torch.random.fork_rng(devices=[]):  # building it must not draw from the run's generators
                model = ctx.workload.selector(c, self.params.selector_width, self.params.selector_hidden)
            self._aws_head = fedaws.class_head(model, c)
        head = self._aws_head
        own = {sites.index(s): r.arrays for s, r in replied.items()}
        return fedaws.server_step(averaged, own, head, self.params.fedaws_nu, self.params.fedaws_lr)

    def _combine(self, models: Sequence[Arrays], weights: Sequence[float]) -> Arrays:
        """How the global model is combined: ``fedsm.aggregation`` (mean, trimmed mean, median)."""
        return aggregate(models, weights, self.params.aggregation, self.params.trim)

    def check_reply(self, task: Task, reply: Reply) -> None:
        """A ``"route"`` reply must have the layout :func:`pick_gamma` / :func:`pick_gamma_per_model` and the
        routing reports read (:func:`check_route_metrics`); a training or selector-step reply's
        ``routing_acc`` (which picks the best selector, :func:`keep_best_selector`) must be null or in [0, 1]:
        one site reporting 10³⁰ would otherwise pin the best selector to any round it likes."""
        if task.kind == "route":
            check_route_metrics(task.config, reply.metrics)
            return
        acc = reply.metrics.get("routing_acc")
        ok = acc is None or (isinstance(acc, (int, float)) and (math.isnan(acc) or 0.0 <= acc <= 1.0))
        if not ok:  # (NaN: a site without validation cases; the mean leaves it out)
            raise PayloadError(f"{task.kind} reply: routing_acc {acc!r} is not null or in [0, 1]")

    # ----------------------------------------------------------- site half
    def site_handlers(self):
        return {
            "train": self._train,
            "route": self._route,
            "selector_step": self._selector_step,
            "global_step": self._global_step,
            "fedsm_pull": sm_secure.pull,
            "fedsm_release": sm_secure.release,
        }

    def fp16_unsupported(self) -> str | None:
        if self.global_by_fga:
            return FP16_GRADIENT_AVERAGING + ", used by FedSM's global model (fedsm.global_training = 'fga')"
        if self.params.selector_training == "fga":
            return (
                FP16_GRADIENT_AVERAGING
                + ", used by FedSM's selector (fp16 runs with --set fedsm.selector_training=fedavg)"
            )
        # called while Algorithm.__init__ runs, before self.personal is set
        return PERSONALIZATIONS[self.params.personalization](self.cfg, self.params).fp16_unsupported()

    def dp_sample_unsupported(self) -> str | None:
        """DP-SGD privatizes the global and personalized models' local steps (``Site.fit``, or the global
        model's lockstep gradients) and the selector's lockstep gradients (``Site.gradient``); the
        selector's own local loops (``"fedavg"``, ``"fedrs"``, ``"fedaws"``) and the Table 6
        personalizations' loops are not privatized, so they refuse it."""
        if self.params.selector_training != "fga":
            return (
                f"fedsm.selector_training = {self.params.selector_training!r} trains the selector in a loop of its "
                "own; use --set fedsm.selector_training=fga (its exchanged gradients are privatized)"
            )
        if self.params.personalization != "softpull":
            return (
                f"fedsm.personalization = {self.params.personalization!r} trains in a loop of its own; "
                "use --set fedsm.personalization=softpull"
            )
        return None

    def dp_steps_per_round(self, cfg: RunConfig, n: int) -> int | None:
        """The global and personalized models' local steps (2 × the site's steps per round) and the selector's
        lockstep steps (at most ``fedsm.selector_steps``); with two phases the larger phase's count for every
        round (a plan that over-counts, so the derived σ spends at most ε)."""
        spr = steps_per_round(cfg.train, n)
        cap = self.params.max_selector_steps
        selector = spr if cap is None else min(cap, spr)
        return max(2 * spr, selector) if self.two_phase else 2 * spr + selector

    def dp_batches_per_round(self, cfg: RunConfig, n: int) -> tuple[int, int]:
        """The round's privatized batches and the models trained on each: the global and personalized
        models train on the same batches of a round (``site.batches(round, "train")``), and in the joint phase
        the selector's lockstep steps take the first of them again, so each batch is booked once at σ/√m
        (:mod:`fedseg.site.dp`).  Planned: the site's steps per round, each with 3 models (joint, with a
        selector step) or 2 — an over-count where some batches carry fewer models."""
        spr = steps_per_round(cfg.train, n)
        cap = self.params.max_selector_steps
        selector = spr if cap is None else min(cap, spr)
        if self.two_phase:
            return max(spr, selector), 2
        return spr, 3 if selector > 0 else 2

    def predictors(self):
        def make(site: Site, arrays: Arrays, config: dict) -> Callable[[torch.Tensor], torch.Tensor]:
            sel, models = load_composite(site, arrays, config, self.selector_factory, "fedsm-eval/")
            return composite_predict(site, sel, models, config.get("mode", "gate"), thresholds(config))

        return {**super().predictors(), "fedsm": make, sm_secure.HELD: sm_secure.held_predictor}

    def _train(self, site: Site, task: Task) -> Asks[Reply]:
        """Site half of a round: the personalization's site step (global and personalized models) and/or
        the selector's local steps (``selector_training = "fedavg"``, ``"fedrs"`` or ``"fedaws"``), on the round's seeded batches."""
        cfg = task.config
        phase, sites = cfg["phase"], list(cfg["sites"])
        if site.name not in sites:
            raise PayloadError(f"site {site.name}: asked to train FedSM but not among the sites {sites}")
        metrics: dict[str, Any] = {}
        out: Arrays = {}
        steps = 0
        if phase in ("joint", "models"):
            step = yield from self.personal.site_step(site, task)
            if not self.global_by_fga:  # (by fga: trained in the round's "global_step" exchanges)
                out.update(prefixed("global", site.arrays("global")))
            # under secure aggregation one name at every site: the server sums them (S, for each site's SoftPull)
            mine = sm_secure.PERSONAL_SUM if site.cfg.privacy.secure_aggregation else f"personal/{site.name}"
            out.update(prefixed(mine, site.arrays("personal")))
            out.update(step.extra)
            metrics.update(step.metrics)
            steps = step.metrics["steps"]
        if phase in ("joint", "selector") and cfg.get("train_selector", True):
            arrays, sel_metrics, batches = sel_training.train_locally(
                site,
                task,
                self.selector_factory,
                self.labels,
                self.params.selector_lr,
                self.params.max_selector_steps,
                self.params.share_selector_moments,
                self.params.fedrs_alpha if self.params.selector_training == "fedrs" else None,
                self.params.fedaws_margin if self.params.selector_training == "fedaws" else None,
            )
            out.update(arrays)
            metrics.update(sel_metrics)
            steps = steps if phase == "joint" else batches
        metrics["steps"] = steps
        return Reply(arrays=out, metrics=metrics, num_samples=site.num_train)

    def _global_step(self, site: Site, task: Task) -> Asks[Reply]:
        """One lockstep exchange of the global model's gradient averaging (``fedsm.global_training = "fga"``;
        :func:`fedseg.algorithms.fga.gradient_step` with the workload loss)."""
        return (yield from gradient_step(site, task, role="global", prefix="global"))

    def _selector_step(self, site: Site, task: Task) -> Asks[Reply]:
        """One lockstep exchange of the selector's gradient averaging (:func:`.selector.fga_step`)."""
        return (
            yield from sel_training.fga_step(site, task, self.selector_factory, self.labels, self.params.selector_lr)
        )

    def _route(self, site: Site, task: Task) -> Reply:
        """Routing statistics of a composite on one split (:func:`.selection.route_stats`)."""
        return route_stats(site, task, self.selector_factory)


class FedSMExtra(FedSM):
    """FedSM-extra (Section 3.1.2): selector trained in extra rounds with Eq. 1 labels."""

    name = "fedsm-extra"
    title = "FedSM-extra"
    labels = "oracle"
    mode = "argmax"
    two_phase = True

    def __init__(self, cfg: RunConfig):
        super().__init__(cfg)
        self.labels = self.params.extra_objective
        if self.labels == "experts":
            # with Eq. 1's labels the selectors are compared by agreement with them (routing accuracy), as
            # FedSM's; the experts objective does not aim at those one-hot labels where the models' losses on
            # an image are within about τ, so that agreement would be a noisy score: the composite's Dice
            self.selector_criterion = "dice"


class FedSMEnsemble(FedSM):
    """FedSM ensemble (Section 3.1.1): inference is the softmax-weighted mix of all models' outputs; the
    selector is trained on the mixture-of-experts objective of the models' per-image losses
    (``fedsm.ensemble_objective = "experts"``, default) or through the loss of the mix itself (``"mix"``,
    the paper's)."""

    name = "fedsm-ensemble"
    title = "FedSM-ensemble"
    labels = "experts"
    mode = "mix"
    two_phase = True

    selector_criterion = "dice"
    """The validation Dice of the assembled mix, always measured on the assembled models: the output is the
    mix, and a selector with Eq. 1's argmax but flatter weights mixes in worse models (routing accuracy can
    keep a half-trained selector that still puts much of its weight on the global model)."""

    def __init__(self, cfg: RunConfig):
        super().__init__(cfg)
        self.labels = self.params.ensemble_objective
