"""What each fedseg method sends the server, produced by fedseg's own site code.

The audit builds one :class:`~fedseg.site.runtime.Site` per site with the method's site half, sends
each the task the server sends on the method's first round — the seeded initial weights, as the server
draws them — and keeps the reply:

* ``"fga"`` — FGA's first lockstep step (task ``"fga_step"``, step 0): the gradient of the site's
  first batch's mean loss, :func:`fedseg.algorithms.lockstep.gradient_step`;
* ``"fedsm-selector"`` — FedSM's first selector step (``fedsm.selector_training = "fga"``, task
  ``"selector_step"``): the selector's gradient on the site's (flipped) batch with Eq. 2's label, the
  site's own index (:func:`fedseg.algorithms.fedsm.selector.fga_step`);
* ``"fedavg-1step"`` / ``"fedavg-local"`` — FedAvg's update w_before − w_after after one local step and
  after the configured local work (``train.local_steps`` or ``train.local_epochs``),
  :func:`fedseg.algorithms.fedavg.train_global`.

A recording executor (a :class:`~fedseg.site.calls.LocalExecutor`) computes each request at the site, as the default
executor does, and keeps what the site computed with — the batch as the network saw it (after the
selector's flips), its target and loss, the weights — which is the ground truth the attack is scored
against and the labels the attacker is assumed to know.  :func:`private_messages` sends the same tasks to
sites that run fedseg's differential privacy (``privacy.dp``), whose replies are what the server then sees;
:func:`known_seed_message` subtracts from such a reply the noise regenerated from the run seed as the
sites' DP code draws it (:mod:`fedseg.site.dp`), and says whether it matched; :func:`server_isolated` is
an active server that isolates one site's message under secure aggregation with the sites' own code.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fedseg.algorithms import get_algorithm
from fedseg.algorithms.fedsm import FedSM
from fedseg.algorithms.fedsm.selection import selector_role
from fedseg.algorithms.secure import secure_ask
from fedseg.apps.audit.inversion import LocalOptimizer
from fedseg.foundation.arrays import Arrays, prefixed, strip_prefix
from fedseg.foundation.config import DPMode, RunConfig
from fedseg.foundation.device import DTYPES
from fedseg.foundation.errors import ConfigError, FedsegError
from fedseg.foundation.messages import Task
from fedseg.foundation.seeding import derive_seed
from fedseg.privacy.dp import clip_per_sample, clip_update, noise_like, per_sample_gradients, privatized_gradient
from fedseg.privacy.randomness import Randomness
from fedseg.seams.algorithm import ServerContext
from fedseg.simulation.inprocess import InProcessTransport
from fedseg.site.batches import SiteData
from fedseg.site.calls import Call, FitCall, GradientCall, LocalExecutor
from fedseg.site.runtime import Site
from fedseg.site.workload import Workload

__all__ = [
    "MESSAGES",
    "METHOD_MESSAGES",
    "Isolated",
    "KnownSeed",
    "Sent",
    "init_weights",
    "known_seed_message",
    "local_optimizer",
    "private_messages",
    "sent_by_sites",
    "server_isolated",
    "weights_of",
]

MESSAGES = ("fga", "fedsm-selector", "fedavg-1step", "fedavg-local")
"""The messages the audit attacks, in table order."""

METHOD_MESSAGES = {
    "fga": ("fga",),
    "fedsm": ("fedsm-selector",),
    "fedavg": ("fedavg-1step", "fedavg-local"),
}
"""``fedseg audit --method``'s choices and the messages each attacks."""


@dataclass
class Sent:
    """One site's message and what it was computed from."""

    site: str
    kind: str
    """``"gradient"`` (a batch gradient) or ``"update"`` (w_before − w_after)."""
    message: Arrays
    """Parameter name → the gradient or the update, as the server receives it."""
    weights: Arrays
    """Parameter name → the weights the server sent (known to the attacker)."""
    model: nn.Module
    """The network (a copy; the attacker knows the architecture)."""
    batch: torch.Tensor
    """The first batch's images as the network saw them."""
    target: Any
    """The first batch's target (the labels the attacker is assumed to know)."""
    loss: Callable[[torch.Tensor, Any], torch.Tensor]
    seen: torch.Tensor
    """Every distinct image the message was computed from (the first batch for a gradient)."""
    num_samples: int
    """The site's weight in the server's sum (batch size for a gradient, training cases for an update)."""
    steps: int
    batches: list[tuple[torch.Tensor, Any]] = dataclasses.field(default_factory=list)
    """Every local step's batch (images as the network saw them, target), in order (one for a gradient)."""
    optimizer: LocalOptimizer | None = None
    """The site's local optimizer (an update's)."""
    index: int = 0
    """The site's index in the federation (its DP noise key)."""
    role: str = "global"
    """The role whose model sent the message."""


