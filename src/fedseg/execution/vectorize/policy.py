"""``simulation.vectorize``: when a simulation runs its sites' local training as one vectorized computation."""

from __future__ import annotations

import torch

AUTO_MIN_SITES = 4
"""``simulation.vectorize = auto`` vectorizes a CUDA run of at least this many sites.  On an H100 6 sites
run 4.1–4.7× faster stacked than one after another (docs/results/vectorize.md, "GPU with CUDA graphs");
fewer sites are not measured there, and 4 is the threshold chosen below 6."""


def resolve_vectorize(setting: str, device: torch.device, num_sites: int | None = None) -> bool:
    """``simulation.vectorize``: 'on' / 'off', or 'auto' = on on CUDA with at least :data:`AUTO_MIN_SITES`
    sites (``num_sites`` None: any number), off on the CPU (where sites then run exactly as deployed
    sites do, and the bitwise deployment/resume guarantees hold) and for fewer sites."""
    if setting == "auto":
        return device.type == "cuda" and (num_sites is None or num_sites >= AUTO_MIN_SITES)
    return setting == "on"
