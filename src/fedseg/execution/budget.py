"""The engine's privacy budget check before a round: each site's ε after one more planned round against
``privacy.epsilon`` and against a deployed site's own lifetime ceiling."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedseg.foundation.config import PrivacyConfig
from fedseg.foundation.errors import ConfigError

__all__ = ["over_budget"]


def over_budget(
    privacy: PrivacyConfig, report: dict[str, dict[str, Any]] | None, rnd: int, log: Callable[[str], None]
) -> bool:
    """True when round ``rnd`` would take a site past ``privacy.epsilon`` and ``budget_action = "stop"``
    (logged either way); a budget that not even the first round fits is a :class:`ConfigError`.  Also True
    (whatever ``budget_action``) when it would take a deployed site past its policy's lifetime ceiling over
    all its runs (``epsilon_lifetime_next`` > ``epsilon_ceiling`` in its report): the site would refuse it."""
    target = privacy.epsilon
    if report is None:
        return False
    lifetime = {
        s: r["epsilon_lifetime_next"]
        for s, r in report.items()
        if r.get("epsilon_ceiling") is not None and r.get("epsilon_lifetime_next", 0.0) > r["epsilon_ceiling"]
    }
    if lifetime and rnd > 1:  # round 1: the site refused the run at setup already
        worst = max(lifetime, key=lambda s: lifetime[s])
        log(
            f"privacy budget: round {rnd} would take the data of site {worst} to ε = {lifetime[worst]:.3g} over "
            f"all its runs > its policy's max_epsilon = {report[worst]['epsilon_ceiling']:g} (sites over it: "
            f"{sorted(lifetime)}): training stops after round {rnd - 1} (checkpoint saved) and its models are "
            "tested; the site's lifetime budget is its own"
        )
        return True
    if target is None:
        return False
    over = {s: r["epsilon_next"] for s, r in report.items() if r["epsilon_next"] > target}
    if not over:
        return False
    worst = max(over, key=lambda s: over[s])
    said = (
        f"privacy budget: round {rnd} would take site {worst} to ε = {over[worst]:.3g} > privacy.epsilon = "
        f"{target:g} (δ = {privacy.delta:g}; sites over it: {sorted(over)})"
    )
    if privacy.budget_action == "warn":
        log(f"{said}; privacy.budget_action = warn: training on")
        return False
    if rnd == 1:
        raise ConfigError(
            f"{said}: not even one round fits; raise privacy.epsilon or privacy.noise_multiplier, or lower "
            "train.local_epochs / train.local_steps"
        )
    log(
        f"{said}: training stops after round {rnd - 1} (checkpoint saved) and its models are tested; raise "
        "privacy.epsilon (or privacy.noise_multiplier) to train further, or set privacy.budget_action = warn"
    )
    return True
