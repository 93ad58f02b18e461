"""Site runtime: local work counting, seeded batches, batch-norm policy, persistence."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from fedseg.algorithms import get_algorithm
from fedseg.foundation.config import ModelConfig, RunConfig, TrainConfig
from fedseg.foundation.errors import PayloadError
from fedseg.seams.checkpoint import restore_site, save_site
from fedseg.site.runtime import Site
from fedseg.site.workload import segmentation_workload, workload_for
from tests.support.helpers import tiny_config


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
    s.now(s.fit("global", 1))
    s.store["c"] = torch.arange(3.0)
    save_site(s, tmp_path)
    fresh = _site(sites, workload)
    assert restore_site(fresh, tmp_path)
    for k, v in s.models["global"].state_dict().items():
        assert torch.equal(v, fresh.models["global"].state_dict()[k])
    a, b = s.optimizers["global"].state_dict(), fresh.optimizers["global"].state_dict()
    for i in a["state"]:
        assert torch.equal(a["state"][i]["exp_avg_sq"], b["state"][i]["exp_avg_sq"])
    assert torch.equal(fresh.store["c"], torch.arange(3.0))
    assert not restore_site(_site(sites, workload), tmp_path / "empty")


def _bn_stats(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if "running_" in k}


def test_local_batch_norm_evaluation_copies_follow_the_sites_current_statistics(sites):
    """bn_policy = "local": the arrays a site receives carry no running statistics, so the evaluation
    copy ("eval", built once by copying the site's first model) must take the site's *current* ones
    at every evaluation — not keep those of its first evaluation (the bug: after two more rounds of
    training the eval copy still held round 1's statistics)."""
    # Prepare
    model = ModelConfig(channels=(4, 8), strides=(2,), num_res_units=0, norm="batch")
    cfg = RunConfig(federation="x", model=model, train=TrainConfig(batch_size=4, bn_policy="local"))
    wl = segmentation_workload(2, 1, ["fg"], model)
    s = _site(sites, wl, cfg)
    s.model("global")
    s.now(s.fit("global", 1))
    s.model_predictor(s.arrays("global"))
    first = _bn_stats(s.models["eval"])
    # Execute: more training changes the site's statistics, then evaluate again
    s.now(s.fit("global", 2))
    s.now(s.fit("global", 3))
    s.model_predictor(s.arrays("global"))
    # Assert
    now, trained = _bn_stats(s.models["eval"]), _bn_stats(s.models["global"])
    assert now and all(torch.equal(now[k], trained[k]) for k in now)
    assert any(not torch.equal(now[k], first[k]) for k in now)
    # a trained role keeps its own statistics when it receives weights (bn_from is for evaluation copies only)
    s.model("personal")
    s.now(s.fit("personal", 5))
    own = _bn_stats(s.models["personal"])
    s.load("personal", s.arrays("global"))
    assert all(torch.equal(_bn_stats(s.models["personal"])[k], own[k]) for k in own)


def test_local_batch_norm_fedsm_composite_uses_the_sites_own_statistics(sites, tmp_path):
    """FedSM with a batch-norm U-Net and bn_policy = "local", 2 rounds: after the last evaluation the
    composite's global copy holds the site's global-model statistics and its own personalized copy
    the site's personalized-model statistics, both as trained in round 2 (not round 1's)."""
    from safetensors.torch import load_file

    from fedseg.simulation.runner import simulate

    model = ModelConfig(channels=(4, 8), strides=(2,), num_res_units=0, norm="batch")
    cfg = RunConfig(
        federation="x",
        method="fedsm",
        rounds=2,
        model=model,
        train=TrainConfig(batch_size=4, bn_policy="local"),
        params={"fedsm": {"selector_width": 0.0625, "selector_hidden": 8}},
        checkpoint_keep="all",  # the site's saved state is read below
    )
    wl = segmentation_workload(2, 1, ["fg"], model)
    simulate(cfg, wl, sites, out=tmp_path, progress=False)
    st = load_file(str(tmp_path / "checkpoints/sites/site2.safetensors"))

    def stats(role):
        return {
            k.removeprefix(f"model/{role}/"): v
            for k, v in st.items()
            if k.startswith(f"model/{role}/") and "running_" in k
        }

    g, p, cg, cp = stats("global"), stats("personal"), stats("fedsm-eval/global"), stats("fedsm-eval/p1")
    assert g and all(torch.equal(cg[k], g[k]) for k in g)
    assert all(torch.equal(cp[k], p[k]) for k in p)
    assert any(not torch.equal(g[k], p[k]) for k in g)


def test_split_names_have_one_table(sites):
    """Every alias of a split names the same dataset; an unknown name is one error listing the allowed ones."""
    d = sites["site1"]
    assert d.split("train") is d.split("training") is d.train
    assert d.split("val") is d.split("validation") is d.val
    assert d.split("test") is d.split("testing") is d.test
    with pytest.raises(PayloadError, match=r"unknown data split 'valid'; a split is one of \['test', 'testing'"):
        d.split("valid")


def test_workload_for_a_spec_or_its_data_header_is_the_same_workload():
    """The server of a deployment knows only the data header; it builds the workload a simulation builds."""
    cfg = tiny_config()
    header = {"spatial_dims": 2, "in_channels": 3, "labels": {"disc": [1], "cup": [2]}}
    spec = SimpleNamespace(**header)
    a, b = workload_for(header, cfg), workload_for(spec, cfg)
    assert a.metric_names == b.metric_names == ("disc", "cup")
    assert (a.spatial_dims, a.in_channels) == (b.spatial_dims, b.in_channels) == (2, 3)
    x = torch.rand(1, 3, 16, 16)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        ya = a.build_model()(x)
        torch.manual_seed(0)
        yb = b.build_model()(x)
    assert ya.shape == (1, 2, 16, 16) and torch.equal(ya, yb)
