"""What a site tells the planner about its volumes: aggregate numbers, never voxels.

A site answers two kinds of question about its training cases, every number per image channel:

1. :func:`site_fingerprint` — per case, the voxel spacing and the shape in RAS axis order; per channel,
   over the foreground voxels (label > 0) of all its cases, the count, mean and centred sum of squares
   (float64), the minimum and maximum, and the same moments with every case weighted equally (each case's
   mean and variance combined as one sample of weight 1); over all voxels, the minimum and whether every
   value is an integer;
2. :func:`site_histogram` — counts of the same foreground voxels of one channel in equal bins over an
   interval ``(lo, hi]`` the server names, for several such requests at once; voxel-weighted (each voxel
   counts 1) or case-weighted (each voxel of a case with ``n`` foreground voxels counts ``1 / n``, so every
   case adds 1 in all).  The server asks again on narrower intervals, around the ranks it is after, until
   the 0.5 / 99.5 percentiles are exact (:mod:`fedseg.data.volumes.intensity`).

From these the server computes the pooled foreground mean and sd exactly (Chan et al.'s parallel
update of the moments) and the pooled percentiles exactly for integer data (within a stated bound for
floats), without any site sending a voxel value: each reply is a count of voxels in an interval, a sum
of such counts, or a moment over all of a site's cases.

:func:`check_fingerprint` and :func:`check_histogram` are the server's checks of a reply: a malformed or
hostile answer (negative counts, NaN sums, a histogram of the wrong length or one that adds up to more
than the declared count) is rejected with the reason and the plan is made from the other sites.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from fedseg.data.volumes.geometry import spacing_of

__all__ = [
    "CT_AIR",
    "FINGERPRINT_VERSION",
    "WEIGHTINGS",
    "check_fingerprint",
    "check_histogram",
    "combine_moments",
    "ras_order",
    "site_fingerprint",
    "site_histogram",
]

FINGERPRINT_VERSION = 2
CT_AIR = -500.0
"""A channel whose values reach below this is CT-like (air is about −1000 HU; no MR scale goes there), and
its body is the voxels above it (:meth:`fedseg.data.volumes.schemes.ZScoreNormalization.mask`)."""
WEIGHTINGS = ("case", "voxel")
"""How the pooled percentiles, mean and sd weigh the foreground voxels: ``"case"`` (nnU-Net: every training
case counts equally, each of its ``n`` voxels ``1 / n``) or ``"voxel"`` (every voxel counts 1)."""


def ras_order(affine: np.ndarray, values: Sequence[float]) -> list[float]:
    """``values`` per array axis (spacing or shape) reordered to the RAS axes the volume is reoriented to."""
    import nibabel as nib  # deferred: a reader of image files

    ornt = nib.orientations.io_orientation(np.asarray(affine))
    out = [0.0] * 3
    for axis, (target, _flip) in enumerate(ornt):
        out[int(target)] = values[axis]
    return out


def _foreground(image: np.ndarray, label: np.ndarray) -> list[np.ndarray]:
    """float64 foreground values of each channel: voxels whose label is not 0."""
    mask = label != 0
    return [np.asarray(c, dtype=np.float64)[mask] for c in image]


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


def _moments(values: np.ndarray) -> dict[str, float]:
    mean = float(values.mean())
    return {"count": int(values.size), "mean": mean, "m2": float(((values - mean) ** 2).sum())}


def site_fingerprint(cases: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> dict[str, Any]:
    """The first answer of a site (module docstring).

    Parameters
    ----------
    cases
        ``(image (C, X, Y, Z), label (X, Y, Z), affine)`` of every training case, in file units.

    Returns
    -------
    dict
        JSON-ready: ``version``, ``cases`` (``spacing`` and ``shape`` in RAS order) and ``channels``, one
        entry per image channel: ``foreground`` (``count``, ``mean``, ``m2``, ``min``, ``max``, voxel-weighted),
        ``by_case`` (``count`` cases with foreground, ``mean`` of their means, ``m2``: the sum of their
        variances plus the spread of their means — the M2 of the case-weighted foreground), ``min`` (of all
        voxels) and ``integer`` (every voxel an integer).
    """
    records: list[dict[str, Any]] = []
    voxel: list[list[dict[str, float]]] = []
    by_case: list[list[dict[str, float]]] = []
    lo: list[float] = []
    hi: list[float] = []
    vmin: list[float] = []
    integer: list[bool] = []
    for image, label, affine in cases:
        if not voxel:
            nc = image.shape[0]
            voxel, by_case = [[] for _ in range(nc)], [[] for _ in range(nc)]
            lo, hi, vmin, integer = [math.inf] * nc, [-math.inf] * nc, [math.inf] * nc, [True] * nc
        records.append(
            {
                "spacing": ras_order(affine, spacing_of(affine)),
                "shape": [int(s) for s in ras_order(affine, label.shape)],
            }
        )
        for c, fg in enumerate(_foreground(image, label)):
            vmin[c] = min(vmin[c], float(image[c].min()))
            integer[c] = integer[c] and bool(np.all(np.mod(image[c], 1) == 0))
            if fg.size == 0:
                continue
            part = _moments(fg)
            voxel[c].append(part)
            by_case[c].append({"count": 1, "mean": part["mean"], "m2": part["m2"] / part["count"]})
            lo[c], hi[c] = min(lo[c], float(fg.min())), max(hi[c], float(fg.max()))
    channels = []
    for c in range(len(voxel)):
        count, mean, m2 = combine_moments(voxel[c])
        ncase, cmean, cm2 = combine_moments(by_case[c])
        channels.append(
            {
                "foreground": {
                    "count": count,
                    "mean": mean,
                    "m2": m2,
                    "min": lo[c] if count else None,
                    "max": hi[c] if count else None,
                },
                "by_case": {"count": ncase, "mean": cmean, "m2": cm2},
                "min": vmin[c],
                "integer": integer[c],
            }
        )
    return {"version": FINGERPRINT_VERSION, "cases": records, "channels": channels}


def bin_edges(lo: float, hi: float, bins: int) -> np.ndarray:
    """The edges of ``bins`` equal bins over ``(lo, hi]`` (site and server compute the same float64 values)."""
    return np.linspace(float(lo), float(hi), int(bins) + 1)


def site_histogram(
    cases: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]],
    requests: Sequence[Mapping[str, Any]],
    weighting: str = "voxel",
) -> list[list[float]]:
    """The second kind of answer: per request ``{"channel", "lo", "hi", "bins"}`` the (weighted) counts of
    the channel's foreground values in the ``bins`` right-closed bins of :func:`bin_edges` over
    ``(lo, hi]``; values outside count nowhere.  ``weighting`` (:data:`WEIGHTINGS`): ``"voxel"`` counts
    each voxel 1 (integers), ``"case"`` each voxel of a case with ``n`` foreground voxels ``1 / n``."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting {weighting!r} is not one of {WEIGHTINGS}")
    edges = [bin_edges(r["lo"], r["hi"], r["bins"]) for r in requests]
    counts = [np.zeros(len(e) - 1, dtype=np.float64 if weighting == "case" else np.int64) for e in edges]
    for image, label, _affine in cases:
        fgs = _foreground(image, label)
        for r, e, out in zip(requests, edges, counts):
            fg = fgs[int(r["channel"])]
            if fg.size == 0:
                continue
            idx = np.searchsorted(e, fg, side="left") - 1  # e[i] < x <= e[i + 1]
            idx = idx[(idx >= 0) & (idx < len(e) - 1)]
            binned = np.bincount(idx, minlength=len(e) - 1)
            out += np.asarray(binned / fg.size if weighting == "case" else binned, dtype=out.dtype)
    return [c.tolist() for c in counts]


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_moments(m: Any, what: str) -> str | None:
    if not isinstance(m, Mapping):
        return f"has no {what} statistics"
    n = m.get("count")
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= 0):
        return f"{what} count {n!r} is not a non-negative integer"
    if not all(_finite(m.get(k)) for k in ("mean", "m2")) or m["m2"] < 0:
        return f"{what} mean or m2 is missing, not finite or negative"
    return None


