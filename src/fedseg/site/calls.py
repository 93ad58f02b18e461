"""What a site handler asks for, and the executors that answer.

A site handler (``algorithm.site_handlers()``) is a generator: where it needs local training it yields a call
value — ``stats = yield from site.fit(role, rnd)`` (:class:`FitCall`), ``grads, loss = yield from
site.gradient(role, x, y)`` (:class:`GradientCall`), ``yield from site.step_with_gradient(model, opt, grad)``
(:class:`ApplyCall`) — and receives the result; it returns its :class:`~fedseg.foundation.messages.Reply`.  A
handler that trains nothing may be a plain function returning the reply.

A call is a complete request: the site works out everything when it asks (the model, the optimizer, the
round's batches as a lazy :class:`Batches` source, the loss, the device, the precision and its autocast, the
fp16 scaler, the hooks), so an executor computes from the call alone and never touches the site.

An executor drives all the handlers of one ask: it advances each to its next request, computes the requests
and sends the results back.  :class:`LocalExecutor` computes each request at its site, one handler after the
other (deployed sites; simulations that run their sites in turn); :class:`fedseg.site.dpsgd.DPExecutor` computes
them privatized (``privacy.dp = "sample"``); :class:`fedseg.simulation.vectorize.VectorizedExecutor` computes
the requests of all sites of one ask stacked.  Every executor runs in the calling thread.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast

import torch
from torch import nn
from torch.func import functional_call

from fedseg.foundation.config.schema import Precision
from fedseg.foundation.errors import ConfigError
from fedseg.foundation.messages import Reply

__all__ = [
    "ApplyCall",
    "Asks",
    "Batches",
    "Call",
    "Executor",
    "FitCall",
    "Flag",
    "GradientCall",
    "LocalExecutor",
    "LossSums",
    "RoundProgress",
    "as_asks",
    "backward_step",
    "drive",
    "local_apply",
    "local_fit",
    "local_gradient",
    "step_with_gradient",
]

T = TypeVar("T")

Hook = Callable[[nn.Module], None]
"""A per-site edit of the model during local training (``after_backward``: of its gradients; ``after_step``: of
its weights)."""

Loss = Callable[[torch.Tensor, Any], torch.Tensor]
"""``loss(output, target)``: the workload's loss, or a method's own (FGA's, FedSM's selector's)."""


class Batches(Protocol):
    """The ``(x, y)`` training batches of one round, drawn lazily: each iteration starts the round's stream
    afresh (the same seeded batches), and :attr:`steps` is how many it yields at most."""

    @property
    def steps(self) -> int: ...

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...


@dataclass
class Flag:
    """A mutable yes/no a site keeps across rounds (e.g. whether its first round has said what a step costs)."""

    set: bool = False


@dataclass
class FitCall:
    """One round of local training of ``model`` (:meth:`Site.fit <fedseg.site.runtime.Site.fit>`), complete: the
    site works out everything when it asks.  Answered with ``{"loss": mean, "steps": n}``.

    ``extra_loss(model)`` is added to ``loss`` (FedProx's proximal term); ``after_backward(model)`` may edit the
    gradients before each step (SCAFFOLD's gradient correction); ``after_step(model)`` edits the weights after
    each optimizer step (SCAFFOLD's step correction).  The forward pass runs under ``autocast()``; ``scaler``
    (fp16, one per role, kept across rounds) scales the loss.  ``said`` is the site's flag that its first
    round's cost has been said (:class:`RoundProgress`)."""

    site: str  # the site's name, for messages
    role: str
    rnd: int
    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: Batches
    loss: Loss
    device: torch.device
    precision: Precision
    autocast: Callable[[], AbstractContextManager[Any]]
    scaler: torch.amp.GradScaler | None = None
    extra_loss: Callable[[nn.Module], torch.Tensor] | None = None
    after_backward: Hook | None = None
    after_step: Hook | None = None
    said: Flag = field(default_factory=Flag)


@dataclass
class GradientCall:
    """The batch gradient of ``loss(model(x), target)`` at the model's weights or at ``at`` (a lockstep
    gradient-averaging step; :meth:`Site.gradient <fedseg.site.runtime.Site.gradient>`); answered with
    ``({name: gradient}, loss)``."""

    site: str
    role: str
    model: nn.Module
    x: torch.Tensor
    target: Any
    loss: Loss
    device: torch.device
    precision: Precision
    autocast: Callable[[], AbstractContextManager[Any]]
    at: Mapping[str, torch.Tensor] | None = None  # the weights to differentiate at (name → tensor), None: the model's


@dataclass
class ApplyCall:
    """One optimizer step of ``model`` with ``grad`` (parameter name → tensor) as its gradient
    (:meth:`Site.step_with_gradient <fedseg.site.runtime.Site.step_with_gradient>`); answered with None."""

    site: str
    role: str  # the model's role at the site ("?" when it is none of its roles), for messages
    model: nn.Module
    optimizer: torch.optim.Optimizer
    grad: Mapping[str, torch.Tensor]


Call = FitCall | GradientCall | ApplyCall
"""A request of a site handler."""

Asks = Generator[Call, Any, T]
"""A handler (or a part of one) that asks for calls and returns a ``T``."""


class LossSums:
    """Losses summed on the device (float64) and read on the host once, by :meth:`means`:
    a training loop that adds every step's loss never waits for the device."""

    def __init__(self, device: torch.device):
        self.device = device
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, int] = {}

    def add(self, key: str, loss: torch.Tensor) -> None:
        if key not in self._sums:
            self._sums[key] = torch.zeros((), dtype=torch.float64, device=self.device)
            self._counts[key] = 0
        self._sums[key] += loss.detach()
        self._counts[key] += 1

    def count(self, key: str) -> int:
        return self._counts.get(key, 0)

    def means(self) -> dict[str, float]:
        """``{key: mean loss}`` (one host read for all keys)."""
        if not self._sums:
            return {}
        keys = list(self._sums)
        values = torch.stack([self._sums[k] for k in keys]).tolist()
        return {k: v / self._counts[k] for k, v in zip(keys, values)}


