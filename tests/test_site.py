"""Site runtime: local work counting, seeded batches, batch-norm policy, persistence."""

from __future__ import annotations

import math

import torch

from conftest import tiny_config
from fedseg.algorithms import get_algorithm
from fedseg.config import ModelConfig, RunConfig, TrainConfig
from fedseg.site import Site
from fedseg.workload import segmentation_workload


def _site(sites, workload, cfg=None, name="site1"):
    cfg = cfg or tiny_config()
    return Site(name, list(sites).index(name), sites[name], workload, cfg, get_algorithm(cfg))


def test_local_work_in_epochs_and_steps(sites, workload):
    n = len(sites["site1"].train)
    assert _site(sites, workload).steps_per_round() == math.ceil(n / 4)
    assert _site(sites, workload, tiny_config(local_epochs=2.0)).steps_per_round() == 2 * math.ceil(n / 4)
    s = _site(sites, workload, tiny_config(local_epochs=None, local_steps=7))
    assert s.steps_per_round() == 7
    assert len(list(s.batches(1))) == 7


def test_batches_are_seeded_by_round_and_cover_an_epoch(sites, workload):
    s = _site(sites, workload)
    a = [x for x, _ in s.batches(1)]
    b = [x for x, _ in s.batches(1)]
    c = [x for x, _ in s.batches(2)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))
    # one epoch visits every case exactly once
    assert sum(x.shape[0] for x in a) == len(sites["site1"].train)


def test_local_batch_norm_policy_keeps_running_stats_at_the_site(sites):
    model = ModelConfig(channels=(4, 8), strides=(2,), num_res_units=0, norm="batch")
    cfg = RunConfig(federation="x", model=model, train=TrainConfig(batch_size=4, bn_policy="local"))
    wl = segmentation_workload(2, 1, ["fg"], model)
    s = _site(sites, wl, cfg)
    s.model("global")
    shared = s.arrays("global")
    assert not any("running_mean" in k or "num_batches_tracked" in k for k in shared)
    assert any("running_mean" in k for k in s.models["global"].state_dict())


def test_save_and_restore_roundtrip(tmp_path, sites, workload):
    s = _site(sites, workload)
    s.model("global")
    s.fit("global", 1)
    s.store["c"] = torch.arange(3.0)
    s.save(tmp_path)
    fresh = _site(sites, workload)
    assert fresh.restore(tmp_path)
    for k, v in s.models["global"].state_dict().items():
        assert torch.equal(v, fresh.models["global"].state_dict()[k])
    a, b = s.optimizers["global"].state_dict(), fresh.optimizers["global"].state_dict()
    for i in a["state"]:
        assert torch.equal(a["state"][i]["exp_avg_sq"], b["state"][i]["exp_avg_sq"])
    assert torch.equal(fresh.store["c"], torch.arange(3.0))
    assert not _site(sites, workload).restore(tmp_path / "empty")
