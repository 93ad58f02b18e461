"""What the server and the sites say to each other: :class:`Task` and :class:`Reply`.

This is the leaf of the package's layers: it imports nothing of fedseg but the
array type, so the engine, the algorithms, the transports and the deployment wire
format can all share the messages without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fedseg.foundation.arrays import Arrays
from fedseg.foundation.errors import PayloadError

__all__ = ["SPLITS", "SPLIT_KEYS", "Reply", "Task", "split_name"]

SPLIT_KEYS = ("training", "validation", "testing")
"""The data splits by their canonical names: a datalist's keys, in datalist order
(:data:`fedseg.data.datalist.SPLITS`)."""

SPLITS = {
    **{s: s for s in SPLIT_KEYS},
    "train": "training",
    "val": "validation",
    "test": "testing",
}
"""Every name a task may give a data split (``task.config["split"]``) → its canonical name (one of
:data:`SPLIT_KEYS`)."""


def split_name(name: str) -> str:
    """The canonical name of a split (``"val"`` → ``"validation"``); one error naming the allowed names."""
    canonical = SPLITS.get(name) if isinstance(name, str) else None
    if canonical is None:
        raise PayloadError(f"unknown data split {name!r}; a split is one of {sorted(SPLITS)}")
    return canonical


@dataclass
class Task:
    """What the server asks a site to do.

    ``kind`` selects the handler; ``arrays`` carries tensors (models, gradients);
    ``config`` carries small JSON-able settings (round number, step counts…).
    """

    kind: str
    arrays: Arrays = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)


@dataclass
class Reply:
    """What a site sends back: tensors, JSON-able metrics and its sample count (FedAvg's n_k)."""

    arrays: Arrays = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    num_samples: int = 0
