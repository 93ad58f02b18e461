"""Intensity normalization of volumes: a scheme per channel and per site, chosen by the plan.

Every image channel is normalized on its own (nnU-Net; MONAI's ``channel_wise=True``), with the scheme the
plan holds for that channel at that site:

* ``"ct"`` — nnU-Net's CT scheme with statistics pooled over the sites that use it: clip to the pooled
  foreground 0.5 / 99.5 percentiles, subtract the pooled foreground mean, divide by the pooled sd.  The
  percentiles are exact order statistics (:func:`exact_percentiles`), so every site maps a Hounsfield unit
  to the same value.
* ``"zscore"`` — per volume over the body: MR, whose units differ per scan.  The body is nnU-Net's non-zero
  mask (padding and background stored as 0 are left out), or for a CT-like channel the voxels above
  :data:`~fedseg.data.volumes.fingerprint.CT_AIR` (−500: air at −1000 is not body); voxels outside it are
  set to 0.  nnU-Net masks only where cropping to the non-zero voxels keeps under 3/4 of the median case
  (else it takes every voxel; the two agree on a volume without zeros): on the three-scanner federation of
  ``benchmarks/volumes_channels.py`` that rule takes the MR sites' zero background into their statistics
  (``--zscore-body all``) and lowers their Dice from 0.89 / 0.85 to 0.72 / 0.64, so fedseg always masks.  A plan's
  ``"body": "all"`` takes every voxel.
* ``"window"`` — clip to an explicit window ``(lo, hi)`` and scale to [0, 1] (head CT in the federated
  gradient averaging paper).
* ``"minmax"`` — per volume to [0, 1], as 2D photographs are loaded.

:func:`plan_intensity` decides the schemes from the sites' fingerprints: per channel and per site, ``"ct"``
where the site's channel is CT-like (values below −500, integer or float), else ``"zscore"``, unless the
spec names the scheme (``data.intensity``, per channel, or a site's own ``intensity``).  It prints the
decision per channel, naming the sites when they differ.  The plan stores, per channel, the scheme most
sites use and under ``"sites"`` the sites whose scheme differs.

**Percentiles.**  ``"voxel"`` weighting: every foreground voxel counts 1 and the percentile is numpy's
default (linear interpolation between the order statistics of rank ⌊h⌋ and ⌊h⌋ + 1, h = (N − 1) q / 100).
``"case"`` weighting (the default, nnU-Net's definition: every training case contributes equally): each
voxel of a case with ``n`` foreground voxels weighs ``1 / n``; the percentile is the smallest value whose
cumulative weight reaches q % of the total (numpy's ``inverted_cdf`` with those weights), and the mean
and sd are those of the same weighted voxels (the mean of the case means; the sd of the mixture of the
cases).  The server finds each order statistic by asking every site for (weighted) counts in
:data:`HISTOGRAM_BINS` equal bins over an interval and narrowing the interval to the bin where the
cumulative count crosses the rank, starting from the pooled [min, max]: integer data are exact once a bin
is at most 1 wide (two rounds up to a range of 4096² ≈ 1.7·10⁷, whatever one site's extreme value);
float data stop after :data:`FLOAT_ROUNDS` rounds within (max − min) / 4096³ of the percentile
(the bound is recorded in the plan).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from fedseg.data.spec import INTENSITY_MODES
from fedseg.data.volumes.fingerprint import CT_AIR, WEIGHTINGS, bin_edges, check_histogram, combine_moments
from fedseg.foundation.errors import ConfigError, DataError

__all__ = [
    "FLOAT_ROUNDS",
    "HISTOGRAM_BINS",
    "INTENSITY_MODES",
    "PERCENTILES",
    "body_mask",
    "channel_schemes",
    "check_intensity",
    "exact_percentiles",
    "normalize_case",
    "normalize_channel",
    "normalize_volume",
    "plan_intensity",
]

HISTOGRAM_BINS = 4096
PERCENTILES = (0.5, 99.5)
FLOAT_ROUNDS = 3
"""Rounds of counts that float percentiles take (each narrows the interval :data:`HISTOGRAM_BINS`-fold)."""
MAX_ROUNDS = 16

Ask = Callable[[list[dict[str, Any]], str, list[str]], Mapping[str, Any]]
"""``ask(requests, weighting, sites) -> {site: [counts per request]}``: one exchange of histograms."""


def body_mask(x: np.ndarray, scheme: Mapping[str, Any]) -> np.ndarray:
    """The voxels a z-score is taken over: above ``scheme["body"]`` when it is a number, every voxel for
    ``"all"`` (set by hand in the plan), else the non-zero ones."""
    body = scheme.get("body")
    if body == "all":
        return np.ones(x.shape, dtype=bool)
    return x > float(body) if isinstance(body, (int, float)) else x != 0


def normalize_channel(x: np.ndarray, scheme: Mapping[str, Any]) -> np.ndarray:
    """One channel (any spatial shape) normalized by ``scheme`` (module docstring) as float32."""
    x = np.asarray(x, dtype=np.float32)
    mode = scheme.get("mode")
    if mode == "ct":
        lo, hi, mean, sd = (float(scheme[k]) for k in ("lo", "hi", "mean", "sd"))
        return ((np.clip(x, lo, hi) - mean) / max(sd, 1e-8)).astype(np.float32)
    if mode == "window":
        lo, hi = (float(v) for v in scheme["window"])
        return ((np.clip(x, lo, hi) - lo) / (hi - lo)).astype(np.float32)
    if mode == "zscore":
        body = body_mask(x, scheme)
        vals = x[body] if body.any() else x.ravel()
        mean, sd = float(vals.mean()), float(vals.std())
        out = (x - mean) / max(sd, 1e-8)
        if body.any():
            out[~body] = 0.0
        return out.astype(np.float32)
    if mode == "minmax":
        lo, hi = float(x.min()), float(x.max())
        return ((x - lo) / (hi - lo)).astype(np.float32) if hi > lo else np.zeros_like(x)
    raise ValueError(f"unknown intensity mode {mode!r}; use one of {INTENSITY_MODES}")


def normalize_volume(
    image: np.ndarray, mode: str | Sequence[Mapping[str, Any]], stats: Mapping[str, Any] | None = None
) -> np.ndarray:
    """Normalize a ``(C, *spatial)`` volume as float32, each channel on its own.

    ``mode``: one scheme name for every channel, with ``stats`` (``"ct"``: ``{"lo", "hi", "mean", "sd"}``;
    ``"window"``: ``{"window": [lo, hi]}``; ``"zscore"``: optionally ``{"body": threshold}``), or a list
    of one scheme dict per channel."""
    schemes = [{**(stats or {}), "mode": mode}] * len(image) if isinstance(mode, str) else list(mode)
    if len(schemes) != len(image):
        raise ValueError(f"{len(schemes)} intensity schemes for an image of {len(image)} channels")
    return np.stack([normalize_channel(c, s) for c, s in zip(image, schemes)]).astype(np.float32)


def channel_schemes(intensity: Mapping[str, Any], site: str | None, channels: int) -> list[dict[str, Any]]:
    """The scheme of each of ``channels`` channels at ``site`` from a plan's ``intensity``: per channel its
    entry for the site under ``"sites"``, else the channel's own scheme; a plan holding one scheme
    (``{"mode": ...}``) applies it to every channel."""
    if "channels" not in intensity:
        return [dict(intensity)] * channels
    entries = intensity["channels"]
    if len(entries) != channels:
        raise ConfigError(
            f"the plan's intensity has {len(entries)} channel(s) but the images have {channels} -> "
            "run `fedseg plan` again on the spec (delete the plan file)"
        )
    out = []
    for e in entries:
        own = e.get("sites", {}).get(site) if site is not None else None
        out.append(dict(own) if own is not None else {k: v for k, v in e.items() if k not in ("name", "sites")})
    return out


def normalize_case(image: np.ndarray, intensity: Mapping[str, Any], site: str | None = None) -> np.ndarray:
    """A ``(C, *spatial)`` case normalized by the plan's ``intensity`` as ``site`` uses it."""
    return normalize_volume(image, channel_schemes(intensity, site, len(image)))


