"""The intensity normalization schemes of volumes as types: one class per scheme, read from and written to
the plan's JSON.

A scheme is what :mod:`fedseg.data.volumes.intensity` plans per image channel and per site; the plan file
holds it as an object ``{"mode": <name>, <its fields>}``.  :data:`SCHEMES` maps each name to its class
(as nnU-Net's ``ImageNormalization`` subclasses, one per scheme): :func:`scheme_from_config` reads a plan's
object into its class, which refuses missing fields naming the fix; :meth:`IntensityScheme.to_config` writes
the same object back; calling a scheme normalizes one channel of any spatial shape to float32.

* ``"ct"`` (:class:`CTNormalization`, nnU-Net's ``CTNormalization``) — statistics pooled over the sites.
* ``"zscore"`` (:class:`ZScoreNormalization`, nnU-Net's ``ZScoreNormalization``) — per volume, over the body.
* ``"window"`` (:class:`WindowNormalization`) — an explicit window scaled to [0, 1].
* ``"minmax"`` (:class:`RescaleNormalization`, nnU-Net's ``RescaleTo01Normalization``) — per volume to [0, 1].
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from fedseg.data.spec import IntensityMode
from fedseg.data.volumes.fingerprint import CT_AIR
from fedseg.foundation.errors import ConfigError

__all__ = [
    "SCHEMES",
    "CTNormalization",
    "IntensityScheme",
    "RescaleNormalization",
    "WindowNormalization",
    "ZScoreNormalization",
    "scheme_from_config",
]

_EPS = 1e-8
"""Smallest standard deviation a z-score divides by (a constant channel maps to 0, not to inf)."""


class IntensityScheme(ABC):
    """One channel's intensity normalization: its name in the plan (:attr:`mode`), its fields, its mapping."""

    mode: ClassVar[IntensityMode]
    """The scheme's name: the ``"mode"`` of its object in the plan, its key in :data:`SCHEMES`."""

    @classmethod
    @abstractmethod
    def from_config(cls, config: Mapping[str, Any], where: str = "plan") -> IntensityScheme:
        """The scheme of the plan's object ``config`` (its ``"mode"`` already this class's); a missing or
        wrong field is a :class:`ConfigError` naming ``where`` and the fix."""

    @classmethod
    def planned(cls, *, ct_like: bool, window: Sequence[float] | None) -> IntensityScheme:
        """The scheme a plan gives a site's channel it decided on this class for
        (:func:`~fedseg.data.volumes.intensity.plan_intensity`), from what the plan knows of that channel
        alone: whether it is CT-like and the spec's ``window``.  A scheme without fields ignores both;
        ``"ct"``'s statistics are pooled over the sites, so the plan makes it from their histograms
        instead."""
        return cls.from_config({"mode": cls.mode})

    def to_config(self) -> dict[str, Any]:
        """The plan's object of this scheme: ``{"mode": ...}`` then its fields, those left ``None`` out."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        return {"mode": self.mode, **{k: v for k, v in fields.items() if v is not None}}

    @abstractmethod
    def __call__(self, x: np.ndarray) -> np.ndarray:
        """One channel (any spatial shape) normalized, as float32."""

    def describe(self) -> str:
        """The scheme in words, for the plan's log (``zscore over values above -500``)."""
        return self.mode


@dataclass(frozen=True)
class CTNormalization(IntensityScheme):
    """nnU-Net's CT scheme with statistics pooled over the sites that use it: clip to the pooled foreground
    percentiles [lo, hi] (0.5 and 99.5), subtract the pooled foreground mean, divide by the pooled sd.  The
    percentiles are exact order statistics (:func:`fedseg.data.volumes.intensity.exact_percentiles`), so every
    site maps a Hounsfield unit to the same value."""

    mode: ClassVar[IntensityMode] = "ct"
    lo: float
    """Lower clip: the pooled foreground's 0.5 percentile."""
    hi: float
    """Upper clip: the pooled foreground's 99.5 percentile."""
    mean: float
    """The pooled foreground's mean."""
    sd: float
    """The pooled foreground's population standard deviation (nnU-Net's ``np.std``)."""
    weighting: str | None = None
    """How the voxels were weighted in the statistics, ``"case"`` or ``"voxel"`` (recorded by the plan)."""
    bound: float | None = None
    """The most a percentile may differ from the pooled one (0: exact; recorded by the plan)."""

    @classmethod
    def from_config(cls, config: Mapping[str, Any], where: str = "plan") -> CTNormalization:
        if not all(k in config for k in ("lo", "hi", "mean", "sd")):
            raise ConfigError(f"{where}: intensity mode 'ct' needs lo, hi, mean and sd")
        return cls(
            config["lo"], config["hi"], config["mean"], config["sd"], config.get("weighting"), config.get("bound")
        )

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        lo, hi, mean, sd = float(self.lo), float(self.hi), float(self.mean), float(self.sd)
        return ((np.clip(x, lo, hi) - mean) / max(sd, _EPS)).astype(np.float32)


