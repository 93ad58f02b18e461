"""Deterministic random streams: every draw comes from a generator seeded by (run seed, site, round, purpose)."""

from __future__ import annotations

import zlib

import numpy as np
import torch

__all__ = ["derive_seed", "generator"]


def _key(k: int | str) -> int:
    return k if isinstance(k, int) and k >= 0 else zlib.crc32(str(k).encode())


def derive_seed(seed: int, *keys: int | str) -> int:
    """A 63-bit seed derived from the run seed and any keys (site index, round, stream name).

    Different key tuples give statistically independent streams (NumPy ``SeedSequence``),
    so adding a new stream never shifts an existing one.
    """
    ss = np.random.SeedSequence([_key(seed), *(_key(k) for k in keys)])
    return int(ss.generate_state(1, dtype=np.uint64)[0]) & ((1 << 63) - 1)


def generator(seed: int, *keys: int | str) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with :func:`derive_seed`."""
    g = torch.Generator()
    g.manual_seed(derive_seed(seed, *keys))
    return g
