"""A site's DP-SGD (``privacy.dp = "sample"``): its privatized local steps and gradients, and its ε.

With ``privacy.dp = "sample"`` every :meth:`Site.fit <fedseg.site.runtime.Site.fit>` step and every
:meth:`Site.gradient <fedseg.site.runtime.Site.gradient>` (lockstep gradient averaging: FGA, FedSM's
selector) of a site uses DP-SGD's privatized gradient (:func:`fedseg.privacy.dp.privatized_gradient`)
instead of the batch gradient, and counts the step.  A data-independent extra loss (FedProx's proximal
term) is added after the noise, as is SCAFFOLD's correction (``after_backward``): neither reads the data.

The site keeps its count of privatized steps per batch size in ``site.store`` (``privacy/steps/<B>``),
so a restarted or resumed site accounts for the steps it took before.  Its ε is the accountant's
(:mod:`fedseg.privacy.accountant`) for those steps at σ and q = B / n.  σ is ``privacy.noise_multiplier``,
or, when that is unset, the σ whose planned steps (the method's privatized steps per round,
``algorithm.dp_steps_per_round(n)``, times ``rounds``) spend ``privacy.epsilon``.

With ``privacy.dp = "client"`` a site instead clips and noises its round's update
(:meth:`SiteDP.client_update`), counted as one step at q = 1 (every site takes part in every round).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from fedseg.foundation.errors import ConfigError
from fedseg.foundation.seeding import generator
from fedseg.privacy import accountant
from fedseg.privacy.dp import clip_update, noise_like, privatized_gradient

__all__ = ["SiteDP"]

_PREFIX = "privacy/steps/"
_CLIENT = "privacy/client_rounds"


class SiteDP:
    """The DP-SGD state and steps of one :class:`~fedseg.site.runtime.Site` (``site.dp``)."""

    def __init__(self, site: Any):
        self.site = site
        """The :class:`~fedseg.site.runtime.Site` (typed loosely: the runtime imports this module)."""
        self.settings = site.cfg.privacy
        self._sigma: float | None = None

    # ------------------------------------------------------------- accounting
    @property
    def client(self) -> bool:
        """Client-level DP (``privacy.dp = "client"``): one clipped, noised update per round."""
        return self.settings.dp == "client"

    def planned_steps_per_round(self) -> int:
        """The method's privatized steps in one round of this site (``algorithm.dp_steps_per_round(n)``;
        client level: its one update)."""
        if self.client:
            return 1
        plan = getattr(self.site.algorithm, "dp_steps_per_round", None)
        steps = plan(self.site.cfg, self.site.num_train) if plan is not None else None
        if steps is None:
            raise ConfigError(
                f"privacy.dp = 'sample' is not available for method {self.site.algorithm.name!r}; "
                "use --set privacy.dp=off or a method whose local steps it privatizes"
            )
        return int(steps)

    @property
    def batch_size(self) -> int:
        return self.site.cfg.train.batch_size

    @property
    def sigma(self) -> float:
        """The site's noise multiplier σ (given, or derived from ``privacy.epsilon`` once)."""
        if self._sigma is None:
            s = self.settings
            if s.noise_multiplier is not None:
                self._sigma = float(s.noise_multiplier)
            elif self.client:  # every site's update in every round: q = 1
                planned = self.site.cfg.rounds
                self._sigma = accountant.noise_multiplier(s.epsilon, s.delta, 1.0, planned, s.accountant)
            else:
                q = accountant.sample_rate(self.batch_size, self.site.num_train)
                planned = self.planned_steps_per_round() * self.site.cfg.rounds
                self._sigma = accountant.noise_multiplier(s.epsilon, s.delta, q, planned, s.accountant)
        return self._sigma

    def steps(self) -> dict[int, int]:
        """Privatized steps taken so far, per (nominal) batch size (client level: ``{0: updates sent}``)."""
        if self.client:
            return {0: int(self.site.store[_CLIENT])} if _CLIENT in self.site.store else {}
        return {int(k[len(_PREFIX) :]): int(v) for k, v in self.site.store.items() if k.startswith(_PREFIX)}

    def _count(self, batch_size: int) -> int:
        """Count one step at ``batch_size``; returns the site's total before it (the step's noise key)."""
        steps = self.steps()
        total = sum(steps.values())
        self.site.store[f"{_PREFIX}{batch_size}"] = torch.tensor(steps.get(batch_size, 0) + 1, dtype=torch.int64)
        return total

    def history(self, extra_steps: int = 0) -> list[tuple[float, float, int]]:
        """The accountant history of the steps taken (plus ``extra_steps`` more at ``train.batch_size``)."""
        steps = self.steps()
        if self.client:
            return [(self.sigma, 1.0, steps.get(0, 0) + extra_steps)]
        steps[self.batch_size] = steps.get(self.batch_size, 0) + extra_steps
        n = self.site.num_train
        return [(self.sigma, accountant.sample_rate(b, n), t) for b, t in sorted(steps.items()) if t > 0]

    def epsilon(self, extra_steps: int = 0) -> float:
        """ε at ``privacy.delta`` of the steps taken (plus ``extra_steps`` planned ones)."""
        s = self.settings
        return accountant.epsilon(self.history(extra_steps), s.delta, s.accountant)

    def report(self) -> dict[str, Any]:
        """What the engine records per site and round: ε spent, ε after one more planned round, σ, q, steps."""
        steps = self.steps()
        return {
            "epsilon": self.epsilon(),
            "epsilon_next": self.epsilon(self.planned_steps_per_round()),
            "noise_multiplier": self.sigma,
            "sample_rate": 1.0 if self.client else accountant.sample_rate(self.batch_size, self.site.num_train),
            "steps": sum(steps.values()),
        }

    # ------------------------------------------------------------------ steps
    def gradient(
        self,
        role: str,
        x: torch.Tensor,
        target: Any,
        loss: Callable[[torch.Tensor, Any], torch.Tensor] | None = None,
        at: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The privatized gradient of one batch of the role's model (counted as one step) and the mean loss.
        Its noise comes from the generator of (run seed, site, "dp", role, the site's privatized steps so far):
        a key no other step of the run shares, kept across a restart (the count is saved with the site)."""
        site = self.site
        model = site.model(role)
        model.train()
        key = self._count(max(self.batch_size, int(x.shape[0])))
        g = generator(site.cfg.seed, site.index, "dp", role, key)
        return privatized_gradient(
            model,
            site.workload.loss if loss is None else loss,
            x,
            target,
            self.settings.clip,
            self.sigma,
            g,
            params=at,
            autocast=site.autocast,
        )

    def fit(
        self,
        role: str,
        rnd: int,
        stream: str,
        optimizer: Any,
        extra_loss: Callable[[nn.Module], torch.Tensor] | None,
        after_backward: Callable[[nn.Module], None] | None,
        steps: int | None,
    ) -> dict[str, float]:
        """:meth:`Site.fit <fedseg.site.runtime.Site.fit>` with DP-SGD's gradient at every step."""
        site = self.site
        if site.precision == "fp16":
            raise ConfigError(
                "privacy.dp = 'sample' does not run with fp16 loss scaling; use --set train.precision=bf16"
            )
        model = site.model(role)
        opt = optimizer or site.optimizer(role)
        total = torch.zeros((), dtype=torch.float64, device=site.device)
        count = 0
        for x, y in site.batches(rnd, stream, steps):
            opt.zero_grad(set_to_none=True)
            grads, value = self.gradient(role, x, y)
            if extra_loss is not None:  # data-independent (FedProx's proximal term): its exact gradient
                extra = extra_loss(model)
                extra.backward()
                value = value + extra.detach()
            for name, p in model.named_parameters():
                g = grads.get(name)
                if g is None:
                    continue
                g = g.to(dtype=p.dtype)
                p.grad = g if p.grad is None else p.grad + g
            if after_backward is not None:
                after_backward(model)
            opt.step()
            total += value.double()
            count += 1
        return {"loss": float(total) / max(count, 1), "steps": count}

    def client_update(self, role: str, start: Mapping[str, torch.Tensor], num_sites: int) -> dict[str, torch.Tensor]:
        """Client-level DP (``privacy.dp = "client"``): the role's shared arrays as ``start + Δ̃``, where
        Δ̃ = clip(w_k − start, C) + N(0, σ²C² / K) for K = ``num_sites``.  The noise is distributed: the K
        sites' shares sum to N(0, σ²C²) on the server's sum, so neither the server nor a sum under secure
        aggregation ever holds an un-noised update.  Counted as one update of the site; the noise comes from
        the generator of (run seed, site, "dp-client", role, updates so far)."""
        site, s = self.site, self.settings
        arrays = site.arrays(role)
        delta = {k: v - start[k].to(v) for k, v in arrays.items() if v.is_floating_point()}
        clipped, _ = clip_update(delta, s.clip)
        done = self.steps().get(0, 0)
        site.store[_CLIENT] = torch.tensor(done + 1, dtype=torch.int64)
        g = generator(site.cfg.seed, site.index, "dp-client", role, done)
        noise = noise_like(clipped, self.sigma * s.clip / num_sites**0.5, g)
        out = dict(arrays)
        out.update({k: start[k].to(clipped[k]) + clipped[k] + noise[k] for k in clipped})
        return out
