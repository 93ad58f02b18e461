"""DP-SGD at a site (``privacy.dp = "sample"``): the site's executor, which answers its requests privatized, and
the Poisson sampler its training batches come from.  The accounting, the ledger and the derivations are
:mod:`fedseg.site.dp`'s.

Every :meth:`Site.fit <fedseg.site.runtime.Site.fit>` step and every :meth:`Site.gradient
<fedseg.site.runtime.Site.gradient>` (lockstep gradient averaging: FGA, FedSM's global model by FGA and its
selector) uses DP-SGD's privatized gradient (:func:`fedseg.privacy.dp.privatized_gradient`) instead of the batch
gradient.  A data-independent extra loss (FedProx's proximal term) is added after the noise, as are SCAFFOLD's
corrections (``after_backward``, ``after_step``): none reads the data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from fedseg.foundation.errors import ConfigError
from fedseg.foundation.messages import Reply
from fedseg.privacy.dp import privatized_gradient
from fedseg.site.calls import Asks, Call, FitCall, GradientCall, Loss, drive, local_apply
from fedseg.site.dp import SiteDP

__all__ = ["DPExecutor", "PoissonSampler", "privatized"]


def privatized(
    dp: SiteDP,
    role: str,
    model: torch.nn.Module,
    loss: Loss,
    x: torch.Tensor,
    target: Any,
    at: Mapping[str, torch.Tensor] | None,
    autocast: Callable[[], AbstractContextManager[Any]],
    device: torch.device,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The privatized gradient of one batch of ``model`` (role ``role``) and its mean loss (kept at the site),
    booked first in ``dp``'s ledger (:meth:`SiteDP.book_step`), refused past the budget."""
    model.train()
    expected = dp.book_step(role)
    position = ("noise", role, dp.next_draw())
    return privatized_gradient(
        model,
        loss,
        x,
        target,
        dp.settings.clip,
        dp.sigma,
        lambda count, std: dp.random.normal(count, std, *position, device=device),
        params=at,
        autocast=autocast,
        batch_size=expected,
    )


def dp_fit(dp: SiteDP, call: FitCall) -> dict[str, float]:
    """A :class:`~fedseg.site.calls.FitCall` with DP-SGD's gradient at every step (its batches are the
    :class:`PoissonSampler`'s).  A data-independent extra loss (FedProx's proximal term) is added after the
    noise, with its exact gradient; ``after_backward`` and ``after_step`` (SCAFFOLD's corrections) read no
    data."""
    if call.precision == "fp16":
        raise ConfigError("privacy.dp = 'sample' does not run with fp16 loss scaling; use --set train.precision=bf16")
    model, opt = call.model, call.optimizer
    total = torch.zeros((), dtype=torch.float64, device=call.device)
    count = 0
    for x, y in call.batches:
        opt.zero_grad(set_to_none=True)
        grads, value = privatized(dp, call.role, model, call.loss, x, y, None, call.autocast, call.device)
        if call.extra_loss is not None:  # data-independent (FedProx's proximal term): its exact gradient
            extra = call.extra_loss(model)
            extra.backward()
            value = value + extra.detach()
        for name, p in model.named_parameters():
            g = grads.get(name)
            if g is None:
                continue
            g = g.to(dtype=p.dtype)
            p.grad = g if p.grad is None else p.grad + g
        if call.after_backward is not None:
            call.after_backward(model)
        opt.step()
        if call.after_step is not None:
            call.after_step(model)
        total += value.double()
        count += 1
    return {"loss": float(total) / max(count, 1), "steps": count}


class DPExecutor:
    """Answers one site's requests privatized (``privacy.dp = "sample"``; the site's executor, chosen once), the
    handlers one after another: every :class:`~fedseg.site.calls.FitCall` by DP-SGD's steps (:func:`dp_fit`),
    every :class:`~fedseg.site.calls.GradientCall` by DP-SGD's privatized gradient (:func:`privatized`), both
    booked in the site's ledger ``dp``; an :class:`~fedseg.site.calls.ApplyCall` (a step with an averaged,
    already privatized gradient) at the site."""

    def __init__(self, dp: SiteDP):
        self.dp = dp

    def answer(self, call: Call) -> Any:
        if isinstance(call, FitCall):
            return dp_fit(self.dp, call)
        if isinstance(call, GradientCall):
            c = call
            return privatized(self.dp, c.role, c.model, c.loss, c.x, c.target, c.at, c.autocast, c.device)
        return local_apply(call)

    def run(self, handlers: Sequence[Asks[Reply]]) -> list[Reply]:
        """Every handler to its end, in turn; their replies in order."""
        return [drive(h, self.answer) for h in handlers]


class PoissonSampler:
    """The batches of ``privacy.dp = "sample"`` (a :class:`fedseg.site.batches.Sampler`): batch ``j`` of a round
    is a Poisson sample (every case with probability q = B / n) from the site's DP randomness
    (:meth:`SiteDP.batch`), drawn lazily, the same for every model trained on the round's batches."""

    def __init__(self, dp: SiteDP):
        self.dp = dp

    def __call__(
        self,
        rnd: int,
        stream: str,
        split: str,
        steps: int,
        n: int,
        batch_size: int,
        place: Callable[[torch.Tensor], torch.Tensor],
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for step in range(steps):
            idx = self.dp.batch(rnd, stream, split, step, n, batch_size)
            yield place(idx), idx