def _check_scheme(s: Any, where: str) -> None:
    if not isinstance(s, Mapping):
        raise ConfigError(f"{where}: an intensity scheme is an object with a mode")
    mode = s.get("mode")
    if mode not in INTENSITY_MODES:
        raise ConfigError(f"{where}: intensity mode {mode!r}; use {', '.join(map(repr, INTENSITY_MODES))}")
    if mode == "ct" and not all(k in s for k in ("lo", "hi", "mean", "sd")):
        raise ConfigError(f"{where}: intensity mode 'ct' needs lo, hi, mean and sd")
    if mode == "window" and len(s.get("window", ())) != 2:
        raise ConfigError(f"{where}: intensity mode 'window' needs window = [lo, hi]")


def check_intensity(intensity: Any, where: str = "plan") -> None:
    """Refuse a plan's ``intensity`` that cannot be applied, naming the field and the fix."""
    if not isinstance(intensity, Mapping):
        raise ConfigError(f"{where}: intensity must be an object")
    if "channels" not in intensity:
        _check_scheme(intensity, where)
        return
    if not isinstance(intensity["channels"], list) or not intensity["channels"]:
        raise ConfigError(f"{where}: intensity.channels must be a non-empty list, one scheme per image channel")
    for c, e in enumerate(intensity["channels"]):
        _check_scheme(e, f"{where}: intensity.channels[{c}]")
        for site, s in (e.get("sites") or {}).items():
            _check_scheme(s, f"{where}: intensity.channels[{c}].sites.{site}")


