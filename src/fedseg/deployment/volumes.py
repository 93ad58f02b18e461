"""Volumes deployed: the federated plan made over the wire, and each site's splits in the plan's grid.

Before the sites set up a volume run (``mode = "3d"`` or ``"patches2d"``), the server (:func:`plan_and_shape`):

1. **plans** — for the weakest device the sites report with their fingerprints (a CPU's measured
   time a step where any site trains on a CPU, else the smallest GPU memory;
   :func:`fedseg.data.volumes.budget.weakest`) — unless the run carries a plan (the file beside the federation spec, which ``prepare_run``
   copies into ``deploy.json`` with the spec's ``data.intensity`` applied, or the one an earlier job of the
   run made), it asks every site for its fingerprint (operation ``fingerprint``: per-case spacings and
   shapes, foreground moments per channel; never a voxel), then the sites pooled for a CT channel for
   counts of their foreground in the intervals it names (``histogram``, a few rounds until the percentiles
   are exact), and makes the plan exactly as ``fedseg plan`` does
   (:func:`fedseg.data.volumes.plan.make_plan`, sites in federation order, the spec's ``data.intensity`` /
   ``data.window`` / channel names / sites' own schemes from the data header, a malformed or missing reply
   rejected and the plan made from the others);
2. **agrees one volume shape** — every site brings its splits into the plan's grid (``volumes``; the cases
   land in the site's cache, so setup reads them back) and says the largest padded shape of each axis (a
   ``patches2d`` training split of slices has the first two) and its training and validation case counts;
   the server takes the largest shape over the sites, as the simulation pads every site to one shape;
3. derives the run's settings from the plan as a simulation does (:func:`fedseg.data.volumes.load.plan_for_run`:
   patch, U-Net, and for ``3d`` the validation interval from the sites' counts and the agreed shape), records
   the plan, the shape and the counts in ``deploy.json`` (a resumed or re-submitted job reuses them), the plan
   in ``OUT/plan.json`` and the settings in ``OUT/config.toml``, and sends the plan and the shape in the
   setup's data header.

The site's half (:func:`site_operation`, :func:`load_volume_site_data`) reads only its own datalist and
writes its cache only beside it (:func:`site_cache_setting`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from fedseg.data.spec import INTENSITIES, VOLUME_MODES, FederationSpec, SiteSpec
from fedseg.data.volumes.budget import DeviceBudget, device_budget, weakest
from fedseg.data.volumes.fingerprint import WEIGHTINGS, site_fingerprint, site_histogram
from fedseg.data.volumes.load import load_volume_site, pad_to_shape, plan_for_run, split_shape, training_cases
from fedseg.data.volumes.plan import HISTOGRAM_BINS, Plan, make_plan, save_plan
from fedseg.execution.federation import validation_work
from fedseg.foundation.config import RunConfig, dump_toml
from fedseg.foundation.errors import ConfigError, PayloadError
from fedseg.seams.checkpoint import save_json
from fedseg.site.runtime import SiteData, dataset_len

if TYPE_CHECKING:
    from fedseg.data.volumes.lazy import CachedVolumes
    from fedseg.data.volumes.splits import SliceDataset, VolumeDataset

__all__ = [
    "VOLUME_OPS",
    "load_volume_site_data",
    "local_spec",
    "plan_and_shape",
    "site_cache_setting",
    "site_operation",
]

VOLUME_OPS = ("fingerprint", "histogram", "volumes")
"""The site operations of a volume run's planning (beside ``setup``, ``task``…)."""


