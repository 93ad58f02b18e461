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
    sites do, and the bitwise deployment/resume guarantees hold) and for fewer sites.  An explicit 'on' or
    'off' is what runs, on any device.

    Off on the CPU is also the faster choice there at the default U-Net: 6 sites at 64², one torch thread,
    train 0.65× as fast vectorized as one after another in wall time, 0.97× in CPU time (fundus preset at a
    tenth, one local epoch), and 0.69× / 1.06× (5 local steps, 8 cases a site) (``benchmarks/vectorize.py``,
    docs/results/vectorize.md, "CPU"); stacking gains on the CPU for small models (2.38× at 32² with U-Net
    8…64), which ``auto`` does not tell apart, so 'on' is the setting for them."""
    if setting == "auto":
        return device.type == "cuda" and (num_sites is None or num_sites >= AUTO_MIN_SITES)
    return setting == "on"
