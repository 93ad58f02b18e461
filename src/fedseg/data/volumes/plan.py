"""The federated plan of a volume federation: one grid, one patch, one network, one intensity scheme.

The server derives the plan from the sites' fingerprints (:mod:`fedseg.data.volumes.fingerprint`) as
nnU-Net derives its plan from a pooled dataset, without pooling a voxel:

* **target spacing** — the median spacing of every training case of every site, per RAS axis; when the
  coarsest axis is more than 3 × the finest and the median shape along it is less than a third of the
  others (nnU-Net's anisotropy rule), that axis takes the 10th percentile of its spacings instead;
* **intensity** — per image channel and per site (:func:`fedseg.data.volumes.intensity.plan_intensity`):
  ``"ct"`` where a site's channel looks like CT (values below −500) else ``"zscore"`` over the body, unless
  the spec names the scheme; for CT the foreground mean and sd pooled over the sites using it (exact:
  Chan et al.'s parallel combination of each site's count, mean and centred sum of squares, in float64)
  and the pooled 0.5 / 99.5 percentiles (exact order statistics for integer data, from counts only),
  case-weighted (nnU-Net) or voxel-weighted;
* **volume shape** — the median shape of the resampled cases; every case is padded (never stretched) to
  at least the patch;
* **patch, network and batch** — nnU-Net v2's 3D full-resolution planner for a memory budget
  (``gpu_memory``, 8 GiB as nnU-Net's reference; :func:`network_plan`): a patch of 256³ voxels shaped
  isotropic in mm and clipped to the median resampled shape, shrunk along the axis that is the largest
  share of the median shape until the network's feature maps fit the budget; levels pooling each axis
  while it keeps ≥ 4 voxels at the deepest level and its spacing is within 2 × the finest
  (:func:`topology`), 1 × 3 × 3 kernels on a thick-slice axis until its spacing catches up, features 32
  doubling to at most 320, a batch of at least 2; the network of a volume run is MONAI's DynUNet built
  from it, with deep supervision (:mod:`fedseg.models.networks`);
* **validation interval** — left to the run (``eval_every = None``): :func:`eval_interval` picks the
  fewest rounds between validations that keeps sliding-window validation at most
  :data:`EVAL_SHARE` (a fifth) of the computation of the rounds it follows, from each site's validation
  cases, the volume and patch sizes and the training patches of a round.
* **2D patch** (``mode = "patches2d"``, :func:`slice_patch`) — the median in-plane shape, at most
  ``SLICE_PATCH_SIDE`` per side, each side a multiple of the 2D network's down-sampling.

The plan is a small JSON file (:func:`save_plan`, beside the federation spec), printed, recorded with the
run, and any field may be edited by hand.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedseg.data.volumes.fingerprint import check_fingerprint
from fedseg.data.volumes.intensity import HISTOGRAM_BINS, PERCENTILES, Ask, check_intensity, plan_intensity
from fedseg.foundation.errors import ConfigError, DataError

__all__ = [
    "HISTOGRAM_BINS",
    "PERCENTILES",
    "Plan",
    "eval_interval",
    "feature_map_size",
    "load_plan",
    "make_plan",
    "network_plan",
    "save_plan",
    "slice_patch",
    "sliding_windows",
    "target_spacing",
    "topology",
]

ANISOTROPY = 3.0
MIN_FEATURE = 4
"""Fewest voxels an axis keeps at the deepest level (nnU-Net's ``featuremap_min_edge_length``)."""
BASE_FEATURES, MAX_FEATURES = 32, 320
"""nnU-Net's feature channels: 32 at the first level, doubling, at most 320."""
GPU_MEMORY_GIB = 8.0
"""Default memory budget of a plan (nnU-Net's reference GPU), GiB."""
REFERENCE_FEATURE_VOXELS, REFERENCE_GIB, REFERENCE_BATCH = 560_000_000, 8.0, 2
"""nnU-Net v2's calibration of :func:`feature_map_size`: 560 M feature-map voxels fit batch 2 in 8 GB."""
MIN_BATCH = 2
EVAL_SHARE = 0.2
"""Most share of a run's computation that validation may take (:func:`eval_interval`)."""
MIN_VALIDATIONS = 4
"""Fewest validations a run keeps (so its best round is chosen among several)."""
SLICE_PATCH_SIDE = 256


@dataclass
class Plan:
    """A federation's plan (every field may be edited in the JSON file; see the module docstring)."""

    target_spacing: list[float]
    """Voxel spacing (mm) of the RAS axes every volume is resampled to."""
    volume_shape: list[int]
    """Median shape of the resampled training cases (RAS axes)."""
    patch_size: list[int]
    """Training patch and sliding-window size (RAS axes)."""
    channels: list[int]
    """Network feature channels per level (32 doubling to at most 320, nnU-Net's)."""
    strides: list[list[int]]
    """Down-sampling stride per level below the first and per axis (1 where an axis is not pooled)."""
    intensity: dict[str, Any]
    """``{"channels": [scheme per image channel]}``: each ``{"name", "mode", ...}`` (``"ct"`` with ``lo``,
    ``hi``, ``mean``, ``sd``, ``weighting``, ``bound``; ``"zscore"`` with an optional ``body`` threshold;
    ``"window"`` with ``window``), and under ``"sites"`` the schemes of the sites that differ
    (:mod:`fedseg.data.volumes.intensity`).  One scheme ``{"mode": ...}`` applies to every channel."""
    kernels: list[list[int]] | None = None
    """Convolution kernel per level and axis (1 on a thick-slice axis until its spacing catches up); None:
    3 on every axis."""
    batch_size: int | None = None
    """Patches per training batch the memory budget allows (nnU-Net's rule, at least 2); reported beside
    ``train.batch_size``, which sets the batch a run uses."""
    gpu_memory: float | None = None
    """Memory budget (GiB) the plan was sized for (``fedseg plan --gpu-memory``)."""
    eval_every: int | None = None
    """Validate every this many rounds; None (default): derived per run by :func:`eval_interval` (sliding
    windows over every validation volume are costly)."""
    sites: list[str] = field(default_factory=list)
    """Sites whose fingerprints made the plan."""
    rejected: dict[str, str] = field(default_factory=dict)
    """Sites whose fingerprint was refused, with the reason."""
    cases: int = 0
    """Training cases the plan was made from."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any], where: str = "plan") -> Plan:
        names = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(names)}")
        try:
            plan = cls(**d)
        except TypeError as e:
            raise ConfigError(f"{where}: {e}; run `fedseg plan` to write a complete plan") from None
        plan.check(where)
        return plan

    def check(self, where: str = "plan") -> None:
        """Refuse an inconsistent plan (e.g. one edited by hand) with the field and the fix."""
        for name in ("target_spacing", "volume_shape", "patch_size"):
            v = getattr(self, name)
            if not (isinstance(v, list) and len(v) == 3 and all(isinstance(x, (int, float)) and x > 0 for x in v)):
                raise ConfigError(f"{where}: {name} = {v!r}; give three positive numbers (RAS axes)")
        if len(self.strides) != len(self.channels) - 1 or any(len(s) != 3 for s in self.strides):
            raise ConfigError(f"{where}: strides must have one [x, y, z] entry fewer than channels")
        if self.kernels is not None and (
            len(self.kernels) != len(self.channels) or any(len(k) != 3 for k in self.kernels)
        ):
            raise ConfigError(f"{where}: kernels must have one [x, y, z] entry per channels entry")
        factor = [math.prod(s[a] for s in self.strides) for a in range(3)]
        bad = [a for a in range(3) if self.patch_size[a] % factor[a]]
        if bad:
            raise ConfigError(
                f"{where}: patch_size {self.patch_size} is not divisible by the strides' down-sampling {factor} -> "
                "make each side a multiple of its factor"
            )
        check_intensity(self.intensity, where)


def sliding_windows(volume: Sequence[int], patch: Sequence[int], overlap: float) -> int:
    """Windows MONAI's ``sliding_window_inference`` runs over one volume: per axis
    ``ceil((V − P) / step) + 1`` with ``step = int(P · (1 − overlap))`` (at least 1), multiplied."""
    n = 1
    for v, p in zip(volume, patch):
        step = max(1, int(p * (1 - overlap)))
        n *= math.ceil(max(0, v - p) / step) + 1
    return n


def eval_interval(
    sites: Mapping[str, tuple[int, int]],
    volume: Sequence[int],
    patch: Sequence[int],
    overlap: float,
    rounds: int,
    share: float = EVAL_SHARE,
) -> int:
    """Rounds between validations so that validation costs at most ``share`` of the training it follows.

    Costs are counted in forward passes of one patch: a validation of a site is its validation cases ×
    :func:`sliding_windows` windows; a round of training is its patches × 3 (forward and backward, the
    backward pass about twice the forward).  A site validating ``V`` windows after ``k`` rounds of ``T``
    patches spends ``V / (V + 3kT)`` on validation; that is at most ``share`` from
    ``k = ⌈V (1 − share) / (3 T share)⌉``.  The interval is the largest over the sites (sites work in
    parallel, the slowest sets the pace), at least 1, and at most ``rounds / MIN_VALIDATIONS`` so that a
    run validates at least :data:`MIN_VALIDATIONS` times.

    Parameters
    ----------
    sites
        ``{site: (validation cases, training patches per round)}``.
    volume, patch
        The padded volume and the sliding window (voxels per axis).
    overlap
        ``eval.sw_overlap``.
    rounds
        The run's rounds.
    """
    windows = sliding_windows(volume, patch, overlap)
    k = 1
    for n_val, patches in sites.values():
        if n_val and patches:
            k = max(k, math.ceil(n_val * windows * (1 - share) / (3 * patches * share) - 1e-9))  # float slack
    return max(1, min(k, rounds // MIN_VALIDATIONS))


def target_spacing(spacings: np.ndarray, shapes: np.ndarray) -> list[float]:
    """Median spacing per axis, with nnU-Net's anisotropy rule (module docstring)."""
    target = np.median(spacings, axis=0)
    sizes = np.median(shapes * spacings / target, axis=0)
    worst = int(np.argmax(target))
    others = [a for a in range(3) if a != worst]
    if target[worst] > ANISOTROPY * max(target[others]) and sizes[worst] * ANISOTROPY < min(sizes[others]):
        t = float(np.percentile(spacings[:, worst], 10))
        target[worst] = max(t, max(target[others]) + 1e-5)
    return [float(v) for v in target]


def topology(
    patch: Sequence[int], spacing: Sequence[float], min_edge: int = MIN_FEATURE
) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """nnU-Net v2's ``get_pool_and_conv_props``: the strides and kernels of every level and the patch
    rounded to a multiple of each axis' down-sampling.

    At each level an axis is pooled while it keeps at least ``2 · min_edge`` voxels and its current
    spacing is within 2 × the finest of the poolable axes; a lone poolable axis needs ``3 · min_edge``.
    An axis' kernel is 3 from the first level its spacing is within 2 × the finest, 1 before (a 1×3×3
    kernel on a thick-slice axis), and the bottleneck's is 3 on every axis.

    Returns
    -------
    strides
        One ``[x, y, z]`` per level below the first (2 where the axis is pooled).
    kernels
        One ``[x, y, z]`` per level, the first included.
    patch
        The patch, each side rounded down to a multiple of its axis' down-sampling (nnU-Net rounds up and
        pads the cases; rounding down keeps the patch within the median case), with the topology of the
        rounded patch.
    """
    dims = len(spacing)
    sp, size = [float(v) for v in spacing], [float(v) for v in patch]
    kernel = [1] * dims
    strides: list[list[int]] = []
    kernels: list[list[int]] = []
    pools = [0] * dims
    while True:
        valid = [a for a in range(dims) if size[a] >= 2 * min_edge]
        if not valid:
            break
        finest = min(sp[a] for a in valid)
        valid = [a for a in valid if sp[a] / finest < 2]
        if len(valid) == 1 and size[valid[0]] < 3 * min_edge:
            break
        for a in range(dims):
            if kernel[a] != 3 and sp[a] / min(sp) < 2:
                kernel[a] = 3
        strides.append([2 if a in valid else 1 for a in range(dims)])
        kernels.append(list(kernel))
        for a in valid:
            pools[a] += 1
            sp[a] *= 2
            size[a] = math.ceil(size[a] / 2)
    kernels.append([3] * dims)
    factor = [2**p for p in pools]
    rounded = [max(factor[a], int(patch[a]) // factor[a] * factor[a]) for a in range(dims)]
    if rounded != [int(v) for v in patch]:  # a smaller patch may pool less: derive its own topology
        return topology(rounded, spacing, min_edge)
    return strides, kernels, rounded


def features(levels: int, base: int = BASE_FEATURES, cap: int = MAX_FEATURES) -> list[int]:
    """nnU-Net's feature channels: ``base`` at the first level, doubling per level, at most ``cap``."""
    return [min(base * 2**i, cap) for i in range(levels)]


def feature_map_size(
    patch: Sequence[int], strides: Sequence[Sequence[int]], channels: Sequence[int], labels: int
) -> int:
    """nnU-Net v2's VRAM proxy (``PlainConvUNet.compute_conv_feature_map_size``), in feature-map voxels.

    With ``V_s`` the voxels of level ``s`` and ``F_s`` its channels: the encoder's two convolutions per
    level give ``Σ_s 2 F_s V_s``; each decoder level ``t`` below the deepest gives its two convolutions,
    the transposed convolution into it (``3 F_t V_t``) and a segmentation output ``C V_t`` (deep
    supervision)."""
    size = [int(v) for v in patch]
    voxels = [math.prod(size)]
    for s in strides:
        size = [size[a] // s[a] for a in range(len(size))]
        voxels.append(math.prod(size))
    encoder = sum(2 * f * v for f, v in zip(channels, voxels))
    decoder = sum(3 * channels[t] * voxels[t] + labels * voxels[t] for t in range(len(channels) - 1))
    return int(encoder + decoder)


def network_plan(
    median_shape: Sequence[float],
    spacing: Sequence[float],
    *,
    gpu_memory: float = GPU_MEMORY_GIB,
    labels: int = 1,
    dataset_voxels: float | None = None,
    base: int = BASE_FEATURES,
    patch_voxels: int | None = None,
) -> dict[str, Any]:
    """nnU-Net v2's 3D full-resolution network plan for a memory budget.

    1. The starting patch holds 256³ voxels shaped isotropic in mm (``1/spacing`` scaled), clipped to
       the median resampled shape; its topology from :func:`topology`.
    2. While :func:`feature_map_size` exceeds :data:`REFERENCE_FEATURE_VOXELS` × ``gpu_memory / 8``
       (nnU-Net's calibration: 560 M at batch 2 on 8 GB), the axis whose patch is the largest share of the
       median shape loses one multiple of its down-sampling, and the topology is derived again.
       With ``patch_voxels`` the patch is shrunk the same way until it also holds at most that many voxels
       (a budget for small machines and tests).
    3. The batch is ``round(2 · reference / estimate)``, at most the patches that cover 5 % of the
       dataset's voxels, at least 2.

    Returns ``{"patch", "strides", "kernels", "channels", "batch_size", "estimate"}``.
    """
    dims = len(spacing)
    median = [float(v) for v in median_shape]
    inv = [1.0 / float(v) for v in spacing]
    scale = (256.0**dims / math.prod(inv)) ** (1.0 / dims)
    patch = [max(1, min(round(inv[a] * scale), round(median[a]))) for a in range(dims)]
    strides, kernels, patch = topology(patch, spacing)
    reference = REFERENCE_FEATURE_VOXELS * gpu_memory / REFERENCE_GIB
    estimate = feature_map_size(patch, strides, features(len(kernels), base), labels)
    while estimate > reference or (patch_voxels is not None and math.prod(patch) > patch_voxels):
        factor = [math.prod(s[a] for s in strides) for a in range(dims)]
        shrinkable = [a for a in range(dims) if patch[a] > factor[a]]
        if not shrinkable:
            break
        a = max(shrinkable, key=lambda i: patch[i] / median[i])
        trial = list(patch)
        trial[a] -= factor[a]
        trial_strides = topology(trial, spacing)[0]
        patch[a] = max(1, patch[a] - math.prod(s[a] for s in trial_strides))
        strides, kernels, patch = topology(patch, spacing)
        estimate = feature_map_size(patch, strides, features(len(kernels), base), labels)
    batch = round(REFERENCE_BATCH * reference / max(estimate, 1))
    if dataset_voxels is not None:
        batch = min(batch, round(dataset_voxels * 0.05 / math.prod(patch)))
    return {
        "patch": patch,
        "strides": strides,
        "kernels": kernels,
        "channels": features(len(kernels), base),
        "batch_size": max(MIN_BATCH, batch),
        "estimate": estimate,
    }


def make_plan(
    fingerprints: Mapping[str, Any],
    histogram: Ask,
    *,
    gpu_memory: float = GPU_MEMORY_GIB,
    patch_voxels: int | None = None,
    labels: int = 1,
    intensity: str | Mapping[str, Sequence[str]] = "auto",
    window: Sequence[float] | None = None,
    weighting: str = "case",
    channel_names: Sequence[str] | None = None,
    log: Callable[[str], None] = print,
) -> Plan:
    """The plan from every site's fingerprint and their answers to the histogram requests.

    Parameters
    ----------
    fingerprints
        ``{site: first reply}`` (:func:`fedseg.data.volumes.fingerprint.site_fingerprint`).
    histogram
        ``histogram(requests, weighting, sites) -> {site: [counts per request]}``: asks ``sites`` for
        :func:`fedseg.data.volumes.fingerprint.site_histogram` (:data:`fedseg.data.volumes.intensity.Ask`).
    gpu_memory
        Memory budget (GiB) the network, patch and batch are sized for (:func:`network_plan`).
    patch_voxels
        Most voxels of one patch beside the memory budget (None: the budget alone).
    labels
        Label channels (the network's outputs).
    intensity
        ``"auto"`` (per site and channel: CT-like values → ``"ct"``, else ``"zscore"``), one scheme for
        every channel and site, or ``{site: [scheme per channel]}`` with "auto" where the plan decides (the
        spec's ``data.intensity`` and the sites' own, :meth:`fedseg.data.spec.FederationSpec.intensity_table`).
    window
        ``[low, high]`` for the channels whose scheme is ``"window"``.
    weighting
        How the CT percentiles, mean and sd weigh the voxels: ``"case"`` (nnU-Net) or ``"voxel"``.
    channel_names
        The image channel names (default "0", "1", ...).
    log
        Where rejections are reported.

    Raises
    ------
    DataError
        No site's fingerprint can be used.
    """
    ok, rejected = {}, {}
    for site, fp in fingerprints.items():
        why = check_fingerprint(fp)
        if why is None:
            ok[site] = fp
        else:
            rejected[site] = why
            log(f"plan: fingerprint of site {site} rejected ({why}); planning from the other sites")
    if not ok:
        raise DataError(
            "no site sent a usable fingerprint: "
            + "; ".join(f"{s}: {w}" for s, w in rejected.items())
            + " -> check each site's training volumes and labels (`fedseg validate`)"
        )
    cases = [c for fp in ok.values() for c in fp["cases"]]
    spacings = np.array([c["spacing"] for c in cases], dtype=np.float64)
    shapes = np.array([c["shape"] for c in cases], dtype=np.float64)
    spacing = target_spacing(spacings, shapes)
    resampled = np.median(shapes * spacings / np.asarray(spacing), axis=0)
    net = network_plan(
        resampled.tolist(),
        spacing,
        gpu_memory=gpu_memory,
        labels=labels,
        patch_voxels=patch_voxels,
        dataset_voxels=float(np.sum(np.prod(shapes * spacings / np.asarray(spacing), axis=1))),
    )
    patch, channels, strides = net["patch"], net["channels"], net["strides"]

    scheme, bad = plan_intensity(
        ok, histogram, requested=intensity, window=window, weighting=weighting, names=channel_names, log=log
    )
    for site, why in bad.items():
        rejected[site] = why
        del ok[site]
    return Plan(
        target_spacing=spacing,
        volume_shape=[round(float(v)) for v in resampled],
        patch_size=patch,
        channels=channels,
        strides=strides,
        kernels=net["kernels"],
        batch_size=net["batch_size"],
        gpu_memory=gpu_memory,
        intensity=scheme,
        sites=sorted(ok),
        rejected=rejected,
        cases=sum(len(ok[s]["cases"]) for s in ok),
    )


def slice_patch(plan: Plan, factor: int, max_side: int = SLICE_PATCH_SIDE) -> list[int]:
    """The 2D training patch of ``mode = "patches2d"``: the plan's median in-plane shape (first two RAS
    axes), at most ``max_side`` per side, rounded down to a multiple of the 2D network's total
    down-sampling ``factor``, and at least twice ``factor`` (so the deepest level keeps more than one
    voxel, as instance normalization needs)."""
    return [max(2 * factor, min(int(v), max_side) // factor * factor) for v in plan.volume_shape[:2]]


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write the plan as indented JSON (atomically: a reader never sees half a plan)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(plan.to_json(), indent=2) + "\n")
    os.replace(tmp, path)


def load_plan(path: str | Path) -> Plan:
    """Read and check a plan file."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no plan file -> run `fedseg plan` on the federation spec") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e}) -> fix it or delete it and run `fedseg plan`") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a plan is a JSON object -> run `fedseg plan` again")
    return Plan.from_json(raw, where=str(path))
