"""What a site handler asks for, and the executors that answer.

A site handler (``algorithm.site_handlers()``) is a generator: where it needs local training it yields a call
value — ``stats = yield from site.fit(role, rnd)`` (:class:`FitCall`), ``grads, loss = yield from
site.gradient(role, x, y)`` (:class:`GradientCall`), ``yield from site.step_with_gradient(model, opt, grad)``
(:class:`ApplyCall`) — and receives the result; it returns its :class:`~fedseg.foundation.messages.Reply`.  A
handler that trains nothing may be a plain function returning the reply.

An executor drives all the handlers of one ask: it advances each to its next request, computes the requests
and sends the results back.  :class:`LocalExecutor` computes each request at its site, one handler after the
other (deployed sites; simulations that run their sites in turn); :class:`fedseg.site.dp.DPExecutor` computes
them privatized (``privacy.dp = "sample"``); :class:`fedseg.execution.vectorize.VectorizedExecutor` computes
the requests of all sites of one ask stacked.  Every executor runs in the calling thread.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

import torch
from torch import nn
from torch.func import functional_call

from fedseg.foundation.errors import ConfigError
from fedseg.foundation.messages import Reply

__all__ = [
    "ApplyCall",
    "Asks",
    "Call",
    "Executor",
    "FitCall",
    "GradientCall",
    "LocalExecutor",
    "LossSums",
    "RoundProgress",
    "as_asks",
    "drive",
    "local_apply",
    "local_fit",
    "local_gradient",
    "step_with_gradient",
]

T = TypeVar("T")


@dataclass
class FitCall:
    """One round of local training of the role's model (:meth:`Site.fit <fedseg.site.runtime.Site.fit>`);
    answered with ``{"loss": mean, "steps": n}``."""

    site: Any  # a fedseg.site.runtime.Site (which imports this module)
    role: str
    rnd: int
    stream: str = "train"
    optimizer: Any = None
    extra_loss: Callable[[nn.Module], torch.Tensor] | None = None
    after_backward: Callable[[nn.Module], None] | None = None
    steps: int | None = None


@dataclass
class GradientCall:
    """The batch gradient of ``loss(model(x), target)`` at the role's weights or at ``at`` (a lockstep
    gradient-averaging step; :meth:`Site.gradient <fedseg.site.runtime.Site.gradient>`); answered with
    ``({name: gradient}, loss)``."""

    site: Any
    role: str
    x: torch.Tensor
    target: Any
    loss: Callable[[torch.Tensor, Any], torch.Tensor] | None = None
    at: Any = None  # the weights to differentiate at (name → tensor), None: the model's own


@dataclass
class ApplyCall:
    """One optimizer step of ``model`` with ``grad`` (parameter name → tensor) as its gradient
    (:meth:`Site.step_with_gradient <fedseg.site.runtime.Site.step_with_gradient>`); answered with None."""

    site: Any
    model: nn.Module
    optimizer: Any
    grad: Any


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
    clock (no loss, no device synchronization), so a run's numbers are the same with or without it."""

    def __init__(self, site: Any, rnd: int, total: int, log: Callable[[str], None] | None = None):
        self.site, self.rnd, self.total = site, rnd, total
        self.log = log or print
        self.t0 = self.last = time.perf_counter()
        self.t1: float | None = None
        self.first = not site.scratch.get("round_progress_said")

    def step(self, done: int) -> None:
        now = time.perf_counter()
        if done == 1:
            self.t1 = now
        if self.first and done == FIRST_STEPS + 1 and self.t1 is not None:
            self.first = False
            self.site.scratch["round_progress_said"] = True
            per = (now - self.t1) / FIRST_STEPS
            left = per * (self.total - done)
            if (now - self.t0) + left > PROGRESS_EVERY_S:
                self.log(
                    f"{self.site.name}: round {self.rnd}: about {per:.2f} s a training step measured, about "
                    f"{(now - self.t0) + left:.0f} s for this round's {self.total} steps"
                )
        if now - self.last >= PROGRESS_EVERY_S and done < self.total:
            self.last = now
            per = (now - self.t0) / done
            self.log(
                f"{self.site.name}: round {self.rnd}: step {done}/{self.total}, {now - self.t0:.0f} s, "
                f"about {per * (self.total - done):.0f} s left"
            )


def local_fit(c: FitCall) -> dict[str, float]:
    """A :class:`FitCall` computed at its site.

    ``extra_loss(model)`` is added to the workload loss (FedProx's proximal term); ``after_backward(model)``
    may edit gradients before the step (SCAFFOLD's correction).  The forward pass runs under
    ``train.precision``'s autocast (the proximal term outside it, in the weights' dtype); fp16 scales the loss
    (:attr:`Site.scalers`, one per role, kept across rounds).  The loss is summed on the device and read once
    at the end of the round, so no step waits for the host.  A round that takes minutes says what it costs and
    where it is (:class:`RoundProgress`)."""
    site = c.site
    model = site.model(c.role)
    opt = c.optimizer or site.optimizer(c.role)
    scaler = site.scaler(c.role)
    if scaler is not None and not isinstance(opt, torch.optim.Optimizer):
        raise ConfigError(
            f"train.precision = 'fp16' needs a plain torch optimizer, but {site.algorithm.name!r} steps "
            f"with {type(opt).__name__}; use --set train.precision=bf16 (no loss scaling needed)"
        )
    model.train()
    sums = LossSums(site.device)
    progress = RoundProgress(site, c.rnd, c.steps if c.steps is not None else site.steps_per_round())
    for done, (x, y) in enumerate(site.batches(c.rnd, c.stream, c.steps), 1):
        opt.zero_grad(set_to_none=True)
        with site.autocast():
            loss = site.workload.loss(model(x), y)
        if c.extra_loss is not None:
            loss = loss + c.extra_loss(model)
        site.step(c.role, opt, loss, model, c.after_backward)
        sums.add("loss", loss)
        progress.step(done)
    means = sums.means()
    return {"loss": means.get("loss", 0.0), "steps": sums.count("loss")}


def local_gradient(c: GradientCall) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A :class:`GradientCall` computed at its site, in training mode, without a step: ``({name: gradient},
    loss)`` (parameters the loss does not reach are left out; the loss detached, not read).  With ``at`` the
    gradient is taken at those weights, as leaves of their own (the model's parameters and ``.grad`` are not
    touched)."""
    site = c.site
    model = site.model(c.role)
    model.train()
    loss = site.workload.loss if c.loss is None else c.loss
    if c.at is not None:
        p = {k: t.detach().requires_grad_(True) for k, t in c.at.items()}
        with site.autocast():
            value = loss(functional_call(model, p, (c.x,)), c.target)
        gs = torch.autograd.grad(value, list(p.values()), allow_unused=True)
        return {k: g for k, g in zip(p, gs) if g is not None}, value.detach()
    model.zero_grad(set_to_none=True)
    with site.autocast():
        value = loss(model(c.x), c.target)
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
