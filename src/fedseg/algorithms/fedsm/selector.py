"""Training FedSM's model selector, at the sites and on the server.

Two ways (``fedsm.selector_training``):

* ``"fedavg"`` (reference, Alg. 1): local selector steps on the round's first batches
  (:func:`train_locally`), then the server averages the selector — and its Adam moments — with
  weights n_k / n or 1 / K (:func:`average_selector`);
* ``"fga"`` (default profile): every selector step is a lockstep exchange of federated gradient
  averaging (:func:`fga_round` on the server, :func:`fga_step` at the sites).
* ``"fedrs"``: as ``"fedavg"``, with FedRS's restricted softmax in the local loss of Eq. 2's
  labels (:func:`restricted_logits`).
* ``"fedaws"``: as ``"fedavg"``, with FedAwS's positive-only local loss and the server's
  spread-out step (:mod:`fedseg.algorithms.fedsm.fedaws`).

Labels: Eq. 2 (the site's own position, joint phase of FedSM), Eq. 1 (the model with the lowest
loss on the image, FedSM-extra), or for the ensemble (``fedsm.ensemble_objective``) the frozen models'
per-image losses of its mixture-of-experts objective (``"experts"``, :class:`ExpertsLoss`) or the
loss of the softmax-weighted output mix (``"mix"``, the paper's, :class:`MixLoss`);
:func:`selector_loss` (:func:`selector_target` + :func:`selector_objective`, kept apart by lockstep
gradient averaging so that a vectorized simulation computes all sites' gradients in one call).
The frozen global and personalized models of a selector-phase round are loaded at the site by
:func:`load_frozen`.  The server keeps the selector with the best validation
routing accuracy so far (:func:`keep_best_selector`).  The selector network comes from the
workload (``Workload.selector``), on the server (:func:`init_selector`) as at the sites
(:func:`selector_factory`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from fedseg.algorithms.fedavg import aggregation_weights
from fedseg.algorithms.fedsm import fedaws
from fedseg.algorithms.fedsm.selection import (
    SelectorFactory,
    mean_routing,
    oracle_accuracy,
    selector_probs,
    selector_role,
)
from fedseg.algorithms.gradients import optimizer_moments, set_optimizer_moments
from fedseg.algorithms.lockstep import gradient_step, lockstep_round, without_resync
from fedseg.algorithms.softpull import ensemble_mix, experts_loss, image_losses, oracle_labels, routing_accuracy
from fedseg.foundation.arrays import Arrays, prefixed, strip_prefix, weighted_mean
from fedseg.foundation.errors import ConfigError, PayloadError
from fedseg.foundation.messages import Reply, Task
from fedseg.seams.algorithm import Algorithm, ServerContext
from fedseg.site.batches import dataset_len
from fedseg.site.calls import Asks
from fedseg.site.runtime import Site

__all__ = [
    "ExpertsLoss",
    "MixLoss",
    "augment_for_selector",
    "average_selector",
    "fga_round",
    "fga_step",
    "flip_batch",
    "frozen_roles",
    "init_selector",
    "keep_best_selector",
    "load_frozen",
    "restricted_logits",
    "routing_accuracy_at",
    "selector_factory",
    "selector_loss",
    "selector_objective",
    "selector_target",
    "train_locally",
]


def selector_factory(width: float, hidden: int) -> SelectorFactory:
    """``factory(site, num_classes)``: the site's workload selector (``Workload.selector``) of this size."""

    def factory(site: Site, num_classes: int) -> Callable[[], nn.Module]:
        return lambda: site.workload.selector(num_classes, width=width, hidden=hidden)

    return factory


def init_selector(ctx: ServerContext, num_classes: int, width: float, hidden: int) -> Arrays:
    """The seeded initial selector ``selector/…`` (the run's workload selector, as the sites build it)."""
    workload = ctx.workload
    if workload is None:
        raise ConfigError(
            "fedsm: the server context has no workload to build the selector from (ServerContext.workload)"
        )
    role = selector_role(num_classes)
    # ServerContext.init_arrays is declared as init_arrays(role); the engine's also takes the model's factory
    init_arrays = cast(Callable[..., Arrays], ctx.init_arrays)
    return prefixed("selector", init_arrays(role, factory=lambda: workload.selector(num_classes, width, hidden)))


