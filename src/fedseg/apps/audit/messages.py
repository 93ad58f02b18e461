"""What each fedseg method sends the server, produced by fedseg's own site code.

The audit builds one :class:`~fedseg.site.runtime.Site` per site with the method's site half, sends
each the task the server sends on the method's first round — the seeded initial weights, as the server
draws them — and keeps the reply:

* ``"fga"`` — FGA's first lockstep step (task ``"fga_step"``, step 0): the gradient of the site's
  first batch's mean loss, :func:`fedseg.algorithms.fga.gradient_step`;
* ``"fedsm-selector"`` — FedSM's first selector step (``fedsm.selector_training = "fga"``, task
  ``"selector_step"``): the selector's gradient on the site's (flipped) batch with Eq. 2's label, the
  site's own index (:func:`fedseg.algorithms.fedsm.selector.fga_step`);
* ``"fedavg-1step"`` / ``"fedavg-local"`` — FedAvg's update w_before − w_after after one local step and
  after the configured local work (``train.local_steps`` or ``train.local_epochs``),
  :func:`fedseg.algorithms.fedavg.train_global`.

A recording :class:`~fedseg.site.runtime.SiteExecutor` computes each call at the site, as the default
executor does, and keeps what the site computed with — the batch as the network saw it (after the
selector's flips), its target and loss, the weights — which is the ground truth the attack is scored
against and the labels the attacker is assumed to know.  :func:`private_messages` sends the same tasks to
sites that run fedseg's differential privacy (``privacy.dp``), whose replies are what the server then sees.
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
from fedseg.algorithms.fedsm.selection import selector_role
from fedseg.foundation.arrays import Arrays, prefixed, strip_prefix
from fedseg.foundation.config import RunConfig
from fedseg.foundation.errors import ConfigError
from fedseg.foundation.messages import Task
from fedseg.foundation.seeding import derive_seed
from fedseg.site.runtime import Site, SiteData
from fedseg.site.workload import Workload

__all__ = ["MESSAGES", "METHOD_MESSAGES", "Sent", "init_weights", "private_messages", "sent_by_sites", "weights_of"]

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


class _Recorder:
    """A :class:`~fedseg.site.runtime.SiteExecutor` that computes every call at the site (as
    :class:`~fedseg.site.runtime.LocalExecutor`) and records the gradient calls and the local loops."""

    def __init__(self) -> None:
        self.gradients: list[dict[str, Any]] = []
        self.fits: list[dict[str, Any]] = []

    def fit(self, site, role, rnd, stream, optimizer, extra_loss, after_backward, steps):
        self.fits.append({"role": role, "round": rnd, "stream": stream, "steps": steps})
        return site.fit_here(role, rnd, stream, optimizer, extra_loss, after_backward, steps)

    def gradient(self, site, role, x, target, loss, at):
        weights = at if at is not None else {n: p for n, p in site.model(role).named_parameters()}
        self.gradients.append(
            {
                "role": role,
                "x": x.detach().clone(),
                "target": _detached(target),
                "loss": loss if loss is not None else site.workload.loss,
                "weights": {n: t.detach().clone() for n, t in weights.items()},
            }
        )
        return site.gradient_here(role, x, target, loss, at)

    def step_with_gradient(self, site, model, optimizer, grad):
        site.step_with_gradient_here(model, optimizer, grad)


def _detached(target: Any) -> Any:
    if isinstance(target, torch.Tensor):
        return target.detach().clone()
    if isinstance(target, (tuple, list)):
        return type(target)(_detached(t) for t in target)
    return target


def init_weights(cfg: RunConfig, role: str, factory: Callable[[], nn.Module]) -> Arrays:
    """The seeded initial weights of a role's model, drawn as the server draws them
    (:meth:`fedseg.execution.engine.Engine.init_arrays`: seed ``derive_seed(seed, "init", role)``)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(cfg.seed, "init", role))
        model = factory()
    dtype = {"float32": torch.float32, "float64": torch.float64}[cfg.train.dtype]
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
        alg = get_algorithm(dataclasses.replace(cfg, method="fedsm"))
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
            batch, target, loss, seen, count, steps = (
                rec["x"].cpu(),
                rec["target"],
                rec["loss"],
                rec["x"].cpu(),
                int(rec["x"].shape[0]),
                1,
            )
        else:
            batches = list(site.batches(1, "train", asked.steps))  # the seeded batches the local loop used
            weights = {n: asked.init[n].clone() for n in sent}
            batch, target = batches[0][0].cpu(), batches[0][1].detach().clone()
            loss, seen = site.workload.loss, torch.unique(torch.cat([x for x, _ in batches]).cpu(), dim=0)
            count, steps = reply.num_samples, len(batches)
        out.append(Sent(site.name, asked.kind, sent, weights, model, batch, target, loss, seen, count, steps))
    return out


def private_messages(
    message: str, cfg: RunConfig, workload: Workload, data: Mapping[str, SiteData], clip: float, sigma: float
) -> list[Arrays]:
    """Every site's ``message`` as fedseg's differential privacy sends it (:mod:`fedseg.site.dp`): a gradient
    under ``privacy.dp = "sample"`` (DP-SGD's privatized gradient of the same batch), an update under
    ``privacy.dp = "client"`` (clipped, with the site's share of the noise; FedAvg with even weights, the
    weighting client-level DP runs with), at ``privacy.clip`` = ``clip`` and ``privacy.noise_multiplier`` =
    ``sigma``; the noise from the sites' own seeded generators."""
    asked = _asked(message, cfg, workload, list(data))
    mode = "sample" if asked.kind == "gradient" else "client"
    privacy = dataclasses.replace(cfg.privacy, dp=mode, clip=clip, noise_multiplier=sigma, epsilon=None)
    method = "fedavg-even" if mode == "client" else asked.method
    cfg = dataclasses.replace(cfg, method=method, privacy=privacy)
    algorithm = get_algorithm(cfg)
    out = []
    for i, (name, d) in enumerate(data.items()):
        site = Site(name, i, d, workload, cfg, algorithm)
        out.append({k: v.detach() for k, v in _message(asked, site, site.handle(asked.task).arrays).items()})
    return out


def weights_of(sent: Sequence[Sent]) -> list[float]:
    """The server's weights p_k of the sites' messages in its sum: b_k / Σ b (FGA's sample weighting) or
    n_k / n (FedAvg's)."""
    total = sum(s.num_samples for s in sent)
    return [s.num_samples / total for s in sent]