class _Recorder(LocalExecutor):
    """A :class:`~fedseg.site.calls.LocalExecutor` that records the gradient requests and the local loops."""

    def __init__(self) -> None:
        self.gradients: list[dict[str, Any]] = []
        self.fits: list[dict[str, Any]] = []

    def answer(self, call: Call) -> Any:
        if isinstance(call, FitCall):
            self.fits.append({"role": call.role, "round": call.rnd, "steps": call.batches.steps})
        elif isinstance(call, GradientCall):
            at = call.at
            weights = at if at is not None else dict(call.model.named_parameters())
            self.gradients.append(
                {
                    "role": call.role,
                    "x": call.x.detach().clone(),
                    "target": _detached(call.target),
                    "loss": call.loss,
                    "weights": {n: t.detach().clone() for n, t in weights.items()},
                }
            )
        return super().answer(call)


def _detached(target: Any) -> Any:
    if isinstance(target, torch.Tensor):
        return target.detach().clone()
    if isinstance(target, (tuple, list)):
        return type(target)(_detached(t) for t in target)
    return target


def local_optimizer(cfg: RunConfig) -> LocalOptimizer:
    """The site's local optimizer from ``train`` (:meth:`fedseg.site.models.SiteModels.optimizer`: torch's Adam or SGD)."""
    t = cfg.train
    return LocalOptimizer(
        t.optimizer,
        t.lr,
        (t.betas[0], t.betas[1]),
        weight_decay=t.weight_decay,
        momentum=t.momentum if t.optimizer == "sgd" else 0,
    )