# ------------------------------------------------------------------ at a site
def frozen_roles(sites: Sequence[str]) -> list[str]:
    return ["frozen/global", *(f"frozen/p{j}" for j in range(len(sites)))]


def load_frozen(site: Site, arrays: Arrays, sites: Sequence[str]) -> list[nn.Module]:
    """The frozen global and personalized models of a selector-phase round, loaded at the site (eval mode)."""
    names = ["global", *(f"personal/{s}" for s in sites)]
    bn = [
        "global",
        *("personal" if s == site.name else "global" for s in sites),
    ]  # train.bn_policy = "local": the site's own statistics
    frozen = [
        site.load(role, strip_prefix(name, arrays), bn_from=b) for role, name, b in zip(frozen_roles(sites), names, bn)
    ]
    for m in frozen:
        m.eval()
    return frozen


def selector_target(
    site: Site, x: torch.Tensor, y: torch.Tensor, phase: str, own: int, frozen: Sequence[nn.Module], labels: str
) -> Any:
    """What the selector is trained against on a batch (no gradient flows through it): the site's own
    position (Eq. 2, joint phase), Eq. 1's oracle labels (``labels = "oracle"``) or, for the ensemble,
    the frozen models' (B, K + 1) per-image losses (``"experts"``) or their outputs with the ground
    truth (``"mix"``)."""
    if phase == "joint":
        return torch.full((x.shape[0],), own, dtype=torch.long, device=x.device)
    with torch.no_grad():
        outputs = [m(x) for m in frozen]
    if labels == "oracle":
        return oracle_labels(outputs, y, site.workload.loss)
    if labels == "experts":
        return image_losses(outputs, y, site.workload.loss)
    return (outputs, y)