# ------------------------------------------------------------------ computed at the site
PROGRESS_EVERY_S = 30.0
"""A round of local training that lasts longer than this says where it is about this often."""
FIRST_STEPS = 3
"""Steps of a site's first round after which it says what a step and the round will cost (the first step,
which builds the network's buffers, is left out of the estimate)."""


class RoundProgress:
    """What a site says while a round of local training runs: after its first round's first
    :data:`FIRST_STEPS` steps, the measured seconds a step and the round's estimate when the round will take
    longer than :data:`PROGRESS_EVERY_S`; then a line every :data:`PROGRESS_EVERY_S` seconds.  It reads only the
    clock (no loss, no device synchronization), so a run's numbers are the same with or without it.  ``said``:
    the site's flag that its first round has said its estimate (set here, kept by the site)."""

    def __init__(self, name: str, said: Flag, rnd: int, total: int, log: Callable[[str], None] | None = None):
        self.name, self.said, self.rnd, self.total = name, said, rnd, total
        self.log = log or print
        self.t0 = self.last = time.perf_counter()
        self.t1: float | None = None
        self.first = not said.set

    def step(self, done: int) -> None:
        now = time.perf_counter()
        if done == 1:
            self.t1 = now
        if self.first and done == FIRST_STEPS + 1 and self.t1 is not None:
            self.first = False
            self.said.set = True
            per = (now - self.t1) / FIRST_STEPS
            left = per * (self.total - done)
            if (now - self.t0) + left > PROGRESS_EVERY_S:
                self.log(
                    f"{self.name}: round {self.rnd}: about {per:.2f} s a training step measured, about "
                    f"{(now - self.t0) + left:.0f} s for this round's {self.total} steps"
                )
        if now - self.last >= PROGRESS_EVERY_S and done < self.total:
            self.last = now
            per = (now - self.t0) / done
            self.log(
                f"{self.name}: round {self.rnd}: step {done}/{self.total}, {now - self.t0:.0f} s, "
                f"about {per * (self.total - done):.0f} s left"
            )


def backward_step(
    opt: torch.optim.Optimizer,
    loss: torch.Tensor,
    scaler: torch.amp.GradScaler | None = None,
    model: nn.Module | None = None,
    after_backward: Hook | None = None,
    after_step: Hook | None = None,
) -> None:
    """``loss.backward()`` and one step of ``opt``; under fp16 through ``scaler`` (scaled backward, unscaled
    gradients for ``after_backward(model)``, a step skipped and the scale backed off when a gradient
    overflowed).  ``after_step(model)`` follows the step."""
    if scaler is None:
        loss.backward()
        if after_backward is not None and model is not None:
            after_backward(model)
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if after_backward is not None and model is not None:
            after_backward(model)
        scaler.step(opt)
        scaler.update()
    if after_step is not None and model is not None:
        after_step(model)


