"""The randomness of differential privacy at a site: Gaussian noise and Poisson sampling that only the site knows.

**Who can regenerate what.**  The server ships the run config (its ``seed`` included) and assigns the
site indices, so any draw derived from them is a public function of what the server holds: subtracting
regenerated noise recovers the un-noised gradient, and predicted batches void the accountant's
subsampling.  Two modes (``privacy.dp_randomness``):

* ``"os"`` (default): every draw (one noise vector, one batch's sampling) is keyed by 32 fresh bytes
  from the operating system's CSPRNG (:func:`os.urandom`), used for that draw only and then dropped:
  never stored, never sent, never derived from the seed or the site index.  Nobody, the site included,
  can regenerate a draw afterwards; two runs with the same seed draw different noise and batches.
* ``"seeded"`` (tests only): the key is SHA-256 of (run seed, site index, purpose, the draw's position), so
  a run is bitwise reproducible — and the server, which knows the seed, can regenerate every draw: its
  ε against the server is ∞ (recorded so in the results).

**Construction.**  A key is expanded by the ChaCha20 stream cipher (the ``cryptography`` package, as
secure aggregation's masks: :func:`fedseg.privacy.secagg.expand`) into 64-bit words; each word gives a
uniform u = (⌊w / 2¹¹⌋ + ½) · 2⁻⁵³ in (0, 1) (53 bits, never 0 or 1); two uniforms give two standard
normals by Box–Muller (√(−2 ln u₁) cos 2πu₂, √(−2 ln u₁) sin 2πu₂), in float64.  A Gaussian of standard
deviation s is then Opacus' ``secure_mode`` mitigation of floating-point attacks (Holohan & Braghin,
"Secure random sampling in differential privacy", ESORICS 2021, §5.1 with n = 2; Opacus'
``opacus.optimizers.optimizer._generate_noise``): the sum of 2n = 4 standard normals times s / 2, which has
variance s² and whose floating-point value no longer exposes the single draw behind it.  (Opacus also
throws one draw away after seeding its generator; a ChaCha20 key used for one draw has no state to warm.)  ChaCha20 rather
than ``torch.Generator`` seeded per draw: torch's Mersenne Twister is not a cryptographic generator, a
64-bit seed is a smaller key than ChaCha20's 256 bits, and the cipher is the one secure aggregation already
trusts.  The keystream is drawn on the CPU; its conversion to uniforms and normals runs on the device
the noise is for (the seeded mode is therefore bitwise reproducible on one kind of device).
"""

from __future__ import annotations

import hashlib
import math
import os
from typing import get_args

import numpy as np
import torch

from fedseg.foundation.config import DPRandomness
from fedseg.privacy.secagg import expand

__all__ = ["MODES", "Randomness"]

MODES: tuple[str, ...] = get_args(DPRandomness)
"""Values of ``privacy.dp_randomness``."""

_SUMMED = 4
"""Standard normals summed per Gaussian draw (Opacus' secure mode: 2n with n = 2)."""


class Randomness:
    """A site's source of DP noise and sampling (module docstring)."""

    def __init__(self, mode: DPRandomness, seed: int, site_index: int):
        if mode not in MODES:
            raise ValueError(f"privacy.dp_randomness = {mode!r}; use one of {MODES}")
        self.mode = mode
        self._seed, self._index = int(seed), int(site_index)

    @property
    def seeded(self) -> bool:
        """True in the test mode whose draws the server can regenerate (ε against the server is ∞)."""
        return self.mode == "seeded"

    def key(self, *position: object) -> bytes:
        """A 32-byte ChaCha20 key for one draw: fresh OS bytes, or (``"seeded"``) SHA-256 of the run seed,
        the site index and ``position`` (what names the draw: purpose, role, round, step…)."""
        if not self.seeded:
            return os.urandom(32)
        text = repr((self._seed, self._index, *position)).encode()
        return hashlib.sha256(b"fedseg dp randomness " + text).digest()

    def uniform(self, count: int, *position: object, device: torch.device | str | None = None) -> torch.Tensor:
        """``count`` uniforms in (0, 1), float64, on ``device`` (default the CPU; the keystream is always
        the CPU's, its conversion runs on the device)."""
        words = expand(self.key(*position), max(int(count), 0)).view(np.int64)
        x = torch.from_numpy(words.copy()).to(device or "cpu")
        # the word's top 53 bits (an arithmetic shift of its signed view, masked), as a float in (0, 1)
        top = torch.bitwise_and(torch.bitwise_right_shift(x, 11), (1 << 53) - 1)
        return top.to(torch.float64).add_(0.5).mul_(2.0**-53)

    def normal(
        self, count: int, std: float, *position: object, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """``count`` draws of N(0, std²), float64 on ``device`` (default the CPU): each the sum of 4
        Box–Muller normals × std / 2."""
        count = max(int(count), 0)
        pairs = math.ceil(_SUMMED * count / 2)
        u = self.uniform(2 * pairs, *position, device=device).view(pairs, 2)
        r = torch.sqrt(-2.0 * torch.log(u[:, 0]))
        theta = 2.0 * math.pi * u[:, 1]
        z = torch.stack([r * torch.cos(theta), r * torch.sin(theta)], dim=1).reshape(-1)[: _SUMMED * count]
        return z.view(_SUMMED, count).sum(0) * (float(std) / math.sqrt(_SUMMED))

    def poisson(self, n: int, q: float, *position: object) -> torch.Tensor:
        """Poisson sampling: the indices (int64, ascending) of the cases among ``n`` that each entered the
        batch independently with probability ``q``."""
        return torch.nonzero(self.uniform(n, *position) < float(q)).flatten()
