"""The device a volume plan is made for: a CUDA GPU's memory, or a CPU's time per training step.

nnU-Net sizes its patch and network for a GPU's memory (8 GiB its reference).  On a CPU memory is not what
binds — time is: the 8 GiB plan of a brain MRI (DynUNet 32 → 320, 5 levels, a patch of 128 × 96 × 20) takes
tens of seconds a step on two cores.  A plan is therefore made for a **device budget**
(:class:`DeviceBudget`):

* ``"cuda"`` — the GPU's memory (``torch.cuda.get_device_properties``, or ``fedseg plan --gpu-memory GIB``):
  nnU-Net's plan for that memory (:func:`fedseg.data.volumes.plan.network_plan`), DynUNet;
* ``"cpu"`` — a target of :data:`CPU_STEP_SECONDS` seconds per training step at the run's batch: the plan is
  the largest rung of :data:`CPU_LADDER` (a patch of at most so many voxels, features from a base width)
  whose estimated step time fits, estimated as :func:`step_flops` (the multiply-adds of the network's
  convolutions over the patch, forward and backward) divided by the CPU's measured throughput
  (:func:`probe_cpu`: a few timed training steps of one reference U-Net, with the process's torch threads).

The probe's timing only chooses a rung of a small discrete ladder; the choice, the throughput and the
estimate are recorded in the plan file (``Plan.budget``), which a repeated or resumed run, and every
deployed site, reuse: two runs of one plan train the same network on the same patches.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fedseg.foundation.device import resolve_device
from fedseg.foundation.errors import ConfigError

__all__ = [
    "AUTO_NETWORK",
    "CPU_LADDER",
    "CPU_STEP_SECONDS",
    "GFLOPS_ENV",
    "DeviceBudget",
    "device_budget",
    "network_step_flops",
    "probe_cpu",
    "step_flops",
    "unet_step_flops",
    "weakest",
]

CPU_STEP_SECONDS = 0.5
"""Target seconds of one training step (forward, backward, optimizer step of one batch) on a CPU."""
CPU_LADDER: tuple[tuple[int, int], ...] = (
    (12**3, 8),
    (16**3, 16),
    (20**3, 16),
    (24**3, 16),
    (32**3, 16),
    (40**3, 16),
    (48**3, 32),
    (64**3, 32),
    (96**3, 32),
)
"""The CPU plans, cheapest first: ``(most patch voxels, features of the first level)``; features double per
level (at most 320), the patch shaped and the levels derived as nnU-Net does."""
AUTO_NETWORK = {"cuda": "dynunet", "cpu": "unet"}
"""The network ``model.name = "auto"`` builds from a plan made for each device kind (chosen by the
equal-time measurement of ``benchmarks/volume_networks.py``, docs/results/volumes.md)."""
GFLOPS_ENV = "FEDSEG_CPU_GFLOPS"
"""Environment variable that sets a CPU's throughput (GFLOP/s) in place of the probe."""
PROBE_PATCH, PROBE_BASE = 24, 16
"""The probe's reference network: MONAI's U-Net of base 16 on a 24³ patch (3 levels, 16 → 64)."""


@dataclass(frozen=True)
class DeviceBudget:
    """What a plan is sized for: ``kind`` "cuda" with ``gpu_memory`` (GiB), or "cpu" with a target of
    ``step_seconds`` per training step of ``batch`` patches on a CPU of ``gflops`` (measured throughput,
    10⁹ floating-point operations a second of training)."""

    kind: str
    gpu_memory: float | None = None
    step_seconds: float | None = None
    gflops: float | None = None
    batch: int = 2

    def to_json(self) -> dict[str, Any]:
        if self.kind == "cuda":
            return {"device": "cuda", "gpu_memory": self.gpu_memory}
        return {
            "device": "cpu",
            "step_seconds": self.step_seconds,
            "gflops": None if self.gflops is None else round(self.gflops, 3),
            "batch": self.batch,
        }

    @classmethod
    def from_json(cls, d: Any, where: str = "device budget") -> DeviceBudget:
        """A budget as a plan or a site's fingerprint reply carries it; a malformed one is refused."""
        if not isinstance(d, Mapping) or d.get("device") not in ("cuda", "cpu"):
            raise ConfigError(f"{where}: {d!r} is not {{'device': 'cuda' | 'cpu', ...}}")

        def num(key: str) -> float:
            v = d.get(key)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0):
                raise ConfigError(f"{where}: {key} = {v!r}; give a positive number")
            return float(v)

        if d["device"] == "cuda":
            return cls("cuda", gpu_memory=num("gpu_memory"))
        batch = d.get("batch", 2)
        if not (isinstance(batch, int) and not isinstance(batch, bool) and batch >= 1):
            raise ConfigError(f"{where}: batch = {batch!r}; give a positive integer")
        return cls("cpu", step_seconds=num("step_seconds"), gflops=num("gflops"), batch=batch)