def init_weights(cfg: RunConfig, role: str, factory: Callable[[], nn.Module]) -> Arrays:
    """The seeded initial weights of a role's model, drawn as the server draws them
    (:meth:`fedseg.execution.engine.Engine.init_arrays`: seed ``derive_seed(seed, "init", role)``)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(cfg.seed, "init", role))
        model = factory()
    dtype = DTYPES[cfg.train.dtype]
    return {k: (v.to(dtype) if v.is_floating_point() else v).detach().clone() for k, v in model.state_dict().items()}


def _sites(cfg: RunConfig, workload: Workload, data: Mapping[str, SiteData]) -> list[Site]:
    algorithm = get_algorithm(cfg)
    return [
        Site(name, i, d, workload, cfg, algorithm, executor=_Recorder()) for i, (name, d) in enumerate(data.items())
    ]


@dataclass
class _Asked:
    """One message's task as the server sends it on the method's first round."""

    method: str
    role: str
    kind: str
    task: Task
    init: Arrays
    steps: int | None


def _asked(message: str, cfg: RunConfig, workload: Workload, names: Sequence[str]) -> _Asked:
    if message == "fga":
        init = init_weights(cfg, "global", workload.build_model)
        return _Asked(
            "fga", "global", "gradient", Task("fga_step", prefixed("global", init), {"round": 1, "step": 0}), init, None
        )
    if message == "fedsm-selector":
        alg = FedSM(dataclasses.replace(cfg, method="fedsm"))
        p = alg.params
        if p.selector_training != "fga":
            raise ConfigError(
                f"fedsm.selector_training = {p.selector_training!r} sends selector models, not per-step "
                "gradients; the audit attacks the lockstep selector step: --set fedsm.selector_training=fga"
            )
        rnd = alg.first_selector_round()
        phase = alg.phase(rnd)
        c = alg.num_classes(len(names))
        role = selector_role(c)
        init = init_weights(cfg, role, lambda: workload.selector(c, p.selector_width, p.selector_hidden))
        arrays = prefixed("selector", init)
        if phase == "selector":  # the frozen models of the selector phase: the initial global model everywhere
            model = init_weights(cfg, "global", workload.build_model)
            arrays.update(prefixed("global", model))
            for s in names:
                arrays.update(prefixed(f"personal/{s}", model))
        config = {"round": rnd, "step": 0, "phase": phase, "sites": list(names), "num_classes": c, "mode": alg.mode}
        return _Asked("fedsm", role, "gradient", Task("selector_step", arrays, config), init, None)
    if message in ("fedavg-1step", "fedavg-local"):
        steps = 1 if message == "fedavg-1step" else None
        init = init_weights(cfg, "global", workload.build_model)
        config = {"round": 1, "steps": steps, "num_sites": len(names)}
        return _Asked("fedavg", "global", "update", Task("train", prefixed("global", init), config), init, steps)
    raise ConfigError(f"unknown message {message!r}; the audit attacks {', '.join(MESSAGES)}")


def _message(asked: _Asked, site: Site, reply_arrays: Arrays) -> Arrays:
    """What the server takes from a reply: the gradient, or the update w_before − w_after of the parameters."""
    if asked.kind == "gradient":
        return strip_prefix("grad", reply_arrays)
    after = strip_prefix(asked.role, reply_arrays)
    return {n: asked.init[n].to(after[n].device) - after[n] for n, _ in site.model(asked.role).named_parameters()}


def sent_by_sites(message: str, cfg: RunConfig, workload: Workload, data: Mapping[str, SiteData]) -> list[Sent]:
    """Every site's ``message`` (one of :data:`MESSAGES`) on the first round of ``cfg``'s federation, in site
    order, with what it was computed from (privacy off: the plain message)."""
    cfg = dataclasses.replace(cfg, privacy=dataclasses.replace(cfg.privacy, dp="off"))
    asked = _asked(message, cfg, workload, list(data))
    out = []
    for site in _sites(dataclasses.replace(cfg, method=asked.method), workload, data):
        reply = site.handle(asked.task)
        model = copy.deepcopy(site.model(asked.role))  # the attacker knows the architecture
        sent = _message(asked, site, reply.arrays)
        if asked.kind == "gradient":
            rec = site.executor.gradients[-1]  # type: ignore[attr-defined]
            weights = {n: t.detach().clone() for n, t in rec["weights"].items()}
            x = rec["x"].cpu()
            batches = [(x, rec["target"])]
            item = Sent(
                site.name, "gradient", sent, weights, model, x, rec["target"], rec["loss"], x, int(x.shape[0]), 1
            )
        else:
            # the seeded batches the local loop used
            batches = [(x.cpu(), y.detach().clone()) for x, y in site.batches(1, "train", asked.steps)]
            weights = {n: asked.init[n].clone() for n in sent}
            seen = torch.unique(torch.cat([x for x, _ in batches]), dim=0)
            x, y = batches[0]
            item = Sent(
                site.name,
                "update",
                sent,
                weights,
                model,
                x,
                y,
                site.workload.loss,
                seen,
                reply.num_samples,
                len(batches),
            )
            item.optimizer = local_optimizer(cfg)
        item.batches, item.index, item.role = batches, site.index, asked.role
        out.append(item)
    return out


def _dp_sites(
    cfg: RunConfig, workload: Workload, data: Mapping[str, SiteData], mode: DPMode, clip: float, sigma: float
):
    """The sites with their ``privacy.dp = mode`` settings at C = ``clip``, σ = ``sigma`` (their own
    :class:`~fedseg.site.dp.SiteDP` and its randomness, ``privacy.dp_randomness`` as configured)."""
    privacy = dataclasses.replace(
        cfg.privacy,
        dp=mode,
        clip=clip,
        noise_multiplier=sigma,
        epsilon=None,
        secure_aggregation=mode == "client" or cfg.privacy.secure_aggregation,
    )
    cfg = dataclasses.replace(cfg, privacy=privacy)
    algorithm = get_algorithm(dataclasses.replace(cfg, method="fedavg-even" if mode == "client" else cfg.method))
    return [Site(name, i, d, workload, cfg, algorithm) for i, (name, d) in enumerate(data.items())]


def private_messages(
    message: str, cfg: RunConfig, workload: Workload, data: Mapping[str, SiteData], clip: float, sigma: float
) -> list[Arrays]:
    """Every site's ``message`` as fedseg's differential privacy sends it, at ``privacy.clip`` = ``clip`` and
    ``privacy.noise_multiplier`` = ``sigma``, computed on the plain message's own batch (so that the two are
    comparable: :func:`sent_by_sites`) with the noise drawn by each site's own DP randomness
    (:mod:`fedseg.privacy.randomness`) at the position of its first privatized step:

    * a gradient — DP-SGD's (``privacy.dp = "sample"``, :func:`fedseg.privacy.dp.privatized_gradient`): every
      sample's gradient clipped to C, N(0, σ²C²) on their sum, divided by the batch size.  A DP site draws
      its batches by Poisson sampling; the audit attacks the plain message's batch, which is one such draw;
    * an update — client-level DP's (``privacy.dp = "client"``): the update clipped to C plus the site's
      share N(0, σ²C²/K) of the noise.  fedseg sends it only under secure aggregation (the server sees the
      sum); the single share is what the server would see of one site without it."""
    plain = sent_by_sites(message, cfg, workload, data)
    gradient = plain[0].kind == "gradient"
    sites = _dp_sites(cfg, workload, data, "sample" if gradient else "client", clip, sigma)
    out = []
    for site, sent in zip(sites, plain):
        if gradient:

            def normal(count: int, std: float, site: Site = site, sent: Sent = sent) -> torch.Tensor:
                return site.dp.random.normal(count, std, "noise", sent.role, 0)

            grads, _ = privatized_gradient(
                sent.model, sent.loss, sent.batch, sent.target, clip, sigma, normal, params=sent.weights
            )
            out.append({n: grads[n].detach() for n in sent.message})
        else:
            k = len(sites)

            def normal(count: int, std: float, site: Site = site, sent: Sent = sent) -> torch.Tensor:
                return site.dp.random.normal(count, std, "client-noise", sent.role, 0)

            clipped, _ = clip_update({n: -v for n, v in sent.message.items()}, clip)  # w − w_0 = −message
            noise = noise_like(clipped, sigma * clip / k**0.5, normal)
            out.append({n: -(clipped[n] + noise[n]) for n in clipped})
    return out


def _norm(arrays: Mapping[str, torch.Tensor]) -> float:
    return float(sum(v.double().pow(2).sum() for v in arrays.values()) ** 0.5)


@dataclass
class KnownSeed:
    """The attacked site's DP message with the noise regenerated from the run seed subtracted."""

    message: Arrays
    """The DP message minus the regenerated noise (the attacked message)."""
    residual: float
    """‖message − signal‖: what is left of the real noise (0 when the regenerated noise was the site's)."""
    signal: float
    """‖signal‖: the clipped message without noise (what DP hides)."""
    noise: float
    """‖regenerated noise‖ as it enters the message."""

    @property
    def matched(self) -> bool:
        """The regenerated noise was the site's: the residual is below 1e-3 of the signal."""
        return self.residual <= 1e-3 * self.signal

    def note(self) -> str:
        how = "matched" if self.matched else "did NOT match"
        return (
            f"noise regenerated from the run seed {how} the site's: residual ‖{self.residual:.3g}‖ vs signal "
            f"‖{self.signal:.3g}‖ (noise ‖{self.noise:.3g}‖)"
        )


