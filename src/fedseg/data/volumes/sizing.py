"""The patch, network and batch of a volume plan for a device: nnU-Net v2's 3D full-resolution planner for
a GPU's memory (:func:`network_plan`, :func:`topology`, :func:`feature_map_size`), and for a CPU the largest
rung of :data:`fedseg.data.volumes.budget.CPU_LADDER` whose training step fits the time budget
(:func:`device_network_plan`).  :mod:`fedseg.data.volumes.plan` makes the plan from them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from fedseg.data.volumes.budget import AUTO_NETWORK, CPU_LADDER, DeviceBudget, network_step_flops

__all__ = [
    "BASE_FEATURES",
    "GPU_MEMORY_GIB",
    "MAX_FEATURES",
    "MIN_BATCH",
    "MIN_FEATURE",
    "device_network_plan",
    "feature_map_size",
    "features",
    "network_plan",
    "topology",
]

MIN_FEATURE = 4
"""Fewest voxels an axis keeps at the deepest level (nnU-Net's ``featuremap_min_edge_length``)."""
BASE_FEATURES, MAX_FEATURES = 32, 320
"""nnU-Net's feature channels: 32 at the first level, doubling, at most 320."""
GPU_MEMORY_GIB = 8.0
"""Default memory budget of a plan (nnU-Net's reference GPU), GiB."""
REFERENCE_FEATURE_VOXELS, REFERENCE_GIB, REFERENCE_BATCH = 560_000_000, 8.0, 2
"""nnU-Net v2's calibration of :func:`feature_map_size`: 560 M feature-map voxels fit batch 2 in 8 GB."""
MIN_BATCH = 2


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


def device_network_plan(
    median_shape: Sequence[float],
    spacing: Sequence[float],
    budget: DeviceBudget,
    *,
    labels: int = 1,
    in_channels: int = 1,
    dataset_voxels: float | None = None,
    patch_voxels: int | None = None,
    network: str | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`network_plan` for a device budget, and the budget's record for ``Plan.budget``.

    A GPU budget is nnU-Net's plan for its memory.  A CPU budget walks :data:`CPU_LADDER` from the
    cheapest rung: each rung's plan is :func:`network_plan` with the rung's base features and its patch
    voxels (also at most ``patch_voxels`` when given), its step estimated as
    :func:`fedseg.data.volumes.budget.network_step_flops` at the budget's batch over the measured throughput,
    for ``network`` (default: what ``model.name = "auto"`` builds on the budget's device,
    :data:`fedseg.data.volumes.budget.AUTO_NETWORK`); the plan is the last rung whose estimate is within
    ``step_seconds`` (the first rung when none is), with the budget's batch."""
    if budget.kind == "cuda":
        net = network_plan(
            median_shape,
            spacing,
            gpu_memory=float(budget.gpu_memory or GPU_MEMORY_GIB),
            labels=labels,
            dataset_voxels=dataset_voxels,
            patch_voxels=patch_voxels,
        )
        return net, budget.to_json()
    assert budget.gflops is not None and budget.step_seconds is not None
    network = network or AUTO_NETWORK[budget.kind]
    chosen: tuple[int, dict[str, Any], float] | None = None
    for rung, (voxels, base) in enumerate(CPU_LADDER):
        cap = voxels if patch_voxels is None else min(voxels, patch_voxels)
        net = network_plan(
            median_shape, spacing, labels=labels, dataset_voxels=dataset_voxels, base=base, patch_voxels=cap
        )
        flops = network_step_flops(
            network, net["patch"], net["strides"], net["channels"], net["kernels"], in_channels, labels, budget.batch
        )
        seconds = flops / (budget.gflops * 1e9)
        if chosen is None or seconds <= budget.step_seconds:
            chosen = (rung, net, seconds)
        if seconds > budget.step_seconds:
            break
    assert chosen is not None
    rung, net, seconds = chosen
    net["batch_size"] = budget.batch
    return net, {**budget.to_json(), "rung": rung, "estimate_s": round(seconds, 3), "network": network}
