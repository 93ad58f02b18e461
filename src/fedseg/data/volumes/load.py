"""A volume federation's plan and its sites' splits in the plan's grid.

:func:`plan_federation` runs the two fingerprint passes at every site of a spec (in one process, as the
simulation does; each site reads only its own files) and makes the plan.  :func:`load_volume_split`
brings one split of one site into the plan's grid: read with the affine, normalized by the plan's
intensity scheme, reoriented to RAS and resampled to the target spacing, padded at the far end of each
axis to a common shape (padding at the end leaves the affine unchanged), each case's own extent recorded
(:attr:`VolumeDataset.extents`; evaluation predicts over it).  Validation and test cases keep their
original geometry and label, and :class:`VolumeDataset.original_grid` resamples a prediction back into the
scan's own voxels, where Dice is scored.

``mode = "patches2d"`` (federated gradient averaging's protocol) goes through the same plan with the
in-plane spacing only (each scan keeps its slice spacing), and its training split is the stack of every
training volume's axial slices (:class:`SliceDataset`), from which the 2D model's patches are cut;
validation and test splits stay volumes, predicted slice by slice and scored in each scan's own grid.
The spec's ``data.intensity`` (and ``data.window``), per channel, and each site's own ``intensity``
override the plan's intensity schemes (:func:`with_spec_intensity`).  An image whose channels are stored in
separate files (nnU-Net's ``case_0000.nii.gz``, ``case_0001.nii.gz``; a MONAI datalist's list of images)
is read by :func:`read_channels`, which checks every file is on the label's grid.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Literal, cast

import numpy as np
import torch

from fedseg.data.datalist import SPLITS, load_datalist
from fedseg.data.loading import label_channels
from fedseg.data.spec import FederationSpec, SiteSpec
from fedseg.data.volumes.budget import DeviceBudget, device_budget
from fedseg.data.volumes.cache import CACHE_DIR, CachedCase, VolumeCache, plan_key
from fedseg.data.volumes.fingerprint import site_fingerprint, site_histogram
from fedseg.data.volumes.geometry import (
    Geometry,
    label_masks,
    read_channels,
    to_plan_grid,
)
from fedseg.data.volumes.intensity import normalize_case, spec_intensity
from fedseg.data.volumes.lazy import CachedVolumes, CaseFile
from fedseg.data.volumes.plan import (
    EVAL_SHARE,
    GPU_MEMORY_GIB,
    Plan,
    describe_budget,
    eval_interval,
    load_plan,
    make_plan,
    round_cost,
    save_plan,
    slice_patch,
    sliding_windows,
)
from fedseg.data.volumes.splits import (
    SliceDataset,
    VolumeDataset,
    pad_far_end,
    pad_to_common_shape,
    pad_to_shape,
    slice_dataset,
    split_shape,
)
from fedseg.foundation.config import VOLUME_READS, ModelConfig, RunConfig
from fedseg.foundation.errors import ConfigError, DataError

__all__ = [
    "MemoryBudget",
    "SliceDataset",
    "VolumeDataset",
    "ensure_plan",
    "load_volume_site",
    "load_volume_split",
    "memory_budget",
    "pad_to_common_shape",
    "pad_to_shape",
    "plan_federation",
    "plan_for_run",
    "plan_path",
    "plan_spacing",
    "read_channels",
    "site_cache",
    "split_shape",
    "training_cases",
    "with_spec_intensity",
]


def plan_path(fed: FederationSpec) -> Path:
    """Where a federation's plan lives: ``<spec>.plan.json`` beside the spec."""
    return fed.path.with_name(fed.path.stem + ".plan.json")


ImagePath = Path | list[Path]
"""A case's image: one file, or one file per channel."""


def _entries(site: SiteSpec, split: str) -> Iterator[tuple[str, ImagePath, Path]]:
    """``(case id, image path(s), label path)`` of a split; the id is the (first) image path relative to the
    datalist."""
    root = site.datalist.parent
    for entry in load_datalist(site.datalist, site=site.name)[split]:
        first = entry["image"][0] if isinstance(entry["image"], list) else entry["image"]
        try:
            cid = Path(first).relative_to(root).as_posix()
        except ValueError:
            cid = str(first)
        yield cid, entry["image"], entry["label"]


def _cases(fed: FederationSpec, site: SiteSpec, split: str = "training") -> Iterator[tuple]:
    for cid, image_path, label_path in _entries(site, split):
        image, label, affine = read_channels(image_path, label_path, fed.in_channels, fed.label_values)
        yield cid, image, label, affine