def known_seed_message(
    message: str,
    cfg: RunConfig,
    workload: Workload,
    data: Mapping[str, SiteData],
    clip: float,
    sigma: float,
    sent: Sent,
) -> KnownSeed:
    """An attacker who knows the run seed and the site's index regenerates the attacked site's (the first's)
    DP noise as a site draws it in the test mode ``privacy.dp_randomness = "seeded"``
    (:class:`fedseg.privacy.randomness.Randomness` keyed by the seed and the index, at the position of the
    site's first privatized step) — DP-SGD's gradient: N(0, σ²C²) over the trainable parameters, divided by
    the batch size; client-level DP: N(0, σ²C²/K) over the update, sent as w_0 − w = −(clipped + noise) — and
    subtracts it from the site's DP message (:func:`private_messages`).  ``sent`` is the site's plain message
    (:func:`sent_by_sites`), from which the clipped signal is computed to say whether the noise matched.
    With the default ``"os"`` randomness every draw is keyed by fresh OS bytes, and it does not."""
    dp_message = private_messages(message, cfg, workload, data, clip, sigma)[0]
    guess = Randomness("seeded", cfg.seed, sent.index)  # what the run seed and the site's index give
    if sent.kind == "gradient":
        b = int(sent.batch.shape[0])
        names = [n for n in sent.weights if n in dp_message]

        def regenerated(count: int, std: float) -> torch.Tensor:
            return guess.normal(count, std, "noise", sent.role, 0)

        noise = {k: v / b for k, v in noise_like({n: dp_message[n] for n in names}, sigma * clip, regenerated).items()}
        grads, _ = per_sample_gradients(sent.model, sent.loss, sent.batch, sent.target, sent.weights)
        summed, _ = clip_per_sample(grads, clip)
        signal = {n: summed[n] / b for n in dp_message}
    else:

        def regenerated(count: int, std: float) -> torch.Tensor:
            return guess.normal(count, std, "client-noise", sent.role, 0)

        full = noise_like(dict(dp_message), sigma * clip / len(data) ** 0.5, regenerated)
        noise = {n: -full[n] for n in dp_message}  # the message is w_0 − w = −(clipped + noise)
        signal, _ = clip_update(sent.message, clip)
    denoised = {n: dp_message[n] - noise[n] for n in dp_message}
    residual = _norm({n: denoised[n] - signal[n].to(denoised[n]) for n in denoised})
    return KnownSeed(denoised, residual, _norm(signal), _norm(noise))


