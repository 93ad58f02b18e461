"""The privacy accountant of DP-SGD: ε of a site's privatized steps at δ, and the noise multiplier of a target ε.

A site's privatized steps are a composition of subsampled Gaussian mechanisms, each with noise multiplier σ
(the noise's standard deviation over the clipping norm) and sampling rate q = batch size / training cases.
They are kept as Opacus' accountant history, ``[(σ, q, steps), ...]``, and ε is Opacus' own
(``opacus.accountants.RDPAccountant`` or ``PRVAccountant``).

**Sampling assumption.**  Both accountants analyse Poisson subsampling: every case enters a batch
independently with probability q.  fedseg's DP runs draw their batches that way
(:meth:`fedseg.site.runtime.Site.batches` under ``privacy.dp = "sample"``), each case's coin from the site's
DP randomness (:mod:`fedseg.privacy.randomness`), which the server cannot predict.  The privatized sum is
divided by the expected batch size B (:func:`fedseg.privacy.dp.privatized_gradient`), so the accountant's
mechanism is the one run.  With ``privacy.dp_randomness = "seeded"`` the server can regenerate the batches
and the noise: ε holds against other parties, not against the server (ε = ∞ there).

Opacus is imported inside the functions (a heavy optional dependency).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

__all__ = ["History", "epsilon", "noise_multiplier", "sample_rate"]

History = Sequence[tuple[float, float, int]]
"""Opacus' accountant history: ``(noise multiplier σ, sampling rate q, steps)`` per kind of step."""


def sample_rate(batch_size: int, n: int) -> float:
    """q = batch size / training cases (at most 1): the Poisson sampling rate the accountant assumes."""
    if n < 1:
        raise ValueError(f"a site with {n} training cases has no sampling rate")
    return min(1.0, batch_size / n)


@functools.lru_cache(maxsize=256)
def _rdp_one_step(sigma: float, q: float) -> np.ndarray:
    from opacus.accountants.analysis.rdp import compute_rdp
    from opacus.accountants.rdp import RDPAccountant

    return np.asarray(compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=RDPAccountant.DEFAULT_ALPHAS))


def _rdp_epsilon(history: tuple[tuple[float, float, int], ...], delta: float) -> float:
    """Opacus' ``RDPAccountant.get_epsilon`` for ``history``, its per-step RDP cached per (σ, q): the RDP of
    t steps is t times one step's (``compute_rdp`` multiplies the same way), so a site can check its budget
    before every step without recomputing the orders."""
    from opacus.accountants.analysis.rdp import get_privacy_spent
    from opacus.accountants.rdp import RDPAccountant

    rdp = sum(_rdp_one_step(s, q) * t for s, q, t in history)
    eps, _ = get_privacy_spent(orders=RDPAccountant.DEFAULT_ALPHAS, rdp=rdp, delta=delta)
    return float(eps)


def _accountant(kind: str, history: History):
    from opacus.accountants import create_accountant

    acc = create_accountant(mechanism=kind)
    acc.history = [(float(s), float(q), int(t)) for s, q, t in history if t > 0]
    return acc


def epsilon(history: History, delta: float, accountant: str = "rdp") -> float:
    """ε at ``delta`` of the steps in ``history`` (0 with no steps), by Opacus' ``accountant``
    ('rdp' or 'prv').  Answers are kept (an RDP answer over Opacus' fractional orders is slow)."""
    return _epsilon(tuple((float(s), float(q), int(t)) for s, q, t in history if t > 0), float(delta), accountant)


@functools.lru_cache(maxsize=1024)
def _epsilon(history: tuple[tuple[float, float, int], ...], delta: float, accountant: str) -> float:
    if not history:
        return 0.0
    if accountant == "rdp":
        return _rdp_epsilon(history, delta)
    return float(_accountant(accountant, history).get_epsilon(delta=delta))


@functools.lru_cache(maxsize=256)
def noise_multiplier(target_epsilon: float, delta: float, q: float, steps: int, accountant: str = "rdp") -> float:
    """The smallest σ (to Opacus' tolerance of 0.01 in ε) whose ``steps`` subsampled steps at rate ``q``
    spend at most ``target_epsilon`` at ``delta``: ``opacus.accountants.utils.get_noise_multiplier``."""
    from opacus.accountants.utils import get_noise_multiplier

    return float(
        get_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=delta,
            sample_rate=q,
            steps=max(1, int(steps)),
            accountant=accountant,
        )
    )
