"""Test helpers shared by the test files: tiny in-memory federations that train in well under a second;
bitwise comparison of checkpoints and run folders; a small synthetic federation and stand-ins for finished
runs (``jobs.run``) of the grid and tracking tests; a counter of host reads of tensor values."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch.utils.data import TensorDataset

from fedseg.foundation.config import ModelConfig, RunConfig, TrainConfig
from fedseg.site.runtime import SiteData

__all__ = [
    "SETS",
    "SMALL",
    "TINY_MODEL",
    "assert_same_arrays",
    "assert_same_checkpoints",
    "count_host_reads",
    "every_method_config",
    "fake_results",
    "fake_run",
    "load_arrays",
    "override_value",
    "same_arrays",
    "server_state",
    "site_state",
    "strip_times",
    "synth_fundus",
    "tiny_config",
    "tiny_sites",
]

TINY_MODEL = ModelConfig(channels=(4, 8, 16), strides=(2, 2), num_res_units=1)


def tiny_sites(num_sites: int = 3, n_train: int = 6, size: int = 16, seed: int = 0) -> dict[str, SiteData]:
    """Sites whose masks are bright pixels of a site-specific threshold (learnable, heterogeneous)."""
    g = torch.Generator().manual_seed(seed)
    data = {}
    for k in range(num_sites):

        def split(n: int) -> TensorDataset:
            x = torch.rand(n, 1, size, size, generator=g)
            return TensorDataset(x, (x > 0.3 + 0.1 * k).float())  # noqa: B023

        data[f"site{k + 1}"] = SiteData(split(n_train + 2 * k), split(3), split(3))
    return data


def tiny_config(method: str = "fedavg", rounds: int = 3, **train) -> RunConfig:
    return RunConfig(
        federation="(in memory)",
        method=method,
        rounds=rounds,
        model=TINY_MODEL,
        train=TrainConfig(batch_size=4, **train),
        checkpoint_keep="all",  # the tests read every site's state of finished runs (resume, bitwise equality)
    )


def every_method_config(method: str) -> RunConfig:
    """The tiny run of ``method`` that the every-method comparisons share (the ``simulated`` fixture of
    tests/conftest.py: resume, deployment): 2 rounds of :func:`tiny_config`; FedSM's variants with a narrow
    selector trained in round 2 (FedSM-extra crosses its phase boundary there).  ``"fedsm+global-fga"``: FedSM
    whose global model trains by gradient averaging (lockstep exchanges, the sites' persistent global Adam)."""
    method, _, variant = method.partition("+")
    cfg = tiny_config(method, rounds=2)
    if method.startswith("fedsm"):
        fedsm = {"selector_width": 0.0625, "selector_rounds": 1}
        if variant == "global-fga":
            fedsm["global_training"] = "fga"
        cfg = dataclasses.replace(cfg, params={**cfg.params, "fedsm": fedsm})
    return cfg


def count_host_reads(monkeypatch, *files: str) -> dict[str, int]:
    """Count host reads of tensor values (``float(t)``, ``t.item()``, ``t.tolist()``) made directly
    by code in the source files whose path ends with one of ``files`` (e.g. ``"fedseg/site/runtime.py"``):
    each is a device synchronisation on a GPU.  Returns the live counter ``{"n": …}``."""
    calls = {"n": 0}
    ends = tuple(files) + tuple(f.replace("/", "\\") for f in files)

    def counted(real):
        def wrapper(t, *args, **kwargs):
            if sys._getframe(1).f_code.co_filename.endswith(ends):
                calls["n"] += 1
            return real(t, *args, **kwargs)

        return wrapper

    for name in ("__float__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
    return calls


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


SMALL = ["model.channels=[4,8,16]", "model.strides=[2,2]", "model.num_res_units=1", "train.batch_size=8"]
"""``--set`` overrides of a small U-Net for runs on :func:`synth_fundus`'s images."""
SETS = [x for s in SMALL for x in ("--set", s)]
""":data:`SMALL` as command-line arguments."""


def synth_fundus(folder: Path) -> Path:
    """A small synthetic fundus federation (5 % of the paper's cases, 32² images) in ``folder``; its spec."""
    from fedseg.cli import main

    out = Path(folder) / "fundus"
    assert main(["synth", "--preset", "fundus", "--out", str(out), "--scale", "0.05", "--size", "32"]) == 0
    return out / "federation.toml"


def override_value(overrides: Sequence[str], key: str, default: str) -> str:
    """The value ``--set key=value`` gives ``key`` among ``overrides`` (as written), else ``default``."""
    return next((o.split("=", 1)[1] for o in overrides if o.startswith(f"{key}=")), default)


def fake_results(val: float, test: float, primary: str | None = "global", seed: int = 0) -> dict[str, Any]:
    """A results document of two sites s1, s2 with validation score ``val`` and test Dice ``test``: of a
    method with a ``primary`` candidate (FedAvg), or for None of one whose sites own their models (Local:
    site models at ``val`` ± 0.1, mean ``val``)."""
    rows = (
        [{"name": "global", "home_site": None, "best_val_dice": val, "client_avg_dice": test}]
        if primary
        else [
            {"name": f"local/s{i}", "home_site": f"s{i}", "best_val_dice": val + d, "client_avg_dice": test}
            for i, d in ((1, 0.1), (2, -0.1))
        ]
    )
    return {
        "method": "fedavg" if primary else "local",
        "label": "FedAvg" if primary else "Local",
        "primary": primary,
        "sites": ["s1", "s2"],
        "seed": seed,
        "rows": rows,
        "per_site_dice": {"s1": test, "s2": test},
        "client_avg_dice": test,
        "global_dice": test,
    }


def fake_run(scores: Callable[[str, int], tuple[float, float]], folder: bool = False) -> Callable[..., dict]:
    """A stand-in for :func:`fedseg.apps.studies.jobs.run` that trains nothing: the FedAvg results
    (:func:`fake_results`) whose validation and test scores ``scores(lr, seed)`` gives for the run's
    ``train.lr`` override (as written, default "1e-3") and seed, saved as ``OUT/results.json``.  ``folder``:
    also what a finished run's folder holds beside it (the resolved config with ``train.lr``, a two-round
    history of s1's validation Dice ``val`` · round / 2, ``config.toml`` and a best checkpoint)."""
    from fedseg.seams.checkpoint import save_json

    def run(config: Any, out: Any = None, overrides: Sequence[str] = (), **kw: Any) -> dict:
        lr, seed = override_value(overrides, "train.lr", "1e-3"), kw["seed"]
        val, test = scores(lr, seed)
        res = fake_results(val, test, seed=seed)
        if folder:
            res["config"] = {"method": "fedavg", "seed": seed, "train": {"lr": float(lr)}}
            res["history"] = [
                {"round": r, "train_loss": {"s1": 1.0 / r}, "val_dice": {"global": {"s1": val * r / 2}}} for r in (1, 2)
            ]
        save_json(res, Path(out) / "results.json")
        if folder:
            (Path(out) / "config.toml").write_text("method = 'fedavg'\n")
            (Path(out) / "checkpoints").mkdir(exist_ok=True)
            (Path(out) / "checkpoints" / "best.safetensors").write_bytes(b"x")
        return res

    return run


def fedavg_weights_sequential_and_vectorized(folder: Path, net: Any) -> dict[str, dict[str, torch.Tensor]]:
    """The server weights of two float64 FedAvg rounds of ``net`` (a ModelConfig) on the tiny sites, run one
    site after another (``"off"``) and vectorized (``"on"``, whose log must say the sites trained as one
    computation)."""
    import dataclasses

    from fedseg.foundation.config import SimulationConfig
    from fedseg.simulation.runner import simulate
    from fedseg.site.workload import segmentation_workload

    weights = {}
    for mode in ("off", "on"):
        cfg = dataclasses.replace(
            tiny_config("fedavg", rounds=2, dtype="float64"), model=net, simulation=SimulationConfig(vectorize=mode)
        )
        logs: list[str] = []
        wl = segmentation_workload(2, 1, ["fg"], net)
        simulate(cfg, wl, tiny_sites(), out=folder / mode, progress=False, log=logs.append)
        if mode == "on":
            assert any("trains as one vectorized computation" in m for m in logs), logs
        weights[mode] = load_file(str(folder / mode / "checkpoints" / "server.safetensors"))
    assert weights["on"].keys() == weights["off"].keys()
    return weights