def _channel(fp: Mapping[str, Any], c: int) -> Mapping[str, Any]:
    return fp["channels"][c]


def _moments(fp: Mapping[str, Any], c: int, weighting: str) -> Mapping[str, Any]:
    ch = _channel(fp, c)
    return ch["by_case"] if weighting == "case" else ch["foreground"]


def exact_percentiles(
    fingerprints: Mapping[str, Any],
    pools: Mapping[int, Sequence[str]],
    ask: Ask,
    *,
    weighting: str = "case",
    qs: Sequence[float] = PERCENTILES,
    bins: int = HISTOGRAM_BINS,
    log: Callable[[str], None] = print,
) -> tuple[dict[int, dict[str, Any]], dict[str, str]]:
    """The percentiles ``qs`` of each channel's foreground pooled over the sites ``pools[channel]`` (module
    docstring), from counts only.

    Returns ``({channel: {"values": [...], "bound": b, "rounds": r}}, rejected)``: ``bound`` 0 when the
    values are exact (integer data), else the most any value may differ from the pooled percentile;
    ``rejected`` the sites whose reply could not be used (the search restarts without them)."""
    if weighting not in WEIGHTINGS:
        raise ConfigError(f"percentile weighting {weighting!r} is not one of {WEIGHTINGS}")
    rejected: dict[str, str] = {}
    pooled = {c: list(sites) for c, sites in pools.items() if sites}
    while True:
        result, bad = _search(fingerprints, pooled, ask, weighting, qs, bins)
        if not bad:
            return result, rejected
        for site, why in bad.items():
            log(f"plan: histogram of site {site} rejected ({why}); planning from the other sites")
            rejected[site] = why
        pooled = {c: [s for s in sites if s not in bad] for c, sites in pooled.items()}
        pooled = {c: sites for c, sites in pooled.items() if sites}
        if not pooled:
            raise DataError("no site sent a usable histogram -> check the sites' logs")


