"""Deployment settings: the ``[deploy]`` section of a run config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedseg.foundation.config import RunConfig, dataclass_from_dict
from fedseg.foundation.errors import ConfigError

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
    probe_timeout_s
        A site that failed its last exchange is first pinged with this timeout; if
        it does not answer it is left out of the exchange at once instead of
        costing the whole deadline again (a dead site would otherwise cost one
        deadline per exchange, i.e. several per round).
    max_restarts
        How many times the supervisor (``fedseg deploy run`` / ``rehearse``)
        re-submits the run from its last round checkpoint when the FLARE job ends
        without results (aborted or failed), before giving up with the resume
        command.  0 turns automatic recovery off.
    rejoin
        When a site restarts (it re-registers with the FLARE server, so its old
        job process is gone), end the job after the current round and re-submit
        it from that round's checkpoint with the site back in.  Restarts for a
        rejoin do not count against ``max_restarts``.
    rejoin_wait_s
        Before a re-submission, how long to wait for sites missing from the
        server's list to connect (the job then starts with those present, at
        least ``min_sites``).
    max_update_ratio
        A reply whose update ‖w_k − w‖ (the tensors it returns of those the task
        sent; of a training task per √(local step), the steps following from the
        site's declared count) is more than this many times the median update of the exchange's
        other replies is rejected before aggregation (a site cannot move the global
        model far on its own); so is one whose tensors the task did not send (a
        lockstep gradient, SCAFFOLD's ``dc``) have a norm more than this many times
        the median of the other replies'.  0 turns the rule off.
    max_abs_value
        The server refuses to checkpoint an aggregate holding a value larger in
        magnitude than this (or a NaN/infinity); the previous checkpoint stays
        the one ``--resume`` starts from.
    shutdown_grace_s
        Once the run has its results, or has stopped for a site's rejoin, how long
        the supervisor lets FLARE end the job by itself before aborting it (a
        killed site can keep FLARE's job open for minutes).
    """

    min_sites: int = 1
    """Fewest valid replies an exchange needs; fewer stops the run (the last checkpoint stays resumable)."""
    round_deadline_s: float = 600.0
    """Seconds a site has to answer one task; a late or invalid reply is left out of that exchange."""
    setup_timeout_s: float = 300.0
    """Seconds a site has to load its data and build its runtime when the run starts."""
    max_payload_mb: float = 4096.0
    """Largest reply accepted, in MiB."""
    probe_timeout_s: float = 10.0
    """A site that failed its last exchange is first pinged with this timeout and left out at once if it does not answer."""
    max_restarts: int = 3
    """Times the supervisor re-submits the run from its last checkpoint when the job ends without results; 0 = off."""
    rejoin: bool = True
    """When a site restarts, end the job after the round and re-submit it with the site back in."""
    rejoin_wait_s: float = 30.0
    """Before a re-submission, seconds to wait for missing sites to connect."""
    max_update_ratio: float = 10.0
    """Reject a reply whose update is more than this many times the median of the others' (0 = off)."""
    max_abs_value: float = 1e12
    """Refuse to checkpoint an aggregate holding a value larger in magnitude than this (or NaN / infinity)."""
    shutdown_grace_s: float = 10.0
    """Once results are in (or the run stopped for a site's rejoin), seconds FLARE may take to end the job by itself before it is aborted."""

    def validate(self) -> None:
        if self.min_sites < 1:
            raise ConfigError(f"deploy.min_sites must be >= 1, got {self.min_sites}")
        if not self.round_deadline_s > 0:
            raise ConfigError(f"deploy.round_deadline_s must be > 0 seconds, got {self.round_deadline_s}")
        if not self.setup_timeout_s > 0:
            raise ConfigError(f"deploy.setup_timeout_s must be > 0 seconds, got {self.setup_timeout_s}")
        if not self.max_payload_mb > 0:
            raise ConfigError(f"deploy.max_payload_mb must be > 0, got {self.max_payload_mb}")
        if not self.probe_timeout_s > 0:
            raise ConfigError(f"deploy.probe_timeout_s must be > 0 seconds, got {self.probe_timeout_s}")
        if self.max_restarts < 0:
            raise ConfigError(f"deploy.max_restarts must be >= 0 (0 = no automatic recovery), got {self.max_restarts}")
        if self.rejoin_wait_s < 0:
            raise ConfigError(f"deploy.rejoin_wait_s must be >= 0 seconds, got {self.rejoin_wait_s}")
        if not (self.max_update_ratio == 0 or 1.0 < self.max_update_ratio < float("inf")):
            raise ConfigError(
                f"deploy.max_update_ratio must be > 1 (reject updates that many times the median) or 0 (off), got {self.max_update_ratio}"
            )
        if not 0 < self.max_abs_value < float("inf"):
            raise ConfigError(f"deploy.max_abs_value must be a finite number > 0, got {self.max_abs_value}")
        if self.shutdown_grace_s < 0:
            raise ConfigError(f"deploy.shutdown_grace_s must be >= 0 seconds, got {self.shutdown_grace_s}")

    @property
    def max_payload_bytes(self) -> int:
        return int(self.max_payload_mb * (1 << 20))


def deploy_params(cfg: RunConfig | dict[str, Any]) -> DeployParams:
    """The run's :class:`DeployParams` (from ``cfg.params["deploy"]`` or a plain table), validated."""
    table = cfg.params.get(SECTION, {}) if isinstance(cfg, RunConfig) else cfg
    p = dataclass_from_dict(DeployParams, table, SECTION)
    p.validate()
    if isinstance(cfg, RunConfig) and cfg.privacy.secure_aggregation and p.max_update_ratio:
        raise ConfigError(
            f"deploy.max_update_ratio = {p.max_update_ratio:g} compares each site's update with the others', which "
            "privacy.secure_aggregation = true hides from the server (it sees only their sum): set "
            "--set deploy.max_update_ratio=0 to deploy with secure aggregation"
        )
    return p
