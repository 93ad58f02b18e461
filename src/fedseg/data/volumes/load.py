"""A volume federation's plan and its sites' splits in the plan's grid.

:func:`plan_federation` runs the two fingerprint passes at every site of a spec (in one process, as the
simulation does; each site reads only its own files) and makes the plan.  :func:`load_volume_split`
brings one split of one site into the plan's grid: read with the affine, normalized by the plan's
intensity scheme, reoriented to RAS and resampled to the target spacing, padded at the far end of each
axis to a common shape (padding at the end leaves the affine unchanged).  Validation and test cases keep
their original geometry and label, and :class:`VolumeDataset.original_grid` resamples a prediction back
into the scan's own voxels, where Dice is scored.

``mode = "patches2d"`` (federated gradient averaging's protocol) goes through the same plan with the
in-plane spacing only (each scan keeps its slice spacing), and its training split is the stack of every
training volume's axial slices (:class:`SliceDataset`), from which the 2D model's patches are cut;
validation and test splits stay volumes, predicted slice by slice and scored in each scan's own grid.
The spec's ``data.intensity`` (and ``data.window``) override the plan's intensity scheme
(:func:`with_spec_intensity`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from fedseg.data.datalist import load_datalist
from fedseg.data.loading import SegmentationDataset, label_channels
from fedseg.data.spec import FederationSpec, SiteSpec
from fedseg.data.volumes.fingerprint import site_fingerprint, site_histogram
from fedseg.data.volumes.geometry import Geometry, read_case, to_original_grid, to_plan_grid
from fedseg.data.volumes.intensity import normalize_volume
from fedseg.data.volumes.plan import Plan, load_plan, make_plan, save_plan, slice_patch
from fedseg.foundation.config import EvalConfig, ModelConfig, RunConfig
from fedseg.foundation.errors import ConfigError, DataError

__all__ = [
    "SliceDataset",
    "VolumeDataset",
    "ensure_plan",
    "load_volume_split",
    "pad_to_common_shape",
    "plan_federation",
    "plan_for_run",
    "plan_path",
    "plan_spacing",
    "with_spec_intensity",
]


def plan_path(fed: FederationSpec) -> Path:
    """Where a federation's plan lives: ``<spec>.plan.json`` beside the spec."""
    return fed.path.with_name(fed.path.stem + ".plan.json")


def _cases(fed: FederationSpec, site: SiteSpec, split: str = "training") -> Iterator[tuple]:
    root = site.datalist.parent
    for entry in load_datalist(site.datalist, site=site.name)[split]:
        image, label, affine = read_case(entry["image"], entry["label"], fed.in_channels, fed.label_values)
        try:
            cid = Path(entry["image"]).relative_to(root).as_posix()
        except ValueError:
            cid = str(entry["image"])
        yield cid, image, label, affine


def _triples(fed: FederationSpec, site: SiteSpec) -> Iterator[tuple]:
    for _cid, image, label, affine in _cases(fed, site):
        yield image, label, affine


def plan_federation(
    fed: FederationSpec, *, patch_voxels: int = 64 * 64 * 32, log: Callable[[str], None] = print
) -> Plan:
    """Fingerprint every site's training cases (two passes) and make the plan; no voxel leaves a site."""
    fingerprints = {s.name: site_fingerprint(_triples(fed, s)) for s in fed.sites}

    def histograms(edges: list[float]) -> dict[str, list[int]]:
        return {s.name: site_histogram(_triples(fed, s), edges) for s in fed.sites if s.name in fingerprints}

    return make_plan(
        fingerprints, histograms, patch_voxels=patch_voxels, intensity=fed.intensity, window=fed.window, log=log
    )


def with_spec_intensity(
    plan: Plan, fed: FederationSpec, where: str = "plan", log: Callable[[str], None] = print
) -> Plan:
    """The plan with the spec's ``data.intensity`` in place of its own scheme ("auto": the plan's).

    ``"ct"`` needs the pooled statistics that only a plan made with the histograms has: a plan file
    made with another scheme is refused, naming the file and the fix."""
    want, have = fed.intensity, plan.intensity
    if want == "auto" or (want == have.get("mode") and (want != "window" or have.get("window") == list(fed.window))):
        return plan
    if want == "ct":
        raise ConfigError(
            f"{where}: data.intensity = 'ct' but the plan's intensity is {have.get('mode')!r} (no pooled CT "
            "statistics) -> delete the plan file and run `fedseg plan` on the spec to fingerprint the sites again"
        )
    scheme = {"mode": want, **({"window": list(fed.window)} if want == "window" else {})}
    log(f"plan: intensity {scheme} (data.intensity in the spec; the plan's was {have.get('mode')!r})")
    return dataclasses.replace(plan, intensity=scheme)