def _search(
    fps: Mapping[str, Any], pools: Mapping[int, list[str]], ask: Ask, weighting: str, qs: Sequence[float], bins: int
) -> tuple[dict[int, dict[str, Any]], dict[str, str]]:
    targets: list[dict[str, Any]] = []
    setup: dict[int, dict[str, Any]] = {}
    frac: dict[tuple[int, float], float] = {}  # voxel weighting: h − ⌊h⌋ per channel and percentile
    for c, sites in pools.items():
        total = sum(_moments(fps[s], c, weighting)["count"] for s in sites)
        lo = min(_channel(fps[s], c)["foreground"]["min"] for s in sites)
        hi = max(_channel(fps[s], c)["foreground"]["max"] for s in sites)
        integer = all(_channel(fps[s], c)["integer"] for s in sites)
        a0 = math.floor(lo) - 1.0 if integer else float(np.nextafter(lo, -np.inf))
        setup[c] = {"total": total, "integer": integer, "lo": lo, "hi": hi}
        for q in qs:
            if weighting == "voxel":
                h = (total - 1) * q / 100.0
                k = math.floor(h)
                ranks = [(k + 1, q, 0), (min(k + 2, total), q, 1)]
                frac[(c, q)] = h - k
            else:
                ranks = [(q / 100.0 * total, q, 0)]
            for t, qq, which in ranks:
                targets.append({"c": c, "t": t, "q": qq, "which": which, "a": a0, "b": float(hi), "below": 0.0})
    rounds = 0
    while any("value" not in t for t in targets) and rounds < MAX_ROUNDS:
        rounds += 1
        open_ = [t for t in targets if "value" not in t]
        keys = sorted({(t["c"], t["a"], t["b"]) for t in open_})
        requests = [{"channel": c, "lo": a, "hi": b, "bins": bins} for c, a, b in keys]
        asked = sorted({s for c, _, _ in keys for s in pools[c]})
        replies = ask(requests, weighting, asked)
        sums = [np.zeros(bins, dtype=np.float64) for _ in keys]
        bad: dict[str, str] = {}
        for s in asked:
            reply = replies.get(s)
            if not (isinstance(reply, list) and len(reply) == len(requests)):
                bad[s] = f"answered {type(reply).__name__} instead of {len(requests)} histograms"
                continue
            for i, (c, _, _) in enumerate(keys):
                if s not in pools[c]:
                    continue
                why = check_histogram(reply[i], bins, _moments(fps[s], c, weighting)["count"])
                if why is not None:
                    bad[s] = why
                    break
                sums[i] += np.asarray(reply[i], dtype=np.float64)
        if bad:
            return {}, bad
        index = {k: i for i, k in enumerate(keys)}
        for t in open_:
            c = t["c"]
            counts = sums[index[(c, t["a"], t["b"])]]
            cum = t["below"] + np.cumsum(counts)
            slack = 1e-9 * setup[c]["total"] if weighting == "case" else 0.0
            j = min(int(np.searchsorted(cum, t["t"] - slack, side="left")), bins - 1)
            edges = bin_edges(t["a"], t["b"], bins)
            t["below"] = float(cum[j - 1]) if j else t["below"]
            t["a"], t["b"] = float(edges[j]), float(edges[j + 1])
            width = t["b"] - t["a"]
            if setup[c]["integer"] and width <= 1.0:
                t["value"], t["bound"] = float(math.floor(t["b"])), 0.0
            elif not setup[c]["integer"] and (rounds >= FLOAT_ROUNDS or width <= bins * np.spacing(abs(t["b"]))):
                t["value"], t["bound"] = t["b"], width
    out: dict[int, dict[str, Any]] = {}
    for c in pools:
        values, bound = [], 0.0
        for q in qs:
            mine = sorted((t for t in targets if t["c"] == c and t["q"] == q), key=lambda t: t["which"])
            bound = max([bound] + [t.get("bound", math.inf) for t in mine])
            if weighting == "voxel":
                x0, x1 = mine[0].get("value", mine[0]["b"]), mine[1].get("value", mine[1]["b"])
                values.append(x0 + frac[(c, q)] * (x1 - x0))
            else:
                values.append(mine[0].get("value", mine[0]["b"]))
        out[c] = {"values": values, "bound": bound, "rounds": rounds}
    return out, {}


def _decide(requested: str, fp: Mapping[str, Any], c: int) -> tuple[str, bool]:
    ct_like = float(_channel(fp, c)["min"]) < CT_AIR
    return (requested if requested != "auto" else ("ct" if ct_like else "zscore")), ct_like


