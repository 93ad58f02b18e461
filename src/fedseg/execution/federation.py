"""A run's data: a federation spec read into memory, a volume run's plan applied to its settings, the data
layout a run folder keeps, and the validation work a plan weighs (a simulation counts its loaded splits, a
deployed server the counts its sites report)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from tqdm.auto import tqdm

from fedseg.data.loading import load_split
from fedseg.data.spec import LAYOUT_NAME, data_header, load_federation
from fedseg.data.validate import raise_if_invalid
from fedseg.data.volumes.load import ensure_plan, load_volume_site, pad_to_common_shape, plan_for_run, split_shape
from fedseg.foundation.config import RunConfig
from fedseg.seams.checkpoint import save_json
from fedseg.site.runtime import SiteData, dataset_len, steps_per_round

if TYPE_CHECKING:
    from fedseg.data.volumes.lazy import CachedVolumes
    from fedseg.data.volumes.splits import SliceDataset, VolumeDataset

__all__ = ["load_federation_data", "plan_volume_run", "validation_work", "write_layout"]


def load_federation_data(
    federation: str | Path,
    progress: bool = False,
    log: Callable[[str], None] = print,
    volume_cache: str = "auto",
    volume_reads: str = "auto",
    device: str = "auto",
    batch: int = 2,
) -> tuple[Any, dict[str, SiteData]]:
    """Validate a federation spec and load every site's splits into memory.

    Volumes (``mode = "3d"`` or ``"patches2d"``) are brought into the federation's plan grid (the plan
    file beside the spec, made by federated fingerprinting when there is none; :mod:`fedseg.data.volumes`),
    each case read from its site's cache of preprocessed cases when it is there (``volume_cache``, the run
    setting) and held in memory or read from there as used (``volume_reads``); ``patches2d`` training splits
    are the volumes' axial slices.  A new plan is made for the run's ``device`` and ``batch`` patches a step
    (:func:`fedseg.data.volumes.load.ensure_plan`)."""
    raise_if_invalid(federation)
    fed = load_federation(federation)
    if fed.volumes:
        plan = ensure_plan(fed, log=log, device=device, batch=batch)
        data = {
            s.name: SiteData(*load_volume_site(fed, s, plan, volume_cache, log, volume_reads, len(fed.sites)))
            for s in tqdm(fed.sites, desc="loading sites", unit="site", disable=not progress, leave=False)
        }
        return fed, pad_to_common_shape(data)
    data = {}
    for s in tqdm(fed.sites, desc="loading sites", unit="site", disable=not progress, leave=False):
        data[s.name] = SiteData(*(load_split(fed, s, split) for split in ("training", "validation", "testing")))
    return fed, data


def validation_work(cfg: RunConfig, cases: Mapping[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """``{site: (validation cases, training patches per round)}`` from ``{site: (validation cases, training
    cases)}``: what :func:`fedseg.data.volumes.plan.eval_interval` weighs (a simulation counts its loaded
    splits, a deployed server the counts its sites report)."""
    return {s: (v, steps_per_round(cfg.train, t) * cfg.train.batch_size) for s, (v, t) in cases.items()}


def plan_volume_run(
    cfg: RunConfig, fed: Any, data: Mapping[str, SiteData], log: Callable[[str], None] = print
) -> tuple[RunConfig, Any]:
    """The run config of a volume federation with its plan applied (:func:`fedseg.data.volumes.load.plan_for_run`:
    patch, network, and for ``3d`` the validation interval from the loaded splits, padded to one shape) and
    the plan (:func:`fedseg.data.volumes.load.ensure_plan`, already logged by :func:`load_federation_data`)."""
    plan = ensure_plan(fed, log=lambda m: None)
    work, volume = None, None
    if fed.mode == "3d":  # the validation interval weighs 3D sliding windows against 3D patches
        work = validation_work(cfg, {s: (dataset_len(d.val), dataset_len(d.train)) for s, d in data.items()})
        val = next(iter(data.values())).val
        # a volume federation's splits are volume splits; every split is padded to one shape
        volume = None if val is None else split_shape(cast("VolumeDataset | SliceDataset | CachedVolumes", val))
    return plan_for_run(cfg, plan, log=log, sites=work, volume=volume, mode=fed.mode), plan


def write_layout(out: str | Path, fed: Any, plan: Any = None) -> Path:
    """``OUT/data.json``: the federation's data layout (:func:`fedseg.data.spec.data_header`) and a volume run's
    plan, the format a deployed site keeps in its work folder, so that the run folder alone is enough for
    ``fedseg predict`` and ``fedseg export`` wherever it is copied."""
    header = data_header(fed)
    if plan is not None:
        header["plan"] = plan.to_json()
    path = Path(out) / LAYOUT_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    save_json(header, path)
    return path