def ensure_plan(fed: FederationSpec, log: Callable[[str], None] = print) -> Plan:
    """The federation's plan file, or a new plan written beside the spec (and logged) when there is none;
    the spec's ``data.intensity`` overrides its intensity scheme."""
    path = plan_path(fed)
    if path.is_file():
        return with_spec_intensity(load_plan(path), fed, str(path), log)
    plan = plan_federation(fed, log=log)
    save_plan(plan, path)
    log(f"plan: {path} (made from {plan.cases} training cases of {len(plan.sites)} sites; edit it to override)")
    return plan


def plan_spacing(fed: FederationSpec, plan: Plan) -> tuple[float, float, float]:
    """The spacing volumes are resampled to: the plan's target spacing, or for ``patches2d`` its in-plane
    spacing with each scan's own slice spacing (0 keeps an axis' spacing in MONAI's ``Spacing``)."""
    x, y, z = (float(v) for v in plan.target_spacing)
    return (x, y, 0.0) if fed.mode == "patches2d" else (x, y, z)


class VolumeDataset(SegmentationDataset):
    """Cases in the plan's grid, padded to one shape, with what is needed to score in each scan's own grid.

    Attributes (beside :class:`SegmentationDataset`'s)
    -----------
    affines : list of np.ndarray
        The plan-grid affine of every case.
    originals : list of Geometry or None
        The scan's own grid (validation and test splits).
    original_labels : list of torch.Tensor or None
        The label channels (L, X, Y, Z) in the scan's own grid (validation and test splits).
    """

    def __init__(self, images, labels, case_ids, affines, originals=None, original_labels=None):
        super().__init__(images, labels, case_ids)
        self.affines = affines
        self.originals = originals
        self.original_labels = original_labels

    def original_grid(self, i: int, prediction: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(prediction, label)`` of case ``i`` in its scan's own grid: the prediction (logits, C × plan
        grid) resampled linearly back through the inverse of the plan's resampling and reorientation."""
        if self.originals is None:
            raise ValueError("this split keeps no original geometry (training split)")
        pred = to_original_grid(prediction, self.affines[i], self.originals[i], mode="bilinear")
        return pred.to(prediction.device), self.original_labels[i].to(prediction.device)


class SliceDataset(SegmentationDataset):
    """The axial slices of volumes in the plan's in-plane grid: images ``(S, C, X, Y)``, labels
    ``(S, L, X, Y)``, case ids ``<volume id>#<z>``; every slice of every volume, none of the padding."""


def _slices(images: list[np.ndarray], labels: list[np.ndarray], ids: list[str], patch: list[int]) -> SliceDataset:
    xs, ys, sids = [], [], []
    for x, lab, cid in zip(images, labels, ids):
        for z in range(x.shape[-1]):
            xs.append(x[..., z])
            ys.append(lab[..., z])
            sids.append(f"{cid}#{z}")
    shape = [max([im.shape[1 + a] for im in xs] + [patch[a]]) for a in range(2)]
    x, y = _pad_far_end(xs, ys, shape)
    return SliceDataset(x, y, sids)


def load_volume_split(fed: FederationSpec, site: SiteSpec, split: str, plan: Plan) -> VolumeDataset | SliceDataset:
    """One split of one site in the plan's grid (module docstring): volumes, or for the training split of
    ``mode = "patches2d"`` their axial slices."""
    keep = split != "training"
    images, labels, ids, affines, originals, orig_labels = [], [], [], [], [], []
    spacing = plan_spacing(fed, plan)
    for cid, image, label, affine in _cases(fed, site, split):
        x = normalize_volume(image, plan.intensity["mode"], plan.intensity)
        x, lab, new_affine = to_plan_grid(x, label, affine, spacing)
        images.append(x)
        labels.append(lab)
        ids.append(cid)
        affines.append(new_affine)
        if keep:
            originals.append(Geometry(affine, tuple(label.shape)))
            orig_labels.append(torch.from_numpy(label_channels(label, fed.labels)))
    if not images:
        raise DataError(f"{site.name}: {site.datalist}: split {split!r} has no cases -> add cases to the datalist")
    if fed.mode == "patches2d":
        if not keep:
            return _slices(images, [label_channels(lab, fed.labels) for lab in labels], ids, slice_patch(plan, 1))
        shape = [max(im.shape[1 + a] for im in images) for a in range(3)]
    else:
        shape = [max([im.shape[1 + a] for im in images] + [plan.patch_size[a]]) for a in range(3)]
    x, y = _pad_far_end(images, [label_channels(lab, fed.labels) for lab in labels], shape)
    return VolumeDataset(
        x,
        y,
        ids,
        affines,
        originals if keep else None,
        orig_labels if keep else None,
    )


