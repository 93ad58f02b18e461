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
against, the labels the attacker is assumed to know, and the per-sample gradients of sample-level DP.
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

__all__ = ["MESSAGES", "METHOD_MESSAGES", "Sent", "init_weights", "per_sample_gradients", "sent_by_sites"]

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
    per_sample: list[Arrays] | None = None
    """The first batch's per-sample gradients (gradient messages), for sample-level DP."""


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


def _rows(target: Any, i: int) -> Any:
    """Sample ``i`` of a batch target (tensor or tuple/list of tensors), batch axis kept."""
    if isinstance(target, torch.Tensor):
        return target[i : i + 1]
    if isinstance(target, (tuple, list)):
        return type(target)(_rows(t, i) for t in target)
    return target


def init_weights(cfg: RunConfig, role: str, factory: Callable[[], nn.Module]) -> Arrays:
    """The seeded initial weights of a role's model, drawn as the server draws them
    (:meth:`fedseg.execution.engine.Engine.init_arrays`: seed ``derive_seed(seed, "init", role)``)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(cfg.seed, "init", role))
        model = factory()
    dtype = {"float32": torch.float32, "float64": torch.float64}[cfg.train.dtype]
    return {k: (v.to(dtype) if v.is_floating_point() else v).detach().clone() for k, v in model.state_dict().items()}


def per_sample_gradients(site: Site, record: Mapping[str, Any]) -> list[Arrays]:
    """The gradient of each sample of a recorded gradient call alone, at the recorded weights (the
    site's :meth:`~fedseg.site.runtime.Site.gradient_here` on a batch of one)."""
    x = record["x"]
    out = []
    for i in range(x.shape[0]):
        g, _ = site.gradient_here(
            record["role"], x[i : i + 1], _rows(record["target"], i), record["loss"], record["weights"]
        )
        out.append({n: v.detach() for n, v in g.items()})
    return out


def _sites(cfg: RunConfig, workload: Workload, data: Mapping[str, SiteData]) -> list[Site]:
    algorithm = get_algorithm(cfg)
    return [
        Site(name, i, d, workload, cfg, algorithm, executor=_Recorder()) for i, (name, d) in enumerate(data.items())
    ]


def _from_gradient(site: Site, reply_arrays: Arrays, weights_model: nn.Module) -> Sent:
    rec = site.executor.gradients[-1]  # type: ignore[attr-defined]
    message = strip_prefix("grad", reply_arrays)
    return Sent(
        site=site.name,
        kind="gradient",
        message=message,
        weights={n: t.detach().clone() for n, t in rec["weights"].items()},
        model=weights_model,
        batch=rec["x"].cpu(),
        target=rec["target"],
        loss=rec["loss"],
        seen=rec["x"].cpu(),
        num_samples=int(rec["x"].shape[0]),
        steps=1,
        per_sample=per_sample_gradients(site, rec),
    )


def _fga(cfg: RunConfig, workload: Workload, data: Mapping[str, SiteData]) -> list[Sent]:
    cfg = dataclasses.replace(cfg, method="fga")
    init = init_weights(cfg, "global", workload.build_model)
    out = []
    for site in _sites(cfg, workload, data):
        reply = site.handle(Task("fga_step", prefixed("global", init), {"round": 1, "step": 0}))
        out.append(_from_gradient(site, reply.arrays, copy.deepcopy(site.model("global"))))
    return out


def _selector(cfg: RunConfig, workload: Workload, data: Mapping[str, SiteData]) -> list[Sent]:
    cfg = dataclasses.replace(cfg, method="fedsm")
    alg = get_algorithm(cfg)
    if alg.params.selector_training != "fga":
        raise ConfigError(
            f"fedsm.selector_training = {alg.params.selector_training!r} sends selector models, not per-step "
            "gradients; the audit attacks the lockstep selector step: --set fedsm.selector_training=fga"
        )
    names = list(data)
    rnd = alg.first_selector_round()
    phase = alg.phase(rnd)
    c = alg.num_classes(len(names))
    role = selector_role(c)
    p = alg.params
    init = init_weights(cfg, role, lambda: workload.selector(c, p.selector_width, p.selector_hidden))
    arrays = prefixed("selector", init)
    if phase == "selector":  # the frozen models of the selector phase: the initial global model everywhere
        model = init_weights(cfg, "global", workload.build_model)
        arrays.update(prefixed("global", model))
        for s in names:
            arrays.update(prefixed(f"personal/{s}", model))
    config = {"round": rnd, "step": 0, "phase": phase, "sites": names, "num_classes": c, "mode": alg.mode}
    out = []
    for site in _sites(cfg, workload, data):
        reply = site.handle(Task("selector_step", arrays, config))
        out.append(_from_gradient(site, reply.arrays, copy.deepcopy(site.model(role))))
    return out


def _fedavg(cfg: RunConfig, workload: Workload, data: Mapping[str, SiteData], steps: int | None) -> list[Sent]:
    cfg = dataclasses.replace(cfg, method="fedavg")
    init = init_weights(cfg, "global", workload.build_model)
    out = []
    for site in _sites(cfg, workload, data):
        reply = site.handle(Task("train", prefixed("global", init), {"round": 1, "steps": steps}))
        after = strip_prefix("global", reply.arrays)
        model = site.model("global")
        names = [n for n, _ in model.named_parameters()]
        update = {n: init[n].to(after[n].device) - after[n] for n in names}
        batches = list(site.batches(1, "train", steps))  # the same seeded batches the local loop used
        x0, y0 = batches[0]
        seen = torch.unique(torch.cat([x for x, _ in batches]).cpu(), dim=0)
        attacker = copy.deepcopy(model)
        out.append(
            Sent(
                site=site.name,
                kind="update",
                message=update,
                weights={n: init[n].clone() for n in names},
                model=attacker,
                batch=x0.cpu(),
                target=y0.detach().clone(),
                loss=site.workload.loss,
                seen=seen,
                num_samples=reply.num_samples,
                steps=len(batches),
            )
        )
    return out


def sent_by_sites(message: str, cfg: RunConfig, workload: Workload, data: Mapping[str, SiteData]) -> list[Sent]:
    """Every site's ``message`` (one of :data:`MESSAGES`) on the first round of ``cfg``'s federation,
    in site order."""
    if message == "fga":
        return _fga(cfg, workload, data)
    if message == "fedsm-selector":
        return _selector(cfg, workload, data)
    if message == "fedavg-1step":
        return _fedavg(cfg, workload, data, 1)
    if message == "fedavg-local":
        return _fedavg(cfg, workload, data, None)
    raise ConfigError(f"unknown message {message!r}; the audit attacks {', '.join(MESSAGES)}")


def weights_of(sent: Sequence[Sent]) -> list[float]:
    """The server's weights p_k of the sites' messages in its sum: b_k / Σ b (FGA's sample weighting) or
    n_k / n (FedAvg's)."""
    total = sum(s.num_samples for s in sent)
    return [s.num_samples / total for s in sent]