def local_fit(c: FitCall) -> dict[str, float]:
    """A :class:`FitCall` computed at its site, from the call alone.

    The forward pass runs under the call's autocast (the extra loss outside it, in the weights' dtype); fp16
    scales the loss (the call's scaler).  The loss is summed on the device and read once at the end of the
    round, so no step waits for the host.  A round that takes minutes says what it costs and where it is
    (:class:`RoundProgress`)."""
    if c.scaler is not None and c.after_step is not None:
        raise ConfigError(
            f"site {c.site}: train.precision = 'fp16' skips an overflowed step, which a correction after each "
            "step (SCAFFOLD's correction = 'step') would not know; use --set train.precision=bf16 (no loss "
            "scaling needed)"
        )
    model, opt = c.model, c.optimizer
    model.train()
    sums = LossSums(c.device)
    progress = RoundProgress(c.site, c.said, c.rnd, c.batches.steps)
    for done, (x, y) in enumerate(c.batches, 1):
        opt.zero_grad(set_to_none=True)
        with c.autocast():
            loss = c.loss(model(x), y)
        if c.extra_loss is not None:
            loss = loss + c.extra_loss(model)
        backward_step(opt, loss, c.scaler, model, c.after_backward, c.after_step)
        sums.add("loss", loss)
        progress.step(done)
    means = sums.means()
    return {"loss": means.get("loss", 0.0), "steps": sums.count("loss")}


def local_gradient(c: GradientCall) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A :class:`GradientCall` computed at its site, in training mode, without a step: ``({name: gradient},
    loss)`` (parameters the loss does not reach are left out; the loss detached, not read).  With ``at`` the
    gradient is taken at those weights, as leaves of their own (the model's parameters and ``.grad`` are not
    touched)."""
    model = c.model
    model.train()
    if c.at is not None:
        p = {k: t.detach().requires_grad_(True) for k, t in c.at.items()}
        with c.autocast():
            value = c.loss(functional_call(model, p, (c.x,)), c.target)
        gs = torch.autograd.grad(value, list(p.values()), allow_unused=True)
        return {k: g for k, g in zip(p, gs) if g is not None}, value.detach()
    model.zero_grad(set_to_none=True)
    with c.autocast():
        value = c.loss(model(c.x), c.target)
    value.backward()
    grads = {n: q.grad.detach().clone() for n, q in model.named_parameters() if q.grad is not None}
    return grads, value.detach()


def step_with_gradient(model: nn.Module, optimizer: torch.optim.Optimizer, grad: Mapping[str, torch.Tensor]) -> None:
    """One ``optimizer`` step with ``grad`` (parameter name → tensor; a parameter it does not name gets no
    gradient) as the model's gradient."""
    for name, p in model.named_parameters():
        g = grad.get(name)
        p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype).clone()
    optimizer.step()


def local_apply(c: ApplyCall) -> None:
    """An :class:`ApplyCall` computed at its site (:func:`step_with_gradient`)."""
    step_with_gradient(c.model, c.optimizer, c.grad)


# ------------------------------------------------------------------------- driving
def as_asks(handler_result: Any) -> Asks[Any]:
    """A handler's result as a generator: a plain function's reply becomes one that asks nothing."""
    if inspect.isgenerator(handler_result):
        return cast("Asks[Any]", handler_result)
    return _done(handler_result)


def _done(value: Any) -> Asks[Any]:
    return value
    yield  # pragma: no cover  (makes this a generator)


def drive(asks: Asks[T], answer: Callable[[Call], Any]) -> T:
    """Run one handler to its end, each request answered by ``answer``; returns what it returns."""
    result: Any = None
    try:
        while True:
            call = asks.send(result)
            result = answer(call)
    except StopIteration as stop:
        return stop.value


class Executor(Protocol):
    """Who answers a site's requests: :meth:`answer` computes one; :meth:`run` drives the handlers of one ask."""

    def answer(self, call: Call) -> Any: ...

    def run(self, handlers: Sequence[Asks[Reply]]) -> list[Reply]: ...


class LocalExecutor:
    """Computes every request at its site, the handlers one after another, in the calling thread (deployed
    sites, and simulations that run their sites in turn)."""

    def answer(self, call: Call) -> Any:
        """One request computed at its site."""
        if isinstance(call, FitCall):
            return local_fit(call)
        if isinstance(call, GradientCall):
            return local_gradient(call)
        return local_apply(call)

    def run(self, handlers: Sequence[Asks[Reply]]) -> list[Reply]:
        """Every handler to its end, in turn; their replies in order."""
        return [drive(h, self.answer) for h in handlers]
