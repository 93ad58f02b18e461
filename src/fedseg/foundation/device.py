"""Where a run computes: device resolution, determinism, mixed precision, host copies.

A run names its device in the run config (``device = "auto" | "cpu" | "cuda" | "cuda:N"``;
``auto`` is the first CUDA device when one is available, else the CPU) and its
precision in ``train.precision`` (``fp32`` | ``bf16`` | ``fp16``).  Models, optimizer
state, batches and the server's aggregation live on that device; everything that
leaves the process (checkpoints, deployment payloads, results) is a host tensor
(:func:`to_host`), so a run checkpointed on a GPU resumes on the CPU and back.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping

import torch

from fedseg.foundation.config.schema import FloatDtype, Precision
from fedseg.foundation.errors import ConfigError

__all__ = [
    "DTYPES",
    "PRECISIONS",
    "autocast",
    "configure_determinism",
    "describe",
    "fits_on_device",
    "fp16_refusal",
    "grad_scaler",
    "resolve_device",
    "to_device",
    "to_host",
]

PRECISIONS: dict[Precision, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""``train.precision`` → the autocast dtype (None: no autocast, plain float32/float64)."""
DTYPES: dict[FloatDtype, torch.dtype] = {"float32": torch.float32, "float64": torch.float64}
"""``train.dtype`` → the torch dtype of weights, optimizer state and aggregation."""

CUBLAS_WORKSPACE = ":4096:8"
"""cuBLAS workspace setting PyTorch requires for deterministic matrix products on CUDA."""


def resolve_device(name: str) -> torch.device:
    """The ``torch.device`` a run's ``device`` setting names.

    ``auto`` → ``cuda`` when CUDA is available, else ``cpu``.  ``cuda``/``cuda:N`` on a
    machine without CUDA (or without GPU N) raises :class:`ConfigError` naming the fix.
    A CUDA device always comes back with its index (``cuda`` → ``cuda:<current>``): tensors
    report ``cuda:0``, and ``torch.device("cuda") != torch.device("cuda:0")``, so an unindexed
    device would make every "is it already there?" test fail (and pin a CUDA tensor).
    """
    text = str(name).strip().lower()
    if text == "auto":
        text = "cuda" if torch.cuda.is_available() else "cpu"
    if text == "cpu":
        return torch.device("cpu")
    if text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device = {name!r}, but CUDA is not available on this machine (torch {torch.__version__}); "
                'run on the CPU with --device cpu (or --set device=cpu), or leave device = "auto"'
            )
        dev = torch.device(text)
        if dev.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        if dev.index >= torch.cuda.device_count():
            raise ConfigError(
                f"device = {name!r}, but this machine has {torch.cuda.device_count()} CUDA device(s) "
                f"(cuda:0 … cuda:{torch.cuda.device_count() - 1}); pick one of them or --device cpu"
            )
        return dev
    raise ConfigError(f"device = {name!r} is not known; use 'auto', 'cpu', 'cuda' or 'cuda:N' (e.g. --device cuda:1)")


def describe(device: torch.device) -> str:
    """Human-readable name: ``cpu`` or ``cuda:0 (NVIDIA H100 80GB HBM3)``."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return str(device)


def configure_determinism(device: torch.device, deterministic: bool = True) -> None:
    """Make the same seed on the same CUDA device give bitwise the same weights.

    Sets ``CUBLAS_WORKSPACE_CONFIG`` (unless the user set it) and
    ``torch.use_deterministic_algorithms(True, warn_only=True)``, and turns off cuDNN's
    autotuner and TF32 (whose choice of kernel may differ between runs).  It costs speed
    — deterministic convolution backward kernels and no TF32 (see docs/architecture.md)
    — and is skipped on the CPU, whose kernels are deterministic.  ``deterministic=False``
    (``deterministic = false`` in the run config) restores PyTorch's defaults and turns
    the cuDNN autotuner on: faster, not bitwise reproducible.
    """
    if device.type != "cuda":
        return
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    torch.backends.cudnn.benchmark = not deterministic
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.allow_tf32 = not deterministic
    torch.backends.cuda.matmul.allow_tf32 = False  # PyTorch's default; TF32 matmuls change results visibly


def autocast(device: torch.device, precision: Precision, cache: bool = True) -> contextlib.AbstractContextManager:
    """``torch.autocast`` for ``precision`` on ``device`` (a no-op context for fp32); ``cache=False`` turns
    off autocast's cache of cast weights (required inside a CUDA graph capture; the same numbers)."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype, cache_enabled=cache)


def grad_scaler(device: torch.device, precision: Precision) -> torch.amp.GradScaler | None:
    """A gradient scaler for fp16 (its small exponent range underflows gradients); None otherwise."""
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type)


def fp16_refusal(what: str) -> str:
    """The error of a run that asks fp16 of a method whose site work ``what`` uses raw gradients outside
    an optimizer step (:meth:`fedseg.seams.algorithm.Algorithm.fp16_unsupported`)."""
    return (
        f"train.precision = 'fp16' is not supported by {what}: fp16's loss scaling can unscale gradients and skip "
        "an overflowed step only inside an optimizer step; use --set train.precision=bf16 (float32's exponent range, "
        "no loss scaling needed) or fp32"
    )


def to_host(arrays: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached host (CPU) copies of every tensor — what is written to disk or sent."""
    return {k: v.detach().to("cpu", copy=True) for k, v in arrays.items()}


def to_device(arrays: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor on ``device`` (tensors already there are kept, not copied)."""
    return {k: v.to(device) for k, v in arrays.items()}


def fits_on_device(nbytes: int, device: torch.device, fraction: float = 0.5) -> bool:
    """True when ``nbytes`` of data may live on ``device`` (always on the CPU; on CUDA, up to
    ``fraction`` of the free memory, leaving the rest to models and activations)."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return nbytes <= fraction * free