def training_cases(fed: FederationSpec, site: SiteSpec) -> Iterator[tuple]:
    """``(image, label, affine)`` of every training case of a site, in file units (what the fingerprint reads)."""
    for _cid, image, label, affine in _cases(fed, site):
        yield image, label, affine


def plan_federation(
    fed: FederationSpec,
    *,
    gpu_memory: float = GPU_MEMORY_GIB,
    patch_voxels: int | None = None,
    weighting: str = "case",
    log: Callable[[str], None] = print,
    budget: DeviceBudget | None = None,
    network: str | None = None,
) -> Plan:
    """Fingerprint every site's training cases and make the plan, asking the sites for histograms as the plan
    needs them (each request a pass over a site's own cases); no voxel leaves a site.  The plan is sized for
    ``budget`` (:mod:`fedseg.data.volumes.budget`; None: a GPU of ``gpu_memory``)."""
    fingerprints = {s.name: site_fingerprint(training_cases(fed, s)) for s in fed.sites}

    def histograms(requests: list[dict], weighting: str, sites: list[str]) -> dict[str, list[list[float]]]:
        return {
            s.name: site_histogram(training_cases(fed, s), requests, weighting) for s in fed.sites if s.name in sites
        }

    return make_plan(
        fingerprints,
        histograms,
        gpu_memory=gpu_memory,
        patch_voxels=patch_voxels,
        labels=len(fed.labels),
        in_channels=fed.in_channels,
        budget=budget,
        network=network,
        intensity=fed.intensity_table(),
        window=fed.window,
        weighting=weighting,
        channel_names=fed.channel_names,
        log=log,
    )


def with_spec_intensity(
    plan: Plan, fed: FederationSpec, where: str = "plan", log: Callable[[str], None] = print
) -> Plan:
    """The plan with the spec's schemes in place of its own where they name one
    (:func:`~fedseg.data.volumes.intensity.spec_intensity`; ``where`` names the plan file in a refusal)."""
    intensity = spec_intensity(plan.intensity, fed, where, log)
    return plan if intensity is None else dataclasses.replace(plan, intensity=intensity)


def ensure_plan(fed: FederationSpec, log: Callable[[str], None] = print, device: str = "auto", batch: int = 2) -> Plan:
    """The federation's plan file, or a new plan written beside the spec (and logged) when there is none,
    made for the ``device`` the run trains on with ``batch`` patches a step
    (:func:`fedseg.data.volumes.budget.device_budget`; a CPU is probed once, here, and the choice kept in the
    file, which later runs reuse); the spec's ``data.intensity`` overrides its intensity scheme."""
    path = plan_path(fed)
    if path.is_file():
        return with_spec_intensity(load_plan(path), fed, str(path), log)
    plan = plan_federation(fed, log=log, budget=device_budget(device, batch=batch))
    save_plan(plan, path)
    log(f"plan: {path} (made from {plan.cases} training cases of {len(plan.sites)} sites; edit it to override)")
    log(describe_budget(plan))
    return plan


def plan_spacing(fed: FederationSpec, plan: Plan) -> tuple[float, float, float]:
    """The spacing volumes are resampled to: the plan's target spacing, or for ``patches2d`` its in-plane
    spacing with each scan's own slice spacing (0 keeps an axis' spacing in MONAI's ``Spacing``)."""
    x, y, z = (float(v) for v in plan.target_spacing)
    return (x, y, 0.0) if fed.mode == "patches2d" else (x, y, z)


def site_cache(
    setting: str, fed: FederationSpec, site: SiteSpec, plan: Plan, log: Callable[[str], None] = print
) -> VolumeCache | None:
    """The site's cache of preprocessed cases under ``plan`` for the run setting ``volume_cache``: ``"auto"``
    (``.fedseg-cache`` beside the site's datalist), ``"off"`` (None) or a folder (``<folder>/<site>``)."""
    if setting == "off":
        return None
    root = site.datalist.parent / CACHE_DIR if setting == "auto" else Path(setting).expanduser() / site.name
    return VolumeCache(root, plan_key(plan, fed.in_channels, fed.label_values, plan_spacing(fed, plan)), log=log)


