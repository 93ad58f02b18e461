"""What the server and the sites say to each other: :class:`Task` and :class:`Reply`.

This is the leaf of the package's layers: it imports nothing of fedseg but the
array type, so the engine, the algorithms, the transports and the deployment wire
format can all share the messages without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fedseg.core.arrays import Arrays

__all__ = ["Reply", "Task"]


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
