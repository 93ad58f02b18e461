"""A deployed site's evaluation is not an oracle for the server.

Each test acts as the server with only what it holds: it sets a site up (the run config it ships), sends tasks
and planning requests over the site's byte operations, and reads the replies.  Against the sites of the release
before these checks, the probes below were answered (the training split's foreground sizes exactly, any crafted
candidate, any histogram interval); now the site's policy refuses them.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from fedseg.deployment.policy import SitePolicy, policy_from_dict
from fedseg.deployment.site import SiteConfig, SiteRuntime
from fedseg.deployment.wire import decode_reply, encode_task
from fedseg.foundation.config import PrivacyConfig, dump_toml
from fedseg.foundation.errors import ConfigError, PayloadError
from fedseg.foundation.messages import Task
from fedseg.privacy.protocol import model_digest
from tests.deploy.test_deploy import HEADER, _workload
from tests.support.helpers import tiny_config, tiny_sites

POLICY = SitePolicy(secure_aggregation=False, evaluation="per_case")
"""The loosest evaluation a policy allows (per-case scores) in a run without secure aggregation (cheap to run)."""


def _site(tmp_path, policy=POLICY, cfg=None):
    cfg = cfg or dataclasses.replace(tiny_config("fedavg", rounds=2), privacy=PrivacyConfig())
    data = tiny_sites(3)
    rt = SiteRuntime(
        SiteConfig("site1", "(in memory)", str(tmp_path / "site1")),
        loader=lambda *a: (data["site1"], _workload(cfg)),
        policy=policy,
    )
    desc = {"run_id": "r1", "sites": list(data), "data": HEADER, "config_toml": dump_toml(cfg.to_dict())}
    assert "refused" not in json.loads(rt.call("setup", json.dumps(desc).encode()))
    return rt, cfg, data["site1"]


def _ask(rt, kind, arrays, config):
    return decode_reply(rt.call("task", encode_task(Task(kind, arrays, config)))).metrics


def _probe(cfg) -> dict[str, torch.Tensor]:
    """A model the server crafts: every weight 0 and the output bias +10, so it predicts foreground everywhere.
    Its Dice on a case with f foreground pixels of N is 2f / (f + N), so f = D·N / (2 − D)."""
    state = {k: torch.zeros_like(v) for k, v in _workload(cfg).build_model().state_dict().items()}
    last = [k for k in state if k.endswith("bias")][-1]
    state[last] = torch.full_like(state[last], 10.0)
    return state


def _evaluate(rt, candidates: dict[str, dict[str, torch.Tensor]], split: str):
    arrays = {f"{name}/{k}": v for name, a in candidates.items() for k, v in a.items()}
    spec = [{"name": name, "predictor": "model", "config": {}} for name in candidates]
    return _ask(rt, "evaluate", arrays, {"split": split, "candidates": spec})


def test_training_split_is_never_evaluated(tmp_path):
    """The all-foreground probe on the training split: from per-case Dice D_i the server reads each training case's
    foreground size f_i = D_i·N / (2 − D_i) exactly (and their mean under aggregates); no DP noise covers an
    evaluation.  A deployed site refuses evaluation on its training split."""
    rt, cfg, _ = _site(tmp_path)
    with pytest.raises(PayloadError, match="scores models on the training split"):
        _evaluate(rt, {"probe": _probe(cfg)}, "training")
    with pytest.raises(PayloadError, match="training split"):
        _evaluate(rt, {"probe": _probe(cfg)}, "train")


def test_only_models_that_left_training_are_evaluated(tmp_path):
    """A crafted candidate (the probe) on the validation split before any training, and again after a round's
    honest validation, is refused: the site evaluates the models it saw leave training (a round's model as sent,
    its own replies), one new model per round it trained (the round's aggregate, which the engine evaluates
    before sending it as the next round's model), one final test per run, and the digests its policy allows."""
    rt, cfg, data = _site(tmp_path)
    probe = _probe(cfg)
    with pytest.raises(PayloadError, match="did not see leave training"):
        _evaluate(rt, {"probe": probe}, "validation")
    torch.manual_seed(0)
    w0 = {k: v.detach().clone() for k, v in _workload(cfg).build_model().state_dict().items()}
    sent = decode_reply(
        rt.call("task", encode_task(Task("train", {f"global/{k}": v for k, v in w0.items()}, {"round": 1})))
    )
    w1 = {k[len("global/") :]: v for k, v in sent.arrays.items()}  # the round's aggregate (here: this site's)
    assert len(_evaluate(rt, {"global": w0}, "validation")["per_case"]["global"]) == len(data.val)
    aggregate = {k: (v + w0[k]) / 2 if v.is_floating_point() else v for k, v in w1.items()}
    assert _evaluate(rt, {"global": aggregate}, "validation")["per_case"]  # the round's one new model
    with pytest.raises(PayloadError, match="did not see leave training"):
        _evaluate(rt, {"probe": probe}, "validation")
    assert _evaluate(rt, {"global": aggregate}, "testing")["per_case"]  # seen: the final test is free
    assert _evaluate(rt, {"probe": probe}, "testing")  # the run's one final test of a new model
    with pytest.raises(PayloadError, match="one final test per run"):
        _evaluate(rt, {"other": {k: v * 2 if v.is_floating_point() else v for k, v in probe.items()}}, "testing")
    allowed = dataclasses.replace(POLICY, allowed_models=(model_digest(probe),))
    rt2, _, _ = _site(tmp_path / "b", allowed)
    assert _evaluate(rt2, {"probe": probe}, "validation")["per_case"]["probe"]


def test_route_runs_only_selectors_that_left_training(tmp_path):
    """FedSM's ``route`` task runs a composite's selector over a split's cases and sends back how many went to each
    model: a server that crafts a selector with one output per case region reads the site's labels or features
    from the counts.  Against the old site any crafted selector was routed on validation, without limit (only the
    training split was refused); now ``route`` is held to the evaluation rule, part by part.

    Acting as the server: a crafted selector (every weight 0, one output's bias +10: every case to one model)
    before any round is refused; after a round whose task carried the run's selector, a route of that selector
    (with the global and personalized models the round sent) is answered and spends nothing, the crafted one then
    takes the round's one new model, a second one the run's one final assembly (FedSM routes the composite it
    assembles after the last round on validation), and a third is refused."""
    fedsm = {"selector_width": 0.0625, "selector_hidden": 8, "selector_training": "fedavg", "selector_steps": 1}
    cfg = dataclasses.replace(tiny_config("fedsm", rounds=2, local_epochs=None, local_steps=1), privacy=PrivacyConfig())
    cfg = dataclasses.replace(cfg, params={**cfg.params, "fedsm": fedsm})
    rt, cfg, _ = _site(tmp_path, cfg=cfg)
    sites, wl = ["site1", "site2", "site3"], _workload(cfg)
    torch.manual_seed(0)
    w0 = {k: v.detach().clone() for k, v in wl.build_model().state_dict().items()}
    sel = {k: v.detach().clone() for k, v in wl.selector(3, 0.0625, 8).state_dict().items()}
    crafted = {k: torch.zeros_like(v) for k, v in sel.items()}
    crafted[[k for k in crafted if k.endswith("bias")][-1]][0] = 10.0
    models = {f"{p}/{k}": v for p in ["global", *(f"personal/{s}" for s in sites)] for k, v in w0.items()}
    config = {"sites": sites, "num_classes": 3, "mode": "gate", "gammas": [0.5], "scores": False}

    def route(selector):
        arrays = {**models, **{f"selector/{k}": v for k, v in selector.items()}}
        return _ask(rt, "route", arrays, {**config, "split": "validation"})

    with pytest.raises(PayloadError, match=r"\['selector', .* did not see leave training"):
        route(crafted)
    base = {"round": 1, "phase": "joint", "sites": sites, "num_classes": 3, "mode": "gate", "train_selector": True}
    sent = {k: v for k, v in models.items() if not k.startswith(("personal/site2/", "personal/site3/"))}
    _ask(rt, "train", {**sent, **{f"selector/{k}": v for k, v in sel.items()}}, base)
    assert route(sel)["n"] > 0  # the selector the round sent, with the models it sent: seen
    assert route(crafted)["selections"][0]["counts"][1] > 0  # the round's one new model
    assert route({k: v * 2 for k, v in crafted.items()})["n"] > 0  # the run's one final assembly
    with pytest.raises(PayloadError, match=r"one per round it trained \(1\)"):
        route({k: v * 3 for k, v in crafted.items()})


def test_deployed_sites_evaluate_aggregates_by_default():
    """A site's default policy sends each candidate's mean over its cases, not per-case scores."""
    assert SitePolicy().evaluation == "aggregates"
    assert policy_from_dict({}).evaluation == "aggregates"
    with pytest.raises(ConfigError, match="allowed_models"):
        policy_from_dict({"allowed_models": ["not a digest"]})


def test_histogram_intervals_are_bounded_by_the_site(tmp_path):
    """The volume plan's ``histogram`` requests name their intervals: a server that asks for many narrow ones
    reads the site's voxel values.  The site answers at most ``max_histogram_requests`` intervals between two
    setups and no bin narrower than ``min_histogram_width``; the refusal comes before any data is read."""
    policy = dataclasses.replace(POLICY, max_histogram_requests=4, min_histogram_width=1.0)
    rt = SiteRuntime(SiteConfig("site1", "(in memory)", str(tmp_path / "site1")), policy=policy)
    narrow = {"data": HEADER, "weighting": "voxels", "requests": [{"channel": 0, "lo": 0, "hi": 10, "bins": 100}]}
    with pytest.raises(PayloadError, match="min_histogram_width is 1"):
        rt.call("histogram", json.dumps(narrow).encode())
    many = {**narrow, "requests": [{"channel": 0, "lo": 0, "hi": 100, "bins": 10}] * 5}
    with pytest.raises(PayloadError, match="max_histogram_requests is 4"):
        rt.call("histogram", json.dumps(many).encode())
    refusing = dataclasses.replace(POLICY, tasks=("train", "evaluate"))
    rt = SiteRuntime(SiteConfig("site1", "(in memory)", str(tmp_path / "site2")), policy=refusing)
    with pytest.raises(PayloadError, match="task kind 'fingerprint' is not among the policy's tasks"):
        rt.call("fingerprint", json.dumps({"data": HEADER}).encode())
