"""Test helpers shared by the test files: bitwise comparison of checkpoints and run folders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

__all__ = [
    "assert_same_arrays",
    "assert_same_checkpoints",
    "load_arrays",
    "same_arrays",
    "server_state",
    "site_state",
    "strip_times",
]

TIMES = ("time_s", "wall_time_s")


def strip_times(obj: Any) -> Any:
    """``obj`` (results, history) without wall-clock entries, which differ between equal runs."""
    if isinstance(obj, dict):
        return {k: strip_times(v) for k, v in obj.items() if k not in TIMES}
    if isinstance(obj, list):
        return [strip_times(v) for v in obj]
    return obj


def load_arrays(path: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def server_state(run: str | Path) -> dict[str, torch.Tensor]:
    """The server state a run folder's last checkpoint holds."""
    return load_arrays(Path(run) / "checkpoints" / "server.safetensors")


def same_arrays(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Same names and every tensor bitwise equal (same dtype, same bits)."""
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def site_state(run: str | Path, site: str) -> dict[str, torch.Tensor]:
    """A site's state (models, optimizer moments, ``store``) in a run folder's last checkpoint."""
    return load_arrays(Path(run) / "checkpoints" / "sites" / f"{site}.safetensors")


def assert_same_arrays(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str = "") -> None:
    """Same names, and every tensor bitwise equal (same dtype, same bits)."""
    assert a.keys() == b.keys(), f"{what}: names differ: {sorted(set(a) ^ set(b))[:5]}"
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: {k} differs"


def assert_same_checkpoints(a: str | Path, b: str | Path, sites: bool = True, best: bool = True) -> None:
    """Two run folders (or their ``checkpoints/`` folders) hold bitwise the same checkpoint: the server
    state, the best models and their records, every site's state and its JSON record (models, optimizer
    moments, scalers, ``store``), and the same progress (round, history without timings)."""
    a, b = (Path(p) / "checkpoints" if (Path(p) / "checkpoints").is_dir() else Path(p) for p in (a, b))
    assert_same_arrays(load_arrays(a / "server.safetensors"), load_arrays(b / "server.safetensors"), "server state")
    pa, pb = (json.loads((d / "progress.json").read_text()) for d in (a, b))
    assert pa["round"] == pb["round"], f"checkpoints of rounds {pa['round']} and {pb['round']}"
    assert strip_times(pa["history"]) == strip_times(pb["history"]), "histories differ"
    if best:
        assert_same_arrays(load_arrays(a / "best.safetensors"), load_arrays(b / "best.safetensors"), "best models")
        assert json.loads((a / "best.json").read_text()) == json.loads((b / "best.json").read_text()), "best.json"
    if sites:
        names = sorted(p.name for p in (a / "sites").iterdir())
        assert names == sorted(p.name for p in (b / "sites").iterdir()), "different site files"
        for n in names:
            if n.endswith(".safetensors"):
                assert_same_arrays(load_arrays(a / "sites" / n), load_arrays(b / "sites" / n), f"site state {n}")
            else:
                assert json.loads((a / "sites" / n).read_text()) == json.loads((b / "sites" / n).read_text()), n
