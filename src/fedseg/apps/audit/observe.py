r"""What the server observes of the sites' messages under each protection.

The audit attacks the server's view, so a protection enters it as a transform of the messages:

* ``"plain"`` — one site's message as sent (the attacked site's gradient or update);
* ``"secagg"`` — secure aggregation: only the weighted sum Σ_k p_k m_k over the K sites
  (the masks cancel exactly in the sum and hide everything else; the audit forms the sum
  directly);
* ``"dp"`` — differential privacy, as each site sends it: a gradient message is one DP-SGD step's
  (``privacy.dp = "sample"``: every sample's gradient clipped to L2 norm C, their sum noised with
  N(0, σ²C²) per coordinate, divided by the batch size), an update message is clipped to norm C
  and noised with the site's share N(0, σ²C²/K) of client-level DP's noise on the sum
  (``privacy.dp = "client"``: the sum of K shares carries σC, and no party sees an un-noised update);
* ``"secagg+dp"`` — the sum over the sites of their DP messages.

Every noise draw comes from a generator seeded by (seed, "audit-noise", site, message).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from fedseg.foundation.arrays import Arrays

__all__ = [
    "PROTECTIONS",
    "Protection",
    "client_dp",
    "clip",
    "global_norm",
    "sample_dp",
    "secure_sum",
]

Protection = Literal["plain", "secagg", "dp", "secagg+dp"]
PROTECTIONS: tuple[Protection, ...] = ("plain", "secagg", "dp", "secagg+dp")


def global_norm(arrays: Mapping[str, torch.Tensor]) -> float:
    """L2 norm of all the floating-point arrays together (float64)."""
    return float(sum(v.double().pow(2).sum() for v in arrays.values() if v.is_floating_point()) ** 0.5)


def clip(arrays: Mapping[str, torch.Tensor], bound: float) -> Arrays:
    """``arrays`` scaled by min(1, C / ‖arrays‖) (one norm over all of them)."""
    norm = global_norm(arrays)
    scale = min(1.0, bound / norm) if norm > 0 else 1.0
    return {k: v * scale for k, v in arrays.items()}


def _noise(arrays: Mapping[str, torch.Tensor], std: float, generator: torch.Generator) -> Arrays:
    """Gaussian noise of ``std`` per coordinate, drawn on the CPU in name order (reproducible on every device)."""
    return {
        k: torch.randn(v.shape, generator=generator, dtype=torch.float32).to(device=v.device, dtype=v.dtype) * std
        for k, v in arrays.items()
    }


def sample_dp(
    per_sample: Sequence[Mapping[str, torch.Tensor]], bound: float, sigma: float, generator: torch.Generator
) -> Arrays:
    """One DP-SGD gradient of a batch of B samples: (1/B) (Σ_i clip_C(g_i) + N(0, σ²C²))."""
    if not per_sample:
        raise ValueError("sample-level DP needs the per-sample gradients of a non-empty batch")
    clipped = [clip(g, bound) for g in per_sample]
    total = {k: sum(c[k] for c in clipped) for k in clipped[0]}
    noise = _noise(total, sigma * bound, generator)
    return {k: (total[k] + noise[k]) / len(per_sample) for k in total}


def client_dp(
    update: Mapping[str, torch.Tensor], bound: float, sigma: float, num_sites: int, generator: torch.Generator
) -> Arrays:
    """A site's update under client-level DP with the noise shared among the K sites: clip_C(u) + N(0, σ²C²/K)."""
    clipped = clip(update, bound)
    noise = _noise(clipped, sigma * bound / num_sites**0.5, generator)
    return {k: clipped[k] + noise[k] for k in clipped}


def secure_sum(messages: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> Arrays:
    """Σ_k p_k m_k: all the server learns of the sites' messages under secure aggregation."""
    if len(messages) != len(weights) or not messages:
        raise ValueError(f"{len(messages)} messages and {len(weights)} weights; give one weight per message")
    return {k: sum(w * m[k] for m, w in zip(messages, weights)) for k in messages[0]}
