"""Evaluation batches of volumes over each case's own extent rather than the split's padded shape.

Volume splits are padded at the far end of each axis to one shape shared by the federation (so that training
can stack them), and their datasets record each case's own extent in the plan's grid (``extents``,
:class:`fedseg.data.volumes.load.VolumeDataset`).  Evaluation cuts every case back to its extent before it
is predicted, padded at the far end only up to the sliding window (``model.roi_size``) along an axis where
the case is smaller (images with the case's lowest value, as the split's padding; labels with 0), so the
sliding windows of a small scan are those of its own size, not those of the federation's largest scan.
The prediction is cut back to the extent (:func:`crop_to_extent`); the origin never moves, so the
plan-grid affine of the case stays valid for it.

Datasets without ``extents`` (2D images) are batched as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch.nn import functional

__all__ = ["EvalGroup", "crop_to_extent", "eval_groups", "pad_far_end", "window_shape"]

EvalGroup = tuple[int, "tuple[int, ...] | None", torch.Tensor, torch.Tensor]
"""``(index of the first case, extent of its cases or None, images, labels)``: one evaluation batch."""


def window_shape(extent: Sequence[int], roi: Sequence[int] | None) -> tuple[int, ...]:
    """The shape a case of ``extent`` is predicted at: its extent, raised to the window ``roi`` along the
    axes where it is smaller (``roi`` may name fewer axes, e.g. the in-plane window of ``patches2d``)."""
    roi = list(roi or [])
    return tuple(max(int(e), int(roi[a])) if a < len(roi) else int(e) for a, e in enumerate(extent))


def crop_to_extent(t: torch.Tensor, extent: Sequence[int]) -> torch.Tensor:
    """The region ``[0, extent)`` of the trailing spatial axes of ``t`` (its far end cut off)."""
    lead = t.dim() - len(extent)
    return t[(*[slice(None)] * lead, *(slice(0, int(e)) for e in extent))]


def pad_far_end(x: torch.Tensor, y: torch.Tensor, shape: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (B, C, ...) and ``y`` (B, L, ...) padded at the far end of each spatial axis to ``shape``: each
    image with its own lowest value, labels with 0."""
    short = [int(s) - int(n) for s, n in zip(shape, x.shape[2:])]
    if not any(short):
        return x, y
    pad = [p for d in reversed(short) for p in (0, d)]
    x = torch.stack([functional.pad(c, pad, value=float(c.min())) for c in x])
    return x, functional.pad(y, pad)


def eval_groups(
    ds,
    extents: Sequence[Sequence[int]] | None,
    batch_size: int,
    take: Callable[[object, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    roi: Sequence[int] | None = None,
) -> Iterator[EvalGroup]:
    """A split's cases in dataset order as evaluation batches (:data:`EvalGroup`).

    ``take(ds, idx)`` returns cases ``idx`` of ``ds`` as ``(images, labels)`` (e.g.
    :func:`fedseg.site.batches.batch_of`).  Without ``extents``: ``batch_size`` cases at a time, as stored.
    With them: consecutive cases of one extent, at most ``batch_size``, cut to that extent and padded at the
    far end up to :func:`window_shape` (module docstring)."""
    n = len(ds)
    if extents is None:
        for start in range(0, n, batch_size):
            x, y = take(ds, torch.arange(start, min(n, start + batch_size)))
            yield start, None, x, y
        return
    if len(extents) != n:
        raise ValueError(f"{len(extents)} extents for a split of {n} cases")
    start = 0
    while start < n:
        extent = tuple(int(v) for v in extents[start])
        end = start + 1
        while end < n and end - start < batch_size and tuple(extents[end]) == extent:
            end += 1
        x, y = take(ds, torch.arange(start, end))
        if any(e > s for e, s in zip(extent, x.shape[2:])):
            raise ValueError(f"case {start}: extent {list(extent)} exceeds its stored shape {list(x.shape[2:])}")
        x, y = crop_to_extent(x, extent).contiguous(), crop_to_extent(y, extent).contiguous()
        x, y = pad_far_end(x, y, window_shape(extent, roi))
        yield start, extent, x, y
        start = end
