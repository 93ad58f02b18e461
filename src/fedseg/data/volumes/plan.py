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
  doubling to at most 320, a batch of at least 2 (:mod:`fedseg.data.volumes.sizing`); on a GPU plan the
  network of a volume run is MONAI's DynUNet built from it, with deep supervision
  (:mod:`fedseg.models.networks`);
* **the device** (:mod:`fedseg.data.volumes.budget`) — a GPU's memory sizes the plan as above
  (``fedseg plan --gpu-memory GIB``, or the CUDA device's memory); on a CPU the plan is the largest rung of
  :data:`fedseg.data.volumes.budget.CPU_LADDER` (a smaller patch and fewer features) whose training step is
  estimated within :data:`fedseg.data.volumes.budget.CPU_STEP_SECONDS` from a short probe of this CPU
  (:func:`device_network_plan`); the budget, the rung and the estimate are recorded in ``budget``, and
  ``network`` names what ``model.name = "auto"`` builds from the plan (DynUNet on a GPU, the network the
  equal-time measurement chose on a CPU);
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

from fedseg.data.volumes.budget import AUTO_NETWORK, DeviceBudget, network_step_flops
from fedseg.data.volumes.fingerprint import check_fingerprint
from fedseg.data.volumes.intensity import HISTOGRAM_BINS, PERCENTILES, Ask, check_intensity, plan_intensity
from fedseg.data.volumes.sizing import (
    GPU_MEMORY_GIB,
    device_network_plan,
    feature_map_size,
    features,
    network_plan,
    topology,
)
from fedseg.foundation.config import ModelConfig
from fedseg.foundation.errors import ConfigError, DataError

__all__ = [
    "GPU_MEMORY_GIB",
    "HISTOGRAM_BINS",
    "PERCENTILES",
    "Plan",
    "describe_budget",
    "device_network_plan",
    "eval_interval",
    "feature_map_size",
    "features",
    "load_plan",
    "make_plan",
    "network_plan",
    "round_cost",
    "save_plan",
    "slice_patch",
    "sliding_windows",
    "target_spacing",
    "topology",
]

ANISOTROPY = 3.0
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
    """Memory budget (GiB) the plan was sized for (``fedseg plan --gpu-memory``, or the CUDA device's); None
    for a CPU plan."""
    budget: dict[str, Any] | None = None
    """The device budget the plan was made for (:mod:`fedseg.data.volumes.budget`): ``{"device": "cuda",
    "gpu_memory"}`` or ``{"device": "cpu", "step_seconds", "gflops", "batch", "rung", "estimate_s"}`` (the
    CPU's measured throughput, the ladder rung chosen and its estimated seconds a step).  None: a plan made
    before plans recorded their device (an 8 GiB GPU's)."""
    network: str | None = None
    """What ``model.name = "auto"`` builds from the plan: ``"dynunet"`` or ``"unet"`` (with the plan's channels
    and strides); None: ``"dynunet"``."""
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
        if self.network not in (None, "dynunet", "unet"):
            raise ConfigError(f"{where}: network = {self.network!r}; give 'dynunet' or 'unet' (or null)")
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


def make_plan(
    fingerprints: Mapping[str, Any],
    histogram: Ask,
    *,
    gpu_memory: float = GPU_MEMORY_GIB,
    patch_voxels: int | None = None,
    labels: int = 1,
    in_channels: int = 1,
    budget: DeviceBudget | None = None,
    network: str | None = None,
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
        Memory budget (GiB) the network, patch and batch are sized for (:func:`network_plan`) when no
        ``budget`` is given.
    budget
        The device the plan is made for (:func:`device_network_plan`; :func:`fedseg.data.volumes.budget.device_budget`);
        None: a GPU of ``gpu_memory``.
    network
        What ``model.name = "auto"`` builds from the plan (``"dynunet"`` or ``"unet"``), and on a CPU the network
        whose step the plan is sized for; None: :data:`fedseg.data.volumes.budget.AUTO_NETWORK` of the device.
    patch_voxels
        Most voxels of one patch beside the memory budget (None: the budget alone).
    labels
        Label channels (the network's outputs).
    in_channels
        Image channels (the network's inputs; a CPU plan's cost estimate).
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
    budget = budget or DeviceBudget("cuda", gpu_memory=gpu_memory)
    network = network or AUTO_NETWORK[budget.kind]
    net, record = device_network_plan(
        resampled.tolist(),
        spacing,
        budget,
        network=network,
        labels=labels,
        in_channels=in_channels,
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
        gpu_memory=budget.gpu_memory,
        budget=record,
        network=network,
        intensity=scheme,
        sites=sorted(ok),
        rejected=rejected,
        cases=sum(len(ok[s]["cases"]) for s in ok),
    )


def describe_budget(plan: Plan) -> str:
    """One line saying which device budget the plan was made for, and how to get the GPU plan."""
    b = plan.budget or {"device": "cuda", "gpu_memory": plan.gpu_memory or GPU_MEMORY_GIB}
    net = plan.network or "dynunet"
    shape = f"patch {plan.patch_size}, {net} {plan.channels[0]} → {plan.channels[-1]} in {len(plan.channels)} levels"
    if b.get("device") == "cpu":
        return (
            f"plan: made for this CPU ({b.get('gflops')} GFLOP/s measured): a training step of {b.get('batch')} "
            f"patches estimated {b.get('estimate_s')} s (target {b.get('step_seconds')} s), {shape}; "
            "`fedseg plan SPEC --gpu-memory 8` writes nnU-Net's plan for an 8 GiB GPU instead"
        )
    return f"plan: made for a GPU of {b.get('gpu_memory')} GiB (nnU-Net's rule): {shape}"


def round_cost(plan: Plan, model: ModelConfig, batch: int, steps: int, in_channels: int = 1) -> str | None:
    """The line a run logs at its start on what a round will cost, from a CPU plan's measured throughput
    (``plan.budget["gflops"]``): the seconds of a training step of the run's patch and network (the plan's
    channels and strides; :func:`fedseg.data.volumes.budget.network_step_flops`) at ``batch``, and of a round of
    ``steps`` steps at one site.  None where the plan was made for a GPU or the network is not the plan's
    (each site then says what its first steps took)."""
    b = plan.budget or {}
    gflops = b.get("gflops")
    if b.get("device") != "cpu" or not isinstance(gflops, (int, float)) or gflops <= 0 or model.roi_size is None:
        return None
    if model.module is not None or model.name not in ("dynunet", "unet") or model.channels != tuple(plan.channels):
        return None
    flops = network_step_flops(
        model.name, model.roi_size, plan.strides, plan.channels, plan.kernels, in_channels, 1, batch
    )
    per = flops / (gflops * 1e9)
    return (
        f"plan: a training step of {batch} patches of {list(model.roi_size)} estimated {per:.2f} s on this CPU "
        f"({gflops} GFLOP/s measured when planning); a round of {steps} local steps about {per * steps:.0f} s a site"
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
