"""Deployment settings: the ``[deploy]`` section of a run config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedseg.config import RunConfig, dataclass_from_dict
from fedseg.errors import ConfigError

SECTION = "deploy"


@dataclass(frozen=True)
class DeployParams:
    """Fault handling of a deployed run.

    min_sites
        A round (any exchange with the sites) needs at least this many valid
        replies; fewer stops the run with an error (the last checkpoint stays
        valid for ``--resume``).  Capped at the number of sites asked.
    round_deadline_s
        Seconds a site has to answer one task.  A site that has not answered by
        then, or whose reply fails validation, is left out of that exchange; the
        algorithm aggregates over the sites that answered (FedAvg renormalises
        p_k = n_k / Σ_answered n_j).
    setup_timeout_s
        Seconds a site has to load its data and build its runtime when the run starts.
    max_payload_mb
        Largest reply accepted, in MiB.
    """

    min_sites: int = 1
    round_deadline_s: float = 600.0
    setup_timeout_s: float = 300.0
    max_payload_mb: float = 4096.0

    def validate(self) -> None:
        if self.min_sites < 1:
            raise ConfigError(f"deploy.min_sites must be >= 1, got {self.min_sites}")
        if not self.round_deadline_s > 0:
            raise ConfigError(f"deploy.round_deadline_s must be > 0 seconds, got {self.round_deadline_s}")
        if not self.setup_timeout_s > 0:
            raise ConfigError(f"deploy.setup_timeout_s must be > 0 seconds, got {self.setup_timeout_s}")
        if not self.max_payload_mb > 0:
            raise ConfigError(f"deploy.max_payload_mb must be > 0, got {self.max_payload_mb}")

    @property
    def max_payload_bytes(self) -> int:
        return int(self.max_payload_mb * (1 << 20))


def deploy_params(cfg: RunConfig | dict[str, Any]) -> DeployParams:
    """The run's :class:`DeployParams` (from ``cfg.params["deploy"]`` or a plain table), validated."""
    table = cfg.params.get(SECTION, {}) if isinstance(cfg, RunConfig) else cfg
    p = dataclass_from_dict(DeployParams, table, SECTION)
    p.validate()
    return p