def local_spec(name: str, datalist: str | Path, header: dict[str, Any]) -> FederationSpec:
    """A one-site federation spec of this site's own datalist, laid out as the server's data header says."""
    dl = Path(datalist).resolve()
    intensity, window = _intensity(header, f"site {name}: the server's data header")
    channels = header.get("channels") or []
    if not (isinstance(channels, list) and all(isinstance(c, str) for c in channels)):
        raise PayloadError(f"site {name}: the server's data header: channels {channels!r} is not a list of names")
    return FederationSpec(
        name=f"{name}-local",
        path=dl,
        sites=(SiteSpec(name, dl),),
        spatial_dims=int(header["spatial_dims"]),
        in_channels=int(header["in_channels"]),
        labels={k: tuple(v) for k, v in header["labels"].items()},
        mode=header["mode"],
        image_size=tuple(header["image_size"]) if header.get("image_size") else None,
        foreground_only=bool(header.get("foreground_only", False)),
        intensity=intensity,
        window=window,
        channels=tuple(channels),
    )


def _requested(header: dict[str, Any], where: str) -> str | dict[str, list[str]]:
    """What the spec asks of the plan's intensity, as the data header carries it: one scheme ("auto" included),
    or with ``intensity_table`` (channel or site schemes) ``{site: [scheme per channel]}``."""
    intensity, _ = _intensity(header, where)
    table = header.get("intensity_table")
    if table is None:
        return intensity
    ok = isinstance(table, dict) and all(
        isinstance(v, list) and all(m in INTENSITIES for m in v) for v in table.values()
    )
    if not ok:
        raise PayloadError(f"{where}: intensity_table {table!r} is not {{site: [scheme per channel]}}")
    return table


def _intensity(header: dict[str, Any], where: str) -> tuple[str, tuple[float, float] | None]:
    """The spec's ``data.intensity`` and ``data.window`` as the data header carries them (absent: "auto")."""
    intensity, window = header.get("intensity", "auto"), header.get("window")
    if intensity not in INTENSITIES:
        raise PayloadError(f"{where}: intensity {intensity!r} is not one of {list(INTENSITIES)}")
    if window is None and intensity != "window":
        return intensity, None
    if not (
        intensity == "window"
        and isinstance(window, list)
        and len(window) == 2
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in window)
        and window[0] < window[1]
    ):
        raise PayloadError(f"{where}: window {window!r} with intensity {intensity!r} is not [low, high] of a window")
    return intensity, (float(window[0]), float(window[1]))


def _shape(value: Any, what: str) -> list[int]:
    if not (
        isinstance(value, list)
        and len(value) == 3
        and all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 1 << 16 for v in value)
    ):
        raise PayloadError(f"{what}: {value!r} is not three positive integers")
    return value


def _count(value: Any, what: str) -> int:
    if not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 1 << 31):
        raise PayloadError(f"{what}: {value!r} is not a count of cases")
    return value


def _requests(value: Any, where: str) -> list[dict[str, Any]]:
    """The histogram requests of a ``histogram`` operation, checked (each ``channel``, ``lo < hi``, ``bins``)."""
    ok = isinstance(value, list) and 0 < len(value) <= 1024
    for r in value if ok else []:
        ok = ok and (
            isinstance(r, dict)
            and isinstance(r.get("channel"), int)
            and r["channel"] >= 0
            and isinstance(r.get("bins"), int)
            and 1 <= r["bins"] <= 4 * HISTOGRAM_BINS
            and all(isinstance(r.get(k), (int, float)) and math.isfinite(r[k]) for k in ("lo", "hi"))
            and r["lo"] < r["hi"]
        )
    if not ok:
        raise PayloadError(f"{where}: histogram requests are not a list of {{channel, lo < hi, bins}}")
    return [{"channel": r["channel"], "lo": float(r["lo"]), "hi": float(r["hi"]), "bins": r["bins"]} for r in value]


def site_cache_setting(value: Any, name: str, log: Callable[[str], None]) -> str:
    """The cache a deployed site uses for the run's ``volume_cache``: ``"off"`` or ``"auto"`` (beside its own
    datalist).  A folder named by the run is not used: the server does not choose where a site writes."""
    if value in ("auto", "off"):
        return value
    log(f"site {name}: volume_cache = {value!r} names a folder; a site caches beside its own datalist ('auto')")
    return "auto"


