"""Federated gradient averaging (FGA): Remedios et al. 2020, Section 2.2 and Alg. 1.

Every local step is a lockstep exchange.  Site k computes the gradient of its
**mean-reduced** loss on its next batch B_k (b_k = |B_k| samples) at the shared
weights Θ_t and sends it; the server averages

    g_t = Σ_k (b_k / Σ_j b_j) · ∇_Θ (1/b_k) Σ_{i∈B_k} ℓ_i(Θ_t)          ("samples", default)
        = ∇_Θ (1/|∪B_k|) Σ_{i∈∪B_k} ℓ_i(Θ_t)                              (the pooled batch)

and sends g_t back; every site applies g_t with its own Adam (Alg. 1 lines 15–20),
so every site holds the same Θ_{t+1}, m_t, v_t — those of centralized training on
the concatenated batches.  Alg. 1 line 14 writes the uniform mean (1/S) Σ_s g_s
(``fga.weighting = "even"``), which equals the pooled gradient only when all
batches have the same size.

The equivalence needs per-sample operations: no batch norm in training mode (its
batch statistics mix the samples of one site's batch), a loss that is a mean over
samples (not ``reduction="sum"``, not MONAI ``DiceLoss(batch=True)``) and
deterministic layers (dropout draws differ).  :func:`~fedseg.algorithms.gradients.equivalence_problems`
finds the first two and the site warns (:class:`~fedseg.algorithms.gradients.FGAEquivalenceWarning`).

The exchange itself (its protocol, the digests of the sites' states, a stale site's resync, secure
aggregation of each step) is :mod:`fedseg.algorithms.lockstep`; this module is FGA's settings and its two
halves over it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fedseg.algorithms.gradients import FP16_GRADIENT_AVERAGING
from fedseg.algorithms.lockstep import ROLE, gradient_step, lockstep_round, without_resync
from fedseg.algorithms.weighting import GradientWeighting
from fedseg.foundation.arrays import Arrays, prefixed, strip_prefix
from fedseg.foundation.messages import Reply, Task
from fedseg.seams.algorithm import Algorithm, Candidate, ServerContext
from fedseg.site.calls import Asks
from fedseg.site.runtime import Site, steps_per_round

__all__ = ["FGA", "FGAParams", "fga_step"]


@dataclass(frozen=True)
class FGAParams:
    """Settings of FGA.

    weighting
        ``"samples"`` (default): gradients weighted by batch sample counts b_k, so
        unequal batches still give the pooled batch's gradient; ``"even"``: the
        uniform mean of Alg. 1 line 14 (equal only for equal batch sizes).
    steps
        Lockstep steps per round: ``"max"`` (default) over the sites' steps per
        round (``train.local_epochs`` × ⌈n_k / batch⌉ or ``train.local_steps``),
        smaller sites cycle their seeded permutations; ``"min"`` stops with the
        smallest site.
    check_sync
        At each round's end every site reports a digest of its weights and optimizer
        state; warn if they differ (they are bitwise equal on identical hardware).
    """

    weighting: GradientWeighting = "samples"
    steps: Literal["max", "min"] = "max"
    """Lockstep steps per round: 'max' over the sites' steps per round (smaller sites cycle their data) or 'min' (stop with the smallest site)."""
    check_sync: bool = True
    """At each round's end compare digests of the sites' weights and optimizer state and warn if they differ."""


def fga_step(site: Site, task: Task) -> Asks[Reply]:
    """Site half of FGA (:func:`gradient_step` for the global model)."""
    return (yield from gradient_step(site, task))


# ---------------------------------------------------------------------- server half
class FGA(Algorithm):
    name = "fga"
    title = "FGA"
    section = "fga"
    Params = FGAParams

    def summed(self, task: Task) -> bool:
        """A lockstep step's gradient (``step`` set) is summed; the closing task (``step`` None) only applies."""
        return task.kind == "fga_step" and task.config.get("step") is not None

    def secure_aggregation_unsupported(self) -> str | None:
        return None  # each step's average is one secure sum of the sites' gradients (lockstep_round)

    def init_state(self, ctx: ServerContext) -> Arrays:
        return prefixed(ROLE, ctx.init_arrays(ROLE))

    def fp16_unsupported(self) -> str | None:
        return FP16_GRADIENT_AVERAGING

    def server_round(self, ctx: ServerContext, state: Arrays, rnd: int) -> tuple[Arrays, dict[str, Any]]:
        p = self.params
        weights, metrics, _ = lockstep_round(
            ctx,
            rnd,
            first=state if rnd == 1 else {},
            weighting=p.weighting,
            steps=p.steps,
            check_sync=p.check_sync,
            state=state,
        )
        return {**without_resync(state, ROLE), **weights}, metrics

    def candidates(self, state: Arrays, ctx: ServerContext) -> list[Candidate]:
        return [Candidate(ROLE, strip_prefix(ROLE, state))]

    def dp_steps_per_round(self, cfg, n: int) -> int | None:
        """DP-SGD: each lockstep exchange sends the privatized gradient (``Site.gradient``).  Planned as the
        site's own steps per round; with ``fga.steps = "max"`` a site with fewer cases than the largest takes
        that site's count (its ε then exceeds the plan, and the budget check applies)."""
        return steps_per_round(cfg.train, n)

    def site_handlers(self):
        return {"fga_step": fga_step}
