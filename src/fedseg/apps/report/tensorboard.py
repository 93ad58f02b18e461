"""TensorBoard scalars from a run's per-round history entries (``fedseg run --tensorboard``).

The engine calls ``on_round(entry)`` after every round with that round's history
entry (``docs/results-format.md``); :class:`TensorBoardLogger` turns it into scalars:

* ``train_loss/<site>`` (and any other per-site metric the method records, e.g.
  FedSM's ``personal_loss/<site>``, ``selector_loss/<site>``, ``routing_acc/<site>``),
* ``val_dice/<candidate>/<site>`` and ``val_score/<candidate>``,
* ``bytes/<site>/sent|received`` plus ``bytes/total/sent|received`` (and the same
  for ``eval_bytes``),
* ``alpha/<site>`` (Auto-FedAvg's aggregation weights) when present,
* ``time_s``,

each at step = the round.  Writing uses ``torch.utils.tensorboard.SummaryWriter``,
which needs the ``tensorboard`` package (``pip install 'fedseg[report]'``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedseg.foundation.errors import ConfigError

__all__ = ["TensorBoardLogger", "round_scalars", "tensorboard_available"]

_SKIP = {"round"}


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        f = float(v)
        return f if math.isfinite(f) else None
    return None


def round_scalars(entry: Mapping[str, Any]) -> dict[str, float]:
    """Flatten one history entry into ``{tag: value}``.

    Nested dicts become ``/``-joined tags (``val_dice/global/site1``); non-numeric
    values (strings, lists, None, booleans, NaN) are left out.  ``bytes`` and
    ``eval_bytes`` also get ``<key>/total/sent`` and ``<key>/total/received``
    summed over sites.

    Example: ``{"round": 3, "train_loss": {"a": 0.5}, "alpha": {"a": 1.0}}`` →
    ``{"train_loss/a": 0.5, "alpha/a": 1.0}``.
    """
    out: dict[str, float] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, Mapping):
            for k, sub in v.items():
                walk(f"{prefix}/{k}", sub)
            return
        f = _number(v)
        if f is not None:
            out[prefix] = f

    for key, value in entry.items():
        if key in _SKIP:
            continue
        walk(str(key), value)
        if key in ("bytes", "eval_bytes") and isinstance(value, Mapping):
            for direction in ("sent", "received"):
                found = [_number(s.get(direction)) for s in value.values() if isinstance(s, Mapping)]
                vals = [x for x in found if x is not None]
                if vals:
                    out[f"{key}/total/{direction}"] = float(sum(vals))
    return out


def tensorboard_available() -> bool:
    """Whether ``torch.utils.tensorboard`` can be imported (the ``tensorboard`` package is installed)."""
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


class TensorBoardLogger:
    """``on_round`` callback that writes each history entry's scalars to ``logdir``.

    Raises :class:`fedseg.foundation.errors.ConfigError` with the install command when
    tensorboard is missing.  Use as ``run(..., on_round=TensorBoardLogger(dir))`` and
    call :meth:`close` at the end (or use it as a context manager).
    """

    def __init__(self, logdir: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                "--tensorboard needs the tensorboard package, which is not installed: "
                "pip install 'fedseg[report]' (or pip install tensorboard), or run without --tensorboard"
            ) from None
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(self.logdir))
        self.rounds = 0

    def __call__(self, entry: Mapping[str, Any]) -> None:
        step = int(entry.get("round", self.rounds + 1))
        for tag, value in round_scalars(entry).items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()
        self.rounds += 1

    def close(self) -> None:
        self.writer.close()

    def __enter__(self) -> TensorBoardLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