def _pad_far_end(images: list[np.ndarray], labels: list[np.ndarray], shape: list[int]):
    """Stack ``(C, *spatial)`` images and ``(L, *spatial)`` label channels padded at the far end of each axis
    to ``shape`` (the origin, and so the affine, stays): images with each volume's lowest value (air), labels
    with 0.  Returns float32 tensors ``(N, C, *shape)`` and ``(N, L, *shape)``."""
    x = np.zeros((len(images), images[0].shape[0], *shape), dtype=np.float32)
    y = np.zeros((len(labels), labels[0].shape[0], *shape), dtype=np.float32)
    for i, (im, lab) in enumerate(zip(images, labels)):
        region = (i, slice(None), *(slice(0, s) for s in im.shape[1:]))
        x[i] = im.min()
        x[region] = im
        y[region] = lab
    return torch.from_numpy(x), torch.from_numpy(y)


def pad_to_common_shape(data: dict) -> dict:
    """Pad every volume split of every site at the far end of each axis to one shape (so that pooled
    training, e.g. centralized, can stack them); the affines stay valid because the origin does not move.
    Slice splits (``patches2d``) share the volumes' in-plane shape."""
    sets = [
        ds for d in data.values() for ds in (d.train, d.val, d.test) if isinstance(ds, (VolumeDataset, SliceDataset))
    ]
    dims = [ds.images.dim() - 2 for ds in sets]
    shape = [max(ds.images.shape[2 + a] for ds, n in zip(sets, dims) if n > a) for a in range(max(dims))]
    for ds, n in zip(sets, dims):
        if list(ds.images.shape[2:]) != shape[:n]:
            ds.images, ds.labels = _pad_far_end(list(ds.images.numpy()), list(ds.labels.numpy()), shape[:n])
    return data


def _downsampling(model: ModelConfig) -> int:
    """The 2D network's total down-sampling along the first axis (product of its strides)."""
    factor = 1
    for s in model.strides:
        factor *= int(s) if isinstance(s, int) else int(s[0])
    return factor


def plan_for_run(cfg: RunConfig, plan: Plan, log: Callable[[str], None] = print, mode: str = "3d") -> RunConfig:
    """The run config with the plan's network and patch where the run leaves them at their defaults
    (``model.roi_size`` unset, ``model.channels``/``strides`` as shipped, ``eval.every = 1``), each logged.

    ``mode = "patches2d"``: the 2D network stays as configured and the patch is the plan's in-plane
    patch (:func:`fedseg.data.volumes.plan.slice_patch`)."""
    model, ev = cfg.model, cfg.eval
    if mode == "patches2d":
        if model.roi_size is None:
            patch = slice_patch(plan, _downsampling(model))
            model = dataclasses.replace(model, roi_size=tuple(patch))
            log(f"plan: model.roi_size = {patch} (2D patches of axial slices and in-plane sliding windows)")
    elif model.roi_size is None:
        model = dataclasses.replace(model, roi_size=tuple(plan.patch_size))
        log(f"plan: model.roi_size = {list(plan.patch_size)} (patches and sliding windows)")
    default = ModelConfig()
    if mode != "patches2d" and model.channels == default.channels and model.strides == default.strides:
        model = dataclasses.replace(model, channels=tuple(plan.channels), strides=tuple(tuple(s) for s in plan.strides))
        log(f"plan: U-Net channels {plan.channels}, strides {plan.strides}")
    if ev.every == EvalConfig().every and plan.eval_every != ev.every:
        ev = dataclasses.replace(ev, every=plan.eval_every)
        log(f"plan: eval.every = {plan.eval_every} (sliding windows over every validation volume are costly)")
    return dataclasses.replace(cfg, model=model, eval=ev)