def _preprocess(fed: FederationSpec, site: str, image_path, label_path, plan: Plan, keep: bool) -> CachedCase:
    try:
        image, label, affine = read_channels(image_path, label_path, fed.in_channels, fed.label_values)
    except DataError as e:  # the file and the fix, and whose case it is
        raise DataError(f"{site}: {e}") from None
    x = normalize_case(image, plan.intensity, site)
    x, lab, new_affine = to_plan_grid(x, label, affine, plan_spacing(fed, plan))
    assert lab is not None  # to_plan_grid resamples the label it is given
    return CachedCase(x, lab, new_affine, affine, tuple(label.shape), label if keep else None)


@dataclasses.dataclass
class MemoryBudget:
    """Bytes a site's volumes may take in memory; a split that would exceed it is read from the site's
    cache as it is used (:class:`fedseg.data.volumes.lazy.CachedVolumes`).  ``limit`` None: no limit
    (every split in memory); 0: every split from the cache."""

    limit: int | None
    used: int = 0
    cached: list[str] = dataclasses.field(default_factory=list)
    """The splits read from the cache."""

    def summary(self) -> str:
        held = f"{self.used / 2**20:.1f} MiB of volumes in memory"
        return held + (f"; {', '.join(self.cached)} read from the cache as used" if self.cached else "")