def _scheme_name(s: Mapping[str, Any]) -> str:
    body = f" over values above {s['body']:g}" if "body" in s else ""
    return f"{s['mode']}{body}"


def plan_intensity(
    fingerprints: Mapping[str, Any],
    ask: Ask,
    *,
    requested: str | Mapping[str, Sequence[str]] = "auto",
    window: Sequence[float] | None = None,
    weighting: str = "case",
    names: Sequence[str] | None = None,
    log: Callable[[str], None] = print,
) -> tuple[dict[str, Any], dict[str, str]]:
    """The plan's ``intensity`` from the accepted sites' fingerprints (module docstring), and the sites whose
    histograms were rejected.

    Parameters
    ----------
    fingerprints
        ``{site: first reply}`` of the accepted sites, every one with the same number of channels.
    ask
        One exchange of histograms (:data:`Ask`).
    requested
        "auto" (the plan decides), one scheme for every channel and site, or ``{site: [scheme per channel]}``
        (:meth:`fedseg.data.spec.FederationSpec.intensity_table`).
    window
        ``[low, high]`` for the channels whose scheme is ``"window"``.
    weighting
        ``"case"`` or ``"voxel"`` (module docstring).
    names
        The channel names (for the plan and the log; default "0", "1", ...).
    """
    sites = list(fingerprints)
    nch = {len(fp["channels"]) for fp in fingerprints.values()}
    if len(nch) != 1:
        raise DataError(
            f"the sites' images have different channel counts {sorted(nch)} -> give every site the channels of "
            "data.in_channels"
        )
    channels = nch.pop()
    names = list(names) if names else [str(c) for c in range(channels)]
    table: dict[str, list[dict[str, Any]]] = {s: [] for s in sites}
    for s in sites:
        want = [requested] * channels if isinstance(requested, str) else list(requested.get(s, ["auto"] * channels))
        for c in range(channels):
            mode, ct_like = _decide(want[c], fingerprints[s], c)
            scheme: dict[str, Any] = {"mode": mode}
            if mode == "zscore" and ct_like:
                scheme["body"] = CT_AIR
            if mode == "window":
                if window is None or len(window) != 2:
                    raise ConfigError("intensity 'window' needs window = [low, high] (data.window in the spec)")
                scheme["window"] = [float(v) for v in window]
            table[s].append(scheme)
    pools = {c: [s for s in sites if table[s][c]["mode"] == "ct"] for c in range(channels)}
    rejected: dict[str, str] = {}
    if any(pools.values()):
        found, rejected = exact_percentiles(fingerprints, pools, ask, weighting=weighting, log=log)
        for c, res in found.items():
            pooled = [s for s in pools[c] if s not in rejected]
            n, mean, m2 = combine_moments([_moments(fingerprints[s], c, weighting) for s in pooled])
            stats = {
                "mode": "ct",
                "lo": res["values"][0],
                "hi": res["values"][1],
                "mean": mean,
                "sd": math.sqrt(m2 / n),  # population sd, as nnU-Net's np.std
                "weighting": weighting,
                "bound": res["bound"],
            }
            for s in pooled:
                table[s][c] = stats
    kept = [s for s in sites if s not in rejected]
    entries = []
    for c in range(channels):
        by_site = {s: table[s][c] for s in kept}
        keys = Counter(repr(sorted(v.items())) for v in by_site.values())
        common = max(by_site.values(), key=lambda v: (keys[repr(sorted(v.items()))], v["mode"] == "ct"))
        entry: dict[str, Any] = {"name": names[c], **common}
        differ = {s: v for s, v in by_site.items() if v != common}
        if differ:
            entry["sites"] = differ
        entries.append(entry)
        groups: dict[str, list[str]] = {}
        for s, v in by_site.items():
            groups.setdefault(_scheme_name(v), []).append(s)
        how = "; ".join(f"{k} at {', '.join(v)}" for k, v in groups.items())
        log(f"plan: intensity of channel {names[c]}: {how}")
    return {"channels": entries}, rejected
