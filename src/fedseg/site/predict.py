"""The one prediction path of a site: evaluation (:meth:`fedseg.site.runtime.Site.score_cases`) and
``fedseg predict`` both build a candidate's predictor here and run it on a batch here.

* :func:`predictor` — a candidate's predictor, made by the algorithm's ``predictors()`` (``"model"``: the
  workload model with the candidate's arrays; FedSM's ``"fedsm"``: the selector routing each image through
  the composite with the candidate's thresholds).
* :func:`logits` — the predictor on a batch under ``train.precision``'s autocast, optionally with test-time
  mirroring (the mean of the sigmoid probabilities over every flip of the spatial axes, back as logits).
* :func:`label_map` — per-channel sigmoid outputs as the delivered label map with the spec's own label values
  (:mod:`fedseg.data.labelmap`: nested channels such as disc = [1, 2], cup = [2] give back 0/1/2, a cup lit
  outside the disc 2); the metrics score the channels of this same map.

No file I/O (the site layer's rule): reading scans and writing masks is :mod:`fedseg.apps.predict`'s.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from fedseg.data import labelmap
from fedseg.foundation.arrays import Arrays
from fedseg.foundation.errors import PayloadError


class PredictingSite(Protocol):
    """What prediction needs of a :class:`fedseg.site.runtime.Site` (which imports this module)."""

    name: str
    algorithm: Any

    def autocast(self) -> AbstractContextManager[Any]: ...


__all__ = ["Predict", "from_channels", "label_map", "logits", "mirror_axes", "predictor", "probabilities"]

Predict = Callable[[torch.Tensor], torch.Tensor]
"""A batch ``(B, C, *spatial)`` → per-channel logits ``(B, L, *spatial)``."""


def predictor(site: PredictingSite, name: str, kind: str, arrays: Arrays, config: Mapping[str, Any]) -> Predict:
    """Candidate ``name``'s predictor at ``site``: the algorithm's predictor ``kind`` made from the candidate's
    ``arrays`` and ``config`` (what evaluation and ``fedseg predict`` both run)."""
    make = site.algorithm.predictors().get(kind)
    if make is None:
        raise PayloadError(f"site {site.name}: unknown predictor {kind!r} for candidate {name!r}")
    return make(site, arrays, dict(config))


def mirror_axes(spatial_dims: int) -> list[tuple[int, ...]]:
    """Every subset of the spatial axes of a ``(B, C, *spatial)`` batch (the flips of test-time mirroring,
    the identity first): 4 for 2D, 8 for 3D, as nnU-Net mirrors."""
    axes = range(2, 2 + spatial_dims)
    return [c for k in range(spatial_dims + 1) for c in itertools.combinations(axes, k)]


@torch.no_grad()
def logits(site: PredictingSite, predict: Predict, x: torch.Tensor, tta: bool = False) -> torch.Tensor:
    """``predict(x)`` under the site's autocast; with ``tta`` the mean of the sigmoid probabilities of every
    mirrored copy of ``x`` (:func:`mirror_axes`, each flipped back), returned as logits (float32) so that
    thresholds and metrics apply unchanged."""
    with site.autocast():
        if not tta:
            return predict(x)
        total: torch.Tensor | None = None
        flips = mirror_axes(x.dim() - 2)
        for axes in flips:
            out = predict(x.flip(axes) if axes else x)
            p = torch.sigmoid((out.flip(axes) if axes else out).float())
            total = p if total is None else total + p
    assert total is not None
    return torch.logit(total / len(flips), eps=1e-6)


def probabilities(out: torch.Tensor) -> torch.Tensor:
    """Per-channel probabilities of logits (sigmoid, float32)."""
    return torch.sigmoid(out.float())


def label_map(out: torch.Tensor, labels: Mapping[str, Sequence[int]], threshold: float = 0.5) -> torch.Tensor:
    """Logits ``(L, *spatial)`` as the delivered label map ``(*spatial)`` with the spec's label values:
    :func:`fedseg.data.labelmap.label_map`, the map every metric scores (nested regions painted outermost
    first, the inner ones overwriting, as nnU-Net's region-based training; disjoint labels in the spec's order)."""
    return labelmap.label_map(out, labels, threshold)


def from_channels(on: torch.Tensor, labels: Mapping[str, Sequence[int]]) -> torch.Tensor:
    """Boolean channels ``(L, *spatial)`` as the label map by the same rule (:func:`fedseg.data.labelmap.paint`)."""
    return labelmap.paint(on, labels)
