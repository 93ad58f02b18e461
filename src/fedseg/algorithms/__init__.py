"""Federated methods, one module each, found by name through :data:`REGISTRY`."""

from __future__ import annotations

from fedseg.algorithms.apfl import APFL
from fedseg.algorithms.autofedavg import AutoFedAvg
from fedseg.algorithms.centralized import Centralized
from fedseg.algorithms.cwt import CWT
from fedseg.algorithms.ditto import Ditto
from fedseg.algorithms.fedavg import FedAvg, FedAvgEven
from fedseg.algorithms.fedprox import FedProx
from fedseg.algorithms.fedsm import FedSM, FedSMEnsemble, FedSMExtra
from fedseg.algorithms.fga import FGA
from fedseg.algorithms.ft import FT
from fedseg.algorithms.fwa import FWA
from fedseg.algorithms.local import Local
from fedseg.algorithms.perfedavg import PerFedAvg
from fedseg.algorithms.pfedme import PFedMe
from fedseg.algorithms.scaffold import Scaffold
from fedseg.foundation.config import RunConfig
from fedseg.foundation.errors import ConfigError
from fedseg.seams.algorithm import Algorithm, Candidate, NoParams, ServerContext

REGISTRY: dict[str, type[Algorithm]] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Add an algorithm class to the registry under ``cls.name`` (usable as a decorator)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    REGISTRY[cls.name] = cls
    return cls


for _cls in (
    Centralized,
    Local,
    FedAvg,
    FedAvgEven,
    FGA,
    FWA,
    CWT,
    AutoFedAvg,
    FedSM,
    FedSMExtra,
    FedSMEnsemble,
    FedProx,
    Scaffold,
    FT,
    APFL,
    PerFedAvg,
    PFedMe,
    Ditto,
):
    register(_cls)


# Sections that are not a method's but may appear in any run config: ``[deploy]``
# (deadlines, minimum sites) is read by ``fedseg deploy`` and ignored by a simulation,
# so ``fedseg run OUT/config.toml`` also works on the folder of a deployed run; ``[tracking]``
# (MLflow) is read by the commands that log runs (``fedseg.apps.tracking``).
EXTRA_SECTIONS = frozenset({"deploy", "tracking"})


def known_sections() -> set[str]:
    """Config sections that may appear in a run config: every method's, plus ``EXTRA_SECTIONS``."""
    return {c.section for c in REGISTRY.values() if c.section} | EXTRA_SECTIONS


def get_algorithm(cfg: RunConfig) -> Algorithm:
    """The algorithm named by ``cfg.method``, with its settings parsed from its config section."""
    cls = REGISTRY.get(cfg.method)
    if cls is None:
        raise ConfigError(f"unknown method {cfg.method!r}; known methods: {', '.join(sorted(REGISTRY))}")
    return cls(cfg)


__all__ = [
    "REGISTRY",
    "Algorithm",
    "Candidate",
    "NoParams",
    "ServerContext",
    "get_algorithm",
    "known_sections",
    "register",
]