def load_volume_site_data(
    name: str,
    datalist: str | Path,
    header: dict[str, Any],
    volume_cache: str,
    log: Callable[[str], None],
    volume_reads: str = "auto",
) -> SiteData:
    """This site's splits in the plan's grid of ``header["plan"]``, padded to ``header["volume_shape"]`` when
    the server sent one (through the site's cache, ``volume_cache``; held or read from there as used,
    ``volume_reads``)."""
    fed = local_spec(name, datalist, header)
    plan = Plan.from_json(header["plan"], where=f"site {name}: the server's plan")
    splits = load_volume_site(fed, fed.sites[0], plan, site_cache_setting(volume_cache, name, log), log, volume_reads)
    if header.get("volume_shape") is not None:
        pad_to_shape(splits, _shape(header["volume_shape"], f"site {name}: the server's volume shape"))
    return SiteData(*splits)


def site_operation(
    name: str, datalist: str | Path, op: str, body: dict[str, Any], log: Callable[[str], None], device: str = "auto"
) -> dict[str, Any]:
    """A site's answer to one planning operation (:data:`VOLUME_OPS`); ``body`` holds the data header.  The
    fingerprint's reply also carries the budget of the ``device`` the site trains on
    (:func:`fedseg.data.volumes.budget.device_budget`, for the ``batch`` the body names)."""
    where = f"site {name}: {op}"
    header = body.get("data")
    if not isinstance(header, dict) or header.get("mode") not in VOLUME_MODES:
        raise PayloadError(f"{where}: the request carries no volume data header (mode {' or '.join(VOLUME_MODES)})")
    fed = local_spec(name, datalist, header)
    site = fed.sites[0]
    if op == "fingerprint":
        batch = body.get("batch", 2)
        if not (isinstance(batch, int) and not isinstance(batch, bool) and 1 <= batch <= 1 << 16):
            raise PayloadError(f"{where}: batch {batch!r} is not a positive count of patches")
        return {
            "site": name,
            "fingerprint": site_fingerprint(training_cases(fed, site)),
            "device": device_budget(device, batch=batch).to_json(),
        }
    if op == "histogram":
        weighting = body.get("weighting")
        if weighting not in WEIGHTINGS:
            raise PayloadError(f"{where}: weighting {weighting!r} is not one of {list(WEIGHTINGS)}")
        requests = _requests(body.get("requests"), where)
        if any(r["channel"] >= fed.in_channels for r in requests):
            raise PayloadError(f"{where}: a histogram request names a channel past in_channels = {fed.in_channels}")
        return {"site": name, "counts": site_histogram(training_cases(fed, site), requests, weighting)}
    if op == "volumes":
        cache = str(body.get("volume_cache", "auto"))
        reads = str(body.get("volume_reads", "auto"))
        data = load_volume_site_data(name, datalist, {**header, "volume_shape": None}, cache, log, reads)
        sets = (data.train, data.val, data.test)  # a patches2d training split holds slices: two axes
        splits = [cast("VolumeDataset | SliceDataset | CachedVolumes", ds) for ds in sets if ds is not None]
        shapes = [split_shape(ds) for ds in splits]
        shape = [max(s[a] for s in shapes if len(s) > a) for a in range(3)]
        return {
            "site": name,
            "volume_shape": shape,
            "num_train": dataset_len(data.train),
            "num_validation": dataset_len(data.val),
        }
    raise PayloadError(f"{where}: not a planning operation")


