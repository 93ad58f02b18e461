"""What a site tells the planner about its volumes: aggregate numbers, never voxels.

A site answers two questions about its training cases (:func:`site_fingerprint`, then
:func:`site_histogram`):

1. per case, the voxel spacing and the shape in RAS axis order; over the foreground voxels (label > 0)
   of all its cases, the count, mean and centred sum of squares (float64) and the minimum and maximum;
   over all voxels, the minimum, and whether every value is an integer;
2. the histogram of the same foreground voxels on the grid of bin edges the server fixes from every
   site's answer to 1 (a fine grid, 4096 bins by default, over the pooled range).

From these the server computes the pooled foreground mean and sd exactly (Chan et al.'s parallel
update of the moments) and the pooled percentiles to within one bin (:mod:`fedseg.data.volumes.plan`),
which is what nnU-Net computes on pooled data, without any site sending an intensity.

:func:`check_fingerprint` and :func:`check_histogram` are the server's checks of a reply: a malformed or
hostile answer (negative counts, NaN sums, a histogram of the wrong length or one that does not add up
to the declared count) is rejected with the reason and the plan is made from the other sites.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from fedseg.data.volumes.geometry import spacing_of

__all__ = [
    "FINGERPRINT_VERSION",
    "check_fingerprint",
    "check_histogram",
    "combine_moments",
    "ras_order",
    "site_fingerprint",
    "site_histogram",
]

FINGERPRINT_VERSION = 1


def ras_order(affine: np.ndarray, values: Sequence[float]) -> list[float]:
    """``values`` per array axis (spacing or shape) reordered to the RAS axes the volume is reoriented to."""
    import nibabel as nib  # deferred: a reader of image files

    ornt = nib.orientations.io_orientation(np.asarray(affine))
    out = [0.0] * 3
    for axis, (target, _flip) in enumerate(ornt):
        out[int(target)] = values[axis]
    return out


def _foreground(image: np.ndarray, label: np.ndarray) -> np.ndarray:
    """float64 foreground values of all channels: voxels whose label is not 0."""
    mask = label != 0
    return np.concatenate([np.asarray(c, dtype=np.float64)[mask] for c in image])


def combine_moments(parts: Iterable[Mapping[str, float]]) -> tuple[int, float, float]:
    """``(count, mean, M2)`` of the union of samples given as ``{count, mean, m2}`` per part (M2: the
    centred sum of squares).

    Chan, Golub & LeVeque's pairwise update: for parts a, b with n = n_a + n_b and δ = mean_b − mean_a,
    mean = mean_a + δ n_b / n and M2 = M2_a + M2_b + δ² n_a n_b / n.  Exact up to float64 rounding,
    unlike sums of squares.  A site combines its cases with it, the server the sites.
    """
    n, mean, m2 = 0, 0.0, 0.0
    for p in parts:
        nb = int(p["count"])
        if nb == 0:
            continue
        delta, tot = float(p["mean"]) - mean, n + nb
        mean += delta * nb / tot
        m2 += float(p["m2"]) + delta * delta * n * nb / tot
        n = tot
    return n, mean, m2


def site_fingerprint(cases: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> dict[str, Any]:
    """Pass 1 of a site's fingerprint.

    Parameters
    ----------
    cases
        ``(image (C, X, Y, Z), label (X, Y, Z), affine)`` of every training case, in file units.

    Returns
    -------
    dict
        JSON-ready: ``version``, ``cases`` (``spacing`` and ``shape`` in RAS order), ``foreground``
        (``count``, ``mean``, ``m2``, ``min``, ``max``), ``min`` (of all voxels), ``integer``.
    """
    parts: list[dict[str, float]] = []
    lo, hi, vmin, integer = math.inf, -math.inf, math.inf, True
    records = []
    for image, label, affine in cases:
        records.append(
            {
                "spacing": ras_order(affine, spacing_of(affine)),
                "shape": [int(s) for s in ras_order(affine, label.shape)],
            }
        )
        vmin = min(vmin, float(image.min()))
        integer = integer and bool(np.all(np.mod(image, 1) == 0))
        fg = _foreground(image, label)
        if fg.size == 0:
            continue
        mean_b = float(fg.mean())
        parts.append({"count": fg.size, "mean": mean_b, "m2": float(((fg - mean_b) ** 2).sum())})
        lo, hi = min(lo, float(fg.min())), max(hi, float(fg.max()))
    count, mean, m2 = combine_moments(parts)
    return {
        "version": FINGERPRINT_VERSION,
        "cases": records,
        "foreground": {
            "count": count,
            "mean": mean,
            "m2": m2,
            "min": lo if count else None,
            "max": hi if count else None,
        },
        "min": vmin,
        "integer": integer,
    }


def site_histogram(cases: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]], edges: Sequence[float]) -> list[int]:
    """Pass 2: counts of the foreground values in the bins ``edges`` (values outside go to the end bins)."""
    edges = np.asarray(edges, dtype=np.float64)
    counts = np.zeros(len(edges) - 1, dtype=np.int64)
    for image, label, _affine in cases:
        fg = np.clip(_foreground(image, label), edges[0], edges[-1])
        counts += np.histogram(fg, bins=edges)[0]
    return counts.tolist()


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_fingerprint(fp: Any) -> str | None:
    """Why a site's pass-1 reply cannot be used, or None when it can."""
    if not isinstance(fp, Mapping) or fp.get("version") != FINGERPRINT_VERSION:
        return f"not a version-{FINGERPRINT_VERSION} fingerprint"
    cases = fp.get("cases")
    if not isinstance(cases, list) or not cases:
        return "lists no training case"
    for i, c in enumerate(cases):
        sp, sh = (c.get("spacing"), c.get("shape")) if isinstance(c, Mapping) else (None, None)
        if not (isinstance(sp, list) and len(sp) == 3 and all(_finite(v) and v > 0 for v in sp)):
            return f"case {i}: spacing {sp!r} is not three positive numbers"
        if not (isinstance(sh, list) and len(sh) == 3 and all(isinstance(v, int) and v > 0 for v in sh)):
            return f"case {i}: shape {sh!r} is not three positive integers"
    f = fp.get("foreground")
    if not isinstance(f, Mapping):
        return "has no foreground statistics"
    n = f.get("count")
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= 0):
        return f"foreground count {n!r} is not a non-negative integer"
    if n == 0:
        return "has no foreground voxel in any training case (every label is empty)"
    if not all(_finite(f.get(k)) for k in ("mean", "m2", "min", "max")) or f["m2"] < 0 or f["min"] > f["max"]:
        return "foreground mean, m2, min or max is missing, not finite or inconsistent"
    if not (f["min"] <= f["mean"] <= f["max"]):
        return "foreground mean lies outside its min and max"
    if not _finite(fp.get("min")) or not isinstance(fp.get("integer"), bool):
        return "value minimum or integer flag missing"
    return None


def check_histogram(counts: Any, bins: int, count: int) -> str | None:
    """Why a pass-2 reply cannot be used: wrong length, negative or non-integer counts, or a total that is
    not the site's declared foreground count."""
    if not isinstance(counts, list) or len(counts) != bins:
        return (
            f"histogram has {len(counts) if isinstance(counts, list) else type(counts).__name__} bins, {bins} expected"
        )
    if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
        return "histogram has a negative or non-integer count"
    if sum(counts) != count:
        return f"histogram adds up to {sum(counts)}, not the declared foreground count {count}"
    return None