def step_flops(
    patch: Sequence[int],
    strides: Sequence[Sequence[int]],
    channels: Sequence[int],
    kernels: Sequence[Sequence[int]] | None = None,
    in_channels: int = 1,
    labels: int = 1,
    batch: int = 2,
) -> float:
    """Floating-point operations of one training step of the plan's U-shaped network on ``batch`` patches.

    With ``V_s`` the voxels of level ``s``, ``F_s`` its channels and ``K_s`` its kernel's voxels, the
    multiply-adds per patch are the encoder's two convolutions per level (``V_s K_s (F_{s-1} F_s + F_s²)``,
    ``F_{-1}`` the image channels), each decoder level's transposed convolution (``V_t F_{t+1} F_t``) and two
    convolutions (``V_t K_t (2 F_t · F_t + F_t²)``), and the output (``V_0 F_0 C``).  A step is the forward
    pass and a backward pass of about twice its cost: ``2 × 3 × batch`` times the multiply-adds."""
    size = [int(v) for v in patch]
    voxels = [math.prod(size)]
    for stride in strides:
        size = [max(1, size[a] // int(stride[a])) for a in range(len(size))]
        voxels.append(math.prod(size))
    ks = [math.prod(int(v) for v in k) for k in kernels] if kernels is not None else [27] * len(channels)
    macs = 0.0
    prev = in_channels
    for level, f in enumerate(channels):
        macs += voxels[level] * ks[level] * (prev * f + f * f)
        prev = f
    for t in range(len(channels) - 1):
        f, g = channels[t], channels[t + 1]
        macs += voxels[t] * g * f + voxels[t] * ks[t] * (2 * f * f + f * f)
    macs += voxels[0] * channels[0] * labels
    return 6.0 * batch * macs


def unet_step_flops(
    patch: Sequence[int],
    strides: Sequence[Sequence[int]],
    channels: Sequence[int],
    in_channels: int = 1,
    labels: int = 1,
    batch: int = 2,
    res_units: int = 2,
) -> float:
    """Floating-point operations of one training step of MONAI's ``UNet`` (3 × 3 × 3 kernels, ``res_units``
    convolutions a residual unit) on ``batch`` patches.

    Its first level already convolves at the first stride, so with ``V_s`` the voxels of level ``s`` (``V_0``
    the patch) and ``F_s`` the channels: down layer ``i`` gives ``27 V_{i+1} (2 F_{i-1} F_i + (R − 1) F_i²)``
    (``R`` convolutions and a strided residual convolution), the bottom layer ``V_L (27 (F_{L-1} F_L + (R − 1)
    F_L²) + F_{L-1} F_L)``, and up layer ``i`` a transposed convolution ``27 V_{i+1} U_i O_i`` and one
    convolution ``27 V_i O_i²`` (``U_i`` the concatenated inputs, ``O_i`` its output: ``F_{i-1}``, the labels
    at the top).  A step: ``2 × 3 × batch`` times the multiply-adds."""
    size = [int(v) for v in patch]
    voxels = [math.prod(size)]
    for stride in strides:
        size = [max(1, size[a] // int(stride[a])) for a in range(len(size))]
        voxels.append(math.prod(size))
    depth = len(channels) - 1
    macs = 0.0
    for i in range(depth):
        fin = in_channels if i == 0 else channels[i - 1]
        f = channels[i]
        macs += 27 * voxels[i + 1] * (2 * fin * f + (res_units - 1) * f * f)
        out = labels if i == 0 else channels[i - 1]
        up_in = f + channels[i + 1] if i == depth - 1 else 2 * f
        macs += 27 * voxels[i + 1] * up_in * out + 27 * voxels[i] * out * out
    a, b = channels[depth - 1], channels[depth]
    macs += voxels[depth] * (27 * (a * b + (res_units - 1) * b * b) + a * b)
    return 6.0 * batch * macs


def network_step_flops(
    network: str,
    patch: Sequence[int],
    strides: Sequence[Sequence[int]],
    channels: Sequence[int],
    kernels: Sequence[Sequence[int]] | None = None,
    in_channels: int = 1,
    labels: int = 1,
    batch: int = 2,
) -> float:
    """:func:`unet_step_flops` for ``"unet"``, :func:`step_flops` (DynUNet) otherwise."""
    if network == "unet":
        return unet_step_flops(patch, strides, channels, in_channels, labels, batch)
    return step_flops(patch, strides, channels, kernels, in_channels, labels, batch)


def probe_cpu(repeats: int = 2) -> float:
    """The CPU's training throughput (GFLOP/s) with this process's torch threads: the fastest of ``repeats``
    timed training steps (after one warm-up) of the network a CPU plan builds (MONAI's ``UNet``, base
    :data:`PROBE_BASE`, 3 levels, 2 residual units, instance norm) on a :data:`PROBE_PATCH`³ patch, batch 2,
    Adam, divided into :func:`unet_step_flops` of that network."""
    from monai.networks.nets import UNet

    patch = [PROBE_PATCH] * 3
    strides = [[2, 2, 2], [2, 2, 2]]
    channels = [PROBE_BASE * 2**i for i in range(3)]
    per_axis: Any = strides  # MONAI's UNet takes a stride per axis as well as one number
    net = UNet(3, 1, 1, channels=channels, strides=per_axis, num_res_units=2, norm="instance")
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 1, *patch, generator=g)
    y = (torch.rand(2, 1, *patch, generator=g) > 0.9).float()
    best = math.inf
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.binary_cross_entropy_with_logits(net(x), y).backward()
        opt.step()
        if i:
            best = min(best, time.perf_counter() - t0)
    return unet_step_flops(patch, strides, channels, 1, 1, 2) / best / 1e9


def device_budget(
    device: str | torch.device = "auto",
    *,
    gpu_memory: float | None = None,
    batch: int = 2,
    step_seconds: float = CPU_STEP_SECONDS,
    probe: Any = None,
) -> DeviceBudget:
    """The budget of the device a run trains on: ``gpu_memory`` (GiB) when given (the explicit GPU plan),
    else a CUDA device's memory, else a CPU's ``step_seconds`` a step of ``batch`` patches at the throughput
    ``probe()`` measures (default: the environment variable ``FEDSEG_CPU_GFLOPS`` when set — machines that
    must make the same plan without a plan file set it alike — else :func:`probe_cpu`)."""
    if gpu_memory is not None:
        return DeviceBudget("cuda", gpu_memory=float(gpu_memory))
    if not (step_seconds > 0 and math.isfinite(step_seconds)) or batch < 1:
        raise ConfigError(
            f"a CPU plan's budget: step_seconds = {step_seconds}, batch = {batch}; give a positive time and batch"
        )
    dev = resolve_device(str(device))
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev.index if dev.index is not None else torch.cuda.current_device())
        return DeviceBudget("cuda", gpu_memory=round(props.total_memory / 2**30, 1))
    if probe is None and os.environ.get(GFLOPS_ENV):
        gflops = DeviceBudget.from_json(
            {"device": "cpu", "step_seconds": step_seconds, "gflops": _number(os.environ[GFLOPS_ENV], GFLOPS_ENV)},
            GFLOPS_ENV,
        ).gflops
    else:
        gflops = float((probe or probe_cpu)())
    return DeviceBudget("cpu", step_seconds=step_seconds, gflops=gflops, batch=int(batch))


def _number(text: str, name: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{name} = {text!r}; give the CPU's training throughput in GFLOP/s, e.g. 20") from None


def weakest(budgets: Sequence[DeviceBudget]) -> DeviceBudget | None:
    """The budget every device can meet: a CPU's (the slowest one's) when any device is a CPU, else the
    smallest GPU memory; None for none."""
    cpus = [b for b in budgets if b.kind == "cpu"]
    if cpus:
        return min(cpus, key=lambda b: (b.gflops or 0.0) / (b.step_seconds or 1.0) / b.batch)
    gpus = [b for b in budgets if b.kind == "cuda"]
    return min(gpus, key=lambda b: b.gpu_memory or 0.0) if gpus else None
