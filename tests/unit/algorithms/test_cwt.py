"""Cyclic weight transfer: the visiting order, and the hand-over of weights (and moments) from site to site."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from fedseg.algorithms import get_algorithm
from fedseg.algorithms.cwt import load_optimizer_arrays, optimizer_arrays, visit_order
from fedseg.foundation.errors import ConfigError
from fedseg.simulation.runner import simulate
from fedseg.site.runtime import Site
from tests.support.helpers import assert_same_checkpoints
from tests.unit.algorithms.test_fga import class_sites, config, init_model, mlp_workload, server_weights

# ------------------------------------------------------------------- pure parts


def test_visit_order_rotates_to_the_ending_site():
    # Execute / Assert: the paper's "Cyclic A" ends at A, "Cyclic B" at B
    assert visit_order(["A", "B"]) == ("A", "B")
    assert visit_order(["A", "B"], end="A") == ("B", "A")
    assert visit_order(["A", "B"], end="B") == ("A", "B")
    assert visit_order(["A", "B", "C"], end="A") == ("B", "C", "A")
    assert visit_order(["A", "B", "C"], order="C, A,B") == ("C", "A", "B")
    assert visit_order(["A", "B", "C"], order=("B", "A", "C"), end="C") == ("B", "A", "C")


@pytest.mark.parametrize(
    "order, end, message",
    [
        (None, "Z", r"cwt.end = 'Z' is not a site"),
        ("A,Z", None, r"cwt.order names unknown site\(s\) \['Z'\]"),
        ("A", None, "must list every site exactly once"),
        ("A,B,A", None, "must list every site exactly once"),
        ("A,B", "A", "cwt.end = 'A' but cwt.order ends at 'B'"),
    ],
)
def test_visit_order_rejects_bad_orders(order, end, message):
    with pytest.raises(ConfigError, match=message):
        visit_order(["A", "B"], order, end)


@pytest.mark.parametrize(
    "section, message", [({"optimizer": "share"}, "cwt.optimizer"), ({"order": " , "}, "cwt.order is empty")]
)
def test_cwt_params_are_validated(section, message):
    with pytest.raises(ConfigError, match=message):
        get_algorithm(config("cwt", params={"cwt": section}))


def test_bad_order_fails_before_training():
    with pytest.raises(ConfigError, match="unknown site"):
        simulate(
            config("cwt", params={"cwt": {"order": "site1,siteX"}}), mlp_workload(), class_sites([4, 4]), progress=False
        )


def test_optimizer_arrays_round_trip():
    # Prepare: an Adam after one step
    model = nn.Linear(2, 1).double()
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2, dtype=torch.float64)).sum().backward()
    opt.step()
    # Execute
    packed = optimizer_arrays(opt)
    fresh = torch.optim.Adam(model.parameters())
    load_optimizer_arrays(fresh, packed)
    # Assert
    assert sorted(packed) == ["0/exp_avg", "0/exp_avg_sq", "0/step", "1/exp_avg", "1/exp_avg_sq", "1/step"]
    for k, v in optimizer_arrays(fresh).items():
        assert torch.equal(v, packed[k]), k


# --------------------------------------------------------------------- hand-over


def sequential_reference(cfg, workload, data, cycle, mode, handover=True):
    """One model trained on site batches in visiting order, one step per visit.

    ``transfer``: one Adam for the whole sequence; ``keep``: one Adam per site
    (all over the same parameters), each continuing where that site left it;
    ``reset``: a fresh Adam before each step.  ``handover=False`` is the bug to
    guard against: every visit of a round restarts from the round's start weights.
    """
    model = init_model(cfg, workload)
    algo = get_algorithm(cfg)
    sites = {s: Site(s, i, d, workload, cfg, algo) for i, (s, d) in enumerate(data.items())}
    new_adam = lambda: torch.optim.Adam(model.parameters(), lr=cfg.train.lr, betas=tuple(cfg.train.betas))  # noqa: E731
    shared = new_adam()
    per_site = {s: new_adam() for s in sites}
    model.train()
    for rnd in range(1, cfg.rounds + 1):
        start = {k: v.clone() for k, v in model.state_dict().items()}
        for s in cycle:
            if not handover:
                model.load_state_dict(start)
            ((x, y),) = list(sites[s].batches(rnd, "train", steps=1))
            opt = {"transfer": shared, "keep": per_site[s], "reset": new_adam()}[mode]
            opt.zero_grad(set_to_none=True)
            workload.loss(model(x), y).backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "mode, end, cycle",
    [
        ("transfer", None, ("site1", "site2")),
        ("transfer", "site1", ("site2", "site1")),
        ("keep", None, ("site1", "site2")),
        ("reset", "site1", ("site2", "site1")),
    ],
)
def test_one_step_per_visit_equals_sequential_training(tmp_path, mode, end, cycle):
    """With train.local_steps = 1, 10 rounds of a 2-site cycle are 20 optimizer steps on the sites' batches in
    visiting order; each visit must start from the previous visit's weights (the hand-over FLamby lost),
    so the result equals sequential training bitwise."""
    # Prepare
    data = class_sites([4, 6])
    wl = mlp_workload()
    params = {"optimizer": mode, **({"end": end} if end else {})}
    cfg = config("cwt", rounds=10, batch_size=2, local_steps=1, local_epochs=None, params={"cwt": params})
    # Execute
    res = simulate(cfg, wl, data, out=tmp_path, progress=False)
    # Assert
    assert all(h["order"] == list(cycle) for h in res["history"])
    got = server_weights(tmp_path)
    ref = sequential_reference(cfg, wl, data, cycle, mode)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    # without the hand-over (every visit from the round's start weights) the result differs
    other = sequential_reference(cfg, wl, data, cycle, mode, handover=False)
    assert any(not torch.equal(got[k], other[k]) for k in ref)


def test_transfer_moves_adam_moments_with_the_model(tmp_path):
    """Transfer: after 3 rounds × 2 sites × 1 step the travelling Adam has counted 6 steps; keep: each site's counts 3."""
    data = class_sites([4, 4])
    for mode, server_step, site_step in (("transfer", 6.0, None), ("keep", None, 3.0)):
        cfg = config(
            "cwt", rounds=3, batch_size=2, local_steps=1, local_epochs=None, params={"cwt": {"optimizer": mode}}
        )
        simulate(cfg, mlp_workload(), data, out=tmp_path / mode, progress=False)
        state = load_file(str(tmp_path / mode / "checkpoints/server.safetensors"))
        if server_step is not None:
            assert float(state["optim/0/step"]) == server_step
        else:
            assert not any(k.startswith("optim/") for k in state)
            for s in data:
                assert (
                    float(load_file(str(tmp_path / mode / f"checkpoints/sites/{s}.safetensors"))["optim/global/0/step"])
                    == site_step
                )


def test_cwt_resume_is_bitwise(tmp_path):
    # Prepare
    cfg = config("cwt", rounds=4, dtype="float32", params={"cwt": {"optimizer": "transfer", "end": "site1"}})
    data = class_sites([6, 4])
    # Execute
    simulate(cfg, mlp_workload(), data, out=tmp_path / "full", progress=False)
    assert simulate(cfg, mlp_workload(), data, out=tmp_path / "part", progress=False, stop_after=2) is None
    simulate(cfg, mlp_workload(), class_sites([6, 4]), out=tmp_path / "part", progress=False, resume=True)
    # Assert
    assert_same_checkpoints(tmp_path / "full", tmp_path / "part")
