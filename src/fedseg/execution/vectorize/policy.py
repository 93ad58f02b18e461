"""``simulation.vectorize``: when a simulation runs its sites' local training as one vectorized computation."""

from __future__ import annotations

import torch

AUTO_MIN_SITES = 4
"""``simulation.vectorize = auto`` vectorizes a CUDA run of at least this many sites.  It rests on a
measurement of the eager vectorized step (without CUDA graphs) on an H100, in CHANGELOG.md (0.1.0,
"Vectorized simulation"): 2 sites gained nothing, 6 sites did; 3–5 sites were not measured, 4 is between.
With CUDA graphs (docs/results.md, "Vectorized simulation") fewer sites may gain."""


def resolve_vectorize(setting: str, device: torch.device, num_sites: int | None = None) -> bool:
    """``simulation.vectorize``: 'on' / 'off', or 'auto' = on on CUDA with at least :data:`AUTO_MIN_SITES`
    sites (``num_sites`` None: any number), off on the CPU (where sites then run exactly as deployed
    sites do, and the bitwise deployment/resume guarantees hold) and for fewer sites."""
    if setting == "auto":
        return device.type == "cuda" and (num_sites is None or num_sites >= AUTO_MIN_SITES)
    return setting == "on"
