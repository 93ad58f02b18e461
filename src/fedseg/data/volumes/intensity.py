"""Intensity normalization of volumes: a scheme per channel and per site, chosen by the plan.

Every image channel is normalized on its own (nnU-Net; MONAI's ``channel_wise=True``), with the scheme the
plan holds for that channel at that site: ``"ct"`` (statistics pooled over the sites that use it),
``"zscore"`` (per volume over the body), ``"window"`` or ``"minmax"``, each a class of
:mod:`fedseg.data.volumes.schemes` that the plan's JSON object names by its ``"mode"``.

:func:`plan_intensity` decides the schemes from the sites' fingerprints: per channel and per site, ``"ct"``
where the site's channel is CT-like (values below −500, integer or float), else ``"zscore"`` (over the
voxels above −500 on a CT-like channel, else over the non-zero ones), unless the spec names the scheme
(``data.intensity``, per channel, or a site's own ``intensity``).  It prints the decision per channel,
naming the sites when they differ.  The plan stores, per channel, the scheme most sites use and under
``"sites"`` the sites whose scheme differs.

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

from fedseg.data.spec import INTENSITY_MODES, FederationSpec
from fedseg.data.volumes.fingerprint import CT_AIR, WEIGHTINGS, bin_edges, check_histogram, combine_moments
from fedseg.data.volumes.schemes import (
    SCHEMES,
    CTNormalization,
    IntensityScheme,
    scheme_from_config,
)
from fedseg.foundation.errors import ConfigError, DataError

__all__ = [
    "FLOAT_ROUNDS",
    "HISTOGRAM_BINS",
    "INTENSITY_MODES",
    "PERCENTILES",
    "channel_schemes",
    "check_intensity",
    "exact_percentiles",
    "normalize_case",
    "normalize_volume",
    "plan_intensity",
    "spec_intensity",
]

HISTOGRAM_BINS = 4096
PERCENTILES = (0.5, 99.5)
FLOAT_ROUNDS = 3
"""Rounds of counts that float percentiles take (each narrows the interval :data:`HISTOGRAM_BINS`-fold)."""
MAX_ROUNDS = 16

Ask = Callable[[list[dict[str, Any]], str, list[str]], Mapping[str, Any]]
"""``ask(requests, weighting, sites) -> {site: [counts per request]}``: one exchange of histograms."""


def normalize_volume(
    image: np.ndarray, mode: str | Sequence[Mapping[str, Any]], stats: Mapping[str, Any] | None = None
) -> np.ndarray:
    """Normalize a ``(C, *spatial)`` volume as float32, each channel on its own.

    ``mode``: one scheme name for every channel, with ``stats`` (``"ct"``: ``{"lo", "hi", "mean", "sd"}``;
    ``"window"``: ``{"window": [lo, hi]}``; ``"zscore"``: optionally ``{"body": threshold}``), or a list
    of one scheme object per channel (:func:`~fedseg.data.volumes.schemes.scheme_from_config`)."""
    configs = [{**(stats or {}), "mode": mode}] * len(image) if isinstance(mode, str) else list(mode)
    if len(configs) != len(image):
        raise ValueError(f"{len(configs)} intensity schemes for an image of {len(image)} channels")
    schemes = [scheme_from_config(c, "intensity") for c in configs]
    return np.stack([scheme(c) for c, scheme in zip(image, schemes)]).astype(np.float32)


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


def check_intensity(intensity: Any, where: str = "plan") -> None:
    """Refuse a plan's ``intensity`` that cannot be applied, naming the field and the fix."""
    if not isinstance(intensity, Mapping):
        raise ConfigError(f"{where}: intensity must be an object")
    if "channels" not in intensity:
        scheme_from_config(intensity, where)
        return
    if not isinstance(intensity["channels"], list) or not intensity["channels"]:
        raise ConfigError(f"{where}: intensity.channels must be a non-empty list, one scheme per image channel")
    for c, e in enumerate(intensity["channels"]):
        scheme_from_config(e, f"{where}: intensity.channels[{c}]")
        for site, s in (e.get("sites") or {}).items():
            scheme_from_config(s, f"{where}: intensity.channels[{c}].sites.{site}")


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
    table: dict[str, list[IntensityScheme | None]] = {}  # None: "ct", from the pooled statistics below
    for s in sites:
        want = [requested] * channels if isinstance(requested, str) else list(requested.get(s, ["auto"] * channels))
        table[s] = []
        for c in range(channels):
            mode, ct_like = _decide(want[c], fingerprints[s], c)
            table[s].append(None if mode == "ct" else SCHEMES[mode].planned(ct_like=ct_like, window=window))
    pools = {c: [s for s in sites if table[s][c] is None] for c in range(channels)}
    pooled_ct: dict[int, CTNormalization] = {}
    rejected: dict[str, str] = {}
    if any(pools.values()):
        found, rejected = exact_percentiles(fingerprints, pools, ask, weighting=weighting, log=log)
        for c, res in found.items():
            pooled = [s for s in pools[c] if s not in rejected]
            n, mean, m2 = combine_moments([_moments(fingerprints[s], c, weighting) for s in pooled])
            sd = math.sqrt(m2 / n)  # population sd, as nnU-Net's np.std
            pooled_ct[c] = CTNormalization(res["values"][0], res["values"][1], mean, sd, weighting, res["bound"])
    kept = [s for s in sites if s not in rejected]
    entries = []
    for c in range(channels):
        by_site = {s: pooled_ct[c] if (own := table[s][c]) is None else own for s in kept}
        keys = Counter(by_site.values())
        common = max(by_site.values(), key=lambda v: (keys[v], isinstance(v, CTNormalization)))
        entry: dict[str, Any] = {"name": names[c], **common.to_config()}
        differ = {s: v.to_config() for s, v in by_site.items() if v != common}
        if differ:
            entry["sites"] = differ
        entries.append(entry)
        groups: dict[str, list[str]] = {}
        for s, v in by_site.items():
            groups.setdefault(v.describe(), []).append(s)
        how = "; ".join(f"{k} at {', '.join(v)}" for k, v in groups.items())
        log(f"plan: intensity of channel {names[c]}: {how}")
    return {"channels": entries}, rejected