def _deployed_plan(
    transport: Any, header: dict[str, Any], timeout: float, log: Callable[[str], None], batch: int = 2
) -> Plan:
    replies = transport.exchange("fingerprint", {"data": header, "batch": batch}, timeout)
    # federation order, as `fedseg plan` combines the sites (the pooled moments' rounding follows the order)
    fingerprints = {s: replies[s].get("fingerprint") for s in transport.sites if s in replies}
    budgets = []
    for s in transport.sites:
        if s in replies and replies[s].get("device") is not None:
            try:
                budgets.append(DeviceBudget.from_json(replies[s]["device"], f"site {s}'s device budget"))
            except ConfigError as e:
                log(f"[deploy] {e}; planning for the other sites' devices")
    budget = weakest(budgets)
    if budget is not None:
        log(f"[deploy] planning for the weakest site device: {budget.to_json()}")

    def histograms(requests: list[dict[str, Any]], weighting: str, sites: list[str]) -> dict[str, Any]:
        asked = tuple(s for s in transport.sites if s in sites)
        body = {"data": header, "requests": requests, "weighting": weighting}
        got = transport.exchange("histogram", body, timeout, sites=asked)
        return {s: r.get("counts") for s, r in got.items()}

    where = "the run's data header"
    _, window = _intensity(header, where)
    return make_plan(
        fingerprints,
        histograms,
        budget=budget,
        labels=len(header.get("labels") or {}) or 1,
        in_channels=int(header.get("in_channels", 1)),
        intensity=_requested(header, where),
        window=window,
        channel_names=header.get("channels") or None,
        log=log,
    )


def plan_and_shape(
    out: Path, desc: dict[str, Any], cfg: RunConfig, transport: Any, timeout: float, log: Callable[[str], None]
) -> tuple[RunConfig, dict[str, Any], Plan]:
    """The server's steps before a volume run's setup (module docstring).

    Returns the run config with the plan applied (also written to ``OUT/config.toml``), the data header the
    sites set up with (the plan and the volume shape added) and the plan."""
    header = dict(desc["data"])
    if desc.get("plan") is None:
        plan = _deployed_plan(transport, header, timeout, log, cfg.train.batch_size)
        desc["plan"] = plan.to_json()
        log(f"[deploy] plan made from the fingerprints of {plan.sites} ({plan.cases} training cases)")
    plan = Plan.from_json(desc["plan"], where=f"{out / 'deploy.json'}: plan")
    save_plan(plan, out / "plan.json")
    header["plan"] = plan.to_json()
    if desc.get("volume_shape") is None:
        desc["volume_shape"], desc["site_cases"] = _agree_shape(plan, header, cfg, transport, timeout, log)
    header["volume_shape"] = desc["volume_shape"]
    work, volume = None, None
    if header["mode"] == "3d":  # as a simulation: the validation interval weighs 3D sliding windows
        counts = {s: (int(v), int(t)) for s, (t, v) in desc.get("site_cases", {}).items()}
        work, volume = validation_work(cfg, counts), desc["volume_shape"]
    planned = plan_for_run(cfg, plan, log=log, sites=work, volume=volume, mode=header["mode"])
    if planned != cfg:
        (out / "config.toml").write_text(dump_toml(planned.to_dict()))
    save_json(desc, out / "deploy.json")
    return planned, header, plan


def _agree_shape(
    plan: Plan, header: dict[str, Any], cfg: RunConfig, transport: Any, timeout: float, log: Callable[[str], None]
) -> tuple[list[int], dict[str, list[int]]]:
    """The largest padded shape over the sites' replies to ``volumes`` (for ``3d`` at least the plan's patch,
    as every 3D split is padded to it) and each site's ``[training, validation]`` case counts, in federation
    order; a malformed reply is logged and left out."""
    replies = transport.exchange(
        "volumes", {"data": header, "volume_cache": cfg.volume_cache, "volume_reads": cfg.volume_reads}, timeout
    )
    shape = list(plan.patch_size) if header["mode"] == "3d" else [1, 1, 1]
    cases: dict[str, list[int]] = {}
    for s in transport.sites:
        if s not in replies:
            continue
        r = replies[s]
        try:
            got = _shape(r.get("volume_shape"), f"reply of site {s} to 'volumes'")
            counts = [_count(r.get(k), f"reply of site {s} to 'volumes': {k}") for k in ("num_train", "num_validation")]
        except PayloadError as e:
            log(f"[deploy] {e}; its volume shape is left out")
            continue
        shape = [max(a, b) for a, b in zip(shape, got)]
        cases[s] = counts
    return shape, cases
