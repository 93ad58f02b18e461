"""The ``[privacy]`` section of a run's settings (secure aggregation and differential privacy) and its
word options; a part of :mod:`fedseg.foundation.config.schema`, which re-exports every name, and read
the same way (each field's docstring its description in ``fedseg settings``)."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

from fedseg.foundation.config.coerce import check_literals
from fedseg.foundation.errors import ConfigError

__all__ = ["DP_MODES", "DPMode", "DPRandomness", "PrivacyConfig"]

DPMode = Literal["off", "sample", "client"]
"""Values of ``privacy.dp``."""
DP_MODES: tuple[str, ...] = typing.get_args(DPMode)
DPRandomness = Literal["os", "seeded"]
"""Values of ``privacy.dp_randomness`` (:class:`fedseg.privacy.randomness.Randomness`)."""


@dataclass(frozen=True)
class PrivacyConfig:
    """What a site's messages reveal: secure aggregation of the sums the server needs, and differential
    privacy (``docs/privacy.md``).  Both off by default in a simulation; a deployment turns secure
    aggregation on unless the run config sets it."""

    secure_aggregation: bool = False
    """Sites add pairwise masks (X25519 key agreement, expanded by a seeded stream cipher) to fixed-point
    encodings of what the server only sums, so the server learns the sum and nothing of one site; methods
    that need one site's arrays at the server refuse it with the reason.  A deployment runs with true unless
    the run config sets it (docs/deploy.md), and a site's policy may require it."""
    secagg_fraction_bits: int = 32
    """Fixed-point precision of secure aggregation: each value x is sent as round(n_k · x · 2^bits) modulo 2^64,
    so the weighted mean is off by at most K · 2^-(bits+1) / Σ n_k (K sites); K · n_k · max|x| · 2^bits must stay
    below 2^63 (a site refuses a value that could overflow, naming this setting).  From 8 to 52."""
    secagg_min_sites: int = 3
    """The fewest sites a site masks with (checked by each site, whatever the server sends): a site refuses an
    exchange whose key list or masking list is shorter, and needs a majority t = ⌊K/2⌋ + 1 of the K sites keyed
    at every later step.  With 2, the other site's input is all that hides this site's in the sum.  At least 2."""
    secagg_identity: Literal["auto", "off"] = "auto"
    """'auto': a site that has a certificate (a deployed site's NVIDIA FLARE startup kit: client.crt, client.key,
    rootCA.pem) signs its secure-aggregation keys of each exchange with it and checks every peer's certificate
    (issued by the federation's root CA, common name = the site's name) and signature before it shares with
    it, so no server or path can substitute a site's keys; a peer that fails is left out of that exchange.  A
    site without a certificate (simulation) signs nothing.  'off': no site without a kit signs or checks (a
    deployed site with a kit signs, and checks its peers against its roster, whatever this says)."""
    dp: DPMode = "off"
    """'sample': DP-SGD at each site (per-sample gradient clipping and Gaussian noise on Poisson-sampled
    batches; each site books ε in its own ledger and refuses steps past ``epsilon``); 'client': each site's
    update clipped with its share of the Gaussian noise, masked under secure aggregation (needs
    ``secure_aggregation = true``); 'off': none."""
    epsilon: float | None = None
    """Privacy budget ε per site for the whole run (> 0).  Without ``noise_multiplier`` the noise multiplier
    is derived so that the planned rounds spend at most ε; with it, ε is a budget the run checks before
    every round (``budget_action``).  None: no budget, ε is only reported."""
    delta: float = 1e-5
    """δ of the (ε, δ) guarantee the accountant reports, in (0, 1); keep it below 1 / (training cases of a site).
    A deployed site refuses a run above its policy's ``max_delta`` (default min(1e-5, 1 / (10 · its cases)))."""
    clip: float = 1.0
    """Largest L2 norm of one sample's gradient ('sample': the whole gradient over all parameters of the
    model) or of one site's update w_k − w ('client'); larger ones are scaled down to it (> 0)."""
    noise_multiplier: float | None = None
    """σ: the Gaussian noise's standard deviation is σ · clip (> 0).  None: derived from ``epsilon`` over the
    planned rounds (one of the two must be set when dp is on)."""
    dp_randomness: DPRandomness = "os"
    """Where DP noise and DP batch sampling come from.  'os': a fresh key from the operating system's
    CSPRNG for every draw, never stored or sent, so no other party (the server, which knows the run seed,
    included) can regenerate the noise or predict the batches.  'seeded': keys derived from the run seed
    and the site index, for bitwise reproducible tests only; the server can then regenerate every draw, so
    the results record ε against the server as ∞.  A deployed site draws from its OS whatever this says,
    unless its own policy is ``reproducible`` (docs/deploy.md, "Site policy")."""
    budget_action: Literal["stop", "warn"] = "stop"
    """When the server's forecast says a round would take a site's ε past ``epsilon``: 'stop' ends training
    before that round (the checkpoint of the last round saved, the run then tested), 'warn' says so in the
    log and trains on.  Either way each site refuses any privatized step past ``epsilon`` itself."""
    accountant: Literal["rdp", "prv"] = "rdp"
    """Opacus' accountant of the ε per site: 'rdp' (Rényi DP of the subsampled Gaussian mechanism) or
    'prv' (privacy random variables, tighter)."""

    def validate(self) -> None:
        check_literals(self, "privacy")
        if self.epsilon is not None and not self.epsilon > 0:
            raise ConfigError(f"privacy.epsilon = {self.epsilon}; give a number > 0 (e.g. --set privacy.epsilon=8)")
        if not 0.0 < self.delta < 1.0:
            raise ConfigError(f"privacy.delta = {self.delta}; give a number in (0, 1) (e.g. --set privacy.delta=1e-5)")
        if not (self.clip > 0 and self.clip < float("inf")):
            raise ConfigError(f"privacy.clip = {self.clip}; give a finite number > 0 (e.g. --set privacy.clip=1.0)")
        if self.noise_multiplier is not None and not (0 < self.noise_multiplier < float("inf")):
            raise ConfigError(
                f"privacy.noise_multiplier = {self.noise_multiplier}; give a finite number > 0 "
                "(e.g. --set privacy.noise_multiplier=1.0), or none to derive it from privacy.epsilon"
            )
        if self.dp != "off" and self.epsilon is None and self.noise_multiplier is None:
            raise ConfigError(
                f"privacy.dp = {self.dp!r} needs privacy.epsilon (a target, e.g. --set privacy.epsilon=8) "
                "or privacy.noise_multiplier (e.g. --set privacy.noise_multiplier=1.0)"
            )
        if (
            isinstance(self.secagg_min_sites, bool)
            or not isinstance(self.secagg_min_sites, int)
            or self.secagg_min_sites < 2
        ):
            raise ConfigError(
                f"privacy.secagg_min_sites = {self.secagg_min_sites!r}; give an integer ≥ 2 "
                "(e.g. --set privacy.secagg_min_sites=3)"
            )
        if self.dp == "client" and not self.secure_aggregation:
            raise ConfigError(
                "privacy.dp = 'client' needs privacy.secure_aggregation = true: each site adds only 1/K of the "
                "noise's variance, which covers the server's sum but not one site's update seen in the clear "
                "(--set privacy.secure_aggregation=true)"
            )
        if not 8 <= self.secagg_fraction_bits <= 52:
            raise ConfigError(
                f"privacy.secagg_fraction_bits = {self.secagg_fraction_bits}; use 8 to 52 "
                "(e.g. --set privacy.secagg_fraction_bits=32)"
            )