def spec_intensity(
    intensity: Mapping[str, Any], fed: FederationSpec, where: str = "plan", log: Callable[[str], None] = print
) -> dict[str, Any] | None:
    """A plan's ``intensity`` with the spec's schemes (``data.intensity``, per channel, and each site's own
    ``intensity``) in place of its own where they name one ("auto": the plan's); None when they change nothing.

    ``"ct"`` needs the pooled statistics that only a plan made with the histograms has: a plan whose
    channel has no CT statistics is refused, naming ``where`` and the fix.  Another scheme the spec names
    is the one a plan makes without the fingerprint: a z-score over the non-zero voxels, the spec's window."""
    names = fed.channel_names
    table = {
        s: [scheme_from_config(x, where) for x in channel_schemes(intensity, s, len(names))] for s in fed.site_names
    }
    changed = []
    for site, wants in fed.intensity_table().items():
        for c, want in enumerate(wants):
            have = table[site][c]
            if want == "auto":
                continue
            if want == "ct":
                if isinstance(have, CTNormalization):
                    continue
                pooled = [t[c] for t in table.values() if isinstance(t[c], CTNormalization)]
                if not pooled:
                    raise ConfigError(
                        f"{where}: the spec asks for intensity 'ct' on channel {names[c]} at {site} but the plan has "
                        "no pooled CT statistics for it -> delete the plan file and run `fedseg plan` on the spec to "
                        "fingerprint the sites again"
                    )
                table[site][c] = pooled[0]
            else:
                asked = SCHEMES[want].planned(ct_like=False, window=fed.window)
                if have.mode == want and (want != "window" or have == asked):
                    continue
                table[site][c] = asked
            changed.append(f"{names[c]} at {site}: {want} (the plan's was {have.mode!r})")
    if not changed:
        return None
    log(f"plan: intensity from the spec (data.intensity, a site's intensity): {'; '.join(changed)}")
    entries = []
    for c, name in enumerate(names):
        first = table[fed.site_names[0]][c]
        differ = {s: t[c].to_config() for s, t in table.items() if t[c] != first}
        entries.append({"name": name, **first.to_config(), **({"sites": differ} if differ else {})})
    return {"channels": entries}
