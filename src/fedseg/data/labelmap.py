"""The delivered segmentation: the one label map of a prediction, and the label channels of a label map.

A federation names its label channels by the label-file values each holds (``[data.labels]``): ``disc = [1,
2]``, ``cup = [2]`` are nested regions (the cup lies inside the disc), ``liver = [1]``, ``spleen = [2]``
disjoint labels.  A network gives one logit per channel; fedseg delivers one integer label map, and every
score — validation, the best round, FedSM's choices, test, ``compare``, the report — is a score of that map's
channels, so the Dice a run reports is the Dice of the masks ``fedseg predict`` writes.

* :func:`paint_order` — the channels in the order they are painted, each with the value it paints: a channel
  before every channel nested inside it (the outermost region first), otherwise in the spec's order; a
  channel's value is the one of its values that lights exactly it and the channels holding it.
* :func:`label_map` — per-channel logits → the label map: channel ``c`` lit where ``sigmoid(logit) >
  threshold``, the lit channels painted in :func:`paint_order`, a later one overwriting an earlier one — as
  nnU-Net's region-based training turns regions into labels.  A cup lit outside the disc makes the pixel
  cup (2), which is disc as well; of two disjoint labels lit at one pixel, the later in the spec wins.
* :func:`paint` — the same from channels already thresholded (keep-largest-component rebuilds a map so).
* :func:`channels` — the label channels of a label map, ``isin(map, values_c)``: the rule the ground truth's
  channels are read with (:func:`fedseg.data.loading.label_channels`), for the nested disc and cup the
  regions ``map >= 1`` and ``map >= 2``, for disjoint labels ``map == value``.
* :func:`delivered` — ``channels(label_map(...))``: what every metric scores.

Where the lit channels are those of some value (nested channels that nest, disjoint ones that do not
overlap), :func:`delivered` gives back exactly the thresholded channels; elsewhere it gives the map's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

import numpy as np
import torch

__all__ = ["channels", "delivered", "label_map", "map_dtype", "paint", "paint_order"]

Labels = Mapping[str, Sequence[int]]
A = TypeVar("A", np.ndarray, torch.Tensor)


def paint_order(labels: Labels) -> list[tuple[int, int]]:
    """``[(channel, value)]`` in painting order (module docstring).

    Order: repeatedly the first channel, in the spec's order, that no remaining channel strictly contains.
    Value of channel ``c``: among its values, the one lighting the fewest channels other than ``c`` and those
    that contain it (the smaller on a tie) — ``disc = [1, 2]``, ``cup = [2]`` paint disc 1, then cup 2;
    ``whole = [1, 2, 3]``, ``core = [2, 3]``, ``enhancing = [3]`` paint 1, 2, 3."""
    sets = [frozenset(int(v) for v in vs) for vs in labels.values()]
    left = list(range(len(sets)))
    order = []
    while left:
        c = next(c for c in left if not any(sets[d] > sets[c] for d in left if d != c))
        left.remove(c)
        holders = {d for d, s in enumerate(sets) if s >= sets[c]}  # c and the channels containing it

        def mismatch(v: int, holders: set[int] = holders) -> tuple[int, int]:
            return sum((v in s) != (d in holders) for d, s in enumerate(sets)), v

        order.append((c, min(sets[c], key=mismatch)))
    return order


def map_dtype(labels: Labels) -> torch.dtype:
    """The label map's type: ``uint8`` for values below 256, else ``int32``."""
    top = max((int(v) for vs in labels.values() for v in vs), default=0)
    return torch.uint8 if top < 256 else torch.int32


def paint(lit: torch.Tensor, labels: Labels, dim: int = 0) -> torch.Tensor:
    """Boolean channels (``lit``, the channel axis ``dim``) as the label map (that axis dropped): each channel's
    value painted where it is lit, in :func:`paint_order`."""
    if lit.shape[dim] != len(labels):
        raise ValueError(f"{lit.shape[dim]} channels for {len(labels)} labels {list(labels)}")
    shape = lit.shape[:dim] + lit.shape[dim + 1 :]
    out = torch.zeros(shape, dtype=map_dtype(labels), device=lit.device)
    for c, v in paint_order(labels):
        out.masked_fill_(lit.select(dim, c).bool(), v)
    return out


def label_map(out: torch.Tensor, labels: Labels, threshold: float = 0.5, dim: int = 0) -> torch.Tensor:
    """Per-channel logits (channel axis ``dim``, e.g. ``(L, *spatial)``) as the delivered label map (that axis
    dropped): channel ``c`` lit where ``sigmoid(logit) > threshold``, then :func:`paint`."""
    return paint(torch.sigmoid(out.float()) > threshold, labels, dim)


def channels(label: A, labels: Labels, dim: int = 0) -> A:
    """The label channels of a label map (numpy or torch), stacked at ``dim``: channel ``c`` is
    ``isin(label, values_c)`` (boolean)."""
    if isinstance(label, np.ndarray):
        return np.stack([np.isin(label, list(vs)) for vs in labels.values()], axis=dim)
    return torch.stack(
        [torch.isin(label, torch.tensor(list(vs), device=label.device, dtype=label.dtype)) for vs in labels.values()],
        dim=dim,
    )


def delivered(out: torch.Tensor, labels: Labels, threshold: float = 0.5, dim: int = 1) -> torch.Tensor:
    """The label channels (boolean, the shape of ``out``) of the delivered label map of logits ``out`` (channel
    axis ``dim``; ``(B, L, *spatial)`` by default): what the metrics score."""
    return channels(label_map(out, labels, threshold, dim), labels, dim)
