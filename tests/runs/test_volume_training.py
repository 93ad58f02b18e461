"""nnU-Net's training settings: SGD with Nesterov momentum and the poly learning-rate schedule."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fedseg.foundation.config import TrainConfig
from fedseg.foundation.errors import ConfigError
from fedseg.simulation.runner import simulate
from fedseg.site.runtime import poly_lr
from fedseg.site.workload import segmentation_workload
from tests.support.helpers import tiny_config, tiny_sites


def test_poly_schedule_and_nesterov_sgd(tmp_path, monkeypatch):
    """Round r of R trains at lr · (1 − (r − 1)/R)^0.9 (nnU-Net's poly, a round per epoch): 0.01, 0.01 · (2/3)^0.9,
    0.01 · (1/3)^0.9 over 3 rounds, measured on the optimizer each site steps with; the SGD is Nesterov's.
    Nesterov without SGD momentum is refused naming the fix."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.01, momentum=0.99, nesterov=True)
    seen = []
    for r in (1, 2, 3):
        poly_lr(opt, r, 3)
        seen.append(opt.param_groups[0]["lr"])
    assert seen == pytest.approx([0.01, 0.01 * (2 / 3) ** 0.9, 0.01 * (1 / 3) ** 0.9])

    steps: list[tuple[float, bool]] = []
    real = torch.optim.SGD.step

    def spy(self, *a, **k):
        steps.append((self.param_groups[0]["lr"], self.param_groups[0]["nesterov"]))
        return real(self, *a, **k)

    monkeypatch.setattr(torch.optim.SGD, "step", spy)
    cfg = tiny_config("fedavg", rounds=3, local_steps=1, local_epochs=None)
    cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(
            cfg.train, optimizer="sgd", lr=0.01, momentum=0.99, nesterov=True, lr_schedule="poly"
        ),
    )
    sites = tiny_sites(num_sites=2)
    simulate(
        cfg, segmentation_workload(2, 1, ["fg"], cfg.model), sites, out=tmp_path, progress=False, log=lambda m: None
    )
    lrs = sorted({round(lr, 12) for lr, _ in steps}, reverse=True)
    assert lrs == pytest.approx(seen) and all(n for _, n in steps)
    with pytest.raises(ConfigError, match="nesterov"):
        TrainConfig(nesterov=True).validate()


def test_poly_schedule_reaches_the_optimizer_scaffold_steps_with():
    """SCAFFOLD's step correction is a hook after each step (``after_step``), not an optimizer wrapper: its
    request carries the site's own optimizer, whose rate the poly schedule set for the round,
    0.01 · (1/2)^0.9 in round 2 of 2."""
    from fedseg.algorithms import get_algorithm
    from fedseg.foundation.arrays import prefixed
    from fedseg.foundation.messages import Task
    from fedseg.site.calls import FitCall
    from fedseg.site.runtime import Site

    cfg = tiny_config("scaffold", rounds=2, local_steps=1, local_epochs=None)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, optimizer="sgd", lr=0.01, lr_schedule="poly"))
    wl = segmentation_workload(2, 1, ["fg"], cfg.model)
    site = Site("site1", 0, tiny_sites(1)["site1"], wl, cfg, get_algorithm(cfg))
    state = prefixed("global", wl.build_model().state_dict())
    call = next(site.asks(Task("train", state, {"round": 2})))
    assert isinstance(call, FitCall) and call.optimizer is site.optimizer("global")
    assert type(call.optimizer) is torch.optim.SGD and call.after_step is not None and call.after_backward is None
    assert call.optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5**0.9)
