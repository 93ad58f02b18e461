"""Intensity normalization of volumes: one scheme per federation, chosen by the plan.

* ``"ct"`` — nnU-Net's CT scheme with federation-wide statistics: clip to the pooled foreground
  0.5 / 99.5 percentiles, subtract the pooled foreground mean, divide by the pooled sd.  The numbers
  come from :mod:`fedseg.data.volumes.plan` (exact pooled moments, percentiles within one histogram bin),
  so every site maps a Hounsfield unit to the same value.
* ``"zscore"`` — per volume over the body (non-zero voxels): MR, whose units differ per scan.
* ``"window"`` — clip to an explicit window ``(lo, hi)`` and scale to [0, 1] (head CT in the federated
  gradient averaging paper).
* ``"minmax"`` — per volume to [0, 1], as 2D photographs are loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fedseg.data.spec import INTENSITY_MODES

__all__ = ["INTENSITY_MODES", "normalize_volume"]


def normalize_volume(image: np.ndarray, mode: str, stats: Mapping[str, Any] | None = None) -> np.ndarray:
    """Normalize a ``(C, *spatial)`` volume as float32.

    Parameters
    ----------
    image
        The volume in file units.
    mode
        One of :data:`INTENSITY_MODES`.
    stats
        ``"ct"``: ``{"lo", "hi", "mean", "sd"}`` (the plan's pooled foreground statistics);
        ``"window"``: ``{"window": [lo, hi]}``.
    """
    x = image.astype(np.float32)
    if mode == "ct":
        lo, hi, mean, sd = (float(stats[k]) for k in ("lo", "hi", "mean", "sd"))
        return ((np.clip(x, lo, hi) - mean) / max(sd, 1e-8)).astype(np.float32)
    if mode == "window":
        lo, hi = (float(v) for v in stats["window"])
        return ((np.clip(x, lo, hi) - lo) / (hi - lo)).astype(np.float32)
    if mode == "zscore":
        body = x != 0
        vals = x[body] if body.any() else x.ravel()
        mean, sd = float(vals.mean()), float(vals.std())
        out = (x - mean) / max(sd, 1e-8)
        out[~body] = 0.0 if body.any() else out[~body]
        return out.astype(np.float32)
    if mode == "minmax":
        lo, hi = float(x.min()), float(x.max())
        return (x - lo) / (hi - lo) if hi > lo else np.zeros_like(x)
    raise ValueError(f"unknown intensity mode {mode!r}; use one of {INTENSITY_MODES}")