def check_fingerprint(fp: Any) -> str | None:
    """Why a site's first reply cannot be used, or None when it can."""
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
    channels = fp.get("channels")
    if not isinstance(channels, list) or not channels:
        return "has no channel statistics"
    for c, ch in enumerate(channels):
        where = f"channel {c}: "
        if not isinstance(ch, Mapping):
            return where + "not an object"
        f: Any = ch.get("foreground")
        why = _check_moments(f, "foreground") or _check_moments(ch.get("by_case"), "case-weighted")
        if why:
            return where + why
        if f["count"] == 0:
            return where + "has no foreground voxel in any training case (every label is empty)"
        if ch["by_case"]["count"] > len(cases) or ch["by_case"]["count"] > f["count"]:
            return where + "counts more cases with foreground than it has cases or foreground voxels"
        if not all(_finite(f.get(k)) for k in ("min", "max")) or f["min"] > f["max"]:
            return where + "foreground min or max is missing, not finite or inconsistent"
        if not (f["min"] <= f["mean"] <= f["max"] and f["min"] <= ch["by_case"]["mean"] <= f["max"]):
            return where + "foreground mean lies outside its min and max"
        if not _finite(ch.get("min")) or not isinstance(ch.get("integer"), bool) or ch["min"] > f["min"]:
            return where + "value minimum or integer flag missing or inconsistent"
    return None


def check_histogram(counts: Any, bins: int, most: float) -> str | None:
    """Why one answer to a histogram request cannot be used: wrong length, negative, non-finite counts, or a
    total above ``most`` (the site's declared foreground count or case count, with float slack)."""
    if not isinstance(counts, list) or len(counts) != bins:
        return (
            f"histogram has {len(counts) if isinstance(counts, list) else type(counts).__name__} bins, {bins} expected"
        )
    if not all(_finite(c) and c >= 0 for c in counts):
        return "histogram has a negative or non-finite count"
    total = math.fsum(counts)
    if total > most * (1 + 1e-9) + 1e-9:
        return f"histogram adds up to {total}, more than the declared {most}"
    return None