def memory_budget(reads: str, sites: int = 1) -> MemoryBudget:
    """The budget of each site for the run setting ``volume_reads``: ``"memory"`` (no limit), ``"cache"`` (0),
    ``"auto"``: a quarter of the machine's physical memory shared by the ``sites`` loaded in this process
    (no limit where the operating system does not say)."""
    if reads not in VOLUME_READS:
        raise ConfigError(f"volume_reads = {reads!r} is not known; use one of {', '.join(VOLUME_READS)}")
    if reads == "memory":
        return MemoryBudget(None)
    if reads == "cache":
        return MemoryBudget(0)
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return MemoryBudget(None)
    return MemoryBudget(int(physical) // (4 * max(1, sites)))


def load_volume_split(
    fed: FederationSpec,
    site: SiteSpec,
    split: str,
    plan: Plan,
    cache: VolumeCache | None = None,
    budget: MemoryBudget | None = None,
) -> VolumeDataset | SliceDataset | CachedVolumes:
    """One split of one site in the plan's grid (module docstring): volumes, or for the training split of
    ``mode = "patches2d"`` their axial slices; each case read from ``cache`` when it holds it under this
    plan and these source files, else preprocessed (and stored there).

    A split whose cases would take ``budget`` past its limit stays in the cache and is read as it is used
    (:class:`~fedseg.data.volumes.lazy.CachedVolumes`, the same items); the cases held so far are released.
    A limit of 0 needs the cache (one error naming the fix when it is off or cannot be written); a
    ``patches2d`` training split (slices) is always held."""
    keep = split != "training"
    slices = fed.mode == "patches2d" and not keep
    can_defer = cache is not None and not slices and budget is not None and budget.limit is not None
    if budget is not None and budget.limit == 0 and not slices and (cache is None or cache.disabled):
        why = "off" if cache is None else f"not writable ({cache.disabled})"
        raise ConfigError(
            f"{site.name}: volume_reads = 'cache' reads volumes from the site's cache, which is {why} -> set "
            "volume_cache to 'auto' or a writable folder, or volume_reads to 'auto' or 'memory'"
        )
    held: list[CachedCase] = []
    files: list[CaseFile | None] = []
    ids, affines, originals = [], [], []
    deferred = can_defer and budget is not None and budget.limit == 0  # can_defer: budget is set
    held_bytes = 0
    entries = list(_entries(site, split))

    def read(cid: str, image_path: ImagePath, label_path: Path) -> CachedCase:
        case = cache.get(cid, image_path, label_path, keep) if cache is not None else None
        if case is None:
            case = _preprocess(fed, site.name, image_path, label_path, plan, keep)
            if cache is not None:
                cache.put(cid, image_path, label_path, case)
        return case

    for n, (cid, image_path, label_path) in enumerate(entries):
        case = read(cid, image_path, label_path)
        deferrable = can_defer and cache is not None and not cache.disabled  # can_defer: cache is set
        path = cache.arrays_path(cid, image_path, label_path) if cache is not None and deferrable else None
        files.append(CaseFile.of(cid, path, case.image, case.label, fed.labels) if path and path.is_file() else None)
        ids.append(cid)
        affines.append(case.affine)
        if keep:
            originals.append(Geometry(case.original_affine, case.original_shape))
        if deferred and files[-1] is None:  # the cache stopped taking cases (logged by it): hold them all
            deferred = False
            assert budget is not None and cache is not None  # deferred only when can_defer: both are set
            if budget.limit == 0:
                raise ConfigError(
                    f"{site.name}: volume_reads = 'cache' but the site's cache stopped taking cases ({cache.disabled})"
                    " -> free space or set volume_cache to a writable folder, or volume_reads to 'auto' or 'memory'"
                )
            held = [read(*e) for e in entries[:n]]
            held_bytes = sum(_case_bytes(c, len(fed.labels)) for c in held)
            budget.used += held_bytes
        if deferred:
            continue
        size = _case_bytes(case, len(fed.labels))
        over = can_defer and budget is not None and budget.limit is not None and budget.used + size > budget.limit
        if over and all(f is not None for f in files):
            assert budget is not None  # over: budget is set
            deferred = True  # from here on the split stays in the cache; what was held is released
            budget.used -= held_bytes
            held = []
            continue
        held.append(case)
        held_bytes += size
        if budget is not None:
            budget.used += size
    if not ids:
        raise DataError(f"{site.name}: {site.datalist}: split {split!r} has no cases -> add cases to the datalist")
    if deferred:
        assert budget is not None  # deferred only when can_defer
        budget.cached.append(split)
        # every case is in the cache: a case it did not take ends deferral (above)
        files_in = cast(list[CaseFile], files)
        least = [0, 0, 0] if fed.mode == "patches2d" else list(plan.patch_size)
        shape = [max([f.extent[a] for f in files_in] + [least[a]]) for a in range(3)]
        return CachedVolumes(files_in, fed.labels, shape, affines if keep else None, originals if keep else None)
    images = [c.image for c in held]
    labels = [c.label for c in held]
    if slices:
        return slice_dataset(images, [label_channels(lab, fed.labels) for lab in labels], ids, slice_patch(plan, 1))
    if fed.mode == "patches2d":
        shape = [max(im.shape[1 + a] for im in images) for a in range(3)]
    else:
        shape = [max([im.shape[1 + a] for im in images] + [plan.patch_size[a]]) for a in range(3)]
    x, y = pad_far_end(images, [label_channels(lab, fed.labels) for lab in labels], shape)
    # the label channels in each scan's own grid, one byte a voxel (scored as float32 region by region)
    # a kept split's cases carry their own-grid label
    orig_labels = (
        [torch.from_numpy(label_masks(cast(np.ndarray, c.original_label), fed.labels)) for c in held] if keep else None
    )
    extents = [tuple(int(s) for s in im.shape[1:]) for im in images]
    return VolumeDataset(x, y, ids, affines, originals if keep else None, orig_labels, extents=extents)


def _case_bytes(case: CachedCase, channels: int) -> int:
    """Bytes a case takes held in memory: float32 image and ``channels`` label channels in the plan's grid,
    and its label channels in its own grid (one byte a voxel)."""
    voxels = int(np.prod(case.label.shape))
    own = int(np.prod(case.original_label.shape)) if case.original_label is not None else 0
    return 4 * voxels * (case.image.shape[0] + channels) + own * channels


def load_volume_site(
    fed: FederationSpec,
    site: SiteSpec,
    plan: Plan,
    volume_cache: str = "auto",
    log: Callable[[str], None] = print,
    volume_reads: str = "auto",
    sites: int = 1,
) -> list[VolumeDataset | SliceDataset | CachedVolumes]:
    """The three splits of one site in the plan's grid, through the site's cache (:func:`site_cache`), held in
    memory or read from the cache as used (``volume_reads``, :func:`memory_budget` with ``sites`` loaded in
    this process); logs one line saying how many cases came from the cache and where the volumes are."""
    cache = site_cache(volume_cache, fed, site, plan, log=log)
    budget = memory_budget(volume_reads, sites)
    splits = [load_volume_split(fed, site, split, plan, cache, budget) for split in SPLITS]
    if cache is not None:
        log(f"{site.name}: {cache.summary()}; {budget.summary()}")
    return splits


def _downsampling(model: ModelConfig) -> int:
    """The 2D network's total down-sampling along the first axis (product of its strides)."""
    factor = 1
    for s in model.levels()[1]:
        factor *= int(s) if isinstance(s, int) else int(s[0])
    return factor


def plan_for_run(
    cfg: RunConfig,
    plan: Plan,
    log: Callable[[str], None] = print,
    sites: Mapping[str, tuple[int, int]] | None = None,
    volume: Sequence[int] | None = None,
    mode: str = "3d",
) -> RunConfig:
    """The run config with the plan's network, patch and validation interval where the run leaves them unset
    (``model.name = "auto"`` becomes ``"dynunet"`` for ``mode = "3d"`` when channels and strides are the
    plan's, else stays MONAI's U-Net; ``model.roi_size``,
    ``model.channels`` and ``strides`` both (with the plan's ``kernels``), ``eval.every``: None) and
    ``train.loss = "auto"`` as Dice + cross-entropy, each logged.

    ``eval.every`` unset (None) becomes the plan's ``eval_every``, or when that is None (the default)
    :func:`fedseg.data.volumes.plan.eval_interval` of ``sites`` (``{site: (validation cases, training
    patches per round)}``) and ``volume`` (the padded volume shape); without them it becomes 1.  A value the
    run sets, 1 included, is kept.
    ``mode = "patches2d"``: the 2D network stays as configured and the patch is the plan's in-plane
    patch (:func:`fedseg.data.volumes.plan.slice_patch`)."""
    model, ev, train = cfg.model, cfg.eval, cfg.train
    if train.loss != train.loss_for(volumes=True):
        loss = cast(Literal["dice", "dicece", "bce"], train.loss_for(volumes=True))  # one of train.loss's values
        train = dataclasses.replace(train, loss=loss)
        log(
            f"plan: train.loss = {train.loss} (Dice + cross-entropy: a Dice loss alone can settle on empty predictions)"
        )
    if mode == "patches2d":
        if model.roi_size is None:
            patch = slice_patch(plan, _downsampling(model))
            model = dataclasses.replace(model, roi_size=tuple(patch))
            log(f"plan: model.roi_size = {patch} (2D patches of axial slices and in-plane sliding windows)")
    elif model.roi_size is None:
        model = dataclasses.replace(model, roi_size=tuple(plan.patch_size))
        log(f"plan: model.roi_size = {list(plan.patch_size)} (patches and sliding windows)")
    from_plan = model.channels is None and model.strides is None
    if mode != "patches2d" and model.name == "auto" and model.module is None and from_plan:
        if plan.network == "unet":
            model = dataclasses.replace(model, name="unet")
            log("plan: model.name = unet (MONAI's U-Net: what the plan's device trains best in equal time)")
        elif len(plan.channels) >= 3:
            model = dataclasses.replace(model, name="dynunet")
            log("plan: model.name = dynunet (MONAI's DynUNet, nnU-Net's network, with deep supervision)")
        else:  # MONAI's DynUNet needs at least 3 levels; a patch that small keeps MONAI's U-Net
            model = dataclasses.replace(model, name="unet")
            log(f"plan: model.name = unet (the plan's {len(plan.channels)} levels are fewer than DynUNet's 3)")
    if mode != "patches2d" and model.channels is None and model.strides is None:
        kernels = None if plan.kernels is None else tuple(tuple(k) for k in plan.kernels)
        model = dataclasses.replace(
            model,
            channels=tuple(plan.channels),
            strides=tuple(tuple(s) for s in plan.strides),
            kernels=model.kernels if model.kernels is not None else kernels,
        )
        log(f"plan: network channels {plan.channels}, strides {plan.strides}, kernels {plan.kernels}")
    assert model.roi_size is not None  # set from the plan above when unset
    if mode == "3d" and sites:
        line = round_cost(plan, model, train.batch_size, max(p for _, p in sites.values()) // train.batch_size)
        if line:
            log(line)
    if ev.every is None:
        every, why = plan.eval_every, "the plan's eval_every"
        if every is None and sites and volume is not None:
            every = eval_interval(sites, volume, model.roi_size, ev.sw_overlap, cfg.rounds)
            windows = sliding_windows(volume, model.roi_size, ev.sw_overlap)
            why = (
                f"validation at most {EVAL_SHARE:.0%} of the computation: {windows} sliding windows per volume, "
                f"{max(v for v, _ in sites.values())} validation volumes at most per site"
            )
        ev = dataclasses.replace(ev, every=every or 1)
        if ev.every != 1:
            log(f"plan: eval.every = {every} ({why})")
    return dataclasses.replace(cfg, model=model, eval=ev, train=train)