@dataclass(frozen=True)
class MixLoss:
    """The ensemble's selector loss: the workload loss of the softmax-weighted mix of the frozen models'
    outputs (target ``(outputs, y)``).  A value (equal for equal workload losses), so that the sites'
    gradients can be computed together in a vectorized simulation."""

    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def __call__(self, logits: torch.Tensor, target: tuple[Sequence[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        outputs, y = target
        return self.loss(ensemble_mix(torch.softmax(logits, dim=1), outputs), y)


@dataclass(frozen=True)
class ExpertsLoss:
    """The ensemble's default selector loss (``fedsm.ensemble_objective = "experts"``): the mixture-of-experts
    negative log-likelihood −log Σ_k ŷ_k exp(−(L_k − min L)/τ) of the per-image losses (target, (B, K + 1);
    :func:`fedseg.algorithms.softpull.experts_loss`, whose logit gradient is ŷ − posterior).  A value, as
    :class:`MixLoss`."""

    tau: float

    def __call__(self, logits: torch.Tensor, losses: torch.Tensor) -> torch.Tensor:
        return experts_loss(logits, losses, self.tau)


def selector_objective(site: Site, phase: str, labels: str) -> Callable[[torch.Tensor, Any], torch.Tensor]:
    """The selector's mean loss of its logits and a :func:`selector_target`: cross-entropy (Eq. 2 or Eq. 1
    labels), :class:`ExpertsLoss` (τ = the run's ``fedsm.ensemble_tau``) or :class:`MixLoss`; the same
    function at every site."""
    if phase == "joint" or labels == "oracle":
        return F.cross_entropy
    if labels == "experts":
        return ExpertsLoss(float(cast(Algorithm, site.algorithm).params.ensemble_tau))
    return MixLoss(site.workload.loss)


def restricted_logits(logits: torch.Tensor, present: Sequence[int], alpha: float) -> torch.Tensor:
    """FedRS's restricted softmax (Li & Zhan, KDD 2021): the logits of the classes not in
    ``present`` (those the site holds no sample of) scaled by ``alpha``; the others unchanged."""
    scale = torch.full((logits.shape[-1],), float(alpha), dtype=logits.dtype, device=logits.device)
    scale[list(present)] = 1.0
    return logits * scale


def selector_loss(
    site: Site,
    sel: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    phase: str,
    own: int,
    frozen: Sequence[nn.Module],
    labels: str,
    restrict: float | None = None,
    aws_margin: float | None = None,
) -> torch.Tensor:
    """The selector's mean loss on a batch: Eq. 2 cross-entropy (joint phase; with ``restrict`` = α,
    FedRS's restricted softmax: every class but the site's own is absent, its logit scaled by α; with
    ``aws_margin`` = m, FedAwS's positive-only loss :func:`.fedaws.selector_positive_loss` instead), Eq. 1
    cross-entropy (``labels = "oracle"``, fedsm-extra) or the ensemble's: the mixture-of-experts objective
    (``labels = "experts"``) or the workload loss of the softmax-weighted output mix (``labels = "mix"``);
    :func:`selector_objective` of :func:`selector_target`."""
    if phase == "joint" and aws_margin is not None:
        return fedaws.selector_positive_loss(sel, x, own, aws_margin)
    logits = sel(x)
    if phase == "joint" and restrict is not None:
        logits = restricted_logits(logits, [own], restrict)
    return selector_objective(site, phase, labels)(logits, selector_target(site, x, y, phase, own, frozen, labels))


def flip_batch(x: torch.Tensor, g: torch.Generator, y: Any = None) -> Any:
    """Each image of ``x`` (B, C, *spatial) flipped along each spatial axis with probability 1/2, the
    draws from ``g`` (B per axis, in axis order): a flip keeps what identifies a site (its intensities,
    contrast, noise) and changes the image's layout.  With ``y`` (the batch's masks, B, C', *spatial)
    each mask is flipped as its image and ``(x, y)`` is returned: a target computed from the segmentation
    models' losses (Eq. 1's labels, the ensemble's objectives) stays that of the pair.  A ``y`` without the
    images' spatial axes (a class label per image, e.g. a classification workload) is returned as it is."""
    out = x
    masks = y if isinstance(y, torch.Tensor) and y.dim() == x.dim() else None
    for d in range(2, x.dim()):
        mask = torch.rand(x.shape[0], generator=g) < 0.5
        if bool(mask.any()):
            out = torch.where(mask.to(x.device).reshape((-1,) + (1,) * (x.dim() - 1)), out.flip(d), out)
            if masks is not None:
                masks = torch.where(
                    mask.to(masks.device).reshape((-1,) + (1,) * (masks.dim() - 1)), masks.flip(d), masks
                )
    return out if y is None else (out, y if masks is None else masks)


def augment_for_selector(
    site: Site, x: torch.Tensor, y: torch.Tensor, rnd: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fedsm.selector_augment`` on a selector batch ``(x, y)``: ``"flip"`` (:func:`flip_batch` of the
    images and their masks alike, from :class:`fedseg.site.batches.Streams`: the run seed, the site, the round and the step, or the site's DP randomness under DP), ``"none"``
    the batch as drawn."""
    if cast(Algorithm, site.algorithm).params.selector_augment != "flip":
        return x, y
    return flip_batch(x, site.streams.generator(rnd, "selector-flip", step), y)


def routing_accuracy_at(site: Site, sel: nn.Module, sites: Sequence[str], phase: str, labels: str) -> float:
    """Validation routing accuracy of ``sel`` at this site: for FedSM's Eq. 2 selector, the fraction of
    images whose argmax is the site itself; for the K + 1-class selectors of the selector phase, the
    fraction whose argmax is Eq. 1's oracle label (the model with the lowest loss on the image; the
    frozen models must be loaded)."""
    if phase == "selector":
        return oracle_accuracy(site, sel, [site.models[r] for r in frozen_roles(sites)], "validation")
    return routing_accuracy(
        selector_probs(site, sel, "validation"), sites.index(site.name), 0 if labels == "site" else 1
    )


def train_locally(
    site: Site,
    task: Task,
    factory: SelectorFactory,
    labels: str,
    lr: float | None,
    max_steps: int | None,
    share_moments: bool,
    restrict: float | None = None,
    aws_margin: float | None = None,
) -> tuple[Arrays, dict[str, Any], int]:
    """The site's selector steps of a ``"fedavg"`` (or ``"fedrs"``: ``restrict`` = α; ``"fedaws"``:
    ``aws_margin`` = m) selector round, on
    the first ``max_steps`` batches of the round's local work (None: all).

    Config: ``round``, ``phase``, ``sites``, ``num_classes`` (and ``steps``); arrays: ``selector/…``,
    ``selector_optim/…`` (the averaged moments), and in the selector phase the frozen models.
    Returns the reply arrays (``selector/…`` and, with ``share_moments``, ``selector_optim/…``), metrics
    (``selector_loss``; ``routing_acc`` of the selector as received, on validation) and the number of
    batches of the round.
    """
    cfg = task.config
    rnd, phase, sites = cfg["round"], cfg["phase"], list(cfg["sites"])
    own, c = sites.index(site.name), int(cfg["num_classes"])
    metrics: dict[str, Any] = {}
    role = selector_role(c)
    sel = site.load(role, strip_prefix("selector", task.arrays), factory(site, c))
    opt_s = site.optimizer(role, params=list(sel.parameters()), lr=lr)
    moments = strip_prefix("selector_optim", task.arrays)
    if moments:
        set_optimizer_moments(opt_s, sel, moments)
    frozen = load_frozen(site, task.arrays, sites) if phase == "selector" else []
    if dataset_len(site.data.val) > 0:
        # routing accuracy of the selector as received (last round's average), on validation
        metrics["routing_acc"] = routing_accuracy_at(site, sel, sites, phase, labels)
    sel.train()
    total: float | torch.Tensor = 0.0
    batches = steps = 0
    for x, y in site.batches(rnd, "train", cfg.get("steps")):
        batches += 1
        if max_steps is None or steps < max_steps:
            x, y = augment_for_selector(site, x, y, rnd, steps)
            steps += 1
            opt_s.zero_grad(set_to_none=True)
            with site.autocast():
                loss = selector_loss(site, sel, x, y, phase, own, frozen, labels, restrict, aws_margin)
            site.roles.step(role, opt_s, loss)
            total += loss.detach().double()  # summed on the device, read once below
    out = prefixed("selector", site.arrays(role))
    if share_moments:
        out.update(prefixed("selector_optim", optimizer_moments(opt_s, sel)))
    metrics["selector_loss"] = float(total) / max(steps, 1)
    return out, metrics, batches


def fga_step(site: Site, task: Task, factory: SelectorFactory, labels: str, lr: float | None) -> Asks[Reply]:
    """Site half of one lockstep exchange of the selector's gradient averaging (``selector_training = "fga"``).

    Config: as :func:`fedseg.algorithms.lockstep.gradient_step` plus ``phase``, ``sites``,
    ``num_classes``.  Step 0 also reports the routing accuracy of the selector as
    the site holds it at the round's start (validation split) and, in the selector
    phase, loads the frozen global and personalized models sent with it.
    """
    cfg = task.config
    sites, phase, c = list(cfg["sites"]), cfg["phase"], int(cfg["num_classes"])
    if site.name not in sites:
        raise PayloadError(f"site {site.name}: asked to train FedSM's selector but not among the sites {sites}")
    own = sites.index(site.name)
    role = selector_role(c)
    build = factory(site, c)
    arrays = task.arrays
    routing = None
    if cfg.get("step") == 0:
        init = strip_prefix("selector", arrays)
        sel = site.load(role, init, build) if init else site.model(role, build)
        arrays = {k: v for k, v in arrays.items() if not k.startswith("selector/")}
        if phase == "selector":
            load_frozen(site, arrays, sites)
        if dataset_len(site.data.val) > 0:
            routing = routing_accuracy_at(site, sel, sites, phase, labels)
    frozen = [site.models[r] for r in frozen_roles(sites)] if phase == "selector" else []
    reply = yield from gradient_step(
        site,
        Task(task.kind, arrays, cfg),
        role=role,
        prefix="selector",
        factory=build,
        lr=lr,
        loss=selector_objective(site, phase, labels),
        target=lambda x, y: selector_target(site, x, y, phase, own, frozen, labels),
        transform=lambda x, y, rnd, step: augment_for_selector(site, x, y, rnd, step),
        check_loss=F.cross_entropy if labels != "mix" or phase == "joint" else None,
    )
    if routing is not None:
        reply.metrics["routing_acc"] = routing
    return reply


# ----------------------------------------------------------------- on the server
def average_selector(
    replies: Mapping[str, Reply], counts: Sequence[int], weighting: str, share_moments: bool
) -> Arrays:
    """The ``"fedavg"`` selector's average over the replies (Alg. 1 line 15): ``selector/…`` and, with
    ``share_moments``, its Adam moments ``selector_optim/…`` with the weights of its parameters."""
    names = list(replies)
    p_sel = aggregation_weights(counts, weighting)
    out = prefixed("selector", weighted_mean([strip_prefix("selector", replies[s].arrays) for s in names], p_sel))
    moments = [strip_prefix("selector_optim", replies[s].arrays) for s in names]
    if share_moments and all(moments):
        # the moments are averaged with the weights of the selector's parameters
        out.update(prefixed("selector_optim", weighted_mean(moments, p_sel)))
    return out


def fga_round(
    ctx: ServerContext,
    new: Arrays,
    rnd: int,
    config: dict[str, Any],
    send_selector: bool,
    max_steps: int | None,
) -> dict[str, Any]:
    """The selector's round by federated gradient averaging (``selector_training = "fga"``), into ``new``.

    Lockstep ``"selector_step"`` exchanges (:func:`fedseg.algorithms.lockstep.lockstep_round`):
    the initial selector goes to the sites on the first selector round only (``send_selector``; then
    every site holds the same weights and Adam state), the frozen global and
    personalized models with step 0 of every selector-phase round; the server keeps
    the selector that site 1 returns after the last step.  ``config``: ``phase``, ``sites``,
    ``num_classes``, ``mode``.
    """
    sites = list(ctx.sites)
    first: Arrays = {}
    if send_selector:
        first.update({k: v for k, v in new.items() if k.startswith("selector/")})
    if config["phase"] == "selector":
        first.update({k: v for k, v in new.items() if k.startswith(("global/", "personal/"))})
    weights, m, start = lockstep_round(
        ctx,
        rnd,
        kind="selector_step",
        first=first,
        config=config,
        prefix="selector",
        max_steps=max_steps,
        state=new,
    )
    kept = without_resync(new, "selector")  # resync entries: only while a deployed site is stale (lockstep_round)
    new.clear()
    new.update(kept)
    new.update(weights)
    out: dict[str, Any] = {"selector_loss": m["train_loss"], "selector_steps": m["steps"]}
    if "in_sync" in m:
        out["selector_in_sync"] = m["in_sync"]
    routing = {s: start[s].get("routing_acc") for s in sites if s in start}
    if any(v is not None for v in routing.values()):
        out["routing_acc"] = routing
    return out


def keep_best_selector(new: Arrays, before: Arrays, accs: Mapping[str, Any] | None, measured_round: int) -> None:
    """Keep in ``new`` the selector with the best mean validation routing accuracy so far.

    ``accs`` are the sites' routing accuracies of ``before`` — the selector the sites held at the
    start of this round, i.e. after round ``measured_round`` — so the best is kept one round late;
    the final selector is compared at the end (:meth:`FedSM.final_candidates`).
    """
    score = mean_routing(accs)
    if score is None or not before:
        return
    if "best_selector_score" in new and float(new["best_selector_score"]) >= score:
        return
    new.update(prefixed("best_selector", {k.removeprefix("selector/"): v.clone() for k, v in before.items()}))
    new["best_selector_score"] = torch.tensor(score, dtype=torch.float64)
    new["best_selector_round"] = torch.tensor(measured_round, dtype=torch.int64)
