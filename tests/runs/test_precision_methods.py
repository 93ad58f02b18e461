"""``train.precision`` in the methods that run their own local loops.

APFL, pFedMe, Per-FedAvg, FGA (and FedSM's ``fga`` selector), Auto-FedAvg's weight-learning
step and FedSM's ``fedavg`` selector loop do not train through :meth:`Site.fit`; each runs its
forward passes under :meth:`Site.autocast`, steps through ``site.roles.step``
(:meth:`fedseg.site.models.SiteModels.step`; fp16: the role's gradient scaler) where an optimizer steps on a loss, and sums its losses on the device
(:class:`fedseg.site.runtime.LossSums`).  fp16 is refused at the start of a run, with one error naming
bf16, where a method uses raw gradients outside an optimizer step (a loss scale cannot be
unscaled or an overflowed step skipped there) — see docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fedseg.foundation.errors import ConfigError
from fedseg.simulation.runner import simulate
from fedseg.site.calls import LossSums
from fedseg.site.runtime import Site
from tests.support.helpers import count_host_reads, tiny_config, tiny_sites

FEDSM_FEDAVG = {"fedsm": {"selector_training": "fedavg", "selector_steps": "all"}}

# (method, settings, what fp16 does: None = runs with loss scaling, else a phrase of its refusal)
CASES = {
    "apfl": ("apfl", {}, "APFL"),
    "apfl-outputs": ("apfl", {"apfl": {"mix": "outputs"}}, "APFL"),
    "pfedme": ("pfedme", {}, "pFedMe"),
    "perfedavg-hf": ("perfedavg", {"perfedavg": {"variant": "hf"}}, "Per-FedAvg"),
    "fga": ("fga", {}, "gradient averaging"),
    "autofedavg": ("autofedavg", {"autofedavg": {"interval": 1}}, None),
    "fedsm-fedavg-selector": ("fedsm", FEDSM_FEDAVG, None),
    "fedsm-fga-selector": ("fedsm", {"fedsm": {"selector_training": "fga"}}, "gradient averaging"),
    "fedsm-apfl": ("fedsm", {"fedsm": {"selector_training": "fedavg", "personalization": "apfl"}}, "APFL"),
}


def _run(
    workload, out: Path, method: str, params: dict, precision: str, **train
) -> tuple[dict, dict[str, torch.Tensor]]:
    cfg = dataclasses.replace(tiny_config(method, rounds=2, precision=precision, **train), params=params)
    res = simulate(cfg, workload, tiny_sites(), out=out, progress=False, log=lambda m: None)
    return res, load_file(str(out / "checkpoints" / "server.safetensors"))


def _differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], prefix: str = "") -> bool:
    keys = [k for k in a if k.startswith(prefix) and a[k].is_floating_point()]
    return bool(keys) and any(not torch.equal(a[k], b[k]) for k in keys)


@pytest.mark.parametrize(
    "case",
    [
        "apfl",
        "apfl-outputs",
        "pfedme",
        "perfedavg-hf",
        "fga",
        "autofedavg",
        "fedsm-fedavg-selector",
        "fedsm-fga-selector",
    ],
)
def test_bf16_runs_finite_and_differs_from_fp32(tmp_path, workload, case):
    method, params, _ = CASES[case]
    _, w32 = _run(workload, tmp_path / "fp32", method, params, "fp32")
    res, w16 = _run(workload, tmp_path / "bf16", method, params, "bf16")
    assert res["precision"] == "bf16"
    assert all(torch.isfinite(v).all() for v in w16.values() if v.is_floating_point())
    assert all(v.dtype == w32[k].dtype for k, v in w16.items())  # float32 master weights and aggregates
    losses = [v for e in res["history"] for v in e["train_loss"].values()]
    assert losses and all(torch.isfinite(torch.tensor(losses)))
    # the method's own loop ran under autocast: the part it trains changed
    part = {"autofedavg": "autofedavg/", "fedsm-fedavg-selector": "selector/", "fedsm-fga-selector": "selector/"}.get(
        case, ""
    )
    assert _differs(w16, w32, part)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp16_runs_with_loss_scaling_or_is_refused_naming_bf16(tmp_path, workload, case):
    method, params, refused = CASES[case]
    if refused is not None:
        with pytest.raises(
            ConfigError, match=rf"train.precision = 'fp16' is not supported by {refused}.*train.precision=bf16"
        ):
            _run(workload, tmp_path / "fp16", method, params, "fp16")
        assert not (tmp_path / "fp16" / "checkpoints").exists()  # refused before any training
        return
    _, w32 = _run(workload, tmp_path / "fp32", method, params, "fp32")
    _, w16 = _run(workload, tmp_path / "fp16", method, params, "fp16")
    assert all(torch.isfinite(v).all() for v in w16.values() if v.is_floating_point())
    part = {"autofedavg": "autofedavg/", "fedsm-fedavg-selector": "selector/"}[case]
    assert _differs(w16, w32, part)
    scalers = __import__("json").loads((tmp_path / "fp16" / "checkpoints" / "sites" / "site1.json").read_text())[
        "scalers"
    ]
    assert {"autofedavg": "autofedavg/beta", "fedsm-fedavg-selector": "selector@3"}[
        case
    ] in scalers  # the loop's own scaler, saved


LOOPS = {
    "apfl": ("apfl", {}, "fedseg/algorithms/apfl.py"),
    "pfedme": ("pfedme", {}, "fedseg/algorithms/pfedme.py"),
    "perfedavg": ("perfedavg", {}, "fedseg/algorithms/perfedavg.py"),
    "autofedavg": ("autofedavg", {"autofedavg": {"interval": 1}}, "fedseg/algorithms/autofedavg.py"),
    "fedsm-fedavg-selector": (
        "fedsm",
        {"fedsm": {**FEDSM_FEDAVG["fedsm"], "personalization": "ft"}},
        "fedseg/algorithms/fedsm/selector.py",
    ),
}


@pytest.mark.parametrize("case", sorted(LOOPS))
def test_local_loops_read_no_loss_per_step_and_enter_autocast(tmp_path, workload, monkeypatch, case):
    """Host reads of tensor values (each a device sync on a GPU) made by the method's module and
    site.py do not grow with the number of local steps (1 vs 4): losses are summed on the device.
    The same runs count the method's own entries into :meth:`Site.autocast` (and those of
    :meth:`Site.gradient`, computed by :func:`fedseg.site.calls.local_gradient`, through which pFedMe's inner steps take
    their gradients).
    (FedSM with ``ft`` personalization, so that its loop trains only the selector.)"""
    method, params, module = LOOPS[case]
    reads = count_host_reads(
        monkeypatch, module, "fedseg/site/runtime.py", "fedseg/site/models.py", "fedseg/site/calls.py"
    )
    entered = {"n": 0}
    real = Site.autocast

    def counting(site):
        caller = __import__("sys")._getframe(1).f_code
        if caller.co_filename.endswith(module) or (
            caller.co_name == "local_gradient" and caller.co_filename.endswith("fedseg/site/calls.py")
        ):
            entered["n"] += 1
        return real(site)

    monkeypatch.setattr(Site, "autocast", counting)
    counts = []
    for steps in (1, 4):
        reads["n"] = entered["n"] = 0
        cfg = dataclasses.replace(tiny_config(method, rounds=1, local_steps=steps, local_epochs=None), params=params)
        simulate(cfg, workload, tiny_sites(), out=tmp_path / str(steps), progress=False, log=lambda m: None)
        counts.append((reads["n"], entered["n"]))
    (reads1, entered1), (reads4, entered4) = counts
    assert reads1 == reads4, f"{case}: {reads1} host reads with 1 local step, {reads4} with 4"
    assert entered1 > 0 and (
        entered4 > entered1 or case == "autofedavg"
    )  # Auto-FedAvg's β steps do not follow local_steps


def test_loss_sums_means_match_python_float_sums_bitwise():
    """fp32 metrics must not change: a float64 device sum of float32 losses is the Python float sum."""
    losses = [torch.tensor(v, dtype=torch.float32) for v in (0.1, 0.7, 1e-8, 3.3)]
    sums = LossSums(torch.device("cpu"))
    total = 0.0
    for t in losses:
        sums.add("loss", t)
        total += float(t)
    assert (
        sums.means() == {"loss": total / 4} and sums.count("loss") == 4 and LossSums(torch.device("cpu")).means() == {}
    )