@dataclass
class Isolated:
    """What an active server got of the attacked site's message under secure aggregation."""

    message: Arrays | None
    """The attacked site's message as the server recovered it (None: the sites did not let it)."""
    how: str
    """What the server did and what came of it."""
    error: float | None = None
    """‖recovered − sent‖ / ‖sent‖ (None when nothing was recovered)."""


def server_isolated(
    message: str, cfg: RunConfig, workload: Workload, data: Mapping[str, SiteData], sent: Sent
) -> Isolated:
    """An active server against secure aggregation, run through the sites' own code
    (:meth:`fedseg.site.runtime.Site.handle`, :mod:`fedseg.site.secure`) with the server's own exchange
    (:func:`fedseg.algorithms.secure.secure_ask`), the sites' ``privacy.secure_aggregation`` on:

    * a gradient: the same (round, step) asked twice, of all K sites and of all but the attacked one; the
      difference of the two sums over the difference of their weights is the attacked site's gradient;
    * an update: ``steps = 0`` sent to every other site, whose replies are then the weights the server sent;
      the sum less their known part, over the attacked site's weight, is its trained model.

    ``sent`` is the attacked (first) site's plain message, to measure what was recovered.  A site that refuses
    (an error from its code) or leaves itself out ends the attack: ``message`` is None and ``how`` says why."""
    names = list(data)
    if len(names) < 3:
        return Isolated(None, f"needs 3 or more sites (--sites), got {len(names)}")
    privacy = dataclasses.replace(cfg.privacy, secure_aggregation=True, dp="off")
    asked = _asked(message, dataclasses.replace(cfg, privacy=privacy), workload, names)
    cfg = dataclasses.replace(cfg, method=asked.method, privacy=privacy)
    algorithm = get_algorithm(cfg)
    sites = [Site(name, i, d, workload, cfg, algorithm) for i, (name, d) in enumerate(data.items())]
    logged: list[str] = []
    ctx = ServerContext(
        InProcessTransport(sites), tuple(names), cfg, lambda role: asked.init, log=logged.append, workload=workload
    )
    me, others = names[0], names[1:]
    try:
        if asked.kind == "gradient":
            weighting = "samples"
            first = secure_ask(ctx, {s: asked.task for s in names}, weighting)
            second = secure_ask(ctx, {s: asked.task for s in others}, weighting)
            if first.rejected or second.rejected or me not in first.replies or me in second.replies:
                return Isolated(None, "the sums were refused or left the site out: " + "; ".join(logged[-3:]))
            w = first.weight - second.weight
            got = {k: (first.total[k] - second.total.get(k, 0)) / w for k in first.total}
            how = "asked the same (round, step) of all sites, then of all but the attacked one; difference of the sums"
        else:
            weighting = algorithm.weighting() if hasattr(algorithm, "weighting") else "samples"
            zero = Task(asked.task.kind, asked.task.arrays, {**asked.task.config, "steps": 0})
            total = secure_ask(ctx, {me: asked.task, **{s: zero for s in others}}, weighting)
            if total.rejected or me not in total.replies:
                return Isolated(None, "the sum was refused or left the site out: " + "; ".join(logged[-3:]))
            start = prefixed(asked.role, asked.init)
            c = {s: (float(r.num_samples) if weighting == "samples" else 1.0) for s, r in total.replies.items()}
            known = {k: sum(c[s] * start[k].double() for s in others) for k in total.total if k in start}
            got = {k: (total.total[k] - known[k]) / c[me] for k in known}
            how = "steps = 0 sent to every other site; the sum less their known weights"
    except FedsegError as e:
        return Isolated(None, f"a site refused: {e}")
    recovered = {k: v.to(torch.float32) for k, v in _message(asked, sites[0], got).items()}
    err = _norm({n: recovered[n] - sent.message[n] for n in sent.message}) / max(_norm(sent.message), 1e-30)
    what = "recovered" if err < 1e-3 else "NOT recovered (the sites did not do what the server asked)"
    return Isolated(recovered, f"{how}: the attacked site's message {what}, relative error {err:.2g}", err)


def weights_of(sent: Sequence[Sent]) -> list[float]:
    """The server's weights p_k of the sites' messages in its sum: b_k / Σ b (FGA's sample weighting) or
    n_k / n (FedAvg's)."""
    total = sum(s.num_samples for s in sent)
    return [s.num_samples / total for s in sent]