@dataclass(frozen=True)
class ZScoreNormalization(IntensityScheme):
    """nnU-Net's z-score per volume over the body: MR, whose units differ per scan; voxels outside the body
    are set to 0.

    The body is nnU-Net's non-zero mask (padding and background stored as 0 are left out), or for a CT-like
    channel the voxels above :data:`~fedseg.data.volumes.fingerprint.CT_AIR` (−500: air at −1000 is not
    body).  nnU-Net masks only where cropping to the non-zero voxels keeps under 3/4 of the median case (else
    it takes every voxel; the two agree on a volume without zeros); fedseg always masks, because on a
    federation whose MR sites store their background as 0 that rule takes the background into their
    statistics and lowers their Dice (``benchmarks/volumes_channels.py --case scanners --zscore-body all``,
    docs/results/volumes.md, "Intensities per channel and per site").  ``body = "all"`` takes every voxel.
    A volume without a body voxel is z-scored over all of its voxels."""

    mode: ClassVar[IntensityMode] = "zscore"
    body: float | str | None = None
    """The body: none = the non-zero voxels, a number = the voxels above it, ``"all"`` = every voxel."""

    @classmethod
    def from_config(cls, config: Mapping[str, Any], where: str = "plan") -> ZScoreNormalization:
        body = config.get("body")
        if not (body is None or body == "all" or (isinstance(body, (int, float)) and not isinstance(body, bool))):
            raise ConfigError(
                f"{where}: intensity mode 'zscore' has body = {body!r}; use a number (the voxels above it), "
                "'all' or leave it out (the non-zero voxels)"
            )
        return cls(body)

    @classmethod
    def planned(cls, *, ct_like: bool, window: Sequence[float] | None) -> IntensityScheme:
        """Over the voxels above :data:`~fedseg.data.volumes.fingerprint.CT_AIR` on a CT-like channel, else
        over the non-zero ones."""
        return cls(CT_AIR if ct_like else None)

    def mask(self, x: np.ndarray) -> np.ndarray:
        """The voxels of ``x`` the z-score is taken over (:attr:`body`)."""
        if self.body == "all":
            return np.ones(x.shape, dtype=bool)
        return x > float(self.body) if isinstance(self.body, (int, float)) else x != 0

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        body = self.mask(x)
        vals = x[body] if body.any() else x.ravel()
        mean, sd = float(vals.mean()), float(vals.std())
        out = (x - mean) / max(sd, _EPS)
        if body.any():
            out[~body] = 0.0
        return out.astype(np.float32)

    def describe(self) -> str:
        if self.body is None:
            return self.mode
        return f"{self.mode} over {'every voxel' if self.body == 'all' else f'values above {float(self.body):g}'}"


@dataclass(frozen=True)
class WindowNormalization(IntensityScheme):
    """Clip to an explicit window [lo, hi] and scale it to [0, 1] (head CT in the federated gradient averaging
    paper; ``data.window`` in the spec)."""

    mode: ClassVar[IntensityMode] = "window"
    window: tuple[float, float]
    """``[lo, hi]``, the values mapped to 0 and 1."""

    @classmethod
    def from_config(cls, config: Mapping[str, Any], where: str = "plan") -> WindowNormalization:
        window = config.get("window")
        if not isinstance(window, (list, tuple)) or len(window) != 2:
            raise ConfigError(f"{where}: intensity mode 'window' needs window = [lo, hi]")
        return cls((window[0], window[1]))

    @classmethod
    def planned(cls, *, ct_like: bool, window: Sequence[float] | None) -> IntensityScheme:
        """The spec's window (``data.window``)."""
        if window is None or len(window) != 2:
            raise ConfigError("intensity 'window' needs window = [low, high] (data.window in the spec)")
        return cls((float(window[0]), float(window[1])))

    def to_config(self) -> dict[str, Any]:
        return {"mode": self.mode, "window": list(self.window)}

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        lo, hi = (float(v) for v in self.window)
        return ((np.clip(x, lo, hi) - lo) / (hi - lo)).astype(np.float32)


@dataclass(frozen=True)
class RescaleNormalization(IntensityScheme):
    """Per volume to [0, 1] by its own minimum and maximum (nnU-Net's ``RescaleTo01Normalization``), as 2D
    photographs are loaded; a constant volume maps to 0."""

    mode: ClassVar[IntensityMode] = "minmax"

    @classmethod
    def from_config(cls, config: Mapping[str, Any], where: str = "plan") -> RescaleNormalization:
        return cls()

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        lo, hi = float(x.min()), float(x.max())
        return ((x - lo) / (hi - lo)).astype(np.float32) if hi > lo else np.zeros_like(x)


SCHEMES: dict[str, type[IntensityScheme]] = {
    c.mode: c for c in (CTNormalization, ZScoreNormalization, WindowNormalization, RescaleNormalization)
}
"""Each scheme's name (``"mode"`` in the plan, ``data.intensity`` in the spec) → its class."""


def scheme_from_config(config: Any, where: str = "plan") -> IntensityScheme:
    """The scheme of a plan's object ``{"mode": ..., ...}`` (:data:`SCHEMES`); anything else is a
    :class:`ConfigError` naming ``where`` and the schemes there are."""
    if not isinstance(config, Mapping):
        raise ConfigError(f"{where}: an intensity scheme is an object with a mode")
    mode = config.get("mode")
    cls = SCHEMES.get(mode) if isinstance(mode, str) else None
    if cls is None:
        raise ConfigError(f"{where}: unknown intensity mode {mode!r}; use {', '.join(map(repr, SCHEMES))}")
    return cls.from_config(config, where)
