"""The flat, parameter-major layout of K sites' stacked parameters, and stacking of batch trees."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch


class Layout:
    """Where each site's parameters live in one flat buffer, parameter-major: parameter j of all K
    sites is one contiguous ``K × shape`` block (a contiguous weight for the vmapped convolution),
    site i's copy of it the block's row i."""

    def __init__(self, params: Sequence[torch.Tensor], k: int):
        self.k = k
        self.shapes = [p.shape for p in params]
        self.sizes = [p.numel() for p in params]
        self.starts = [k * o for o in itertools.accumulate([0, *self.sizes[:-1]])]
        self.numel = k * sum(self.sizes)
        self._reps = torch.tensor([n for n in self.sizes for _ in range(k)], device=params[0].device)

    def pack(self, rows: Sequence[Sequence[torch.Tensor]], out: torch.Tensor | None = None) -> torch.Tensor:
        """``rows[i][j]`` (site i, parameter j) into a flat buffer (``out``: into that one), each parameter's
        rows stacked straight into its block (one copy of every element)."""
        if out is None:
            out = torch.empty(self.numel, dtype=rows[0][0].dtype, device=rows[0][0].device)
        for j, block in enumerate(self.blocks(out)):
            torch.stack([r[j] for r in rows], out=block)
        return out

    def blocks(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The ``K × shape`` view of every parameter."""
        return [
            flat[a : a + self.k * n].view(self.k, *shape) for a, n, shape in zip(self.starts, self.sizes, self.shapes)
        ]

    def per_element(self, per_site: torch.Tensor) -> torch.Tensor:
        """A per-site value (``K``) for every element of a flat buffer."""
        return torch.repeat_interleave(per_site.repeat(len(self.sizes)), self._reps, output_size=self.numel)


def stack_tree(items: Sequence[Any]) -> Any:
    """Stack K same-shaped trees (tensors, tuples/lists of them) leaf by leaf along a new first dimension."""
    if torch.is_tensor(items[0]):
        return torch.stack(list(items))
    return type(items[0])(stack_tree([it[j] for it in items]) for j in range(len(items[0])))
